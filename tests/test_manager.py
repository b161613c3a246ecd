"""KVCacheManager against real ``rdmakv serve`` processes (issue 3 item 6, issue 5 item 1).

Every node is a real child process on 127.0.0.1 (``node_factory``); node-side
effects are checked through a separate plain :class:`KVClient` (``exists`` /
``stats``). Where a test counts the manager's node calls it swaps the
manager's real client for :class:`CountingClient`, which forwards every call
to it unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import NodeProcess

from rdmakv.blocks.keys import BlockKey, KeyNamespace
from rdmakv.client.node_client import KVClient
from rdmakv.engine.l1 import KeepHint
from rdmakv.engine.manager import Acquired, KVCacheManager, tp_namespace
from rdmakv.errors import ConfigError

BLOCK_TOKENS = 4
BLOCK_BYTES = 16 * 1024  # smaller than the node's 64 KiB blocks: values need not fill one
CLIENT_TIMEOUT = 2.0  # seconds; bounds every node wait in these tests
FLUSH_TIMEOUT = 10.0
VOCAB = 32000

pytestmark = pytest.mark.timeout(60)


class CountingClient:
    """Forwards to a real :class:`KVClient`, counting the calls that reach the node."""

    COUNTED = frozenset({"exists", "get", "get_sizes", "put", "delete"})

    def __init__(self, real: KVClient) -> None:
        self.real = real
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if name not in self.COUNTED:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def count_calls(mgr: KVCacheManager) -> Counter[str]:
    """Put a :class:`CountingClient` in front of the manager's real client; its counts."""
    assert mgr.client is not None
    counting = CountingClient(mgr.client)
    mgr.client = counting  # type: ignore[assignment]
    return counting.calls


def kv_bytes(key: BlockKey, nbytes: int) -> np.ndarray:
    """The KV an engine would have computed for block ``key``: a function of the key only."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def tokens_of(seed: int, num_blocks: int, tail: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, num_blocks * BLOCK_TOKENS + tail, dtype=np.int32)


def make_manager(node: NodeProcess | str | None, **kw: Any) -> KVCacheManager:
    """A test manager on ``node`` (a node, an address string: a cluster too, or None)."""
    opts: dict[str, Any] = {
        "namespace": KeyNamespace(model="test-model", dtype="float16", kv_layout="NHD"),
        "block_tokens": BLOCK_TOKENS,
        "block_bytes": BLOCK_BYTES,
        "l1_bytes": 64 * BLOCK_BYTES,
        "node": node if node is None or isinstance(node, str) else node.endpoint,
        "transport": "tcp",
        "offload": "all",
        "max_pending_offload_bytes": 64 * BLOCK_BYTES,
        "timeout": CLIENT_TIMEOUT,
        "lock_slab": False,
    }
    opts.update(kw)
    if opts["offload"] is None:  # the manager's own default
        del opts["offload"]
    return KVCacheManager(**opts)


def compute_and_put(
    mgr: KVCacheManager,
    tokens: np.ndarray,
    first: int = 0,
    count: int | None = None,
    keep: KeepHint = None,
) -> list[BlockKey]:
    """Compute (fill) blocks ``first..first+count`` of ``tokens`` and put them; their keys."""
    keys = mgr.keyer.keys(tokens)
    count = len(keys) - first if count is None else count
    handles = mgr.allocate_for(count)
    for h, key in zip(handles, keys[first : first + count], strict=True):
        mgr.block_view(h)[:] = kv_bytes(key, BLOCK_BYTES)
    mgr.put(tokens, handles, first_block=first, keep=keep)
    return keys[first : first + count]


def assert_kv(mgr: KVCacheManager, got: Acquired, tokens: np.ndarray) -> None:
    keys = mgr.keyer.keys(tokens)
    for i, h in enumerate(got.handles):
        assert np.array_equal(mgr.block_view(h), kv_bytes(keys[i], BLOCK_BYTES)), f"block {i}"


@pytest.fixture
def probe(node: NodeProcess) -> Iterator[KVClient]:
    """A control-only client of ``node`` for checking what the node holds."""
    c = KVClient(*node.address, None, transport="tcp", timeout=CLIENT_TIMEOUT)
    yield c
    c.close()


ManagerFactory = Callable[..., KVCacheManager]


@pytest.fixture
def managers(node: NodeProcess) -> Iterator[ManagerFactory]:
    made: list[KVCacheManager] = []

    def make(**kw: Any) -> KVCacheManager:
        m = make_manager(node, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# -- offload modes drive the node ------------------------------------------------------------


def test_offload_all_puts_every_block_on_the_node(
    managers: ManagerFactory, probe: KVClient
) -> None:
    m = managers(offload="all")
    keys = compute_and_put(m, tokens_of(1, 12))
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(keys) == [True] * 12
    assert m.offloader is not None and m.offloader.sent_blocks == 12
    assert probe.stats()["commits"] == 12


def test_default_offload_sends_everything_but_what_a_hint_excludes(
    managers: ManagerFactory, probe: KVClient
) -> None:
    m = managers(offload=None)  # the default: reuse, budget 1
    assert m.l1.offload_mode == "reuse"
    plain = compute_and_put(m, tokens_of(11, 4))
    kept = compute_and_put(m, tokens_of(12, 4), keep=True)
    one_shot = compute_and_put(m, tokens_of(13, 4), keep=False)
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(plain + kept) == [True] * 8
    assert probe.exists(one_shot) == [False] * 4
    # A one-shot request's blocks that turn out to be reused are sent on that reuse.
    got = m.acquire(tokens_of(13, 4)[: 2 * BLOCK_TOKENS])
    assert got.l1_blocks == 2
    m.release(got)
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(one_shot) == [True] * 2 + [False] * 2


def test_keep_hint_as_a_prefix_length_sends_only_the_blocks_inside_it(
    managers: ManagerFactory, probe: KVClient
) -> None:
    m = managers(offload=None)
    # "The first 2.5 blocks' tokens will be reused": blocks 0 and 1 lie inside.
    keys = compute_and_put(m, tokens_of(15, 4), keep=2 * BLOCK_TOKENS + BLOCK_TOKENS // 2)
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(keys) == [True, True, False, False]
    tokens = tokens_of(16, 2)
    handles = m.allocate_for(2)
    for bad in (-1, "yes", 1.5):
        with pytest.raises(ConfigError, match=r"keep must be True, False, None or a token count"):
            m.put(tokens, handles, keep=bad)  # type: ignore[arg-type]
    m.discard(handles)


def test_offload_budget_sends_less_and_is_checked(
    managers: ManagerFactory, probe: KVClient, node: NodeProcess
) -> None:
    m = managers(offload="reuse", offload_budget=0.25)
    keys = [k for i in range(30) for k in compute_and_put(m, tokens_of(20 + i, 4))]
    assert m.flush(FLUSH_TIMEOUT)
    sent = probe.exists(keys)
    assert 0 < sum(sent) < len(keys) // 2  # about a quarter...
    assert not any(sent[i] and not sent[i - 1] for i in range(len(keys)) if i % 4)  # ...closed
    with pytest.raises(ConfigError, match="offload budget must be in \\(0, 1\\]"):
        make_manager(node, offload="reuse", offload_budget=2.0)
    with pytest.raises(ConfigError, match="applies only to offload mode 'reuse', not 'all'"):
        make_manager(node, offload="all", offload_budget=0.5)


def test_offload_hot_puts_only_reaccessed_blocks(managers: ManagerFactory, probe: KVClient) -> None:
    m = managers(offload="hot", policy="lru")
    tokens = tokens_of(2, 8)
    keys = compute_and_put(m, tokens)
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(keys) == [False] * 8, "nothing is hot before a re-access"
    got = m.acquire(tokens[: 3 * BLOCK_TOKENS])  # re-access of blocks 0..2 makes them hot
    assert got.l1_blocks == 3
    m.release(got)
    assert m.flush(FLUSH_TIMEOUT)
    assert probe.exists(keys) == [True] * 3 + [False] * 5


def test_offload_cold_puts_evicted_blocks_only(managers: ManagerFactory, probe: KVClient) -> None:
    m = managers(offload="cold", policy="lru", l1_bytes=4 * BLOCK_BYTES)
    tokens = tokens_of(3, 10)
    keys = compute_and_put(m, tokens)  # 10 blocks into a 4-block L1: the 6 oldest are evicted
    assert m.flush(FLUSH_TIMEOUT)
    assert m.l1.stats.evictions == 6
    assert probe.exists(keys) == [True] * 6 + [False] * 4
    assert all(k in m.l1 for k in keys[6:])


def test_offload_backpressure_drops_and_never_blocks_the_engine(
    node: NodeProcess, managers: ManagerFactory, probe: KVClient
) -> None:
    m = managers(offload="all", max_pending_offload_bytes=2 * BLOCK_BYTES)
    tokens = tokens_of(4, 20)
    assert node.proc is not None
    node.pause()  # the node stalls: offloads cannot finish
    try:
        keys = compute_and_put(m, tokens)  # must return although nothing can be sent
        assert len(m.l1) == 20
        stats = m.l1.stats
        assert stats.offloads == 2
        assert stats.offloads_dropped == 18
        assert m.queue is not None and m.queue.dropped == 18
    finally:
        node.resume()
    assert m.flush(FLUSH_TIMEOUT)
    # Whatever the stalled batch achieved, the dropped blocks never reached the node.
    assert probe.exists(keys[2:]) == [False] * 18


# -- L1 miss -> one batched node fetch -------------------------------------------------------


def test_l1_miss_falls_through_to_one_batched_fetch_that_fills_l1(
    managers: ManagerFactory, probe: KVClient
) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(5, 10, tail=3)
    compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    compute_and_put(reader, tokens, first=0, count=3)  # blocks 0..2 already in the reader's L1
    calls = count_calls(reader)
    before = probe.stats()

    got = reader.acquire(tokens)
    after = probe.stats()
    assert (got.num_blocks, got.l1_blocks, got.l2_blocks) == (10, 3, 7)
    assert got.num_tokens == 40  # the 3 trailing tokens are a partial block: never cached
    assert_kv(reader, got, tokens)
    assert calls["get_sizes"] == 1, "one batched node fetch"
    assert after["lookups"] - before["lookups"] == 7, "only the blocks L1 missed"
    assert after["leases_granted"] == before["leases_granted"], "a tcp GET takes no lease"
    reader.release(got)

    again = reader.acquire(tokens)
    assert (again.num_blocks, again.l1_blocks) == (10, 10), "fetched blocks entered L1"
    assert_kv(reader, again, tokens)
    assert calls["get_sizes"] == 1, "an all-L1 hit makes no node call"
    assert probe.stats()["lookups"] == after["lookups"]
    reader.release(again)
    assert reader.l1.held_handles == 0


def test_acquire_stops_at_the_first_block_the_node_lacks(
    managers: ManagerFactory, probe: KVClient
) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(6, 8)
    keys = compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    assert probe.delete([keys[5]]) == [True]
    reader = managers(offload="none")
    got = reader.acquire(tokens)
    assert got.num_blocks == 5
    assert_kv(reader, got, tokens)
    assert keys[6] not in reader.l1, "blocks after the gap are not admitted"
    assert reader.slab.used_blocks == len(reader.l1), "blocks fetched past the gap were freed"
    reader.release(got)


def test_acquire_max_tokens_caps_the_fetch(managers: ManagerFactory, probe: KVClient) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(7, 8)
    compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    before = probe.stats()["lookups"]
    got = reader.acquire(tokens, max_tokens=3 * BLOCK_TOKENS + 1)
    assert got.num_blocks == 3
    assert probe.stats()["lookups"] - before == 3
    reader.release(got)
    with pytest.raises(ConfigError, match="max_tokens"):
        reader.acquire(tokens, max_tokens=-1)


def test_digest_mismatch_from_the_node_is_a_miss(
    node: NodeProcess, managers: ManagerFactory, client_slab: Any
) -> None:
    reader = managers(offload="none")
    tokens = tokens_of(8, 4)
    chain = reader.keyer.chain(tokens)
    with KVClient(*node.address, client_slab, transport="tcp", timeout=CLIENT_TIMEOUT) as raw:
        handles = client_slab.alloc_many(4)
        for h, (_, key, _) in zip(handles, chain, strict=True):
            client_slab.numpy(h)[:BLOCK_BYTES] = kv_bytes(key, BLOCK_BYTES)
        digests = [d for _, _, d in chain]
        digests[2] = bytes(16)  # block 2 stored under its key but with some other digest
        assert raw.put([k for _, k, _ in chain], handles, BLOCK_BYTES, digests) == [True] * 4
    got = reader.acquire(tokens)
    assert got.num_blocks == 2
    assert_kv(reader, got, tokens)
    assert chain[2][1] not in reader.l1
    assert reader.stats.l2_miss_blocks >= 1
    reader.release(got)


# -- node failures ---------------------------------------------------------------------------


def test_node_killed_mid_workload_gives_l1_hits_and_misses_then_reconnects(
    node: NodeProcess, managers: ManagerFactory
) -> None:
    writer = managers(offload="all")
    warm, cold, later = tokens_of(9, 6), tokens_of(10, 6), tokens_of(11, 6)
    compute_and_put(writer, warm)
    compute_and_put(writer, cold)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    got = reader.acquire(warm)
    assert got.l2_blocks == 6
    reader.release(got)

    pending = reader.prefetch(cold)  # node I/O in flight (or about to be) at the kill
    node.kill()
    reader.wait_prefetches(FLUSH_TIMEOUT)
    arrived = pending.result(0)
    assert 0 <= arrived <= 6
    got = reader.acquire(warm)
    assert (got.num_blocks, got.l1_blocks) == (6, 6), "L1 still answers"
    assert_kv(reader, got, warm)
    reader.release(got)
    got = reader.acquire(cold)
    assert got.num_blocks == arrived, "blocks not prefetched in time are misses"
    reader.release(got)
    errors = reader.stats.l2_errors
    assert reader.exists(later) == 0
    assert reader.stats.l2_errors > errors, "the dead node was asked and failed fast"
    compute_and_put(writer, later)  # the offloader's put fails: counted, not raised
    assert writer.flush(FLUSH_TIMEOUT)

    node.restart()  # same port, empty store
    compute_and_put(writer, tokens_of(12, 6))
    assert writer.flush(FLUSH_TIMEOUT)
    fresh = tokens_of(12, 6)
    assert reader.exists(fresh) == 6 * BLOCK_TOKENS
    got = reader.acquire(fresh)
    assert got.l2_blocks == 6, "the manager reconnected to the restarted node"
    assert_kv(reader, got, fresh)
    reader.release(got)


def test_stalled_node_gives_l1_hits_within_the_timeout_then_recovers(
    node: NodeProcess, managers: ManagerFactory
) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(17, 8)
    compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    compute_and_put(reader, tokens, first=0, count=2)
    assert node.proc is not None
    node.pause()  # alive but silent: only the timeout ends the wait
    try:
        got = reader.acquire(tokens)
        assert (got.num_blocks, got.l1_blocks) == (2, 2)
        assert reader.stats.l2_errors == 1
        reader.release(got)
    finally:
        node.resume()
    got = reader.acquire(tokens)
    assert (got.num_blocks, got.l1_blocks) == (8, 2), "the next acquire reconnects and fetches"
    assert_kv(reader, got, tokens)
    reader.release(got)


# -- exists / prefetch / partial blocks (issue 5 item 1) ----------------------------------------


def test_exists_is_l1_index_plus_at_most_one_node_call(
    managers: ManagerFactory, probe: KVClient
) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(13, 10, tail=2)
    keys = compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    compute_and_put(reader, tokens, first=0, count=4)
    calls = count_calls(reader)

    assert reader.exists(tokens[: 4 * BLOCK_TOKENS]) == 16
    assert calls["exists"] == 0, "a full L1 hit needs no node call"
    assert reader.exists(tokens) == 40
    assert calls["exists"] == 1
    assert probe.delete([keys[7]]) == [True]
    assert reader.exists(tokens) == 7 * BLOCK_TOKENS
    assert calls["exists"] == 2
    assert calls["get_sizes"] == 0, "exists fetches nothing"
    assert reader.l1.held_handles == 0, "exists takes no references"


def test_prefetch_is_asynchronous_and_fills_l1(node: NodeProcess, managers: ManagerFactory) -> None:
    writer = managers(offload="all")
    tokens = tokens_of(14, 8)
    keys = compute_and_put(writer, tokens)
    assert writer.flush(FLUSH_TIMEOUT)
    reader = managers(offload="none")
    calls = count_calls(reader)
    assert node.proc is not None
    node.pause()
    try:
        fut = reader.prefetch(tokens)  # returns although the node cannot answer yet
        assert not fut.done()
        assert reader.l1.count_prefix(keys) == 0
    finally:
        node.resume()
    reader.wait_prefetches(FLUSH_TIMEOUT)
    assert fut.result(0) == 8
    assert reader.l1.count_prefix(keys) == 8
    assert reader.l1.held_handles == 0, "prefetched blocks are cached, not held"
    got = reader.acquire(tokens)
    assert got.l1_blocks == 8
    assert_kv(reader, got, tokens)
    assert calls["get_sizes"] == 0, "prefetch has its own connection; acquire is an L1 hit"
    reader.release(got)


def test_partial_blocks_are_never_cached(managers: ManagerFactory) -> None:
    m = managers(offload="all")
    tokens = tokens_of(15, 3, tail=BLOCK_TOKENS - 1)
    handles = m.allocate_for(4)
    with pytest.raises(ConfigError, match="full blocks"):
        m.put(tokens, handles)  # the 4th handle would be the partial tail
    m.discard(handles)
    compute_and_put(m, tokens)
    assert len(m.l1) == 3
    assert m.exists(tokens) == 3 * BLOCK_TOKENS
    got = m.acquire(tokens)
    assert got.num_tokens == 3 * BLOCK_TOKENS
    m.release(got)
    assert m.slab.used_blocks == len(m.l1)


def test_manager_without_node_is_an_l1_cache() -> None:
    with make_manager(None) as m:
        tokens = tokens_of(16, 5)
        compute_and_put(m, tokens)
        assert m.exists(tokens) == 20
        got = m.acquire(tokens)
        assert got.l1_blocks == 5
        assert_kv(m, got, tokens)
        m.release(got)
        assert m.prefetch(tokens).result(0) == 0


# -- TP key namespaces -----------------------------------------------------------------------


BASE_NS = KeyNamespace(model="m", dtype="bfloat16", kv_layout="NHD")


def test_tp_namespace_shares_keys_where_the_bytes_are_identical() -> None:
    def ns(rank: int, size: int, heads: int) -> KeyNamespace:
        return tp_namespace(BASE_NS, tp_rank=rank, tp_size=size, num_kv_heads=heads)

    # One KV head replicated on every rank (e.g. MLA): every TP size shares.
    assert {ns(r, s, 1) for s in (1, 2, 4, 8) for r in range(s)} == {BASE_NS}
    # Split heads: ranks differ, and so do TP sizes that give different slices.
    assert ns(0, 2, 8) != ns(1, 2, 8)
    assert ns(0, 2, 8) != ns(0, 4, 8)
    # TP=1 holds every head: the base namespace.
    assert ns(0, 1, 8) == BASE_NS
    # More ranks than heads: ranks holding the same head share, across TP sizes too.
    assert ns(0, 8, 4) == ns(1, 8, 4) == ns(0, 4, 4)
    assert ns(7, 8, 4) == ns(6, 8, 4) == ns(3, 4, 4) != ns(5, 8, 4)
    with pytest.raises(ConfigError, match="divide"):
        ns(0, 3, 8)
    with pytest.raises(ConfigError, match="tp_rank"):
        ns(4, 4, 8)
