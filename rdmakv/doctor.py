"""``rdmakv doctor``: what RDMA this machine has, and what is wrong with it.

Reads sysfs (works without opening a device) and, when the native RDMA
module is built, queries each port through libibverbs for the active MTU and
limits.
Every problem found is stated plainly with the command that fixes it; the
exit status is 0 when rdmakv can use RDMA here, 1 otherwise.

``rdmakv doctor --tune`` instead times the TCP send plans on this host, once
(:func:`time_send_plans`), and prints the ``tcp.send_plan`` line to set: the
data path itself never measures (native/rk_tcp.h).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv import native_core
from rdmakv.client.streams import default_streams, usable_cpus
from rdmakv.config import env_var
from rdmakv.errors import RdmakvError
from rdmakv.transport import checksum
from rdmakv.transport.congestion import apply_congestion, probe_congestion
from rdmakv.transport.rdma import verbs
from rdmakv.transport.tcp import loop as tcp

MEMLOCK_RECOMMENDED = 1 << 30
"""Below this, a typical slab or node pool (GiBs) cannot be pinned/registered."""
UVERBS_DIR = Path("/dev/infiniband")
SETUP_HOST = "deploy/softroce/setup-host.sh"
RUN_IN_VM = "deploy/softroce/run-in-vm.sh"

TUNE_VALUE_BYTES = 64 * 1024
"""The values a tuning send moves: a KV block of a typical size (the plans cut
their windows between whole values where they fit)."""
TUNE_SEND_BYTES = 8 << 20
"""Bytes per timed send: many windows of either size, so that a send's fixed
costs weigh little."""
TUNE_ROUNDS = 16
"""Timed sends per plan (the plans take turns, so a busy moment hits them all)."""
TUNE_WARM_UP_ROUNDS = 2
"""Untimed rounds first: a new connection's first sends cost more, whatever the plan."""
TUNE_TIMEOUT_S = 30.0
"""A tuning send or receive that moves nothing for this long fails."""


@dataclass
class Problem:
    what: str
    fix: str


@dataclass
class PortReport:
    device: str
    port: int
    state: str
    phys_state: str
    link_layer: str
    active_mtu: int | None
    gids: list[dict[str, Any]]


@dataclass
class Report:
    native: str
    devices: list[str]
    ports: list[PortReport] = field(default_factory=list)
    memlock: str = ""
    selected: str | None = None
    memory_windows: str = ""
    """Type-2 memory windows on the selected device: what a node needs to confine
    each RDMA client to its own extents (KVNode rdma_confinement="windows")."""
    tcp_congestion: str = ""
    """The TCP congestion control rdmakv's connections run here (and, when the
    kernel refused the one they ask for, why and the fix). Speed only: not a
    problem for the exit status."""
    value_checksums: str = ""
    """How value checksums are computed here (:func:`rdmakv.transport.checksum.describe`),
    with the fix where that build is slow. Speed only, like ``tcp_congestion``."""
    tcp_streams: str = ""
    """Connections a client opens to one node over TCP when ``streams`` is
    unset, and the usable CPUs that decide it (:func:`rdmakv.client.streams.default_streams`)."""
    tcp_recv_spin: str = ""
    """How long a native TCP receive polls for more bytes before it sleeps
    (:func:`recv_spin`). Speed only."""
    tcp_send_plan: str = ""
    """The plan of this process's hashed TCP sends (:func:`send_plan`). Speed only."""
    native_core: str = ""
    """The native core's pieces and the file they were loaded from
    (:func:`native_core_line`): which build a process here runs."""
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _mtu(device: str, port: int) -> int | None:
    """Active MTU in bytes via libibverbs, None when the native RDMA module is missing."""
    if not verbs.native_available():
        return None
    try:
        sel = verbs.Selection(device, port, 0, bytes(verbs.GID_LEN), "", "", 0)
        dev = verbs.Device(sel)  # raises for a port that is not ACTIVE
    except RdmakvError:
        return None
    try:
        return verbs.MTU_BYTES.get(dev.attrs.active_mtu)
    finally:
        dev.close()


def _windows(sel: verbs.Selection) -> str:
    """Whether ``sel``'s device has type-2 memory windows, in words."""
    try:
        dev = verbs.Device(sel)
    except RdmakvError as e:
        return f"unknown (cannot open {sel.device}: {e})"
    try:
        if dev.supports_windows:
            return "type 2 supported: a node confines each RDMA client to its own extents"
        return (
            "NOT supported: a node with rdma_confinement='windows' (the default) will not "
            "serve rdma on this device (it falls back to tcp, or set rdma_confinement='none' "
            "to expose the whole pool to every RDMA client); clients are unaffected"
        )
    finally:
        dev.close()


def _netdev_hint(info: verbs.PortInfo) -> str:
    ndevs = {g.netdev for g in info.gids if g.netdev}
    return next(iter(ndevs)) if len(ndevs) == 1 else "<netdev>"


NATIVE_PIECES = ("tcp loop", "node index", "node request loop", "client calls")
"""What the native core holds (docs/operations.md, "The native core")."""


def native_core_line() -> str:
    """The native core's pieces, and the file they were loaded from. The core
    is required (rdmakv does not import without it); the optional RDMA module
    has its own line, ``native RDMA core``."""
    return f"{', '.join(NATIVE_PIECES)} ({native_core.FILE})"


def recv_spin() -> str:
    """The receive spin of a process here (this one read the same environment;
    native/rk_tcp.h, docs/operations.md)."""
    us = tcp.recv_spin_us()
    if us == 0:
        return f"off ({tcp.ENV_RECV_SPIN}=0)"
    return (f"up to {us} us per wait, while a CPU is spare "
            f"({tcp.ENV_RECV_SPIN} sets it, 0 turns it off)")


def send_plan() -> str:
    """The plan of a hashed send here: the configuration's ``tcp.send_plan``,
    which the command applied before this ran (native/rk_tcp.h)."""
    name = tcp.send_plan_name()
    if name is None:
        return "none (sends do not hash as they go: no native hasher)"
    return f"{name} (tcp.send_plan sets it; `rdmakv doctor --tune` times the plans here)"


def time_send_plans(
    rounds: int = TUNE_ROUNDS, send_bytes: int = TUNE_SEND_BYTES
) -> dict[str, float]:
    """Each plan of :data:`rdmakv.transport.tcp.loop.SEND_PLANS`: bytes its hashed sends
    moved per second of the sending thread's CPU (the median of ``rounds``
    sends of ``send_bytes`` in :data:`TUNE_VALUE_BYTES` values, each hashed, to
    a receiving thread over a loopback TCP connection like a client's). The
    plans take turns; the plan in use before is put back. Raises
    :class:`RdmakvError` where the loop does not hash as it sends."""
    if not tcp.native_checksums():
        raise RdmakvError(
            "no hashed sends to tune here: the xxhash module exports no XXH3_64bits to call"
        )
    before = tcp.send_plan_name()
    count = send_bytes // TUNE_VALUE_BYTES
    src = np.random.default_rng(0).integers(0, 256, count * TUNE_VALUE_BYTES, dtype=np.uint8)
    iov = np.empty((count, 2), dtype=np.uint64)
    iov[:, 0] = np.uint64(src.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(
        TUNE_VALUE_BYTES)
    iov[:, 1] = TUNE_VALUE_BYTES
    sink = np.empty(src.nbytes, dtype=np.uint8)
    sink_iov = np.array([[sink.ctypes.data, sink.nbytes]], dtype=np.uint64)
    hashes = np.zeros(count, dtype=np.uint64)
    sends = (TUNE_WARM_UP_ROUNDS + rounds) * len(tcp.SEND_PLANS)
    cpu: dict[str, list[float]] = {name: [] for name in tcp.SEND_PLANS}
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname()[:2], timeout=TUNE_TIMEOUT_S)
        receiver, _ = server.accept()
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            for _ in range(sends):
                tcp.recv_iov(receiver, sink_iov)
        except (OSError, RdmakvError) as e:
            failed.append(e)

    thread = threading.Thread(target=receive, name="rdmakv-tune-receiver", daemon=True)
    try:
        for sock in (sender, receiver):
            sock.settimeout(TUNE_TIMEOUT_S)  # non-blocking underneath, as a client's
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            apply_congestion(sock)
        thread.start()
        names = list(tcp.SEND_PLANS)
        for r in range(TUNE_WARM_UP_ROUNDS + rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                tcp.set_send_plan(name)
                start = time.thread_time_ns()
                tcp.send_iov(sender, iov, hashes)
                spent = time.thread_time_ns() - start
                if r >= TUNE_WARM_UP_ROUNDS:
                    cpu[name].append(spent / 1e9)
        thread.join(TUNE_TIMEOUT_S)
    finally:
        if before is not None:
            tcp.set_send_plan(before)
        sender.close()
        receiver.close()
    if failed:
        raise RdmakvError(f"tuning's receiver failed: {failed[0]}")
    return {name: src.nbytes / max(statistics.median(s), 1e-9) for name, s in cpu.items()}


def render_tune(rates: dict[str, float], in_use: str | None) -> str:
    """:func:`time_send_plans`' result, and the configuration to copy."""
    best = max(rates, key=lambda name: rates[name])
    lines = [
        f"tcp send plans here: bytes sent per second of the sending thread's CPU (median of "
        f"{TUNE_ROUNDS} hashed sends of {TUNE_SEND_BYTES >> 20} MiB in "
        f"{TUNE_VALUE_BYTES >> 10} KiB values over loopback; more is better, and a few "
        f"percent is noise: run it on an idle host, twice):"
    ]
    for name, rate in sorted(rates.items(), key=lambda item: -item[1]):
        mark = "  (in use)" if name == in_use else ""
        lines.append(f"  {name}  {rate / 1e9:6.2f} GB/s{mark}")
    lines += [
        f"fastest: {best}. To use it, put these lines in the rdmakv config (docs/config.md),",
        f"or set {env_var('tcp', 'send_plan')}={best}:",
        "tcp:",
        f"  send_plan: {best}",
    ]
    return "\n".join(lines)


def tune_main(as_json: bool = False) -> int:
    """``rdmakv doctor --tune``: 0, or 1 where there is nothing to tune."""
    in_use = tcp.send_plan_name()
    try:
        rates = time_send_plans()
    except RdmakvError as e:
        print(f"rdmakv doctor --tune: {e}")
        return 1
    if as_json:
        best = max(rates, key=lambda name: rates[name])
        print(json.dumps({"send_plans_bytes_per_cpu_s": rates, "in_use": in_use,
                          "fastest": best, "config": {"tcp": {"send_plan": best}}}, indent=2))
    else:
        print(render_tune(rates, in_use))
    return 0


def diagnose(root: Path = verbs.SYSFS_IB) -> Report:
    """Collect the facts and the problems (pure reading; changes nothing).

    ``root`` is the sysfs directory of RDMA devices (tests point it elsewhere).
    """
    report = Report(
        native="built" if verbs.native_available() else f"MISSING ({verbs.NATIVE_ERROR})",
        devices=verbs.list_devices(root),
    )
    if not verbs.native_available():
        report.problems.append(Problem(
            "the native RDMA core (rdmakv._native_verbs) is not built, so rdmakv is TCP-only",
            "apt-get install libibverbs-dev ibverbs-providers, then reinstall rdmakv "
            "(pip install -e .)",
        ))
    if not report.devices:
        ib_core = Path("/sys/module/ib_core").exists()
        report.problems.append(Problem(
            "no RDMA device" + ("" if ib_core else " (the kernel has no InfiniBand/RDMA support "
                                "loaded: no ib_core module)"),
            f"hardware: load its driver (e.g. modprobe mlx5_ib). Soft-RoCE: sudo {SETUP_HOST} "
            f"<netdev> (modprobe rdma_rxe; rdma link add rxe0 type rxe netdev <netdev>). "
            f"A kernel without rdma_rxe: run under {RUN_IN_VM} -- <cmd>",
        ))
    elif root == verbs.SYSFS_IB and not (UVERBS_DIR.is_dir() and any(UVERBS_DIR.glob("uverbs*"))):
        report.problems.append(Problem(
            "RDMA devices exist but /dev/infiniband/uverbs* is missing (user verbs unavailable)",
            "modprobe ib_uverbs",
        ))
    usable_port = False
    for dev in report.devices:
        for p in verbs.list_ports(dev, root):
            info = verbs.port_info(dev, p, root)
            gids = [
                {"index": g.index, "gid": g.text, "type": g.type or "?", "netdev": g.netdev}
                for g in info.gids
            ]
            mtu = _mtu(dev, p) if root == verbs.SYSFS_IB else None
            report.ports.append(PortReport(dev, p, info.state, info.phys_state,
                                           info.link_layer, mtu, gids))
            if not info.active:
                fix = (
                    f"ip link set {_netdev_hint(info)} up (and check the link/cable)"
                    if info.link_layer == "Ethernet"
                    else "check the cable and that a subnet manager runs "
                    "(systemctl start opensm)"
                )
                report.problems.append(Problem(f"{dev} port {p} is {info.state or 'not ACTIVE'}",
                                               fix))
                continue
            if info.link_layer == "Ethernet" and not any(g.is_roce_v2 for g in info.gids):
                report.problems.append(Problem(
                    f"{dev} port {p} has no RoCE v2 GID (only "
                    f"{', '.join(sorted({g.type or '?' for g in info.gids})) or 'none'})",
                    f"give the netdev an IP address: ip addr add <ip>/<len> dev "
                    f"{_netdev_hint(info)}",
                ))
                continue
            usable_port = True
    if report.devices and not usable_port and not report.problems:
        report.problems.append(Problem("no usable RDMA port", f"see the ports above; {SETUP_HOST}"))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        report.memlock = "unlimited"
    else:
        report.memlock = f"{soft} bytes"
        if soft < MEMLOCK_RECOMMENDED:
            report.problems.append(Problem(
                f"memlock limit is {soft} bytes: registering a slab or node pool larger than "
                "that fails (ibv_reg_mr: Cannot allocate memory)",
                "ulimit -l unlimited (shell); LimitMEMLOCK=infinity (systemd); "
                "docker run --ulimit memlock=-1; or raise memlock in /etc/security/limits.conf",
            ))
    running, refused = probe_congestion()
    report.tcp_congestion = (running or "unknown (no TCP_CONGESTION here)") + (
        f"; {refused}" if refused else "")
    report.value_checksums = checksum.describe()
    report.native_core = native_core_line()
    report.tcp_recv_spin = recv_spin()
    report.tcp_send_plan = send_plan()
    cpus = usable_cpus()
    report.tcp_streams = f"{default_streams('tcp', cpus)} ({cpus} usable CPU{'s' * (cpus != 1)})"
    if usable_port and verbs.native_available() and root == verbs.SYSFS_IB:
        try:
            sel = verbs.select()
            report.selected = sel.describe()
            report.memory_windows = _windows(sel)
        except RdmakvError as e:
            report.problems.append(Problem(f"rdmakv cannot select a port: {e}",
                                           f"check {verbs.ENV_DEVICE}/{verbs.ENV_PORT}/"
                                           f"{verbs.ENV_GID_INDEX} overrides"))
    return report


def render(report: Report) -> str:
    lines = [f"native RDMA core: {report.native}"]
    if not report.devices:
        lines.append("RDMA devices: none")
    for pr in report.ports:
        mtu = f"{pr.active_mtu}" if pr.active_mtu else "?"
        lines.append(f"{pr.device} port {pr.port}: {pr.state} ({pr.phys_state}), "
                     f"link layer {pr.link_layer or '?'}, active MTU {mtu}")
        if not pr.gids:
            lines.append("    no GIDs")
        for g in pr.gids:
            lines.append(f"    gid[{g['index']}] {g['gid']}  {g['type']}"
                         + (f"  on {g['netdev']}" if g["netdev"] else ""))
    lines.append(f"memlock limit: {report.memlock}")
    env = {k: os.environ[k] for k in (verbs.ENV_DEVICE, verbs.ENV_PORT, verbs.ENV_GID_INDEX)
           if k in os.environ}
    if env:
        lines.append("overrides: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if report.selected:
        lines.append(f"rdmakv would use: {report.selected}")
    if report.memory_windows:
        lines.append(f"memory windows: {report.memory_windows}")
    lines.append(f"tcp congestion control: {report.tcp_congestion}")
    lines.append(f"value checksums: {report.value_checksums}")
    lines.append(f"tcp connections per node, streams unset: {report.tcp_streams}")
    lines.append(f"native core: {report.native_core}")
    lines.append(f"tcp receive spin: {report.tcp_recv_spin}")
    lines.append(f"tcp send plan: {report.tcp_send_plan}")
    if report.ok:
        lines.append("OK: RDMA is usable (transport auto picks rdma)")
    else:
        lines.append("PROBLEMS (transport auto falls back to tcp):")
        for pb in report.problems:
            lines.append(f"  - {pb.what}\n    fix: {pb.fix}")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    report = diagnose()
    print(json.dumps(report.to_dict(), indent=2) if as_json else render(report))
    return 0 if report.ok else 1
