"""The ``rdma`` transport: one-sided RDMA WRITE/READ over RC queue pairs.

Client side (:class:`RdmaTransport`): the client slab is registered once per
device (shared by every peer); each peer connection gets one RC QP whose
connection info is exchanged with the node over the control channel
(``Op.RDMA_CONNECT``, JSON :class:`~rdmakv.transport.verbs.ConnInfo` both
ways). A put is RDMA WRITEs from slab blocks into node extents, a get is RDMA
READs from leased node extents into slab blocks (the extent strategy of
:mod:`rdmakv.transport.extents`); the node CPU is not in the data path.
Batches go to the native hot loop (SGL gathering, chained WRs, selective
signalling, bounded outstanding WRs, batched CQ polling).

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
* ``auto`` falls back to TCP, logging why, when RDMA is not usable here
  (:func:`rdmakv.transport.resolve_transport`) or cannot be set up with a
  peer (:class:`rdmakv.client.KVClient`, as it connects).
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
    CONFINE_WINDOWS,
    ExtentGuard,
    IoFuture,
    NodeDataPath,
    NodeHandler,
    NodeSession,
    Ops,
    OpTable,
    check_local_ops,
    check_remote_ops,
)
from rdmakv.transport.checksum import checksum_ranges
from rdmakv.transport.extents import ExtentTransport

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

    __slots__ = ("done", "opcode", "started", "stats", "status", "table", "timeout")

    def __init__(self, opcode: int, table: OpTable, timeout: float) -> None:
        self.opcode = opcode
        # Built on the submitting thread, while the QP still runs the previous
        # batch: converting on the worker would leave the QP idle meanwhile.
        self.table = table
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
                    f"RDMA batch of {len(self._job.table)} ops not complete after {wait} s"
                )
            else:
                self._settled = True
                self._error = self._tp._settle(self._job)
                if self._job.opcode == verbs.OP_READ and (
                    self._error is None or isinstance(self._error, RdmaOpsFailed)
                ):  # the ops that did not fail hold their bytes now
                    self.checksums = self._tp.checksums(self._job.table)
        if self._error is not None:
            raise self._error


WORKER_HANDOFF_S = 0.05
"""Longest a submit waits for an idle QP worker to take its batch."""
DRAIN_WAIT_S = 5.0
"""Extra wait for the worker after forcing the QP to ERROR (the native loop's
own drain is bounded at 2 s; this only guards against a stuck device)."""


class RdmaTransport(ExtentTransport):
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
        # rkey an extent was handed out with -> the rkey to use now: a node that
        # confines clients with memory windows rebinds them on reconnect.
        self._rkey_map: dict[int, int] = {}
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
        self._ch.set_timeout(self._timeout)
        _, payload = self._ch.call(
            Op.RDMA_CONNECT, encode_json({"conn": mine.to_dict()}), "RDMA_CONNECT"
        )
        reply = decode_json(bytes(payload), "RDMA_CONNECT")
        remote = verbs.ConnInfo.from_dict(reply.get("conn"))
        self._apply_remap(reply.get("remap"))
        info = self._info
        if remote.region_addr != info.pool_base or remote.region_len != info.pool_len:
            raise RdmaError(
                f"node's RDMA region 0x{remote.region_addr:x}+{remote.region_len} does not "
                f"match its pool 0x{info.pool_base:x}+{info.pool_len}"
            )
        self._qp.connect(remote)
        self._remote = remote

    def _apply_remap(self, remap: Any) -> None:
        """Fold the node's {old rkey -> new rkey} pairs (windows it rebound on our
        new QP) into the map from handed-out rkeys to current ones. Only live
        windows are kept, so the map stays as small as what we hold."""
        if remap is None:
            self._rkey_map = {}
            return
        if not isinstance(remap, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
            for p in remap
        ):
            raise RdmaError(f"RDMA_CONNECT: malformed rkey remap {remap!r}")
        step = {int(a): int(b) for a, b in remap}
        fresh = {orig: step[cur] for orig, cur in self._rkey_map.items() if cur in step}
        for old, new in step.items():
            fresh.setdefault(old, new)
        self._rkey_map = fresh

    def _mapped(self, table: OpTable) -> OpTable:
        """``table`` with the rkeys the node rebound since it handed them out
        replaced (a fresh table; the caller's is left as it is)."""
        m = self._rkey_map
        if not m:
            return table
        rkeys = table[:, 3].tolist()
        out = table.copy()
        out[:, 3] = [m.get(k, k) if k else 0 for k in rkeys]
        return out

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

    def write(self, ops: Ops, timeout: float) -> IoFuture:
        return self._submit(verbs.OP_WRITE, ops, timeout)

    def read(self, ops: Ops, timeout: float) -> IoFuture:
        return self._submit(verbs.OP_READ, ops, timeout)

    def _submit(self, opcode: int, ops: Ops, timeout: float) -> IoFuture:
        check_local_ops(ops, self._slab)
        table = verbs.op_table(ops)
        check_remote_ops(table, self._info.pool_base, self._info.pool_len)
        if not len(table):
            return IoFuture.completed()
        try:
            if self._broken or self._remote is None:  # an earlier failure
                self._recover()
        except RdmakvError as e:
            return IoFuture.completed(e)
        job = _Job(opcode, self._mapped(table), timeout)
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
        fut = RdmaFuture(self, job)
        if opcode == verbs.OP_WRITE:  # the writer's checksums, while the device reads
            fut.checksums = self.checksums(table)
        return fut

    def checksums(self, table: OpTable) -> list[int] | None:
        """The value checksum of each op's local bytes (bounds-checked against
        the slab when submitted), in one native call with the GIL released;
        None without the native hasher, or once the transport is closed (the
        caller hashes its slab in Python then)."""
        slab = self._slab
        if slab is None:
            return None
        return checksum_ranges(slab.base_addr, table[:, 0], table[:, 2])

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
        self, opcode: int, table: OpTable, timeout: float
    ) -> tuple[list[int], verbs.JobStats]:
        """Run the ops of ``table`` on the QP (caller holds _qp_lock)."""
        assert self._mr is not None and self._remote is not None
        t0 = time.perf_counter()
        status, stats = self._qp.run(
            opcode, self._mr, self._remote.rkey, table, timeout, sge_limit=self.sge_limit
        )
        self.last_run_s = time.perf_counter() - t0
        self.last_stats = stats
        self.totals.add(stats, self.last_run_s)
        if stats.failed_ops:
            self._broken = True  # the QP is in ERROR now
            log.warning(
                "rdmakv rdma: %d of %d ops failed (first: %s); the QP will be reset",
                stats.failed_ops, len(table), verbs.status_name(stats.first_error),
            )
        return status, stats

    def _settle(self, job: _Job) -> RdmakvError | None:
        """Caller thread, after the worker finished ``job``: recover the QP and
        retry ops that were only flushed or never posted; the error (if any)
        names the ops that really failed."""
        what = "RDMA WRITE" if job.opcode == verbs.OP_WRITE else "RDMA READ"
        n = len(job.table)
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
                        job.opcode, self._mapped(job.table[retry]), job.timeout
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


class _Window:
    """One bound window of a session over [addr, addr+length), shared by the
    ``count`` extent grants it covers (contiguous extents of one grant call
    share a window, so their ops still gather into one WR)."""

    __slots__ = ("addr", "count", "length", "window", "write")

    def __init__(self, window: verbs.MemoryWindow, addr: int, length: int, write: bool) -> None:
        self.window = window
        self.addr = addr
        self.length = length
        self.write = write
        self.count = 0


class _NodeSession:
    """Node-side RDMA state of one session: its QP and the windows bound on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # serialises QP use (binds) and the grant table
        self.qp: verbs.QueuePair | None = None
        # (extent addr, write) -> the windows granting it, one entry per grant
        self.grants: dict[tuple[int, bool], list[_Window]] = {}
        self.windows: set[_Window] = set()


def _runs(extents: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """Contiguous runs of extents, as (addr, length, indexes), in address order."""
    order = sorted(range(len(extents)), key=lambda i: extents[i][0])
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        addr, length = extents[i]
        if runs and runs[-1][0] + runs[-1][1] == addr:
            lo, n, idx = runs[-1]
            idx.append(i)
            runs[-1] = (lo, n + length, idx)
        elif runs and runs[-1][0] == addr and runs[-1][1] >= length:
            runs[-1][2].append(i)  # the same extent twice in one call
        else:
            runs.append((addr, length, [i]))
    return runs


BIND_TIMEOUT_S = 10.0
"""Bound on one batch of window binds (soft-RoCE under emulation is slow)."""


class RdmaNodeDataPath(NodeDataPath):
    """Node side: the pool is registered once; one QP per connected session.

    Confinement ``windows`` (the default): the pool MR grants no remote access
    through its own rkey; every extent the store hands a session is reached
    through a type-2 memory window bound on THAT session's QP (so another
    client cannot use its rkey) and deallocated when the session loses the
    extent (commit/abort for writes, release/expiry for reads, disconnect).
    Devices without type-2 windows refuse to start in this mode. ``none``:
    the old behaviour, one MR with remote read+write whose rkey every client
    learns (any client can read/write the whole pool).

    Caveat (soft-RoCE/rxe, checked on Linux 6.1 and current sources): rxe
    checks a window's rkey, QP and lifetime but not its address range (only
    the underlying MR's), so there a session holding any live window can
    reach the whole pool; hardware HCAs check the window's range.

    Lock order: the store's lock, then a session's lock (grant/revoke come
    from the store); connect/drop take only the session's lock.
    """

    name = "rdma"

    def __init__(self, pool: Slab, *, confinement: str = CONFINE_WINDOWS) -> None:
        super().__init__(pool, confinement=confinement)
        self._dev = _SharedDevice.acquire()
        self.windows = confinement == CONFINE_WINDOWS
        if self.windows and not self._dev.supports_windows:
            raise RdmaUnavailable(
                f"{self._dev.sel.device} does not support type-2 memory windows, which "
                "rdma_confinement='windows' needs to confine each client to its own extents; "
                "set rdma_confinement='none' to serve RDMA with one pool-wide rkey (any "
                "client can then read and write the whole pool)"
            )
        self._mr = self._dev.register(pool.base_addr, pool.nbytes, owner=pool, windows=self.windows)
        self._lock = threading.Lock()
        self._sessions: dict[int, _NodeSession] = {}
        log.info(
            "rdma data path: confinement %s%s", confinement,
            " (per-extent memory windows)" if self.windows else " (one pool-wide rkey)",
        )

    @property
    def rkey(self) -> int:
        return 0 if self.windows else self._mr.rkey

    @property
    def device(self) -> verbs.Device:
        return self._dev

    @property
    def guard(self) -> ExtentGuard | None:
        return self if self.windows else None

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.RDMA_CONNECT: self._connect, Op.RDMA_DISCONNECT: self._disconnect}

    def _session(self, session_id: int, create: bool) -> _NodeSession | None:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None and create:
                s = self._sessions[session_id] = _NodeSession()
            return s

    def _connect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        remote = verbs.ConnInfo.from_dict(decode_json(bytes(payload), "RDMA_CONNECT").get("conn"))
        qp = self._dev.create_qp()
        try:
            qp.connect(remote)
            mine = qp.local_info(self._mr)
        except BaseException:
            qp.close()
            raise
        s = self._session(session.session_id, create=True)
        assert s is not None
        remap: list[list[int]] = []
        with s.lock:
            old, s.qp = s.qp, qp
            if s.windows:
                # A reconnect (the client's recovery from a QP error): the windows
                # of the old QP die with it; rebind what the session still holds
                # on the new one and tell the client its extents' new rkeys.
                remap = self._rebind(s, qp)
            if old is not None:
                old.close()  # its windows are closed first (see QueuePair.close)
        session.one_sided = True
        reply: dict[str, object] = {"conn": mine.to_dict()}
        if remap:
            reply["remap"] = remap
        session.reply(req, encode_json(reply))

    def _rebind(self, s: _NodeSession, qp: verbs.QueuePair) -> list[list[int]]:
        """New windows on ``qp`` for every live window of ``s`` (session lock held)."""
        remap: list[list[int]] = []
        for write in (False, True):
            wins = [w for w in s.windows if w.write == write]
            if not wins:
                continue
            fresh = [self._dev.alloc_window() for _ in wins]
            status = qp.bind_windows(
                self._mr, fresh, [(w.addr, w.length) for w in wins],
                read=not write, write=write, timeout=BIND_TIMEOUT_S,
            )
            failed = 0
            for w, new, st in zip(wins, fresh, status, strict=True):
                old_rkey = w.window.rkey
                w.window.close()
                if st != verbs.ST_OK:
                    new.close()  # its extents' accesses now fail: misses, never wrong data
                    failed += 1
                    continue
                w.window = new
                remap.append([old_rkey, new.rkey])
            if failed:
                log.warning(
                    "rdma: %d of %d windows could not be bound again on a reconnected QP "
                    "(first: %s); the client's reads or writes of those extents fail",
                    failed, len(wins), verbs.status_name(next(x for x in status if x)),
                )
        return remap

    # -- ExtentGuard (called by the store with its lock held) ---------------------
    def grant(self, session: int, extents: Sequence[tuple[int, int]], *, write: bool) -> list[int]:
        out = [0] * len(extents)
        s = self._session(session, create=False)
        if s is None or not extents:
            return out  # not an RDMA session: the tcp path checks its ops itself
        with s.lock:
            qp = s.qp
            if qp is None:
                return out
            runs = _runs(extents)
            try:
                fresh = [self._dev.alloc_window() for _ in runs]
            except RdmakvError as e:
                log.warning("rdma: cannot allocate memory windows: %s", e)
                return out
            try:
                status = qp.bind_windows(
                    self._mr, fresh, [(lo, n) for lo, n, _ in runs],
                    read=not write, write=write, timeout=BIND_TIMEOUT_S,
                )
            except RdmakvError as e:
                log.warning("rdma: binding memory windows failed: %s", e)
                status = [verbs.ST_POST_FAILED] * len(fresh)
            failed = 0
            for (lo, n, idx), mw, st in zip(runs, fresh, status, strict=True):
                if st != verbs.ST_OK:
                    mw.close()
                    failed += 1
                    continue
                w = _Window(mw, lo, n, write)
                s.windows.add(w)
                for i in idx:
                    s.grants.setdefault((extents[i][0], write), []).append(w)
                    w.count += 1
                    out[i] = mw.rkey
            if failed:
                log.warning(
                    "rdma: %d of %d window binds failed (first: %s); those extents get no rkey",
                    failed, len(runs), verbs.status_name(next(x for x in status if x)),
                )
        return out

    def revoke(self, session: int, addrs: Sequence[int], *, write: bool) -> None:
        s = self._session(session, create=False)
        if s is None:
            return
        with s.lock:
            for addr in addrs:
                stack = s.grants.get((addr, write))
                if not stack:
                    continue
                w = stack.pop()
                if not stack:
                    del s.grants[(addr, write)]
                w.count -= 1
                if w.count <= 0:
                    w.window.close()  # ibv_dealloc_mw: revoked now, whatever the QP state
                    s.windows.discard(w)

    # -- sessions -------------------------------------------------------------------
    def _disconnect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        self._drop(session.session_id)
        session.one_sided = False
        session.reply(req)

    def _drop(self, session_id: int) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return
        with s.lock:
            for w in s.windows:
                w.window.close()
            s.windows.clear()
            s.grants.clear()
            if s.qp is not None:
                s.qp.close()
                s.qp = None

    @property
    def sessions(self) -> int:
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.qp is not None)

    def session_closed(self, session: NodeSession) -> None:
        self._drop(session.session_id)

    def close(self) -> None:
        with self._lock:
            ids = list(self._sessions)
        for sid in ids:
            self._drop(sid)
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
