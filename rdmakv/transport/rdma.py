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

* Batches run on a per-connection worker thread; the returned future's
  ``result`` never waits past the batch timeout (the native loop, or the
  future, forces the QP to ERROR and drains it), and once it returns or
  raises no WR still touches the slab or a leased extent: the caller may
  release leases and reuse blocks.
* Ops the device failed (bad address / rkey, peer unreachable) fail the batch
  with :class:`RdmaOpsFailed`, which names the failed op indexes; ops that were
  only flushed behind a failure are retried once on a fresh QP.
* After any failure the QP is reset and reconnected (on the caller's thread,
  over the control channel) before the next batch; if reconnecting fails the
  error says so and the next batch tries again.
* :func:`client_transport` (``auto``) falls back to TCP, logging why, when
  RDMA cannot be set up with a peer.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdmakv.errors import (
    ConfigError,
    ConnectionLost,
    OpsFailed,
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


@dataclass
class DataPathTotals:
    """Running totals of what the native loop did on one transport (bench)."""

    batches: int = 0
    wrs: int = 0
    sges: int = 0
    busy_s: float = 0.0

    def add(self, stats: verbs.JobStats, seconds: float) -> None:
        self.batches += 1
        self.wrs += stats.wrs
        self.sges += stats.sges
        self.busy_s += seconds

    def snapshot(self) -> DataPathTotals:
        return DataPathTotals(self.batches, self.wrs, self.sges, self.busy_s)


class RdmaOpsFailed(RdmaError, OpsFailed):
    """Some ops of a batch failed on the device; ``failed`` are their indexes
    in the batch (the other ops' bytes moved, the QP was already reset and
    reconnected or will be before the next batch). ``statuses`` maps index ->
    completion code."""

    def __init__(self, msg: str, failed: list[int], statuses: dict[int, int]) -> None:
        OpsFailed.__init__(self, msg, failed)
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


class _Job:
    """One batch handed to the QP worker."""

    __slots__ = ("done", "opcode", "ops", "started", "stats", "status", "table", "timeout")

    def __init__(self, opcode: int, ops: list[IoOp], timeout: float) -> None:
        self.opcode = opcode
        self.ops = ops
        # Built on the submitting thread, while the QP still runs the previous
        # batch: converting on the worker would leave the QP idle meanwhile.
        self.table = verbs.op_table(ops)
        self.timeout = timeout
        self.status: list[int] | None = None  # None: skipped (QP was broken)
        self.stats: verbs.JobStats | None = None
        self.started = threading.Event()  # the worker has it (set before the native call)
        self.done = threading.Event()


class RdmaFuture(IoFuture):
    """Completion of one RDMA batch. ``result`` runs on the caller's thread:
    that is where a broken QP is reset and reconnected (over the control
    channel, which only the caller may use) and flushed ops are retried.

    When ``result`` returns or raises, no WR of this batch touches memory any
    more: on a timeout the QP is forced to ERROR and the worker's bounded
    drain is awaited first, so leases may be released and blocks reused.
    """

    def __init__(self, tp: RdmaTransport, job: _Job) -> None:
        super().__init__(job.timeout)
        self._tp = tp
        self._job = job
        self._settled = False

    def done(self) -> bool:
        return self._job.done.is_set()

    def result(self, timeout: float | None = None) -> None:
        if not self._settled:
            wait = self._job.timeout if timeout is None else timeout
            if not self._job.done.wait(wait):
                self._tp._abort_inflight()
                if self._job.done.wait(DRAIN_WAIT_S + self._job.timeout):
                    self._tp._recover_quietly()
                self._settled = True
                self._error = TransportTimeout(
                    f"RDMA batch of {len(self._job.ops)} ops not complete after {wait} s"
                )
            else:
                self._settled = True
                self._error = self._tp._settle(self._job)
        if self._error is not None:
            raise self._error


WORKER_HANDOFF_S = 0.05
"""Longest a submit waits for an idle QP worker to take its batch."""
DRAIN_WAIT_S = 5.0
"""Extra wait for the worker after forcing the QP to ERROR (the native loop's
own drain is bounded at 2 s; this only guards against a stuck device)."""


class RdmaTransport(Transport):
    """Client side of one peer connection.

    ``write``/``read`` validate the ops and queue the batch for this
    connection's QP worker thread (the native loop releases the GIL), so the
    caller can prepare the next batch while this one moves. Batches run in
    submission order. Methods are called from one thread (the KVClient's);
    only the worker touches the QP besides ``_settle``/``_recover``, and both
    hold ``_qp_lock`` while they do.
    """

    name = "rdma"

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch = channel
        self._info = info
        self._timeout = timeout
        self._dev = _SharedDevice.acquire()
        self._mr: verbs.MemoryRegion | None = None
        self._slab: Slab | None = None
        self._remote: verbs.ConnInfo | None = None
        self._broken = False  # the QP failed; _recover() on the caller thread fixes it
        self._closing = False  # close() started: queued batches are skipped, not run
        self._qp_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_idle = True  # no job taken and unfinished
        self.last_stats: verbs.JobStats | None = None
        self.last_run_s = 0.0  # seconds the last batch spent in the native loop (bench)
        self.totals = DataPathTotals()
        self.reconnects = 0
        self.sge_limit = 0  # 0 = the device's max_sge
        try:
            self._qp = self._dev.create_qp()
            self._connect()
        except BaseException:
            self._release()
            raise

    # -- connection (caller thread only: it uses the control channel) -----------
    def _connect(self) -> None:
        """Exchange QP info with the node over the control channel, go to RTS."""
        mine = self._qp.local_info(self._mr if self._mr else _NO_REGION)
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

    def _recover(self) -> None:
        """Reset the QP and reconnect it if a failure broke it (the node
        replaces its side on RDMA_CONNECT). Raises if reconnecting fails; the
        next batch tries again."""
        with self._qp_lock:
            if not self._broken and self._remote is not None:
                return
            self.reconnects += 1
            self._remote = None
            self._qp.reset()
            self._connect()
            self._broken = False

    def _recover_quietly(self) -> None:
        """:meth:`_recover` if the QP is broken; a failure is logged (the next
        batch tries again) because the caller is already reporting an error."""
        if not self._broken:
            return
        try:
            self._recover()
        except RdmakvError as e:
            log.warning("rdmakv rdma: reconnecting the QP failed: %s", e)

    def _abort_inflight(self) -> None:
        """Force the QP to ERROR so the device flushes every posted WR now
        (verbs allow this concurrently with the worker's polling)."""
        self._broken = True
        self._qp.force_error()

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
        return self._submit(verbs.OP_WRITE, ops, timeout)

    def read(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        return self._submit(verbs.OP_READ, ops, timeout)

    def _check_remote(self, ops: Sequence[IoOp]) -> None:
        lo, hi = self._info.pool_base, self._info.pool_base + self._info.pool_len
        for op in ops:
            if op.length < 0 or op.remote_addr < lo or op.remote_addr + op.length > hi:
                raise ConfigError(f"I/O op {op} lies outside the node pool 0x{lo:x}..0x{hi:x}")

    def _submit(self, opcode: int, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        check_local_ops(ops, self._slab)
        self._check_remote(ops)
        if not ops:
            return IoFuture.completed()
        try:
            if self._broken or self._remote is None:  # an earlier failure
                self._recover()
        except RdmakvError as e:
            return IoFuture.completed(e)
        job = _Job(opcode, list(ops), timeout)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="rdmakv-rdma-qp", daemon=True)
            self._worker.start()
        idle = self._worker_idle
        self._jobs.put(job)
        if idle:
            # Wait (GIL released) until the worker took the job: otherwise it
            # would wait for the GIL up to a switch interval (5 ms) or more
            # while this thread goes on in Python, with the QP idle.
            job.started.wait(WORKER_HANDOFF_S)
        return RdmaFuture(self, job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._worker_idle = False
            try:
                with self._qp_lock:
                    job.started.set()
                    if not (self._broken or self._closing or self._remote is None):
                        job.status, job.stats = self._execute(
                            job.opcode, job.table, job.timeout
                        )
            except BaseException as e:  # never leave a future hanging
                log.error("rdmakv rdma: QP worker failed: %s", e)
                self._broken = True
                job.status = None
            finally:
                job.started.set()
                self._worker_idle = True
                job.done.set()

    def _execute(
        self, opcode: int, ops: Sequence[IoOp] | np.ndarray, timeout: float
    ) -> tuple[list[int], verbs.JobStats]:
        """Run ops (or their :func:`verbs.op_table`) on the QP (caller holds _qp_lock)."""
        assert self._mr is not None and self._remote is not None
        t0 = time.perf_counter()
        status, stats = self._qp.run(
            opcode, self._mr, self._remote.rkey, ops, timeout, sge_limit=self.sge_limit
        )
        self.last_run_s = time.perf_counter() - t0
        self.last_stats = stats
        self.totals.add(stats, self.last_run_s)
        if stats.failed_ops:
            self._broken = True  # the QP is in ERROR now
            log.warning(
                "rdmakv rdma: %d of %d ops failed (first: %s); the QP will be reset",
                stats.failed_ops, len(ops), verbs.status_name(stats.first_error),
            )
        return status, stats

    def _settle(self, job: _Job) -> RdmakvError | None:
        """Caller thread, after the worker finished ``job``: recover the QP and
        retry ops that were only flushed or never posted; the error (if any)
        names the ops that really failed."""
        what = "RDMA WRITE" if job.opcode == verbs.OP_WRITE else "RDMA READ"
        n = len(job.ops)
        if job.status is None and self._closing:
            return ConnectionLost(f"{what}: the transport was closed before the batch ran")
        if job.status is None:  # skipped: the QP was already broken
            failed = [(i, verbs.ST_NOT_POSTED) for i in range(n)]
        elif job.stats is not None and job.stats.failed_ops == 0:
            return None
        else:
            failed = [(i, s) for i, s in enumerate(job.status) if s != verbs.ST_OK]
        hard = {i: s for i, s in failed if s not in verbs.RETRYABLE}
        retry = [i for i, s in failed if s in verbs.RETRYABLE]
        if any(s == verbs.ST_TIMEOUT for s in hard.values()):
            self._recover_quietly()
            return TransportTimeout(
                f"{what}: {len(failed)} of {n} ops not done within {job.timeout} s"
            )
        for _ in range(RETRY_ROUNDS):
            if not retry:
                break
            try:
                self._recover()
                with self._qp_lock:
                    status, _ = self._execute(
                        job.opcode, [job.ops[i] for i in retry], job.timeout
                    )
            except RdmakvError as e:
                log.warning("rdmakv rdma: retry after a QP error failed: %s", e)
                break
            again = [(i, s) for i, s in zip(retry, status, strict=True) if s != verbs.ST_OK]
            hard.update((i, s) for i, s in again if s not in verbs.RETRYABLE)
            retry = [i for i, s in again if s in verbs.RETRYABLE]
        hard.update((i, verbs.ST_FLUSHED) for i in retry)
        self._recover_quietly()  # reset/reconnect now, not at the next batch
        if not hard:
            return None
        first = min(hard)
        return RdmaOpsFailed(
            f"{what}: {len(hard)} of {n} ops failed "
            f"(op {first}: {verbs.status_name(hard[first])})",
            sorted(hard),
            hard,
        )

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            self._closing = True
            self._jobs.put(None)
            worker.join(self._timeout + DRAIN_WAIT_S)
            if worker.is_alive():  # stuck device: flush, then wait once more
                self._abort_inflight()
                worker.join(DRAIN_WAIT_S)
            self._worker = None
            if worker.is_alive():
                # Destroying the QP under a running loop would be worse than
                # leaking it: leave it to process exit.
                log.error("rdmakv rdma: QP worker did not stop; leaking its QP")
                self._qp = None  # type: ignore[assignment]
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
        session.one_sided = True
        session.reply(req, encode_json({"conn": mine.to_dict()}))

    def _disconnect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        self._drop(session.session_id)
        session.one_sided = False
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


_logged_reasons: set[str] = set()


def _usable_for_auto() -> bool:
    """The registry's probe; says once per distinct reason why RDMA is not used."""
    ok, why = rdma_usable()
    if not ok and why not in _logged_reasons:
        _logged_reasons.add(why)
        log.info("rdmakv: rdma not usable here (%s); auto uses tcp", why)
    return ok


def _register() -> None:
    from rdmakv.transport import TransportSpec, register_transport

    register_transport(
        TransportSpec("rdma", RdmaTransport, RdmaNodeDataPath, usable=_usable_for_auto)
    )


_register()
