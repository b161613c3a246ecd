"""Verbs layer: device/port/GID selection and the objects of one RDMA device.

The verbs objects live in the native RDMA module (``rdmakv._native_verbs``, built by
cffi from ``native/``), not in pyverbs: pyverbs keeps its ``ibv_qp*`` /
``ibv_cq*`` in Cython-private fields, so a native hot loop cannot post on a
pyverbs QP without poking at object layouts. Owning PD, MR, CQ and QP in one
small C file keeps the ownership plain and the hot loop free of Python.

Ownership and lifetimes:

* :class:`Device` owns one device context and ONE protection domain. Every
  :class:`MemoryRegion` and :class:`QueuePair` made from it must be closed
  before it (``Device.close`` does this for what it handed out).
* A region (client slab, node pool) is registered ONCE per device
  (:meth:`Device.register`); registering the same range again returns the
  existing region, so callers cannot register a slab twice by accident.
* A :class:`QueuePair` is an RC QP with its own CQ, serving one peer. Its jobs
  (:meth:`QueuePair.run`) are serialised by the caller. After any failed job
  the QP is in ERROR (or was forced there on timeout) and must be
  :meth:`QueuePair.reset` and reconnected before it is used again.
* A :class:`MemoryWindow` (type 2) is allocated from the device's PD and bound
  by :meth:`QueuePair.bind_windows` to a range of a region registered with
  ``windows=True``; only that QP's peer can use its rkey, until
  :meth:`MemoryWindow.close` revokes it (a plain verb: it works whatever state
  the QP is in). Close order: windows, then their QP, then the region, then
  the device -- a QP destroyed with windows still bound to it makes rxe block
  for ~50 s (``QueuePair.close`` therefore closes the windows bound on it
  first).
"""

from __future__ import annotations

import ipaddress
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv import native_core
from rdmakv.errors import ConfigError, RdmaError, RdmaUnavailable

# the RDMA module is optional: without libibverbs-dev rdmakv is TCP-only
_ffi, _lib, NATIVE_ERROR = native_core.load_optional(
    "_native_verbs", "native RDMA core",
    "; install libibverbs-dev and reinstall rdmakv (pip install -e .)",
)

SYSFS_IB = Path("/sys/class/infiniband")
ENV_DEVICE = "RDMAKV_RDMA_DEVICE"
ENV_PORT = "RDMAKV_RDMA_PORT"
ENV_GID_INDEX = "RDMAKV_RDMA_GID_INDEX"

PORT_ACTIVE = 4  # enum ibv_port_state
LINK_LAYER_ETHERNET = 2  # enum ibv_link_layer values reported by ibv_query_port
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu
GID_LEN = 16
ERRLEN = 256

# Per-op status codes (mirror native/rk_verbs.h). Values below 64 are the
# device's ibv_wc_status.
ST_OK = 0
ST_TIMEOUT = 1001
ST_NOT_POSTED = 1002
ST_POST_FAILED = 1003
ST_FLUSHED = 1004
ST_STALLED = 1005
ST_REMOTE_ACCESS = 10  # IBV_WC_REM_ACCESS_ERR: bad remote address or rkey
ST_RETRY_EXCEEDED = 12  # IBV_WC_RETRY_EXC_ERR: peer unreachable or its QP gone
QPS_RTS = 3  # enum ibv_qp_state: RESET=0, INIT, RTR, RTS, SQD, SQE, ERR=6
QPS_ERR = 6
WC_STATUS_NAMES = {
    0: "success",
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "work request flushed",
    9: "remote invalid request",
    10: "remote access error (bad address or rkey)",
    11: "remote operation error",
    12: "transport retry counter exceeded (peer unreachable or dead)",
    13: "RNR retry counter exceeded",
    ST_TIMEOUT: "timed out",
    ST_NOT_POSTED: "not posted (QP had already failed)",
    ST_POST_FAILED: "ibv_post_send failed",
    ST_FLUSHED: "flushed after an earlier failure",
    ST_STALLED: "in flight while the QP stalled (no completion for QP_STALL_S)",
}
# Statuses that say nothing about the op itself: it may be retried on a fresh QP.
RETRYABLE = frozenset({ST_NOT_POSTED, ST_FLUSHED, ST_POST_FAILED, ST_STALLED, 5})

OP_WRITE = 0
OP_READ = 1
OP_FIELDS = 4  # rk_op: local_offset, remote_addr, length, rkey (uint64 each)
_EMPTY_OPS = np.zeros((0, OP_FIELDS), dtype=np.uint64)


def op_table(ops: Any) -> np.ndarray:
    """``ops`` ((local_offset, remote_addr, length[, rkey]) rows) as the
    contiguous uint64 table the native loop reads; a table passes through
    uncopied. A row without an rkey (or rkey 0) uses the job's rkey.

    One C-level conversion instead of 4 cffi attribute sets per op: the rows
    are laid out exactly as rk_op (four uint64, no padding).
    """
    if not len(ops):
        return _EMPTY_OPS
    if (isinstance(ops, np.ndarray) and ops.dtype == np.uint64 and ops.ndim == 2
            and ops.shape[1] == OP_FIELDS and ops.flags.c_contiguous):
        return ops  # already the table (base.make_op_table builds them)
    try:
        arr = np.asarray(ops, dtype=np.uint64).reshape(len(ops), -1)
    except (OverflowError, TypeError, ValueError) as e:  # negative, fractional, ragged
        raise ConfigError(f"I/O ops must be rows of integers in [0, 2**64): {e}") from None
    if arr.shape[1] == OP_FIELDS - 1:  # no rkey column
        arr = np.hstack([arr, np.zeros((len(ops), 1), dtype=np.uint64)])
    if arr.shape[1] != OP_FIELDS:
        raise ConfigError(f"I/O ops must have 3 or 4 fields, got {arr.shape[1]}")
    return np.ascontiguousarray(arr)


# QP transport settings (RTS). timeout is 4.096 us * 2**QP_TIMEOUT: 14 ~ 67 ms,
# large enough for soft-RoCE under emulation, small enough that a dead peer is
# detected in well under a second with QP_RETRY_CNT retries.
QP_TIMEOUT = 14
QP_RETRY_CNT = 7
QP_STALL_S = 2.0
"""Seconds without any completion, while WRs are out, after which a QP counts
as stalled (plus the time the outstanding bytes take at 8 MB/s,
``RK_STALL_FLOOR_BPS``, so a big READ on a slow link is not one): its ops are
given up (``ST_STALLED``, retryable on a reset QP) instead of waiting out the
caller's whole timeout. A device that keeps its retry contract completes or
fails a WR within (QP_RETRY_CNT + 1) transport timeouts, ~0.55 s here;
soft-RoCE was seen to leave a READ batch without either for a bench's whole
120 s (bench/README.md, section "Measurements moved from code comments (issue 58)")."""
QP_RNR_RETRY = 7  # 7 = retry forever; one-sided traffic never sees RNR NAKs
DEFAULT_MAX_WR = 1024  # send queue depth per QP (capped by the device's max_qp_wr)
ENV_INFLIGHT = "RDMAKV_RDMA_INFLIGHT_BYTES"
# Bytes of RDMA WRITE kept in flight per QP: several bandwidth-delay products
# of a 200 Gb/s link (~125 KB at 5 us), so hardware stays busy, while the loop
# keeps posting as completions return. On soft-RoCE this matters a lot: each
# post drives rxe's requester from the posting thread; one huge chain leaves
# it to kernel tasklets, far slower (bench/README.md, "Measurements moved from
# code comments (issue 58)").
DEFAULT_INFLIGHT_BYTES = 1 << 20


def gid_text(gid: bytes) -> str:
    """A GID as text; IPv4-mapped ones (RoCE v2 over IPv4) show the IPv4 address."""
    addr = ipaddress.IPv6Address(gid)
    return f"::ffff:{addr.ipv4_mapped}" if addr.ipv4_mapped else str(addr)


def inflight_bytes_setting() -> int:
    """Bytes of WRITE a QP keeps in flight (RDMAKV_RDMA_INFLIGHT_BYTES; 0 = no limit)."""
    if os.environ.get(ENV_INFLIGHT):
        value = _env_int(ENV_INFLIGHT)
        if value < 0:
            raise ConfigError(f"{ENV_INFLIGHT} must be >= 0, got {value}")
        return value
    return DEFAULT_INFLIGHT_BYTES


def status_name(code: int) -> str:
    return WC_STATUS_NAMES.get(code, f"work completion status {code}")


def native_available() -> bool:
    return _lib is not None


def _need_native() -> Any:
    if _lib is None:
        raise RdmaUnavailable(NATIVE_ERROR or "native RDMA core missing")
    return _lib


# -- discovery (sysfs: works without opening the device) ----------------------
@dataclass(frozen=True)
class GidEntry:
    """One GID table entry of a port, as the kernel reports it in sysfs."""

    index: int
    gid: bytes
    type: str  # "RoCE v2", "IB/RoCE v1", or "" when the kernel does not say
    netdev: str | None

    @property
    def text(self) -> str:
        return gid_text(self.gid)

    @property
    def is_roce_v2(self) -> bool:
        return self.type.strip().lower() == "roce v2"

    @property
    def ipv4_mapped(self) -> bool:
        return ipaddress.IPv6Address(self.gid).ipv4_mapped is not None


@dataclass(frozen=True)
class PortInfo:
    device: str
    port: int
    state: str  # e.g. "ACTIVE", "DOWN"
    phys_state: str
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    lid: int
    gids: tuple[GidEntry, ...] = field(default_factory=tuple)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def list_devices(root: Path = SYSFS_IB) -> list[str]:
    """Names of the RDMA devices the kernel knows (empty without any)."""
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def list_ports(device: str, root: Path = SYSFS_IB) -> list[int]:
    try:
        return sorted(int(p.name) for p in (root / device / "ports").iterdir())
    except OSError:
        return []


def port_info(device: str, port: int, root: Path = SYSFS_IB) -> PortInfo:
    """State, link layer and non-empty GIDs of one port, read from sysfs."""
    base = root / device / "ports" / str(port)
    if not base.is_dir():
        raise RdmaUnavailable(f"RDMA device {device!r} has no port {port}")
    gids = []
    gid_dir = base / "gids"
    try:
        indexes = sorted(int(p.name) for p in gid_dir.iterdir())
    except OSError:
        indexes = []
    for i in indexes:
        text = _read(gid_dir / str(i))
        if not text:
            continue
        raw = bytes.fromhex(text.replace(":", ""))
        if len(raw) != GID_LEN or raw == bytes(GID_LEN):
            continue  # empty slot
        gtype = _read(base / "gid_attrs" / "types" / str(i))
        ndev = _read(base / "gid_attrs" / "ndevs" / str(i)) or None
        gids.append(GidEntry(i, raw, gtype, ndev))

    def after_colon(s: str) -> str:  # "4: ACTIVE" -> "ACTIVE"
        return s.split(":", 1)[1].strip() if ":" in s else s

    lid_text = _read(base / "lid")
    return PortInfo(
        device=device,
        port=port,
        state=after_colon(_read(base / "state")),
        phys_state=after_colon(_read(base / "phys_state")),
        link_layer=_read(base / "link_layer"),
        lid=int(lid_text, 16) if lid_text else 0,
        gids=tuple(gids),
    )


def best_gid(info: PortInfo) -> GidEntry | None:
    """RoCE v2 with an IPv4-mapped address first (routable, what RoCE fabrics
    use), then any RoCE v2, then whatever else the port has."""

    def rank(g: GidEntry) -> tuple[int, int]:
        return (0 if g.is_roce_v2 else 1, 0 if g.ipv4_mapped else 1)

    return min(info.gids, key=lambda g: (*rank(g), g.index), default=None)


@dataclass(frozen=True)
class Selection:
    """Which device, port and GID index to use, and why."""

    device: str
    port: int
    gid_index: int
    gid: bytes
    gid_type: str
    link_layer: str
    lid: int

    def describe(self) -> str:
        return (
            f"{self.device} port {self.port} gid[{self.gid_index}]="
            f"{gid_text(self.gid)} ({self.gid_type or self.link_layer})"
        )


def select(
    device: str | None = None, port: int | None = None, gid_index: int | None = None
) -> Selection:
    """Pick device, port and GID; explicit arguments (or the environment
    variables RDMAKV_RDMA_DEVICE / _PORT / _GID_INDEX) override the choice.

    Raises :class:`RdmaUnavailable` saying why when nothing usable exists.
    """
    device = device or os.environ.get(ENV_DEVICE) or None
    if port is None and os.environ.get(ENV_PORT):
        port = _env_int(ENV_PORT)
    if gid_index is None and os.environ.get(ENV_GID_INDEX):
        gid_index = _env_int(ENV_GID_INDEX)
    devices = list_devices()
    if not devices:
        raise RdmaUnavailable(
            "no RDMA device (/sys/class/infiniband is empty or missing); "
            "see `rdmakv doctor` (soft-RoCE: deploy/softroce/setup-host.sh)"
        )
    if device is not None and device not in devices:
        raise RdmaUnavailable(f"RDMA device {device!r} not found (have: {', '.join(devices)})")
    reasons = []
    for dev in [device] if device else devices:
        for p in [port] if port is not None else list_ports(dev):
            info = port_info(dev, p)
            if not info.active:
                reasons.append(f"{dev} port {p} is {info.state or 'in an unknown state'}")
                continue
            if gid_index is not None:
                entry = next((g for g in info.gids if g.index == gid_index), None)
                if entry is None:
                    reasons.append(f"{dev} port {p} has no GID at index {gid_index}")
                    continue
            else:
                entry = best_gid(info)
                if entry is None:
                    reasons.append(f"{dev} port {p} has no GID")
                    continue
            return Selection(dev, p, entry.index, entry.gid, entry.type, info.link_layer, info.lid)
    raise RdmaUnavailable("no usable RDMA port: " + "; ".join(reasons or ["no ports"]))


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


# -- connection info --------------------------------------------------------
@dataclass(frozen=True)
class ConnInfo:
    """What one side of an RC connection tells the other over the control
    channel: its QP, its address, and the one registered region it exposes."""

    qpn: int
    psn: int
    gid: bytes
    lid: int
    mtu: int  # enum ibv_mtu of the sender's port
    region_addr: int
    region_len: int
    rkey: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form for the control channel."""
        return {
            "qpn": self.qpn,
            "psn": self.psn,
            "gid": self.gid.hex(),
            "lid": self.lid,
            "mtu": self.mtu,
            "region_addr": self.region_addr,
            "region_len": self.region_len,
            "rkey": self.rkey,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ConnInfo:
        """Parse and validate a peer's connection info (untrusted input)."""
        if not isinstance(d, dict):
            raise RdmaError(f"RDMA connection info must be an object, got {type(d).__name__}")
        limits = {
            "qpn": 1 << 24,
            "psn": 1 << 24,
            "lid": 1 << 16,
            "mtu": 6,
            "region_addr": 1 << 64,
            "region_len": 1 << 64,
            "rkey": 1 << 32,
        }
        vals: dict[str, int] = {}
        for name, bound in limits.items():
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or not (0 <= v < bound):
                raise RdmaError(f"RDMA connection info field {name!r} invalid: {v!r}")
            vals[name] = v
        if vals["mtu"] not in MTU_BYTES:
            raise RdmaError(f"RDMA connection info mtu {vals['mtu']} is not an ibv_mtu value")
        gid_hex = d.get("gid")
        try:
            gid = bytes.fromhex(gid_hex) if isinstance(gid_hex, str) else b""
        except ValueError:
            gid = b""
        if len(gid) != GID_LEN:
            raise RdmaError(f"RDMA connection info gid invalid: {gid_hex!r}")
        return cls(gid=gid, **vals)


# -- device objects ------------------------------------------------------------
_Owners = list["weakref.ref[Any]"] | None


def _holds(ref: weakref.ref[Any]) -> bool:
    """The owner behind ``ref`` is alive and not closed: its memory is still the range."""
    owner = ref()
    return owner is not None and not getattr(owner, "closed", False)


@dataclass(frozen=True)
class DeviceAttrs:
    max_sge: int
    max_qp_wr: int
    max_qp_rd_atom: int
    max_cqe: int
    max_mr_size: int
    port_state: int
    active_mtu: int
    max_msg_sz: int
    lid: int
    link_layer: int
    gid_tbl_len: int


@dataclass(frozen=True)
class JobStats:
    """What one :meth:`QueuePair.run` did (for the bench and tests)."""

    wrs: int
    sges: int
    post_calls: int
    signaled: int
    polls: int
    max_outstanding: int
    first_error: int
    failed_ops: int


class MemoryRegion:
    """One registered range; dies with :meth:`close` or its :class:`Device`."""

    def __init__(self, dev: Device, handle: Any, addr: int, length: int) -> None:
        self._dev = dev
        self._h = handle
        self.addr = addr
        self.length = length
        lib = _need_native()
        self.lkey: int = int(lib.rk_mr_lkey(handle))
        self.rkey: int = int(lib.rk_mr_rkey(handle))
        self.windows = False  # registered for memory-window access only

    def contains(self, addr: int, length: int) -> bool:
        return length >= 0 and self.addr <= addr and addr + length <= self.addr + self.length

    def _dereg(self) -> None:
        if self._h is not None:
            _need_native().rk_dereg_mr(self._h)
            self._h = None

    def close(self) -> None:
        self._dereg()
        self._dev._forget(self)


class MemoryWindow:
    """A type-2 memory window. ``rkey`` is the key it was last bound with
    (0 before the first bind). Revoked for good by :meth:`close`; closing
    twice is harmless. Must be closed before the QP it is bound on."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self.rkey = 0
        self.qp: QueuePair | None = None

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        if self._h is not None:
            _need_native().rk_mw_dealloc(self._h)
            self._h = None
            if self.qp is not None:
                self.qp._windows.discard(self)
                self.qp = None


class Device:
    """An opened RDMA device port with its one protection domain."""

    def __init__(self, sel: Selection | None = None) -> None:
        lib = _need_native()
        self.sel = sel or select()
        err = _ffi.new("char[]", ERRLEN)
        self._ctx = lib.rk_open(self.sel.device.encode(), self.sel.port, err)
        if self._ctx == _ffi.NULL:
            raise RdmaUnavailable(f"cannot open {self.sel.device}: {_ffi.string(err).decode()}")
        a = _ffi.new("rk_attrs*")
        if lib.rk_query(self._ctx, a, err) != 0:
            lib.rk_close(self._ctx)
            raise RdmaUnavailable(f"cannot query {self.sel.device}: {_ffi.string(err).decode()}")
        self.attrs = DeviceAttrs(
            a.max_sge,
            a.max_qp_wr,
            a.max_qp_rd_atom,
            a.max_cqe,
            a.max_mr_size,
            a.port_state,
            a.active_mtu,
            a.max_msg_sz,
            a.lid,
            a.link_layer,
            a.gid_tbl_len,
        )
        if a.port_state != PORT_ACTIVE:
            self.close()
            raise RdmaUnavailable(f"{self.sel.device} port {self.sel.port} is not ACTIVE")
        self._lock = threading.Lock()
        self._regions: dict[tuple[int, int], tuple[MemoryRegion, _Owners]] = {}
        """(addr, length) -> the region and the owners it was asked for by (None: no
        owner, registered for good)."""
        self._qps: list[QueuePair] = []

    @property
    def registrations(self) -> int:
        """How many ibv_reg_mr calls this device has made (tests: 'once')."""
        return int(_need_native().rk_reg_count(self._ctx)) if self._ctx else 0

    @property
    def supports_windows(self) -> bool:
        """The device reports type-2 memory windows (max_mw > 0, MEM_WINDOW_TYPE_2A/2B)."""
        return bool(self._ctx) and bool(_need_native().rk_mw_supported(self._ctx))

    def alloc_window(self) -> MemoryWindow:
        """A fresh type-2 memory window (unbound: grants nothing until bound)."""
        err = _ffi.new("char[]", ERRLEN)
        h = _need_native().rk_mw_alloc(self._ctx, err)
        if h == _ffi.NULL:
            raise RdmaError(
                f"allocating a memory window on {self.sel.device} failed: "
                f"{_ffi.string(err).decode()}"
            )
        return MemoryWindow(h)

    def register(
        self, addr: int, length: int, owner: object | None = None, *, windows: bool = False
    ) -> MemoryRegion:
        """Register [addr, addr+length) for local write + remote read/write.

        With ``windows`` the region grants NO remote access through its own
        rkey: only through memory windows bound to it (see
        :meth:`QueuePair.bind_windows`). A range registered one way and asked
        for the other way is an error (the two must not be mixed silently).

        Registered ONCE per range: asking again returns the existing region.
        ``owner`` (e.g. the Slab) ties the registration to that object. While
        any owner it was asked for by is alive and not closed, the range is that
        owner's memory, so the region is shared by every owner of it (two slabs
        laid over one buffer, two connections over one slab). Once all of them
        are gone or closed, the registration is stale (it pins pages that may
        no longer be the range's), so it is dropped and registered afresh.
        """
        if addr <= 0 or length <= 0:
            raise ConfigError(f"cannot register addr=0x{addr:x} length={length}")
        with self._lock:
            entry = self._regions.get((addr, length))
            if entry is not None:
                mr, refs = entry
                live = None if refs is None else [r for r in refs if _holds(r)]
                if live is None or live:
                    if mr.windows != windows:
                        raise ConfigError(
                            f"0x{addr:x}+{length} is already registered "
                            f"{'for windows only' if mr.windows else 'with remote access'}"
                        )
                    if live is not None and owner is not None and all(
                        r() is not owner for r in live
                    ):
                        live.append(weakref.ref(owner))
                    self._regions[(addr, length)] = (mr, live)
                    return mr
                del self._regions[(addr, length)]
                mr._dereg()
            err = _ffi.new("char[]", ERRLEN)
            h = _need_native().rk_reg_mr(self._ctx, addr, length, 2 if windows else 1, err)
            if h == _ffi.NULL:
                raise RdmaError(
                    f"registering {length} bytes at 0x{addr:x} on {self.sel.device} failed: "
                    f"{_ffi.string(err).decode()} (memlock limit? see `rdmakv doctor`)"
                )
            mr = MemoryRegion(self, h, addr, length)
            mr.windows = windows
            owners = [weakref.ref(owner)] if owner is not None else None
            self._regions[(addr, length)] = (mr, owners)
            return mr

    def _forget(self, mr: MemoryRegion) -> None:
        with self._lock:
            entry = self._regions.get((mr.addr, mr.length))
            if entry is not None and entry[0] is mr:
                del self._regions[(mr.addr, mr.length)]

    def create_qp(self, max_wr: int = DEFAULT_MAX_WR) -> QueuePair:
        qp = QueuePair(self, max_wr)
        with self._lock:
            self._qps.append(qp)
        return qp

    def _drop_qp(self, qp: QueuePair) -> None:
        with self._lock:
            if qp in self._qps:
                self._qps.remove(qp)

    def close(self) -> None:
        """Destroy every QP and MR made from this device, then the PD/context."""
        if getattr(self, "_ctx", None) is None:
            return
        for qp in list(getattr(self, "_qps", [])):
            qp.close()
        for mr, _ in list(getattr(self, "_regions", {}).values()):
            mr.close()
        _need_native().rk_close(self._ctx)
        self._ctx = None

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class QueuePair:
    """An RC queue pair (with its own CQ) to one peer. Not thread-safe: the
    owner serialises :meth:`run` / :meth:`reset` / :meth:`connect`."""

    def __init__(self, dev: Device, max_wr: int) -> None:
        lib = _need_native()
        self.dev = dev
        a = dev.attrs
        self.max_wr = max(1, min(max_wr, a.max_qp_wr, a.max_cqe))
        self.max_sge = a.max_sge
        self.max_rd_atom = max(1, a.max_qp_rd_atom)
        err = _ffi.new("char[]", ERRLEN)
        self._h = lib.rk_qp_create(dev._ctx, self.max_wr, self.max_sge, self.max_rd_atom, err)
        if self._h == _ffi.NULL:
            why = _ffi.string(err).decode()
            raise RdmaError(f"creating a QP on {dev.sel.device} failed: {why}")
        self.connected = False
        self.max_inflight_bytes = inflight_bytes_setting()
        self._status_buf: Any = None
        self._cap = 0
        self._windows: set[MemoryWindow] = set()  # bound on this QP, closed before it

    def bind_windows(
        self,
        region: MemoryRegion,
        windows: list[MemoryWindow],
        ranges: list[tuple[int, int]],
        *,
        read: bool,
        write: bool,
        timeout: float,
    ) -> list[int]:
        """Bind ``windows[i]`` over ``ranges[i]`` (addr, length) of ``region``
        on this QP (posting BIND_MW work requests; serialise with :meth:`run`).
        Returns per-window status (0: bound, its ``rkey`` updated). A window
        that failed to bind is unusable: close it."""
        n = len(windows)
        if n == 0:
            return []
        for addr, length in ranges:
            if not region.contains(addr, length) or length <= 0:
                raise ConfigError(f"window 0x{addr:x}+{length} is outside the region")
        hs = _ffi.new("rk_mw*[]", [w._h for w in windows])
        addrs = _ffi.new("uint64_t[]", [a for a, _ in ranges])
        lens = _ffi.new("uint64_t[]", [n_ for _, n_ in ranges])
        status = _ffi.new("int32_t[]", n)
        access = (1 if read else 0) | (2 if write else 0)
        lib = _need_native()
        lib.rk_qp_bind_mws(self._h, region._h, hs, addrs, lens, access, n, status, float(timeout))
        out = list(_ffi.unpack(status, n))
        for w, st in zip(windows, out, strict=True):
            w.qp = self
            self._windows.add(w)
            if st == ST_OK:
                w.rkey = int(lib.rk_mw_rkey(w._h))
        return out

    def local_info(self, region: MemoryRegion) -> ConnInfo:
        """This side's connection info, exposing ``region`` to the peer."""
        info = _ffi.new("rk_qp_info*")
        _need_native().rk_qp_info_get(self._h, info)
        s = self.dev.sel
        return ConnInfo(
            int(info.qpn),
            int(info.psn),
            s.gid,
            s.lid,
            self.dev.attrs.active_mtu,
            region.addr,
            region.length,
            region.rkey,
        )

    def connect(self, remote: ConnInfo) -> None:
        """INIT -> RTR -> RTS against ``remote``."""
        r = _ffi.new("rk_remote*")
        r.qpn, r.psn, r.lid, r.mtu = remote.qpn, remote.psn, remote.lid, remote.mtu
        _ffi.memmove(r.gid, remote.gid, GID_LEN)
        use_grh = 1 if self.dev.attrs.link_layer == LINK_LAYER_ETHERNET or remote.lid == 0 else 0
        err = _ffi.new("char[]", ERRLEN)
        rc = _need_native().rk_qp_connect(
            self._h, r, self.dev.sel.gid_index, use_grh, QP_TIMEOUT, QP_RETRY_CNT, QP_RNR_RETRY, err
        )
        if rc != 0:
            raise RdmaError(f"QP connect failed: {_ffi.string(err).decode()}")
        self.connected = True

    def reset(self) -> None:
        """Back to INIT with a fresh PSN; the peer must reconnect too."""
        err = _ffi.new("char[]", ERRLEN)
        self.connected = False
        if _need_native().rk_qp_reset(self._h, err) != 0:
            raise RdmaError(f"QP reset failed: {_ffi.string(err).decode()}")

    def state(self) -> int:
        """ibv_qp_state (QPS_RTS, QPS_ERR, ...)."""
        return int(_need_native().rk_qp_state(self._h))

    def force_error(self) -> None:
        """Move the QP to ERROR (fault injection in tests)."""
        _need_native().rk_qp_force_error(self._h)

    def run(
        self,
        opcode: int,
        local: MemoryRegion,
        rkey: int,
        ops: Any,
        timeout: float,
        sge_limit: int = 0,
        signal_every: int = 0,
        max_inflight_bytes: int | None = None,
        stall_s: float = QP_STALL_S,
    ) -> tuple[list[int], JobStats]:
        """Run one job of same-opcode ops; returns per-op status and stats.

        ``ops`` is a sequence of (local_offset, remote_addr, length). The call
        releases the GIL and returns within ``timeout`` (plus a bounded drain),
        or once the QP gave no completion for ``stall_s`` (0: never); a
        non-zero status means that op's bytes were not (all) moved.
        """
        lib = _need_native()
        n = len(ops)
        if n > self._cap:
            self._cap = max(n, 2 * self._cap)
            self._status_buf = _ffi.new("int32_t[]", self._cap)
        table = op_table(ops)
        buf = _ffi.from_buffer("rk_op[]", table)
        st = _ffi.new("rk_stats*")
        if max_inflight_bytes is not None:
            inflight = max_inflight_bytes
        else:  # reads are already bounded by max_qp_rd_atom outstanding WRs
            inflight = self.max_inflight_bytes if opcode == OP_WRITE else 0
        lib.rk_qp_run(
            self._h,
            opcode,
            local.addr,
            local.lkey,
            rkey,
            buf,
            n,
            self._status_buf,
            sge_limit,
            signal_every,
            inflight,
            float(timeout),
            float(stall_s),
            st,
        )
        status = list(_ffi.unpack(self._status_buf, n)) if n else []
        stats = JobStats(
            st.wrs,
            st.sges,
            st.post_calls,
            st.signaled,
            st.polls,
            st.max_outstanding,
            st.first_error,
            st.failed_ops,
        )
        return status, stats

    def close(self) -> None:
        for w in list(self._windows):  # first: rxe blocks destroying a QP with bound windows
            w.close()
        if self._h is not None:
            _need_native().rk_qp_destroy(self._h)
            self._h = None
            self.dev._drop_qp(self)
