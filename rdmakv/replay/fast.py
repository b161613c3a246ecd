"""The fast replay: the real L1 cache and policies, with a model of the node.

Each engine is the real :class:`~rdmakv.engine.l1.L1Cache` (real eviction policy,
real offload policy, real offload queue) over a slab of tiny blocks, driven in
exactly the order :class:`~rdmakv.engine.manager.KVCacheManager` drives it for an
engine (``exists``, then ``acquire`` capped at that, release, ``allocate_for``
and ``put``). Only the node is a model, :class:`NodeModel`: an LRU set of keys
with the node's rules for what touches recency. Offloads reach the model node
in offer order, right after the call that made them, which is what the real
stack does when each request's offloads are flushed before the next request
(``rdmakv.replay.stack``, and the test that holds the two to the same counts).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from rdmakv.blocks.keys import BlockKey
from rdmakv.blocks.slab import Slab
from rdmakv.engine.l1 import (
    KeepHint,
    L1Cache,
    OffloadPolicy,
    OffloadQueue,
    block_keep,
    make_offload_policy,
)
from rdmakv.errors import ConfigError, RdmakvError, SlabExhausted
from rdmakv.replay.result import (
    AFFINITY_BLOCK,
    HINT_FORMS,
    ROUTINGS,
    ReplayResult,
    ReplaySetup,
)
from rdmakv.replay.trace import OracleOffload, TraceKeys

MODEL_BLOCK_BYTES = 64
"""Slab block size of a model engine: the model moves no KV, only keys."""

Progress = Callable[[int], None]
"""Called with the number of requests replayed since the last call."""
PROGRESS_EVERY = 500


class NodeModel:
    """The node's index as far as hits are concerned: keys in LRU order, bounded in blocks.

    Mirrors :class:`rdmakv.node.store.KVStore`: ``exists`` and ``lookup`` make
    present keys most recent; a put of a present key changes nothing (ALLOC
    answers EXISTS and no bytes move); a put of a new key evicts the least
    recently used ones while the node is full. ``capacity`` None: unbounded.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"node capacity must be a positive number of blocks, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()
        self.stored = 0
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def touch(self, keys: Sequence[BlockKey]) -> list[bool]:
        """``exists`` / ``lookup``: per key, present (and now most recent)."""
        lru = self._lru
        out = []
        for k in keys:
            present = k in lru
            if present:
                lru.move_to_end(k)
            out.append(present)
        return out

    def put(self, keys: Sequence[BlockKey]) -> int:
        """Store the keys not present; returns how many were written."""
        lru = self._lru
        n = 0
        for k in keys:
            if k in lru:
                continue
            if self.capacity is not None and len(lru) >= self.capacity:
                lru.popitem(last=False)
                self.evictions += 1
            lru[k] = None
            n += 1
        self.stored += n
        return n


class ModelEngine:
    """One engine: a real L1 cache fed as the manager feeds it, offloading into a NodeModel."""

    def __init__(
        self,
        setup: ReplaySetup,
        keys: TraceKeys,
        node: NodeModel,
        pending_blocks: int,
    ) -> None:
        self.node = node
        self.block_tokens = keys.trace.block_tokens
        offload: OffloadPolicy
        self.oracle: OracleOffload | None = None
        if setup.offload == "oracle":
            offload = self.oracle = OracleOffload(keys)
        else:
            offload = make_offload_policy(
                setup.offload, setup.l1_blocks, budget=setup.offload_budget
            )
        b = MODEL_BLOCK_BYTES
        self.slab = Slab((setup.l1_blocks + pending_blocks) * b, b, lock=False)
        # Room for a whole L1 too: the final drain (evict_all) offers every block at once.
        self.queue = OffloadQueue((setup.l1_blocks + pending_blocks) * b)
        self.l1 = L1Cache(self.slab, setup.l1_blocks * b, setup.policy, offload, self.queue)

    def request(
        self, r: int, keys: list[BlockKey], digests: list[bytes], keep: KeepHint
    ) -> tuple[int, int]:
        """Replay request ``r``; returns its (L1 hits, node hits)."""
        if self.oracle is not None:
            self.oracle.now = r
        l1, node = self.l1, self.node
        # Scheduler: the hit length from the L1 index plus one node exists.
        n = l1.count_prefix(keys)
        for present in node.touch(keys[n:]):
            if not present:
                break
            n += 1
        # acquire(max_tokens=n): the L1 prefix, then one node fetch of the rest.
        held = l1.acquire_prefix(keys[:n], digests[:n])
        l1_hits = len(held)
        want = keys[l1_hits:n]
        blocks: list[int] = []
        for _ in want:
            try:
                blocks.append(l1.allocate())
            except RdmakvError:  # every entry held: fetch less (as the manager does)
                break
        found = node.touch(want[: len(blocks)])
        node_hits = 0
        stop = False
        for i, h in enumerate(blocks):
            stop = stop or not found[i]
            if stop:
                self.slab.decref(h)
                continue
            k, d = want[i], digests[l1_hits + i]
            try:
                l1.insert(k, h, MODEL_BLOCK_BYTES, d, from_remote=True)
            except SlabExhausted:  # every entry held; insert dropped the block
                stop = True
                continue
            got = l1.get(k, d)
            assert got is not None
            held.append(got)
            node_hits += 1
        self.drain()
        l1.release(held)
        # The misses are computed and put.
        done = l1_hits + node_hits
        l1.poll_offload()
        handles = [l1.allocate() for _ in range(len(keys) - done)]
        for depth in range(done, len(keys)):
            l1.insert(
                keys[depth],
                handles[depth - done],
                MODEL_BLOCK_BYTES,
                digests[depth],
                depth=depth,
                keep=block_keep(keep, depth, self.block_tokens),
            )
        self.drain()
        return l1_hits, node_hits

    def drain(self) -> int:
        """Send every offered block to the node, in offer order; returns blocks written."""
        items = self.queue.take(1 << 30)
        written = self.node.put([it.key for it in items]) if items else 0
        self.queue.done(items)
        self.l1.poll_offload()
        return written

    def close(self) -> None:
        self.l1.clear()
        self.slab.close()


def route(setup: ReplaySetup, keys: Sequence[BlockKey], r: int) -> int:
    """The engine request ``r`` goes to (see :data:`~rdmakv.replay.result.ROUTINGS`)."""
    if setup.engines == 1:
        return 0
    if setup.routing == "random" or not keys:
        return zlib.crc32(r.to_bytes(8, "little")) % setup.engines
    return zlib.crc32(keys[min(AFFINITY_BLOCK, len(keys) - 1)]) % setup.engines


def check_setup(setup: ReplaySetup) -> None:
    """Refuse a setup that cannot be replayed, naming the knob."""
    if setup.l1_blocks <= 0:
        raise ConfigError(f"l1_blocks must be positive, got {setup.l1_blocks}")
    if setup.engines <= 0:
        raise ConfigError(f"engines must be positive, got {setup.engines}")
    if setup.routing not in ROUTINGS:
        raise ConfigError(f"routing must be one of {ROUTINGS}, got {setup.routing!r}")
    if setup.hint_form not in HINT_FORMS:
        raise ConfigError(f"hint_form must be one of {HINT_FORMS}, got {setup.hint_form!r}")
    if not 0.0 <= setup.hint_noise <= 1.0:
        raise ConfigError(f"hint_noise must be in [0, 1], got {setup.hint_noise}")
    if setup.timeline_s <= 0:
        raise ConfigError(f"timeline_s must be positive, got {setup.timeline_s}")


def replay_hint(keys: TraceKeys, setup: ReplaySetup, r: int) -> KeepHint:
    """The ``keep`` hint request ``r`` carries in this replay (see :class:`ReplaySetup`)."""
    if not setup.hints:
        return None
    if setup.hint_form == "prefix":
        return keys.reused_tokens(r)
    return keys.hint(r, setup.hint_noise)


def pending_room(keys: TraceKeys) -> int:
    """Offload room (blocks) so that no offer of one request is ever dropped.

    A request can offer each of its blocks at insert and as many evicted ones.
    """
    longest = max((len(k) for k in keys.keys), default=1)
    return 2 * longest + 16


def replay_model(
    keys: TraceKeys, setup: ReplaySetup, progress: Progress | None = None
) -> ReplayResult:
    """Replay the whole trace of ``keys`` through the model; see the module docstring."""
    check_setup(setup)
    node = NodeModel(setup.node_blocks)
    room = pending_room(keys)
    engines = [ModelEngine(setup, keys, node, room) for _ in range(setup.engines)]
    result = ReplayResult(setup)
    trace = keys.trace
    try:
        for r, req in enumerate(trace):
            ks, ds = keys.keys[r], keys.digests[r]
            keep = replay_hint(keys, setup, r)
            engine = engines[route(setup, ks, r)]
            l1_hits, node_hits = engine.request(r, ks, ds, keep)
            result.count_request(req.timestamp_ms, len(ks), l1_hits, node_hits)
            if progress is not None and (r + 1) % PROGRESS_EVERY == 0:
                progress(PROGRESS_EVERY)
        if progress is not None:
            progress(len(trace) % PROGRESS_EVERY)
        result.sent_blocks = node.stored
        for e in engines:
            e.l1.evict_all()
            result.drained_blocks += e.drain()
            result.dropped_offloads += e.queue.dropped
        result.extra["node_evictions"] = node.evictions
        result.extra["l1_evictions"] = sum(e.l1.stats.evictions for e in engines)
        policy = engines[0].l1.offload_policy
        for what in ("offered_hint", "offered_ghost", "offered_hot", "offered_prefix"):
            if hasattr(policy, what):
                result.extra[what] = sum(getattr(e.l1.offload_policy, what) for e in engines)
    finally:
        for e in engines:
            e.close()
    return result
