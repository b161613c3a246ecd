"""The client side of the ``rdma`` transport: :class:`RdmaTransport`.

The client slab is registered once per device; each node connection gets one
RC queue pair, connected over the control channel, and a worker thread that
runs its batches through the native hot loop. The put/get strategy is the
extent one (:mod:`rdmakv.transport.extents`); the failure rules are in the
package docstring (:mod:`rdmakv.transport.rdma`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from rdmakv.blocks.slab import Slab
from rdmakv.errors import (
    ConnectionLost,
    RdmaError,
    RdmakvError,
    TransportTimeout,
)
from rdmakv.transport.base import (
    IoFuture,
    Ops,
    OpTable,
    check_local_ops,
    check_remote_ops,
)
from rdmakv.transport.checksum import checksum_ranges
from rdmakv.transport.extents import ExtentTransport
from rdmakv.transport.rdma import verbs
from rdmakv.transport.rdma.device import NO_REGION, DataPathTotals, RdmaOpsFailed, SharedDevice
from rdmakv.wire.batches import decode_json, encode_json
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import NodeInfo, Op

log = logging.getLogger("rdmakv.rdma")

RETRY_ROUNDS = 1
"""How often ops flushed behind a failure are retried on a reconnected QP."""


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
        self._dev = SharedDevice.acquire()
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
        mine = self._qp.local_info(self._mr if self._mr else NO_REGION)
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
