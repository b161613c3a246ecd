"""A connector worker's transfer thread: loads and saves run off the engine's thread.

The engine's step must never wait for the network. A :class:`TransferWorker`
takes each step's loads and saves from the engine thread
(:meth:`TransferWorker.load` and :meth:`TransferWorker.save` only queue),
runs the loads (fetch into the slab, then slab -> engine blocks) and saves
(engine blocks -> slab, then the offload to the node) on one thread of its
own, and reports what finished when the engine asks
(:meth:`TransferWorker.results`).

Invariants (who owns what, when it ends):

* Only the transfer thread touches the :class:`~rdmakv.connectors.group_stores.GroupStores`
  (its managers and slabs are single-threaded); the engine thread queues jobs
  and reads results under one lock.
* Saves go before loads: a save holds engine blocks the engine wants back
  (a finished request's blocks are freed only once its saves are done), and
  a save's work is local (its network write goes through the manager's
  offloader thread), so it never queues behind a slow node's load for long.
* A load fails without a node call (the engine recomputes it) when it was
  submitted before a node call of an earlier load failed (a stalled or dead
  node: the loads queued behind the stuck one fail with it, they do not wait
  the timeout in turn), or when it has not started ``timeout`` seconds after
  it was submitted. A load therefore ends within one client timeout of its
  submission, or two when it waited its turn behind slow loads and then found
  the node stalled.
* A request with a save is *held*: once the engine says it finished, it is
  reported in ``finished_sending`` when none of its saves is queued or running
  (the engine keeps its blocks until then). The scheduler side asks the engine
  to hold exactly the requests that had a save in some plan, so both sides agree.
* :meth:`TransferWorker.drop_saves` (a preemption: the engine frees the
  blocks right after) drops the request's queued saves and waits only for a
  running one, whose work is local copies.
* Audits (:mod:`rdmakv.connectors.audit`): an audit *fetch* queues in the save
  FIFO, so it runs before the save of the same blocks (the engine thread
  queues a step's audits in ``start_load_kv``, before ``wait_for_save`` queues
  its saves) and that save always does the comparison: the fetched bytes are
  read before the save's put could put the computed ones in L1 under the same
  keys. Saves wait behind an audit fetch for at most one node call: a fetch
  not started ``timeout`` seconds after it was queued is skipped, and after a
  fetch met a node failure audits are skipped for
  :data:`~rdmakv.connectors.audit.AUDIT_BACKOFF_S` (an audit is optional; a
  save holds engine blocks). Skipped fetches are counted, never errors.
* An audit's fetched slab blocks are held from its fetch until the save that
  compares them, and released (outcome recorded) when its request finishes
  or is preempted, or at :meth:`TransferWorker.close`: nothing outlives the
  request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rdmakv.connectors.audit import AUDIT_BACKOFF_S, PendingAudit
from rdmakv.connectors.copy_stream import CopyStream
from rdmakv.connectors.group_stores import GroupStores
from rdmakv.connectors.paged import PagedGroupCopier
from rdmakv.connectors.plan import Transfer
from rdmakv.errors import ConfigError, RdmakvError

log = logging.getLogger("rdmakv.connectors.transfers")


@dataclass
class TransferResults:
    """What finished since the last :meth:`TransferWorker.results` call.

    ``finished_recving``: requests whose asynchronous load ended (failed ones
    too, as vLLM wants); ``failed_recving``: those that failed as a whole
    (hybrid models); ``bad_blocks``: engine blocks a single-group load could not
    fill (the engine recomputes from the first one); ``finished_sending``:
    held requests whose saves are all done.
    """

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    bad_blocks: set[int] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)


@dataclass
class LoadJob:
    """One request's load: submitted at ``submitted``, failed unstarted at ``deadline``."""

    transfer: Transfer
    report_async: bool
    submitted: float
    deadline: float
    after: Any = None
    """The engine work the copies into its blocks wait for (:meth:`CopyStream.engine_mark`)."""
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Save:
    transfer: Transfer
    after: Any


@dataclass
class _AuditFetch:
    transfer: Transfer
    deadline: float


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


class TransferWorker:
    """Runs the loads and saves of a worker connector's plans on its own thread.

    ``stores`` and ``copiers`` (one per KV cache group) are owned by the worker
    from here on; :meth:`close` closes the stores. ``hybrid`` models report a
    failed load per request, others per engine block. ``timeout`` is the
    client timeout (see the module docstring).
    """

    def __init__(
        self,
        stores: GroupStores,
        copiers: Sequence[PagedGroupCopier],
        *,
        null_block: int | None,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(copiers) != len(stores.groups):
            raise ConfigError(f"{len(copiers)} copiers for {len(stores.groups)} KV cache groups")
        devices = {c.device for c in copiers}
        if len(devices) != 1:
            raise ConfigError(f"KV cache groups on several devices: {sorted(map(str, devices))}")
        self.stores = stores
        self.copiers = list(copiers)
        self.null_block = null_block
        self.hybrid = len(copiers) > 1
        self.timeout = timeout
        self.stream = CopyStream(devices.pop())
        self._clock = clock
        self._lock = threading.Condition()
        self._saves: deque[_Save | _AuditFetch] = deque()
        self._loads: deque[LoadJob] = deque()
        self._calls: deque[_Call] = deque()
        self._running: _Save | _AuditFetch | LoadJob | _Call | None = None
        self._audits: dict[str, PendingAudit] = {}
        """Fetched audits by request (transfer thread only)."""
        self._audits_paused_until = 0.0
        self._audited: set[str] = set()
        """Requests with an audit queued or held (engine side, under the lock)."""
        self._saves_pending: Counter[str] = Counter()
        self._held: set[str] = set()
        self._finished: set[str] = set()
        self._results = TransferResults()
        self._node_failed_at = float("-inf")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rdmakv-transfer", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def load(
        self, transfers: Sequence[Transfer], *, report_async: bool, after: Any = None
    ) -> list[LoadJob]:
        """Queue loads; returns their jobs (to :meth:`wait` for, in synchronous mode).
        ``report_async`` loads are reported in ``finished_recving`` when they end; their
        copies into the engine's blocks run after the engine work ``after`` marks."""
        now = self._clock()
        jobs = [LoadJob(t, report_async, now, now + self.timeout, after) for t in transfers]
        if jobs:
            with self._lock:
                self._check_open()
                self._loads.extend(jobs)
                self._lock.notify()
        return jobs

    def audit(self, transfers: Sequence[Transfer]) -> None:
        """Queue audit fetches (see the module docstring): before this step's saves."""
        if not transfers:
            return
        deadline = self._clock() + self.timeout
        with self._lock:
            self._check_open()
            self._saves.extend(_AuditFetch(t, deadline) for t in transfers)
            self._audited.update(t.req_id for t in transfers)
            self._lock.notify()

    def save(self, transfers: Sequence[Transfer], *, after: Any = None) -> None:
        """Queue saves, reading the engine blocks after the engine work ``after`` marks
        (:meth:`mark`); their requests are held (see the module docstring)."""
        if not transfers:
            return
        with self._lock:
            self._check_open()
            for t in transfers:
                self._saves.append(_Save(t, after))
                self._saves_pending[t.req_id] += 1
                self._held.add(t.req_id)
            self._lock.notify()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the rdmakv transfer worker is closed")

    def mark(self) -> Any:
        """The engine's work so far, for :meth:`submit` (see :class:`CopyStream`)."""
        return self.stream.engine_mark()

    def wait(self, loads: Iterable[LoadJob]) -> None:
        """Synchronous mode: block until these loads ended (each within two timeouts)."""
        for job in loads:
            job.done.wait()

    def drop_saves(self, req_ids: Iterable[str]) -> None:
        """The engine is about to reuse these requests' blocks: drop their queued saves
        and wait for a running one (local copies only) to end."""
        ids = set(req_ids)
        if not ids:
            return
        with self._lock:
            kept: deque[_Save | _AuditFetch] = deque()
            for job in self._saves:
                if job.transfer.req_id not in ids:
                    kept.append(job)
                elif isinstance(job, _Save):
                    self._saves_pending[job.transfer.req_id] -= 1
            self._saves = kept
            # Only a save reads the engine's blocks; a running audit fetch is a node
            # call into slab blocks (its audit is ended by the call queued below), so
            # the engine never waits on the network here.
            while isinstance(self._running, _Save) and self._running.transfer.req_id in ids:
                self._lock.wait()
            self._queue_end_audits(ids)

    def results(self, finished_req_ids: Iterable[str] = ()) -> TransferResults:
        """What ended since the last call; ``finished_req_ids`` are the requests the
        engine finished (held ones are reported once their saves are done)."""
        finished = set(finished_req_ids)
        with self._lock:
            self._queue_end_audits(finished)
            self._finished.update(r for r in finished if r in self._held)
            out, self._results = self._results, TransferResults()
            for req_id in list(self._finished):
                if self._saves_pending[req_id] <= 0:
                    out.finished_sending.add(req_id)
                    self._finished.discard(req_id)
                    self._held.discard(req_id)
                    del self._saves_pending[req_id]
            return out

    def _queue_end_audits(self, req_ids: set[str]) -> None:
        """Under the lock: release these requests' audits on the transfer thread,
        after the queued saves (which compare first)."""
        ending = req_ids & self._audited
        if ending and not self._closed:
            self._audited -= ending
            self._calls.append(_Call(partial(self._end_audits, ending)))
            self._lock.notify()

    def _end_audits(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            audit = self._audits.pop(req_id, None)
            if audit is not None:
                self.stores.end_audit(audit)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` to run on the transfer thread (it owns the stores) after the
        queued saves; returns at once."""
        job = _Call(fn)
        with self._lock:
            self._check_open()
            self._calls.append(job)
            self._lock.notify()
        return job.future

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """:meth:`submit` ``fn`` and wait up to ``timeout`` seconds for its result."""
        return self.submit(fn).result(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until the queued saves ran and their offloads reached the node."""
        deadline = time.monotonic() + timeout
        return bool(
            self.call(lambda: self.stores.flush(max(0.0, deadline - time.monotonic())), timeout)
        )

    def idle(self) -> bool:
        """No job queued or running."""
        with self._lock:
            return self._running is None and not (self._saves or self._loads or self._calls)

    # -- transfer thread -------------------------------------------------------------------
    def _next(self) -> _Save | _AuditFetch | LoadJob | _Call | None:
        with self._lock:
            self._running = None
            self._lock.notify_all()
            while not (self._saves or self._loads or self._calls or self._closed):
                self._lock.wait()
            if self._closed:
                return None
            job: _Save | _AuditFetch | LoadJob | _Call
            if self._saves:
                job = self._saves.popleft()
            elif self._calls:
                job = self._calls.popleft()
            else:
                job = self._loads.popleft()
            self._running = job
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if isinstance(job, _Save):
                self._save(job)
            elif isinstance(job, _AuditFetch):
                self._fetch_audit(job)
            elif isinstance(job, LoadJob):
                self._load(job)
            else:
                try:
                    job.future.set_result(job.fn())
                except BaseException as e:  # handed to the waiting caller
                    job.future.set_exception(e)
        self._fail_queued()

    def _fetch_audit(self, job: _AuditFetch) -> None:
        t = job.transfer
        now = self._clock()
        if now >= job.deadline or now < self._audits_paused_until or self.stores.guard.reason:
            self.stores.audits.stats.fetches_skipped += 1
            return
        errors = self.stores.node_errors()
        old = self._audits.pop(t.req_id, None)
        if old is not None:  # a resumed request is audited anew
            self.stores.end_audit(old)
        try:
            audit = self.stores.fetch_audit(t, self.null_block)
        except RdmakvError as e:
            log.warning("request %s: audit fetch failed: %s", t.req_id, e)
            return
        finally:
            if self.stores.node_errors() != errors:
                self._audits_paused_until = self._clock() + AUDIT_BACKOFF_S
        if audit.waiting:
            self._audits[t.req_id] = audit

    def _save(self, job: _Save) -> None:
        audit = self._audits.get(job.transfer.req_id)
        try:
            self.stores.save(
                job.transfer, self.copiers, self.null_block, self.stream, job.after, audit
            )
        except RdmakvError as e:  # a save is best effort: the blocks stay uncached
            log.warning("request %s: save failed: %s", job.transfer.req_id, e)
        finally:
            if audit is not None and not audit.waiting:
                self.stores.end_audit(self._audits.pop(job.transfer.req_id))
            with self._lock:
                self._saves_pending[job.transfer.req_id] -= 1

    def _load(self, job: LoadJob) -> None:
        t = job.transfer
        if self._clock() >= job.deadline:
            reason = f"not started within {self.timeout:.1f} s"
        elif job.submitted <= self._node_failed_at:
            reason = "queued while the node was failing"
        else:
            reason = ""
        if reason:
            log.warning("request %s: load %s; recomputed", t.req_id, reason)
            self._report_load(job, t.engine_block_ids(self.null_block))
            return
        errors = self.stores.node_errors()
        try:
            failed = self.stores.load(t, self.copiers, self.null_block, self.stream, job.after)
        except RdmakvError as e:
            log.warning("request %s: load failed: %s", t.req_id, e)
            failed = t.engine_block_ids(self.null_block)
        if self.stores.node_errors() > errors:
            # Loads queued behind this one would wait the same timeout in turn.
            self._node_failed_at = self._clock()
        self._report_load(job, failed)

    def _report_load(self, job: LoadJob, failed: set[int]) -> None:
        req_id = job.transfer.req_id
        with self._lock:
            r = self._results
            if job.report_async:
                r.finished_recving.add(req_id)
            if failed:
                if self.hybrid:
                    r.failed_recving.add(req_id)  # vLLM takes no block reports for several groups
                else:
                    r.bad_blocks |= failed
        job.done.set()

    def _fail_queued(self) -> None:
        """After close: queued loads fail (nothing waits forever), queued saves are dropped."""
        with self._lock:
            loads, self._loads = list(self._loads), deque()
            calls, self._calls = list(self._calls), deque()
            self._saves.clear()
            self._running = None
            self._lock.notify_all()
        for job in loads:
            self._report_load(job, job.transfer.engine_block_ids(self.null_block))
        for call in calls:
            call.future.set_exception(ConfigError("the rdmakv transfer worker closed"))

    def close(self) -> None:
        """Finish the running job, fail the queued ones, stop the thread, close the stores."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()
        self._end_audits(set(self._audits))  # the thread is gone: safe here
        self.stores.close()


__all__ = ["LoadJob", "TransferResults", "TransferWorker"]
