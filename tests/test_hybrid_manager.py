"""HybridKVCacheManager against a real node (issue 5 item 3).

Random hit patterns over 2-3 groups with mixed block sizes and block bytes:
each present block is stored either on the node (by a writer manager) or
only in the reader's L1, so both tiers feed the bitmaps. The common hit must
equal the brute-force reference of ``tests/test_hybrid.py``; the acquired
blocks per group must be exactly those the group needs for that length, with
the right bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import NodeProcess
from test_hybrid import reference_longest_common_hit
from test_manager import CountingClient, count_calls

from rdmakv.blocks.keys import BlockKey, KeyNamespace
from rdmakv.client.streams import MultiStreamClient
from rdmakv.engine.groups import (
    MAX_ACQUIRE_ATTEMPTS,
    GroupLayout,
    HybridAcquired,
    HybridKVCacheManager,
)
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, StateSpec
from rdmakv.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

CLIENT_TIMEOUT = 2.0
FLUSH_TIMEOUT = 10.0
VOCAB = 32000
L1_BLOCKS = 64  # per group: more than any request here needs


def layout(group: KVCacheGroup, block_bytes: int) -> GroupLayout:
    """A group with room for L1_BLOCKS blocks, all of which may be pending offload."""
    return GroupLayout(group, block_bytes, L1_BLOCKS * block_bytes, L1_BLOCKS * block_bytes)


THREE_GROUPS = [
    layout(KVCacheGroup(0, FullAttentionSpec(16)), 16 * 1024),
    layout(KVCacheGroup(1, SlidingWindowSpec(32, window=48)), 8 * 1024),
    layout(KVCacheGroup(2, StateSpec(64)), 4 * 1024),
]
TWO_GROUPS = [
    layout(KVCacheGroup(0, FullAttentionSpec(16)), 8 * 1024),
    layout(KVCacheGroup(3, SlidingWindowSpec(48, window=100)), 4 * 1024),
]
NUM_TOKENS = 640  # 10 units of the lcm 64 of THREE_GROUPS; 13 units (+ 16 tokens) of 48


def kv_bytes(key: BlockKey, nbytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, nbytes, dtype=np.uint8
    )


def make(node: NodeProcess | None, layouts: list[GroupLayout], ns: str, offload: str) -> Any:
    return HybridKVCacheManager(
        namespace=KeyNamespace(model=ns, dtype="bfloat16"),
        groups=layouts,
        node=None if node is None else node.endpoint,
        transport="tcp",
        offload=offload,
        timeout=CLIENT_TIMEOUT,
        lock_slab=False,
    )


def put_block(h: HybridKVCacheManager, k: int, tokens: np.ndarray, i: int) -> BlockKey:
    """Compute block ``i`` of the ``k``-th group and put it; returns its key."""
    g = h.groups[k]
    m = h.managers[k]
    key = m.keyer.keys(tokens, g.key_extra())[i]
    (handle,) = m.allocate_for(1)
    m.block_view(handle)[:] = kv_bytes(key, m.block_bytes)
    h.put(g.group_id, tokens, [handle], first_block=i)
    return key


def random_bitmaps(rng: np.random.Generator, layouts: list[GroupLayout]) -> list[list[bool]]:
    """Patterns with long leading runs (so hits are often non-trivial) and random holes."""
    out = []
    for gl in layouts:
        n = NUM_TOKENS // gl.group.block_size
        run = int(rng.integers(0, n + 1))
        density = float(rng.choice([0.5, 0.8, 0.95]))
        out.append([i < run or bool(rng.random() < density) for i in range(n)])
    return out


def assert_acquired(
    h: HybridKVCacheManager, got: HybridAcquired, tokens: np.ndarray, length: int
) -> None:
    assert got.num_tokens == length
    for k, (g, m) in enumerate(zip(h.groups, h.managers, strict=True)):
        assert sorted(got.blocks[k]) == list(g.spec.required_blocks(length)), f"group {k}"
        keys = m.keyer.keys(tokens, g.key_extra())
        for i, handle in got.blocks[k].items():
            view = m.block_view(handle)
            assert view.nbytes == m.block_bytes
            assert np.array_equal(view, kv_bytes(keys[i], m.block_bytes)), f"group {k} block {i}"


@pytest.fixture
def hybrids(node: NodeProcess) -> Iterator[Any]:
    made: list[HybridKVCacheManager] = []

    def factory(layouts: list[GroupLayout], ns: str, offload: str) -> HybridKVCacheManager:
        h = make(node, layouts, ns, offload)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


@pytest.mark.parametrize(
    ("layouts", "seed"),
    [(THREE_GROUPS, s) for s in range(6)] + [(TWO_GROUPS, s) for s in range(6, 9)],
)
def test_common_hit_matches_brute_force_and_acquires_exactly_the_needed_blocks(
    hybrids: Any, layouts: list[GroupLayout], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    ns = f"hybrid-{seed}"
    writer = hybrids(layouts, ns, "all")
    reader = hybrids(layouts, ns, "none")
    tokens = rng.integers(0, VOCAB, NUM_TOKENS + 5, dtype=np.int32)  # + a partial tail
    bitmaps = random_bitmaps(rng, layouts)
    for k, bitmap in enumerate(bitmaps):
        for i, present in enumerate(bitmap):
            if present:  # two thirds on the node, the rest only in the reader's L1
                put_block(writer if rng.random() < 2 / 3 else reader, k, tokens, i)
    assert writer.flush(FLUSH_TIMEOUT)
    expected = reference_longest_common_hit([gl.group for gl in layouts], bitmaps, NUM_TOKENS + 5)
    calls = [Counter[str]() for _ in layouts]
    for k, m in enumerate(reader.managers):
        counting = CountingClient(m.client)  # type: ignore[arg-type]
        calls[k] = counting.calls
        m.client = counting  # type: ignore[assignment]

    assert reader.hit_bitmaps(tokens) == bitmaps
    assert all(c["exists"] <= 1 for c in calls), "at most one node exists per group"
    assert reader.exists(tokens) == expected
    assert all(c["exists"] <= 2 for c in calls), "at most one node exists per group per lookup"
    assert all(c["get_sizes"] == 0 for c in calls), "lookups fetch nothing"
    got = reader.acquire(tokens)
    assert_acquired(reader, got, tokens, expected)
    assert reader.stats.retries == 0
    assert all(c["get_sizes"] <= 1 for c in calls), "one batched fetch per group"
    reader.release(got)
    assert all(m.l1.held_handles == 0 for m in reader.managers)

    again = reader.acquire(tokens)  # everything needed is in L1 now
    assert_acquired(reader, again, tokens, expected)
    assert all(c["get_sizes"] <= 1 for c in calls), "the second acquire is served from L1"
    reader.release(again)


class EvictingClient(CountingClient):
    """A real client whose first fetch finds one block gone: another client deleted it
    on the node between our lookup and our fetch (as eviction would)."""

    def __init__(self, real: Any, victim: BlockKey) -> None:
        super().__init__(real)
        self.victim: BlockKey | None = victim

    def get_sizes(self, keys: Any, handles: Any, digests: Any) -> Any:
        self.calls["get_sizes"] += 1
        if self.victim is not None and self.victim in keys:
            assert self.real.delete([self.victim]) == [True]
            self.victim = None
        return self.real.get_sizes(keys, handles, digests)


def test_block_missing_at_fetch_time_recomputes_the_fixed_point(hybrids: Any) -> None:
    writer = hybrids(THREE_GROUPS, "hybrid-retry", "all")
    reader = hybrids(THREE_GROUPS, "hybrid-retry", "none")
    tokens = np.random.default_rng(42).integers(0, VOCAB, NUM_TOKENS, dtype=np.int32)
    keys = {}
    for k, gl in enumerate(THREE_GROUPS):
        for i in range(NUM_TOKENS // gl.group.block_size):
            keys[k, i] = put_block(writer, k, tokens, i)
    assert writer.flush(FLUSH_TIMEOUT)
    state = reader.managers[2]
    state_blocks = NUM_TOKENS // 64
    assert reader.exists(tokens) == NUM_TOKENS
    evicting = EvictingClient(state.client, keys[2, state_blocks - 1])
    state.client = evicting  # type: ignore[assignment]

    got = reader.acquire(tokens)
    # The state block at 640 vanished: the next hit every group agrees on is 576.
    bitmaps = [[True] * (NUM_TOKENS // gl.group.block_size) for gl in THREE_GROUPS]
    bitmaps[2][state_blocks - 1] = False
    expected = reference_longest_common_hit([gl.group for gl in THREE_GROUPS], bitmaps, NUM_TOKENS)
    assert expected == NUM_TOKENS - 64
    assert_acquired(reader, got, tokens, expected)
    assert reader.stats.retries == 1
    assert evicting.calls["get_sizes"] == 2
    reader.release(got)
    assert all(m.l1.held_handles == 0 for m in reader.managers)


class LastMissingClient(CountingClient):
    """A real client whose every fetch finds its last block gone: each attempt of an
    acquire loses one more block, so it keeps retrying."""

    def get_sizes(self, keys: Any, handles: Any, digests: Any) -> Any:
        self.calls["get_sizes"] += 1
        sizes = self.real.get_sizes(keys, handles, digests)
        return [*sizes[:-1], None]


def test_retries_are_bounded_then_the_request_is_a_miss(hybrids: Any) -> None:
    writer = hybrids(THREE_GROUPS, "hybrid-bounded", "all")
    reader = hybrids(THREE_GROUPS, "hybrid-bounded", "none")
    tokens = np.random.default_rng(7).integers(0, VOCAB, NUM_TOKENS, dtype=np.int32)
    for k, gl in enumerate(THREE_GROUPS):
        for i in range(NUM_TOKENS // gl.group.block_size):
            put_block(writer, k, tokens, i)
    assert writer.flush(FLUSH_TIMEOUT)
    for m in reader.managers:
        m.client = LastMissingClient(m.client)  # type: ignore[assignment]
    got = reader.acquire(tokens)
    assert got.num_tokens == 0
    assert got.blocks == [{}, {}, {}]
    assert reader.stats.retries == MAX_ACQUIRE_ATTEMPTS
    assert reader.stats.gave_up == 1
    assert all(m.l1.held_handles == 0 for m in reader.managers)
    assert all(m.slab.used_blocks == len(m.l1) for m in reader.managers), "no block leaked"


def test_group_is_part_of_the_key(hybrids: Any) -> None:
    h = hybrids(THREE_GROUPS, "hybrid-keys", "none")
    tokens = np.arange(NUM_TOKENS, dtype=np.int32)
    firsts = {
        m.keyer.keys(tokens, g.key_extra())[0] for g, m in zip(h.groups, h.managers, strict=True)
    }
    assert len(firsts) == 3


def test_l1_only_hybrid_and_bad_configuration() -> None:
    with make(None, TWO_GROUPS, "hybrid-l1", "none") as h:
        tokens = np.random.default_rng(3).integers(0, VOCAB, 192, dtype=np.int32)
        for i in range(12):  # full: blocks 0..11 (192 tokens)
            put_block(h, 0, tokens, i)
        put_block(h, 1, tokens, 3)  # a window of 100 tokens at 192 needs blocks 1..3 of 48
        assert h.exists(tokens) == 0
        put_block(h, 1, tokens, 2)
        assert h.exists(tokens) == 0, "at 192 block 1 is missing, at 144 blocks 0..1"
        put_block(h, 1, tokens, 1)
        assert h.exists(tokens) == 192
        got = h.acquire(tokens, max_tokens=150)
        assert got.num_tokens == 0, "capped at 144, which needs window block 0"
        put_block(h, 1, tokens, 0)
        got = h.acquire(tokens, max_tokens=150)
        assert got.num_tokens == 144
        assert sorted(got.blocks[0]) == list(range(9))
        assert sorted(got.blocks[1]) == [0, 1, 2]
        h.release(got)
        with pytest.raises(ConfigError, match="unknown KV cache group"):
            h.put(9, tokens, [])
    with pytest.raises(ConfigError, match="unique"):
        make(None, [THREE_GROUPS[0], THREE_GROUPS[0]], "dup", "none")


def test_batched_lookup_is_one_node_call_per_group_and_streams_reach_every_group(
    node: NodeProcess,
) -> None:
    """``batch_hit_bitmaps`` answers several prompts with one ``exists`` per group,
    as each prompt's own :meth:`hit_bitmaps` would; ``streams`` applies to every group."""
    ns = KeyNamespace(model="hybrid-batch", dtype="bfloat16")
    writer = make(node, TWO_GROUPS, "hybrid-batch", "all")
    reader = HybridKVCacheManager(
        namespace=ns, groups=TWO_GROUPS, node=node.endpoint, transport="tcp", offload="none",
        timeout=CLIENT_TIMEOUT, lock_slab=False, streams=2,
    )
    with writer, reader:
        assert all(
            isinstance(m.client, MultiStreamClient) and m.client.streams == 2
            for m in reader.managers
        )
        rng = np.random.default_rng(11)
        prompts = [rng.integers(0, VOCAB, 192, dtype=np.int32) for _ in range(3)]
        for i in range(12):
            put_block(writer, 0, prompts[0], i)
        for i in (1, 3):  # holes: a window group's bitmap is not a leading run
            put_block(writer, 1, prompts[1], i)
        assert writer.flush(FLUSH_TIMEOUT)
        asks = [(prompts[0], None, None), (prompts[1], None, 150), (prompts[2], None, None)]
        one_by_one = [reader.hit_bitmaps(t, extra=e, max_tokens=m) for t, e, m in asks]
        counts = [count_calls(m) for m in reader.managers]
        assert reader.batch_hit_bitmaps(asks) == one_by_one
        assert [c["exists"] for c in counts] == [1, 1]
        assert one_by_one[0] == [[True] * 12, [False] * 4]
        assert one_by_one[1] == [[False] * 9, [False, True, False]]
        assert reader.batch_hit_bitmaps([]) == []
