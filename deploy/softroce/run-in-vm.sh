#!/usr/bin/env bash
# rdmakv: run a command on a real soft-RoCE (rdma_rxe) device inside a VM, for
# hosts whose kernel has no InfiniBand support (CONFIG_INFINIBAND unset, no
# rdma_rxe module). On kernels that have rdma_rxe use setup-host.sh instead.
#
#   usage: deploy/softroce/run-in-vm.sh [--mem MB] [--cpus N] [--timeout S] -- CMD [ARGS...]
#   needs: apt-get install qemu-system-x86 linux-image-amd64 rdma-core \
#            ibverbs-providers ibverbs-utils perftest busybox-static kmod iproute2 cpio
#
# What it does: boots the host's Debian stock kernel under QEMU, shares the host
# root filesystem read-only and the CURRENT DIRECTORY read-write (at the same
# path) over 9p, loads rdma_rxe, creates rxe0 on a dummy netdev with address
# 198.18.0.1/24, raises the memlock limit, runs CMD from the current directory
# and exits with CMD's exit status (99 / a message if the VM never ran it).
# Inside the VM: device rxe0 (port 1; gid index 1 = ::ffff:198.18.0.1, RoCE v2),
# RDMAKV_TEST_DEVICE=rxe0, /tmp and /dev/shm are fresh tmpfs (put virtualenvs in the
# project directory), CMD's stdout+stderr stream back to this terminal.
#
# Facts it rests on (checked on Debian 12, 6.1 guest kernel):
#  - /dev/kvm on these hosts does not boot a stock kernel: TCG emulation, so
#    code in the VM runs ~10-25x slower; boot + module load take ~5 s.
#  - rdma_rxe needs crc32_generic loaded first ("failed to init crc32 algorithm").
#  - rxe refuses netdev lo; a dummy netdev works, and traffic to its local
#    address never leaves the guest (the VM has no network card at all).
#  - 9p with cache=loose for the read-only root and a read-only view of the
#    project's virtualenvs and code keeps imports fast enough.
set -euo pipefail
MEM=${RDMAKV_VM_MEM:-2048}; CPUS=${RDMAKV_VM_CPUS:-2}; TIMEOUT=${RDMAKV_VM_TIMEOUT:-1200}
GUEST_IP=198.18.0.1/24
while [[ $# -gt 0 ]]; do
  case "$1" in
    --mem) MEM=$2; shift 2;; --cpus) CPUS=$2; shift 2;;
    --timeout) TIMEOUT=$2; shift 2;; --) shift; break;;
    -h|--help) sed -n '2,20p' "$0"; exit 0;;
    *) echo "usage: run-in-vm.sh [--mem MB] [--cpus N] [--timeout S] -- CMD..." >&2; exit 2;;
  esac
done
[[ $# -gt 0 ]] || { echo "run-in-vm.sh: no command given" >&2; exit 2; }

KVER=$(ls /lib/modules 2>/dev/null | grep -E 'amd64$' | sort -V | tail -1 || true)
[[ -n "$KVER" && -f /boot/vmlinuz-$KVER ]] || { echo "run-in-vm.sh: no Debian kernel found; apt-get install linux-image-amd64" >&2; exit 3; }
command -v qemu-system-x86_64 >/dev/null || { echo "run-in-vm.sh: apt-get install qemu-system-x86" >&2; exit 3; }
[[ -x /bin/busybox ]] || { echo "run-in-vm.sh: apt-get install busybox-static" >&2; exit 3; }
for m in rdma_rxe ib_uverbs crc32_generic; do
  modprobe -S "$KVER" --show-depends "$m" >/dev/null 2>&1 || { echo "run-in-vm.sh: kernel $KVER has no module $m" >&2; exit 3; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/rdmakv-vm.XXXXXX")
TAIL=""
cleanup() { [[ -n "$TAIL" ]] && kill "$TAIL" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
mkdir -p "$WORK"/initrd/{bin,mods,newroot,proc,sys,dev} "$WORK/ro"
cp /bin/busybox "$WORK/initrd/bin/busybox"
# Only what is needed to mount 9p goes into the initrd; everything else
# (rdma_rxe, ib_uverbs, dummy) is loaded from the host's /lib/modules once
# the host root is mounted.
MODS=""
for f in $(for m in virtio_pci 9pnet_virtio 9p; do modprobe -S "$KVER" --show-depends $m | awk '$1=="insmod"{print $2}'; done | awk '!seen[$0]++'); do
  cp "$f" "$WORK/initrd/mods/"; MODS="$MODS $(basename "$f" .ko)"
done
CWD=$(pwd)
# The command travels as a bash-quoted line, so arguments with spaces or
# newlines (sh -c 'multi-line script') arrive intact.
{ printf '%q ' "$@"; echo; } > "$WORK/cmd.sh"
cat > "$WORK/initrd/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $MODS; do insmod /mods/\$m.ko; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot || poweroff -f
mount -t proc proc /newroot/proc; mount -t sysfs sys /newroot/sys; mount -t devtmpfs dev /newroot/dev
mount -t tmpfs tmpfs /newroot/tmp; mount -t tmpfs tmpfs /newroot/run
mkdir -p /newroot/dev/shm && mount -t tmpfs tmpfs /newroot/dev/shm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 ctl /newroot/run
mkdir -p /newroot$CWD 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 cwd /newroot$CWD || { echo "cannot mount $CWD in the VM" > /newroot/run/setup_failed; poweroff -f; }
# What the command imports, again, read-only with cache=loose (a second share
# of the same directory): an import stats and opens hundreds of files, and
# without the guest's cache each is a 9p round trip under emulation (vLLM's
# import: ~17 min uncached, under 3 min cached). The code does not change
# while the VM runs; everything else (build/, results) stays writable.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose cwdro /newroot/run/ro
for v in .venv .venv-engines rdmakv tests chaos; do [ -d /newroot$CWD/\$v ] && mount -o bind /newroot/run/ro/\$v /newroot$CWD/\$v; done
chroot /newroot /bin/sh /run/guest.sh
poweroff -f
INIT
chmod +x "$WORK/initrd/init"
cat > "$WORK/guest.sh" <<GUEST
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp RDMAKV_TEST_DEVICE=rxe0
modprobe crc32_generic && modprobe rdma_rxe && modprobe ib_uverbs && modprobe dummy numdummies=0 || { echo 'loading the rdma_rxe modules failed' > /run/setup_failed; exit; }
ip link set lo up && ip link add rk0 type dummy && ip addr add $GUEST_IP dev rk0 && ip link set rk0 up
rdma link add rxe0 type rxe netdev rk0 || { echo 'rdma link add rxe0 failed' > /run/setup_failed; exit; }
ulimit -l unlimited
cd "$CWD"
bash /run/cmd.sh > /run/out.log 2>&1; echo \$? > /run/rc
GUEST
(cd "$WORK/initrd" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$WORK/initrd.gz")
echo 99 > "$WORK/rc"; : > "$WORK/out.log"  # 99 stays if the VM never ran the command
tail -n +1 -F "$WORK/out.log" 2>/dev/null & TAIL=$!
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "$MEM" -smp "$CPUS" \
  -nographic -no-reboot -nic none -kernel "/boot/vmlinuz-$KVER" -initrd "$WORK/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$WORK",mount_tag=ctl,security_model=none \
  -virtfs local,path="$CWD",mount_tag=cwd,security_model=none \
  -virtfs local,path="$CWD",mount_tag=cwdro,security_model=none,readonly=on,multidevs=remap \
  </dev/null > "$WORK/console.log" 2>&1 || echo "run-in-vm.sh: the VM ended abnormally or ran past ${TIMEOUT}s" >&2
sleep 0.5
RC=$(cat "$WORK/rc" 2>/dev/null || echo 99)
if [[ -f "$WORK/setup_failed" || "$RC" == 99 ]]; then
  echo "run-in-vm.sh: the VM did not run the command to the end ($(cat "$WORK/setup_failed" 2>/dev/null || echo 'no exit status came back')); its console said:" >&2
  sed -e 's/\x1b[^a-zA-Z]*[a-zA-Z]//g' "$WORK/console.log" | tail -20 >&2
  RC=99
fi
exit "$RC"
