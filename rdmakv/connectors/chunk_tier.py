"""A remote tier for an engine's host KV buffer of fixed-size chunks (no engine imports).

This is the engine-independent half of rdmakv's vLLM secondary tier
(:mod:`rdmakv.connectors.vllm_tier` is the thin vLLM half): vLLM's CPU tier
holds KV in one buffer of ``chunk_bytes`` rows, names each chunk by an
opaque *name* (its offload key) and asks the tier to store chunk rows on the
nodes, to load them back into rows it allocated, and whether the nodes hold a
name. Keeping this half free of vLLM lets the same code run over RDMA where
no vLLM is installed (``tests/rdma``).

Data path (zero copy): the engine's buffer itself is the KV client's slab
(:meth:`Slab.over_buffer`, one block per row), registered with the transport
once; a store writes a row to the node one-sided (RDMA WRITE, or
scatter-gather socket I/O over TCP) and a load reads the node's value straight
into the row. No staging buffer, no host memcpy. The value is the whole row.

Keys: ``XXH3-128(namespace seed || name)`` with a BLAKE2b digest of the same
input (:class:`~rdmakv.blocks.keys.NamedKeys`); every load checks the digest and the
value's checksum (:class:`~rdmakv.client.node_client.KVClient`), so a collision or bytes
corrupted on the wire or in a node's pool are a failed chunk, never KV
reported loaded.

Threads and who owns what:

* The engine calls every public method from one thread at a time (vLLM:
  under its offloading manager's lock); none of them waits on the network.
* Lookups run on a :class:`~rdmakv.connectors.lookups.BatchLookups` thread
  with a control-only client: :meth:`lookup` answers ``None`` until the node
  answered, questions of a step go out together at :meth:`flush_lookups`, and
  an unanswered question expires after the client timeout as "absent".
* Jobs run on one I/O thread with its own client over the slab. Submitting
  a job only queues it: the offload policy, the row list and the keys are
  worked out on the I/O thread, so a 1,000-chunk job costs the engine thread
  the same as a one-chunk job. A row named
  by a job belongs to that job from :meth:`store` / :meth:`load` until the
  job is returned by :meth:`finished`: only then has every transfer touching
  it ended (a failed transfer is drained first), so the engine may free,
  reuse or read it. Loads go before stores (a request waits for a load; a
  store only keeps rows pinned). A job not started ``timeout`` seconds after
  it was submitted fails without a node call, so a stalled node turns the
  jobs queued behind it into failures, never a pile-up: every job ends within
  about two client timeouts.
* :meth:`close` lets the running job end (bounded by the client timeout),
  fails the queued ones and only then drops the clients and the slab: no
  transfer touches the buffer after it returns.

Selective offload: rdmakv's offload policies (``reuse`` with its budget and
the request's hint, ``hot``, ``all``; :mod:`rdmakv.engine.l1.offload_policies`)
decide which chunks of a store job are sent. The engine's CPU tier plays the
L1, and a policy other than ``all`` needs to see each *use* of a chunk, not
only its first store: with :attr:`ChunkTier.wants_every_use` the engine
offers a request's chunks again when the request uses them (vLLM: the
request-level offload policy cascades a request's CPU-tier hits to the tier
too). A chunk offered for the first time goes to the policy as freshly
computed; one the policy declined before and that is offered again has been
used again (a hit while the CPU tier held it, or a recompute after it left),
which ``reuse`` counts as proven reuse and ``hot`` stores; one already on
the node (sent, or loaded from it) is not sent again (the tier remembers as
many such chunks as the CPU tier holds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rdmakv.blocks.keys import KeyNamespace, NamedKeys
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import NodeClient
from rdmakv.client.remote import open_remote
from rdmakv.connectors.group_stores import StoreOptions
from rdmakv.connectors.lookups import BatchLookups
from rdmakv.engine.l1 import OffloadMode, make_offload_policy
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.metrics.tier import TierMetrics, TierStats

log = logging.getLogger("rdmakv.connectors.tier")

DIGEST_PERSON = b"rdmakv.tier.v1"
"""Version of the chunk value format (one whole row per value), in every digest."""
TIER_OFFLOAD_MODES = (OffloadMode.REUSE.value, OffloadMode.ALL.value, OffloadMode.HOT.value)
"""Offload policies that apply to a tier. ``cold`` needs the CPU tier's evictions,
which vLLM does not show a tier; ``none`` would make the tier useless."""


@dataclass
class JobOutcome:
    """A finished job. ``ok[i]``: chunk ``i`` of the job moved (stored on the node, or
    loaded with its digest and checksum verified); a chunk the offload policy
    declined counts as ok (nothing was asked of the node). ``nbytes`` moved in
    ``seconds`` of I/O-thread time."""

    job_id: int
    is_load: bool
    names: list[bytes]
    ok: list[bool]
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def success(self) -> bool:
        return all(self.ok)


ChunkPlan = Callable[[], tuple[Sequence[int], Sequence[bool | None]]]
"""A store's depth (index in its request's chain) and reuse hint
(:func:`~rdmakv.engine.l1.block_keep`) per chunk; called on the I/O thread."""


@dataclass
class _Job:
    job_id: int
    is_load: bool
    names: list[bytes]
    given_rows: Iterable[int]
    """As the engine gave them (``rows`` once the I/O thread took the job)."""
    deadline: float
    plan: ChunkPlan | None = None
    """Stores: what the offload policy weighs (depth 0, no hint when None)."""
    rows: list[int] = field(default_factory=list)
    send: list[bool] = field(default_factory=list)
    """Stores: which chunks the policy picked (the others are reported ok, unsent)."""


class ChunkTier:
    """Chunks of ``buffer`` (rows of ``chunk_bytes``) <-> the remote tier of ``options``.

    ``namespace`` names what must match to share chunks (model, dtype, chunk
    layout, parallel layout). ``capacity_chunks`` is the engine's CPU tier
    size, the L1 the offload policy reasons about. ``label`` names this tier
    in the metrics. See the module docstring for the threads and invariants.
    """

    def __init__(
        self,
        buffer: object,
        chunk_bytes: int,
        namespace: KeyNamespace,
        options: StoreOptions,
        *,
        label: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if options.offload not in TIER_OFFLOAD_MODES:
            raise ConfigError(
                f'rdmakv tier option "offload" must be one of {list(TIER_OFFLOAD_MODES)}, '
                f"got {options.offload!r}"
            )
        self.options = options
        self.timeout = options.timeout
        self.keys = NamedKeys(namespace, DIGEST_PERSON)
        self.stats = TierStats()
        self._clock = clock
        self.slab = Slab.over_buffer(buffer, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        capacity = self.slab.num_blocks
        self.policy = make_offload_policy(
            options.offload, capacity, budget=options.offload_budget
        )
        # The policy, _unsent and _sent belong to the I/O thread (no lock).
        self._unsent: OrderedDict[bytes, None] = OrderedDict()
        """Chunks the policy declined (bounded, oldest out)."""
        self._sent: OrderedDict[bytes, None] = OrderedDict()
        """Chunks sent, most recently offered last (bounded, oldest out)."""
        self._memory = capacity
        self._owners: dict[str, set[bytes]] = {}
        self._refs: Counter[bytes] = Counter()
        self._lock = threading.Condition()
        self._loads: deque[_Job] = deque()
        self._stores: deque[_Job] = deque()
        self._running: _Job | None = None
        self._done: list[JobOutcome] = []
        self._closed = False
        self.client: NodeClient | None = None
        self._lookup_client: NodeClient | None = None
        self.lookups: BatchLookups[bytes, bytes, bool] | None = None
        self.metrics: TierMetrics | None = None
        try:
            self.client = self._open(self.slab)
            self._lookup_client = self._open(None)
            self.lookups = BatchLookups(
                self._exists,
                lambda: False,
                self.timeout,
                on_close=self._lookup_client.close,
                clock=clock,
                name="rdmakv-tier-lookup",
            )
            self.metrics = TierMetrics.attach(label, self, options.metrics_port)
        except BaseException:
            self._close_parts()
            raise
        self._thread = threading.Thread(target=self._run, name="rdmakv-tier-io", daemon=True)
        self._thread.start()

    def _open(self, slab: Slab | None) -> NodeClient:
        o = self.options
        return open_remote(
            o.node,
            slab,
            token=o.secret(),
            transport=o.transport,
            timeout=o.timeout,
            replication=o.replication,
            # lookups are control-only: one connection is enough
            streams=1 if slab is None and o.streams is None else o.streams,
        )

    @property
    def expired_lookups(self) -> int:
        """Lookups unanswered within the client timeout (read as absent)."""
        return self.lookups.stats.expired if self.lookups is not None else 0

    @property
    def wants_every_use(self) -> bool:
        """The policy needs each use of a chunk offered (every policy but ``all``)."""
        return self.options.offload != OffloadMode.ALL.value

    @property
    def transport_name(self) -> str | None:
        return self.client.transport_name if self.client is not None else None

    # -- lookups (engine thread) -----------------------------------------------------------
    def lookup(self, name: bytes, owner: str) -> bool | None:
        """Whether the nodes hold ``name``: None while the question is out (it is asked
        at the next :meth:`flush_lookups`). ``owner`` (a request) keeps the answer
        until :meth:`release_owner`."""
        lookups = self.lookups
        if lookups is None:
            raise ConfigError("the rdmakv tier is closed")
        mine = self._owners.get(owner)
        if mine is None:
            mine = self._owners[owner] = set()
        if name not in mine:
            mine.add(name)
            self._refs[name] += 1
        return lookups.ask(name, name, wake=False)

    def flush_lookups(self) -> None:
        """Send this step's questions (one batch: one round trip per node)."""
        self._need_lookups().flush()

    def release_owner(self, owner: str) -> None:
        """``owner`` is done: forget the answers no other owner asked for."""
        lookups = self._need_lookups()
        for name in self._owners.pop(owner, ()):
            self._refs[name] -= 1
            if self._refs[name] <= 0:
                del self._refs[name]
                lookups.forget(name)

    def _exists(self, names: list[bytes]) -> list[bool]:
        """The lookup thread's batch: one ``exists`` (per node of a cluster)."""
        assert self._lookup_client is not None
        found = self._lookup_client.exists(self.keys.keys(names))
        self.stats.lookup_keys += len(names)
        self.stats.lookup_found += sum(found)
        return found

    def _need_lookups(self) -> BatchLookups[bytes, bytes, bool]:
        if self.lookups is None:
            raise ConfigError("the rdmakv tier is closed")
        return self.lookups

    # -- jobs (engine thread) --------------------------------------------------------------
    def store(
        self,
        job_id: int,
        names: Sequence[bytes],
        rows: Iterable[int],
        *,
        plan: ChunkPlan | None = None,
    ) -> None:
        """Queue a store of ``rows`` (one per name) under ``names``: chunks just
        computed, or (:attr:`wants_every_use`) used again. When the I/O thread takes
        the job, the offload policy picks which chunks are sent from ``plan`` (depth
        0 and no hint when None); a job with nothing to send ends without a node call."""
        self._queue(_Job(job_id, False, list(names), rows, self._clock() + self.timeout,
                         plan))

    def _pick(self, job: _Job) -> None:
        """I/O thread: the job's rows as ints and the policy's choice of chunks."""
        job.rows = [int(r) for r in job.given_rows]
        n = len(job.names)
        if len(job.rows) != n:
            raise ConfigError(f"{n} chunk names but {len(job.rows)} rows")
        if job.is_load:
            return
        depths, keeps = job.plan() if job.plan is not None else ([0] * n, [None] * n)
        job.send = [
            self._offer(name, d, k) for name, d, k in zip(job.names, depths, keeps, strict=True)
        ]

    def _offer(self, name: bytes, depth: int, keep: bool | None) -> bool:
        """Whether to send ``name`` now (the module docstring's rules)."""
        if name in self._sent:
            self._sent.move_to_end(name)
            self.stats.known_chunks += 1
            return False
        if name in self._unsent:  # used again since the policy declined it
            send = self.policy.on_hot(name, depth, keep)
            self.stats.hot_chunks += send
        else:
            send = self.policy.on_insert(name, depth, keep)
        if send:
            self._unsent.pop(name, None)
            self._remember(self._sent, name)
            return True
        if name not in self._unsent:
            # The policy's last look at it as fresh (``reuse`` keeps a ghost): a
            # later offer is a use again.
            self.policy.on_evict(name, depth, keep)
        self._remember(self._unsent, name)
        self.stats.declined_chunks += 1
        return False

    def _remember(self, names: OrderedDict[bytes, None], name: bytes) -> None:
        names[name] = None
        names.move_to_end(name)
        if len(names) > self._memory:
            names.popitem(last=False)

    def load(self, job_id: int, names: Sequence[bytes], rows: Iterable[int]) -> None:
        """Queue a load of ``names`` into ``rows`` (one per name); reported by
        :meth:`finished`."""
        self._queue(_Job(job_id, True, list(names), rows, self._clock() + self.timeout))

    def _queue(self, job: _Job) -> None:
        with self._lock:
            self._check_open()
            (self._loads if job.is_load else self._stores).append(job)
            self._lock.notify()

    def finished(self) -> list[JobOutcome]:
        """The jobs that ended since the last call (their rows are the engine's again).
        A chunk a load could not fill reads as absent in lookups from now on."""
        with self._lock:
            done, self._done = self._done, []
        if self.lookups is not None:
            for out in done:
                for name, ok in zip(out.names, out.ok, strict=True):
                    if out.is_load and not ok:  # else vLLM promotes it again and again
                        self.lookups.settle(name, False)
        return done

    def busy(self) -> bool:
        """A job is queued, running, or ended and not yet returned by :meth:`finished`."""
        with self._lock:
            return bool(self._running or self._loads or self._stores or self._done)

    def drain(self) -> None:
        """Block until no job is queued or running (each ends within two client
        timeouts); their outcomes wait for :meth:`finished`."""
        with self._lock:
            while self._running or self._loads or self._stores:
                self._lock.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the rdmakv tier is closed")

    # -- I/O thread ------------------------------------------------------------------------
    def _next(self) -> _Job | None:
        with self._lock:
            self._running = None
            self._lock.notify_all()
            while not (self._loads or self._stores or self._closed):
                self._lock.wait()
            if self._closed:
                return None
            self._running = self._loads.popleft() if self._loads else self._stores.popleft()
            return self._running

    def _run(self) -> None:
        while (job := self._next()) is not None:
            start = time.perf_counter()
            try:
                self._pick(job)
            except Exception:  # rows or a plan the engine got wrong: fail the job, not the thread
                log.exception("rdmakv tier: %s job %d refused",
                              "load" if job.is_load else "store", job.job_id)
                self._report(JobOutcome(job.job_id, job.is_load, job.names,
                                        [False] * len(job.names)), job)
                continue
            if self._clock() >= job.deadline:
                log.warning(
                    "rdmakv tier: %s job %d not started within %.1f s (node slow?); failed",
                    "load" if job.is_load else "store", job.job_id, self.timeout,
                )
                self.stats.expired_jobs += 1
                ok = [False] * len(job.names)
                nbytes = 0
            elif job.is_load:
                ok, nbytes = self._do_load(job)
            elif not any(job.send):
                ok, nbytes = [True] * len(job.names), 0
            else:
                ok, nbytes = self._do_store(job)
            self._report(JobOutcome(job.job_id, job.is_load, job.names, ok, nbytes,
                                    time.perf_counter() - start), job)
        self._fail_queued()

    def _report(self, out: JobOutcome, job: _Job) -> None:
        sent = job.send or [True] * len(out.ok)  # a refused store picked nothing
        moved = sum(out.ok) if job.is_load else sum(
            o and s for o, s in zip(out.ok, sent, strict=True)
        )
        if job.is_load:
            self.stats.loaded_chunks += moved
            self.stats.failed_load_chunks += len(out.ok) - moved
        else:
            self.stats.stored_chunks += moved
            self.stats.failed_store_chunks += out.ok.count(False)
        with self._lock:
            self._done.append(out)

    def _do_load(self, job: _Job) -> tuple[list[bool], int]:
        assert self.client is not None
        try:
            ok = self.client.get(
                self.keys.keys(job.names), job.rows, self.keys.digests(job.names)
            )
        except RdmakvError as e:
            log.warning("rdmakv tier: load job %d of %d chunks failed: %s",
                        job.job_id, len(job.names), e)
            return [False] * len(job.names), 0
        for name, got in zip(job.names, ok, strict=True):
            if got:  # on the node already: offered again, it is not sent back
                self._remember(self._sent, name)
        nbytes = sum(ok) * self.chunk_bytes
        self.stats.get_bytes += nbytes
        return list(ok), nbytes

    def _do_store(self, job: _Job) -> tuple[list[bool], int]:
        assert self.client is not None
        picked = [i for i, s in enumerate(job.send) if s]
        names = [job.names[i] for i in picked]
        ok = [True] * len(job.names)  # declined chunks: nothing asked, nothing failed
        try:
            stored = self.client.put(
                self.keys.keys(names),
                [job.rows[i] for i in picked],
                self.chunk_bytes,
                self.keys.digests(names),
            )
        except RdmakvError as e:
            log.warning("rdmakv tier: store job %d of %d chunks failed: %s",
                        job.job_id, len(names), e)
            stored = [False] * len(names)
        for i, s in zip(picked, stored, strict=True):
            ok[i] = s
            if not s:  # offered again, it is sent again
                self._sent.pop(job.names[i], None)
        nbytes = sum(stored) * self.chunk_bytes
        self.stats.put_bytes += nbytes
        return ok, nbytes

    def _fail_queued(self) -> None:
        """After close: queued jobs end failed without touching the buffer."""
        with self._lock:
            jobs = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._running = None
            for job in jobs:
                self._done.append(
                    JobOutcome(job.job_id, job.is_load, job.names, [False] * len(job.names))
                )
            self._lock.notify_all()

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Let the running job end, fail the queued ones, then close the clients and
        drop the slab (the buffer itself stays the engine's). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._thread.join()
        self._close_parts()

    def _close_parts(self) -> None:
        if self.metrics is not None:
            self.metrics.detach(self)
            self.metrics = None
        if self.lookups is not None:
            self.lookups.close()  # closes the lookup client
            self.lookups = None
        elif self._lookup_client is not None:
            self._lookup_client.close()
        self._lookup_client = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.slab.close()

    def describe(self) -> dict[str, Any]:
        """Static facts for logs and vLLM's config-info metric."""
        return {
            "node": self.options.node,
            "transport": self.transport_name or "",
            "offload": self.options.offload,
            "replication": self.options.replication,
            "chunk_bytes": self.chunk_bytes,
        }


__all__ = ["DIGEST_PERSON", "TIER_OFFLOAD_MODES", "ChunkTier", "JobOutcome"]
