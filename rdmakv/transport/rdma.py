"""The ``rdma`` transport: one-sided RDMA WRITE/READ over RC queue pairs.

Client side (:class:`RdmaTransport`): the client slab is registered once per
device (shared by every peer); each peer connection gets one RC QP whose
connection info is exchanged with the node over the control channel
(``Op.RDMA_CONNECT``, JSON :class:`~rdmakv.transport.verbs.ConnInfo` both
ways). A put is RDMA WRITEs from slab blocks into node extents, a get is RDMA
READs from leased node extents into slab blocks; the node CPU is not in the
data path. Batches go to the native hot loop (SGL gathering, chained WRs,
selective signalling, bounded outstanding WRs, batched CQ polling).

Node side (:class:`RdmaNodeDataPath`): the pool is registered ONCE at start;
each session that sends ``RDMA_CONNECT`` gets its own QP (a repeated connect
replaces it: that is how a client recovers from a QP error), destroyed when the
session ends or on ``RDMA_DISCONNECT``.

Failure rules:

* Every batch returns within its timeout (the native loop forces the QP to
  ERROR and drains it on timeout), so once ``write``/``read`` returns no WR
  still touches the slab or a leased extent: the caller may release leases.
* Ops the device failed (bad address / rkey, peer unreachable) fail the batch
  with :class:`RdmaOpsFailed`, which names the failed op indexes; ops that were
  only flushed behind a failure are retried once on a fresh QP.
* After any failure the QP is reset and reconnected before the next batch;
  if reconnecting fails the error says so and the next batch tries again.
* :func:`client_transport` (``auto``) falls back to TCP, logging why, when
  RDMA cannot be set up with a peer.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rdmakv.errors import (
    ConfigError,
    RdmaError,
    RdmakvError,
    RdmaUnavailable,
    TransportTimeout,
)
from rdmakv.protocol import Channel, Header, NodeInfo, Op, decode_json, encode_json
from rdmakv.slab import Slab
from rdmakv.transport import verbs
from rdmakv.transport.base import (
    IoFuture,
    IoOp,
    NodeDataPath,
    NodeHandler,
    NodeSession,
    Transport,
    check_local_ops,
)

log = logging.getLogger("rdmakv.rdma")

RETRY_ROUNDS = 1
"""How often ops flushed behind a failure are retried on a reconnected QP."""


class RdmaOpsFailed(RdmaError):
    """Some ops of a batch failed on the device; ``failed`` are their indexes
    in the batch (the other ops' bytes moved). ``statuses`` maps index -> code."""

    def __init__(self, msg: str, failed: list[int], statuses: dict[int, int]) -> None:
        super().__init__(msg)
        self.failed = failed
        self.statuses = statuses


# -- one shared device per process -------------------------------------------------
class _SharedDevice:
    """The process-wide :class:`verbs.Device`: every transport and data path in
    a process shares one PD, so a slab registered for one peer is registered
    for all, exactly once, and stays registered across reconnects. The device
    lives until the process exits (like a GPU context); registrations of
    closed slabs are replaced when the range is registered again."""

    _lock = threading.Lock()
    _dev: verbs.Device | None = None

    @classmethod
    def acquire(cls) -> verbs.Device:
        with cls._lock:
            if cls._dev is None:
                cls._dev = verbs.Device(verbs.select())
                atexit.register(cls._close)
                log.info("rdmakv rdma: using %s", cls._dev.sel.describe())
            return cls._dev

    @classmethod
    def _close(cls) -> None:
        with cls._lock:
            if cls._dev is not None:
                cls._dev.close()
                cls._dev = None


def rdma_usable() -> tuple[bool, str]:
    """(True, description) when a usable device/port/GID and the native core
    exist, else (False, why)."""
    if not verbs.native_available():
        return False, verbs.NATIVE_ERROR or "native RDMA core missing"
    try:
        return True, verbs.select().describe()
    except (RdmaUnavailable, ConfigError) as e:
        return False, str(e)


class RdmaTransport(Transport):
    """Client side of one peer connection. Not thread-safe: the KVClient
    serialises batches (each completes before ``write``/``read`` returns)."""

    name = "rdma"

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch = channel
        self._info = info
        self._timeout = timeout
        self._dev = _SharedDevice.acquire()
        self._mr: verbs.MemoryRegion | None = None
        self._slab: Slab | None = None
        self._remote: verbs.ConnInfo | None = None
        self.last_stats: verbs.JobStats | None = None
        self.last_run_s = 0.0  # seconds the last batch spent in the native loop (bench)
        self.reconnects = 0
        self.sge_limit = 0  # 0 = the device's max_sge
        try:
            self._qp = self._dev.create_qp()
            self._connect()
        except BaseException:
            self._release()
            raise

    # -- connection ----------------------------------------------------------
    def _connect(self) -> None:
        """Exchange QP info with the node over the control channel, go to RTS."""
        mine = self._qp.local_info(self._mr) if self._mr else self._placeholder_info()
        self._ch.sock.settimeout(self._timeout)
        _, payload = self._ch.call(
            Op.RDMA_CONNECT, encode_json({"conn": mine.to_dict()}), "RDMA_CONNECT"
        )
        remote = verbs.ConnInfo.from_dict(decode_json(bytes(payload), "RDMA_CONNECT").get("conn"))
        info = self._info
        if remote.region_addr != info.pool_base or remote.region_len != info.pool_len:
            raise RdmaError(
                f"node's RDMA region 0x{remote.region_addr:x}+{remote.region_len} does not "
                f"match its pool 0x{info.pool_base:x}+{info.pool_len}"
            )
        self._qp.connect(remote)
        self._remote = remote

    def _placeholder_info(self) -> verbs.ConnInfo:
        # The node never initiates I/O, so before the slab is registered the
        # client exposes no region (zero address/length/rkey).
        full = self._qp.local_info(_NO_REGION)
        return full

    def _reconnect(self) -> None:
        self.reconnects += 1
        self._remote = None
        self._qp.reset()
        self._connect()

    # -- Transport -------------------------------------------------------------
    def register_local(self, slab: Slab) -> None:
        """Register the slab with the device (a no-op if it already is)."""
        self._mr = self._dev.register(slab.base_addr, slab.nbytes, owner=slab)
        self._slab = slab

    @property
    def device(self) -> verbs.Device:
        return self._dev

    @property
    def qp(self) -> verbs.QueuePair:
        return self._qp

    def write(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        return self._run(verbs.OP_WRITE, ops, timeout)

    def read(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        return self._run(verbs.OP_READ, ops, timeout)

    def _check_remote(self, ops: Sequence[IoOp]) -> None:
        lo, hi = self._info.pool_base, self._info.pool_base + self._info.pool_len
        for op in ops:
            if op.length < 0 or op.remote_addr < lo or op.remote_addr + op.length > hi:
                raise ConfigError(f"I/O op {op} lies outside the node pool 0x{lo:x}..0x{hi:x}")

    def _run(self, opcode: int, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        check_local_ops(ops, self._slab)
        self._check_remote(ops)
        assert self._mr is not None
        if not ops:
            return IoFuture.completed()
        what = "RDMA WRITE" if opcode == verbs.OP_WRITE else "RDMA READ"
        try:
            if self._remote is None:  # an earlier failure left us disconnected
                self._reconnect()
            self._run_job(opcode, ops, timeout, what)
        except RdmakvError as e:
            return IoFuture.completed(e)
        return IoFuture.completed()

    def _run_job(self, opcode: int, ops: Sequence[IoOp], timeout: float, what: str) -> None:
        assert self._mr is not None and self._remote is not None
        pending = list(range(len(ops)))
        hard: dict[int, int] = {}
        for round_ in range(RETRY_ROUNDS + 1):
            t0 = time.perf_counter()
            status, stats = self._qp.run(
                opcode,
                self._mr,
                self._remote.rkey,
                ops if len(pending) == len(ops) else [ops[i] for i in pending],
                timeout,
                sge_limit=self.sge_limit,
            )
            self.last_run_s = time.perf_counter() - t0
            self.last_stats = stats
            if stats.failed_ops == 0:
                break
            failed = [(pending[j], s) for j, s in enumerate(status) if s != verbs.ST_OK]
            retry = [i for i, s in failed if s in verbs.RETRYABLE]
            hard.update((i, s) for i, s in failed if s not in verbs.RETRYABLE)
            timed_out = any(s == verbs.ST_TIMEOUT for _, s in failed)
            log.warning(
                "rdmakv rdma: %s: %d of %d ops failed (first: %s); resetting the QP",
                what,
                len(failed),
                len(pending),
                verbs.status_name(stats.first_error),
            )
            # The QP is in ERROR now; reconnect so the next batch (and the retry)
            # runs on a working QP. The node replaces its QP on RDMA_CONNECT.
            self._reconnect_or_mark()
            if timed_out:
                for i, s in failed:
                    hard.setdefault(i, s)
                raise TransportTimeout(
                    f"{what}: {len(failed)} of {len(ops)} ops not done within {timeout} s"
                )
            if not retry or round_ == RETRY_ROUNDS or self._remote is None:
                hard.update((i, s) for i, s in failed if i not in hard)
                break
            pending = retry
        if hard:
            first = min(hard)
            raise RdmaOpsFailed(
                f"{what}: {len(hard)} of {len(ops)} ops failed "
                f"(op {first}: {verbs.status_name(hard[first])})",
                sorted(hard),
                hard,
            )

    def _reconnect_or_mark(self) -> None:
        try:
            self._reconnect()
        except RdmakvError as e:
            log.warning("rdmakv rdma: reconnecting the QP failed: %s", e)
            self._remote = None

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        qp = getattr(self, "_qp", None)
        if qp is not None:
            qp.close()
            self._qp = None  # type: ignore[assignment]
        self._mr = None
        self._slab = None


class _NoRegion:
    """Stands in for a region before the client slab is registered."""

    addr = 0
    length = 0
    rkey = 0


_NO_REGION: Any = _NoRegion()


def client_transport(
    channel: Channel, info: NodeInfo, timeout: float, *, required: bool = False
) -> Transport:
    """``auto``: RDMA when a usable device exists and the node offers it, else
    TCP. Logs which and why. ``required=True`` (transport ``rdma``) raises
    instead of falling back."""
    from rdmakv.transport.tcp import TcpTransport

    ok, why = rdma_usable()
    if ok and "rdma" not in info.transports:
        ok, why = False, f"the node does not offer rdma (offers {', '.join(info.transports)})"
    if ok:
        try:
            t = RdmaTransport(channel, info, timeout)
            log.info("rdmakv: transport rdma (%s)", why)
            return t
        except RdmakvError as e:
            ok, why = False, f"RDMA set-up with the node failed: {e}"
    if required:
        raise RdmaUnavailable(why)
    log.warning("rdmakv: transport tcp (RDMA not used: %s)", why)
    return TcpTransport(channel, info, timeout)


class RdmaNodeDataPath(NodeDataPath):
    """Node side: the pool is registered once; one QP per connected session."""

    name = "rdma"

    def __init__(self, pool: Slab) -> None:
        super().__init__(pool)
        self._dev = _SharedDevice.acquire()
        self._mr = self._dev.register(pool.base_addr, pool.nbytes, owner=pool)
        self._lock = threading.Lock()
        self._qps: dict[int, verbs.QueuePair] = {}

    @property
    def rkey(self) -> int:
        return self._mr.rkey

    @property
    def device(self) -> verbs.Device:
        return self._dev

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.RDMA_CONNECT: self._connect, Op.RDMA_DISCONNECT: self._disconnect}

    def _connect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        remote = verbs.ConnInfo.from_dict(decode_json(bytes(payload), "RDMA_CONNECT").get("conn"))
        qp = self._dev.create_qp()
        try:
            qp.connect(remote)
            mine = qp.local_info(self._mr)
        except BaseException:
            qp.close()
            raise
        with self._lock:
            old = self._qps.pop(session.session_id, None)
            self._qps[session.session_id] = qp
        if old is not None:
            old.close()
        session.reply(req, encode_json({"conn": mine.to_dict()}))

    def _disconnect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        self._drop(session.session_id)
        session.reply(req)

    def _drop(self, session_id: int) -> None:
        with self._lock:
            qp = self._qps.pop(session_id, None)
        if qp is not None:
            qp.close()

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._qps)

    def session_closed(self, session: NodeSession) -> None:
        self._drop(session.session_id)

    def close(self) -> None:
        with self._lock:
            qps, self._qps = list(self._qps.values()), {}
        for qp in qps:
            qp.close()
        self._mr.close()  # the pool is going away with the node


def node_data_path_or_none(pool: Slab) -> RdmaNodeDataPath | None:
    """The node's RDMA data path, or None (logged) when RDMA is unusable here."""
    ok, why = rdma_usable()
    if not ok:
        log.warning("rdmakv node: rdma not offered (%s); serving tcp only", why)
        return None
    try:
        dp = RdmaNodeDataPath(pool)
    except RdmakvError as e:
        log.warning("rdmakv node: rdma not offered (%s); serving tcp only", e)
        return None
    log.info("rdmakv node: rdma offered on %s", dp.device.sel.describe())
    return dp


def _register() -> None:
    from rdmakv.transport import TransportSpec, register_transport

    register_transport(
        TransportSpec("rdma", RdmaTransport, RdmaNodeDataPath, usable=lambda: rdma_usable()[0])
    )


_register()
