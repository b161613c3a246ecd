#!/usr/bin/env bash
# rdmakv: create a soft-RoCE device (rdma_rxe) on a host whose kernel has it.
#
#   usage: sudo deploy/softroce/setup-host.sh [NETDEV] [RXE_NAME]
#     NETDEV    the Ethernet netdev to put RoCE on (default: the one holding
#               the default route); it must be UP and have an IP address
#     RXE_NAME  name of the new device (default: rxe0)
#   needs: apt-get install rdma-core ibverbs-providers ibverbs-utils iproute2 kmod
#
# Checks, in order, and says what to do when one fails: root, the kernel
# modules (rdma_rxe needs crc32_generic on some kernels), the netdev, an
# existing rxe on it (then it only reports), the port state and a RoCE v2 GID,
# and the memlock limit (registering a slab pins it).
# For kernels WITHOUT rdma_rxe (CONFIG_INFINIBAND unset) use run-in-vm.sh.
set -euo pipefail
NETDEV=${1:-}
NAME=${2:-rxe0}
die() { echo "setup-host.sh: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (sudo $0 $*)"
command -v rdma >/dev/null || die "the 'rdma' tool is missing: apt-get install iproute2"
if [[ -z "$NETDEV" ]]; then
  NETDEV=$(ip -o route show default 2>/dev/null | awk '{for(i=1;i<NF;i++) if($i=="dev"){print $(i+1); exit}}')
  [[ -n "$NETDEV" ]] || die "no default route to pick a netdev from; pass one: $0 eth0"
fi
[[ "$NETDEV" != lo ]] || die "rdma_rxe refuses the loopback netdev; use a real or dummy one (ip link add rk0 type dummy)"
ip link show "$NETDEV" >/dev/null 2>&1 || die "netdev $NETDEV does not exist (ip -br link)"

if ! grep -qw rdma_rxe /proc/modules; then
  modprobe crc32_generic 2>/dev/null || true
  modprobe rdma_rxe || die "kernel $(uname -r) has no rdma_rxe module (CONFIG_RDMA_RXE); use deploy/softroce/run-in-vm.sh"
fi
modprobe ib_uverbs || die "cannot load ib_uverbs"

ip link set "$NETDEV" up
ip -o addr show dev "$NETDEV" | grep -q inet || echo "setup-host.sh: warning: $NETDEV has no IP address; RoCE v2 GIDs come from its addresses (ip addr add ... dev $NETDEV)" >&2

existing=$(rdma link show 2>/dev/null | awk -v nd="$NETDEV" '$0 ~ "netdev "nd"( |$)" {split($2,a,"/"); print a[1]; exit}')
if [[ -n "$existing" ]]; then
  echo "setup-host.sh: $NETDEV already has soft-RoCE device $existing"
  NAME=$existing
else
  rdma link add "$NAME" type rxe netdev "$NETDEV" || die "rdma link add $NAME type rxe netdev $NETDEV failed (dmesg | tail)"
  echo "setup-host.sh: created $NAME on $NETDEV"
fi

state=$(cat "/sys/class/infiniband/$NAME/ports/1/state" 2>/dev/null || echo "?")
echo "setup-host.sh: $NAME port 1: $state"
[[ "$state" == *ACTIVE* ]] || die "$NAME port 1 is not ACTIVE: is $NETDEV up with carrier? (ip link show $NETDEV)"
if ! grep -qs "RoCE v2" /sys/class/infiniband/"$NAME"/ports/1/gid_attrs/types/*; then
  die "$NAME has no RoCE v2 GID: give $NETDEV an IPv4/IPv6 address"
fi
lim=$(ulimit -l)
if [[ "$lim" != unlimited ]]; then
  echo "setup-host.sh: note: memlock limit is ${lim} KiB for this shell; rdmakv pins its slab and pool:" >&2
  echo "  raise it (ulimit -l unlimited, LimitMEMLOCK=infinity, docker --ulimit memlock=-1)" >&2
fi
echo "setup-host.sh: ready. Check with: rdmakv doctor   (or ibv_devinfo -d $NAME)"
