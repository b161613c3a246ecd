"""L1Cache: put/get/acquire/release, capacity, held blocks, digests, offload modes."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.blocks.keys import KEY_BYTES, BlockKeyer, KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.engine.l1 import L1Cache, OffloadItem, OffloadMode, OffloadQueue, S3FIFOPolicy
from rdmakv.errors import ConfigError, InvalidHandle, MemoryLockWarning, SlabExhausted

BS = 64


def make_slab(blocks: int, bs: int = BS) -> Slab:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryLockWarning)
        return Slab(blocks * bs, bs)


@pytest.fixture
def slab() -> Iterator[Slab]:
    s = make_slab(16)
    yield s
    s.close()


def key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


def digest(k: bytes) -> bytes:
    return hashlib.blake2b(k, digest_size=16).digest()


def data(k: bytes, n: int = BS) -> bytes:
    return (k * (BS // KEY_BYTES + 1))[:n]


def read(slab: Slab, cache: L1Cache, h: int) -> bytes:
    return bytes(slab.view(h, cache.nbytes_of(h)))


def test_put_get_release_roundtrip(slab: Slab) -> None:
    c = L1Cache(slab)
    k = key(1)
    assert c.put(k, data(k, 40), digest(k))
    assert len(c) == 1 and c.used_bytes == BS and k in c
    h = c.get(k, digest(k))
    assert h is not None
    assert read(slab, c, h) == data(k, 40)
    assert slab.refcount(h) == 2  # cache + reader
    c.release([h])
    assert slab.refcount(h) == 1
    assert c.get(key(2)) is None
    st_ = c.stats
    assert (st_.hits, st_.misses, st_.inserts) == (1, 1, 1)


def test_put_accepts_numpy_and_rejects_bad_input(slab: Slab) -> None:
    c = L1Cache(slab)
    arr = np.arange(16, dtype=np.float32)  # 64 bytes
    assert c.put(key(1), arr, digest(key(1)))
    h = c.get(key(1))
    assert h is not None
    assert np.array_equal(slab.numpy(h, np.float32), arr)
    c.release([h])
    used = slab.used_blocks
    with pytest.raises(ConfigError, match=r"nbytes 65 outside \(0, block_size=64\]"):
        c.put(key(2), b"x" * 65, digest(key(2)))
    with pytest.raises(ConfigError, match="nbytes 0 outside"):
        c.put(key(2), b"", digest(key(2)))
    with pytest.raises(ConfigError, match="key must be 16 bytes, got 3 bytes"):
        c.put(b"abc", b"x", digest(key(2)))
    with pytest.raises(ConfigError, match="digest must be 16 bytes, got str"):
        c.put(key(2), b"x", "d" * 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bytes-like"):
        c.put(key(2), 12, digest(key(2)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="key must be 16 bytes, got 32 bytes"):
        c.put(key(2) * 2, b"x", digest(key(2)))  # a key the wire carries, but no block key
    assert slab.used_blocks == used and len(c) == 1  # nothing leaked or stored
    # the wire's rules otherwise: a bytearray key or digest is stored as its bytes
    assert c.put(bytearray(key(2)), b"x", bytearray(digest(key(2))))  # type: ignore[arg-type]
    h = c.get(key(2), digest(key(2)))
    assert h is not None
    c.release([h])


def test_duplicate_insert_returns_false_and_drops_the_ref(slab: Slab) -> None:
    c = L1Cache(slab)
    k = key(1)
    assert c.put(k, data(k), digest(k))
    h = c.allocate()
    slab.view(h)[:] = b"\xff" * BS
    assert not c.insert(k, h, BS, digest(k))
    assert not slab.is_live(h)
    assert len(c) == 1 and slab.used_blocks == 1
    h2 = c.get(k)
    assert h2 is not None and read(slab, c, h2) == data(k)  # original kept
    c.release([h2])
    assert not c.put(k, b"other", digest(k))


def test_insert_validates_handles(slab: Slab) -> None:
    c = L1Cache(slab)
    with pytest.raises(InvalidHandle, match="not allocated"):
        c.insert(key(1), 3, BS, digest(key(1)))
    c.put(key(1), data(key(1)), digest(key(1)))
    h = c.get(key(1))
    assert h is not None
    with pytest.raises(InvalidHandle, match="already holds a resident entry"):
        c.insert(key(2), h, BS, digest(key(2)))
    assert c.drop(key(1))  # h is now held by us but no longer resident
    with pytest.raises(InvalidHandle, match="held as a read lease"):
        c.insert(key(2), h, BS, digest(key(2)))
    h2 = c.allocate()
    with pytest.raises(ConfigError, match="nbytes 65"):
        c.insert(key(2), h2, BS + 1, digest(key(2)))
    assert slab.refcount(h2) == 1  # invalid args: caller keeps its reference
    c.release([h])
    slab.decref(h2)


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_capacity_is_never_exceeded(slab: Slab, policy: str) -> None:
    c = L1Cache(slab, capacity_bytes=5 * BS + 10, policy=policy)
    assert c.capacity_bytes == 5 * BS
    for i in range(40):
        c.put(key(i), data(key(i)), digest(key(i)))
        if i % 3 == 0:
            h = c.get(key(i // 2))
            if h is not None:
                c.release([h])
        assert c.used_bytes <= c.capacity_bytes
        assert len(c) <= 5
    assert c.stats.evictions == 40 - 5
    assert slab.used_blocks == len(c)


def test_lru_evicts_least_recent(slab: Slab) -> None:
    c = L1Cache(slab, capacity_bytes=3 * BS, policy="lru")
    for i in range(3):
        c.put(key(i), data(key(i)), digest(key(i)))
    h = c.get(key(0))
    assert h is not None
    c.release([h])
    c.put(key(3), data(key(3)), digest(key(3)))
    assert [c.contains(key(i)) for i in range(4)] == [True, False, True, True]


def test_held_blocks_are_never_evicted_or_overwritten(slab: Slab) -> None:
    c = L1Cache(slab, capacity_bytes=3 * BS)
    ks = [key(i) for i in range(3)]
    for k in ks:
        c.put(k, data(k), digest(k))
    held = c.acquire_prefix(ks)
    assert len(held) == 3
    with pytest.raises(SlabExhausted, match="every resident block is held"):
        c.put(key(9), data(key(9)), digest(key(9)))
    with pytest.raises(SlabExhausted, match="cannot allocate a block"):
        c.allocate()
    assert [read(slab, c, h) for h in held] == [data(k) for k in ks]
    assert slab.used_blocks == 3  # the failed put leaked nothing
    c.release(held[:1])
    assert c.put(key(9), data(key(9)), digest(key(9)))
    assert not c.contains(ks[0]) and c.contains(ks[1])
    c.release(held[1:])


def test_acquire_prefix_and_count_prefix(slab: Slab) -> None:
    c = L1Cache(slab)
    ks = [key(i) for i in range(5)]
    for k in ks[:3]:
        c.put(k, data(k), digest(k))
    assert c.count_prefix(ks) == 3
    assert c.stats.hits == 0  # count_prefix has no side effects
    hs = c.acquire_prefix(ks, [digest(k) for k in ks])
    assert len(hs) == 3
    assert [read(slab, c, h) for h in hs] == [data(k) for k in ks[:3]]
    assert c.held_handles == 3
    assert (c.stats.hits, c.stats.misses) == (3, 1)
    assert c.acquire_prefix([ks[4], ks[0]]) == []  # stops at the first miss
    with pytest.raises(ConfigError, match="2 keys but 1 digests"):
        c.acquire_prefix(ks[:2], [digest(ks[0])])
    c.release(hs)
    assert c.held_handles == 0
    assert slab.used_blocks == 3


def test_release_is_all_or_nothing_and_refuses_foreign_handles(slab: Slab) -> None:
    c = L1Cache(slab)
    c.put(key(1), data(key(1)), digest(key(1)))
    c.put(key(2), data(key(2)), digest(key(2)))
    h1 = c.get(key(1))
    assert h1 is not None
    h2_resident_not_held = c.acquire_prefix([key(2)])[0]
    c.release([h2_resident_not_held])
    with pytest.raises(InvalidHandle, match=r"cannot release block handle \d+ 1 time"):
        c.release([h1, h2_resident_not_held])
    assert slab.refcount(h1) == 2  # nothing released by the failed call
    with pytest.raises(InvalidHandle, match="2 time"):
        c.release([h1, h1])
    c.release([h1])
    assert slab.refcount(h1) == 1
    with pytest.raises(InvalidHandle):
        c.release([h1])
    assert c.contains(key(1))  # the cache's own reference was never stolen


def test_digest_mismatch_is_a_miss_and_drops_the_entry(slab: Slab) -> None:
    c = L1Cache(slab)
    k = key(1)
    c.put(k, data(k), digest(k))
    assert c.get(k, digest(key(2))) is None
    assert not c.contains(k)
    assert slab.used_blocks == 0
    s = c.stats
    assert (s.digest_mismatches, s.misses, s.hits) == (1, 1, 0)


def test_dropped_entry_stays_alive_for_its_holder(slab: Slab) -> None:
    c = L1Cache(slab)
    k = key(1)
    c.put(k, data(k), digest(k))
    h = c.get(k)
    assert h is not None
    assert c.drop(k) and not c.drop(k)
    assert c.nbytes_of(h) == BS
    for i in range(2, 12):  # churn the slab: the held block must not be reused
        c.put(key(i), data(key(i)), digest(key(i)))
    assert read(slab, c, h) == data(k)
    c.release([h])
    assert not slab.is_live(h)


def test_forced_key_collision_is_a_miss_not_the_other_blocks_data(slab: Slab) -> None:
    """A deliberately weak key hash makes two different prefixes share a key."""
    ns = KeyNamespace("m", "bf16")
    weak = BlockKeyer(ns, 4, key_hash=lambda b: hashlib.md5(b[:4]).digest())
    a_toks, b_toks = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 5, 6, 7, 8]
    a, b = weak.chain(a_toks), weak.chain(b_toks)
    assert a[0][1] == b[0][1]  # the collision is real
    c = L1Cache(slab)
    for (_p, k, d), payload in zip(a, [b"A0", b"A1"], strict=True):
        c.put(k, payload, d)
    b_keys, b_digs = [k for _, k, _ in b], [d for _, _, d in b]
    assert c.acquire_prefix(b_keys, b_digs) == []
    assert c.get(b_keys[0], b_digs[0]) is None
    assert c.stats.digest_mismatches >= 1
    assert c.stats.hits == 0


def test_constructor_validation(slab: Slab) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes 32 must be between one block"):
        L1Cache(slab, capacity_bytes=32)
    with pytest.raises(ConfigError, match="and the slab size"):
        L1Cache(slab, capacity_bytes=slab.nbytes + BS)
    with pytest.raises(ConfigError, match="unknown eviction policy 'mru'"):
        L1Cache(slab, policy="mru")
    with pytest.raises(ConfigError, match="offload mode 'hot' needs an offload_queue"):
        L1Cache(slab, offload="hot")
    with pytest.raises(ConfigError, match="slab must be a Slab"):
        L1Cache(object())  # type: ignore[arg-type]


# -- offload ---------------------------------------------------------------------


def consume(slab: Slab, q: OffloadQueue) -> list[OffloadItem]:
    """What a transport thread does: take, read the bytes, say done."""
    items = q.take(1000)
    for it in items:
        assert bytes(slab.view(it.handle, it.nbytes)) == data(it.key, it.nbytes)
    q.done(items)
    return items


def test_offload_all_offers_every_insert(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, offload="all", offload_queue=q)
    for i in range(4):
        c.put(key(i), data(key(i), 10 + i), digest(key(i)))
    assert len(q) == 4
    assert all(slab.refcount(h) == 2 for h in range(4))  # cache + pending offload
    items = consume(slab, q)
    assert [it.key for it in items] == [key(i) for i in range(4)]
    assert [it.digest for it in items] == [digest(key(i)) for i in range(4)]
    assert c.poll_offload() == 4
    assert all(slab.refcount(h) == 1 for h in range(4))
    assert c.stats.bytes_offloaded == 10 + 11 + 12 + 13 and c.stats.offloads == 4


def test_offload_hot_lru_once_per_entry_on_first_hit(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, policy="lru", offload=OffloadMode.HOT, offload_queue=q)
    for i in range(3):
        c.put(key(i), data(key(i)), digest(key(i)))
    assert len(q) == 0
    for _ in range(3):
        h = c.get(key(1))
        assert h is not None
        c.release([h])
    assert [it.key for it in consume(slab, q)] == [key(1)]
    assert c.stats.offloads == 1


def test_offload_hot_s3fifo_on_promotion(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, capacity_bytes=4 * BS, policy="s3fifo", offload="hot", offload_queue=q)
    assert isinstance(c.policy, S3FIFOPolicy)
    for i in range(4):
        c.put(key(i), data(key(i)), digest(key(i)))
    h = c.get(key(0))  # a hit while in small is not yet hot
    assert h is not None
    c.release([h])
    assert len(q) == 0
    c.put(key(4), data(key(4)), digest(key(4)))  # eviction promotes key 0 to main
    assert key(0) in c.policy.main_keys()
    assert [it.key for it in consume(slab, q)] == [key(0)]


def test_offload_cold_keeps_victim_alive_until_done(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, capacity_bytes=2 * BS, policy="fifo", offload="cold", offload_queue=q)
    for i in range(5):
        c.put(key(i), data(key(i)), digest(key(i)))
    assert len(q) == 3 and c.stats.evictions == 3
    # Victims are outside the cache but their blocks are still allocated...
    assert slab.used_blocks == 5
    # ...and still hold the right bytes although new blocks were allocated after.
    items = consume(slab, q)
    assert [it.key for it in items] == [key(i) for i in range(3)]
    c.poll_offload()
    assert slab.used_blocks == 2


def test_backpressure_drops_and_counts_without_blocking(slab: Slab) -> None:
    q = OffloadQueue(2 * BS)  # room for two pending blocks
    c = L1Cache(slab, capacity_bytes=4 * BS, offload="all", offload_queue=q)
    for i in range(6):
        assert c.put(key(i), data(key(i)), digest(key(i)))
    s = c.stats
    assert (s.offloads, s.offloads_dropped) == (2, 4)
    assert q.dropped == 4 and q.pending_bytes == 2 * BS
    assert s.bytes_offloaded == 2 * BS
    # Dropped offers released their references. Pending ones do not pin their
    # entries (keys 0 and 1 were evicted) but keep their blocks and bytes alive.
    assert len(c) == 4 and not c.contains(key(0)) and not c.contains(key(1))
    assert slab.used_blocks == len(c) + 2
    items = consume(slab, q)
    assert [it.key for it in items] == [key(0), key(1)]
    c.poll_offload()
    assert slab.used_blocks == len(c)
    assert sum(slab.refcount(h) for h in range(slab.num_blocks)) == len(c)


def test_pending_offloads_never_starve_the_producer() -> None:
    """A stalled consumer must cost offloads (dropped), never the engine's inserts."""
    slab = make_slab(8)  # capacity 4 + a 4-block offload bound
    q = OffloadQueue(4 * BS)
    c = L1Cache(slab, capacity_bytes=4 * BS, offload="all", offload_queue=q)
    for i in range(50):
        assert c.put(key(i), data(key(i)), digest(key(i)))
    assert len(c) == 4 and c.stats.offloads == 4 and c.stats.offloads_dropped == 46
    for it in consume(slab, q):  # the stalled consumer still sees the original bytes
        assert bytes(slab.view(it.handle, it.nbytes)) == data(it.key)
    c.poll_offload()
    assert slab.used_blocks == len(c) == 4
    slab.close()


def test_cold_backpressure_frees_dropped_victims(slab: Slab) -> None:
    q = OffloadQueue(BS)
    c = L1Cache(slab, capacity_bytes=2 * BS, offload="cold", offload_queue=q)
    for i in range(6):
        c.put(key(i), data(key(i)), digest(key(i)))
    assert c.stats.offloads == 1 and c.stats.offloads_dropped == 3
    assert slab.used_blocks == len(c) + 1  # + the one pending victim


# -- property test: random operations, invariants after each --------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["put", "put", "get", "get_bad", "acquire", "release", "drop", "take", "done"]
        ),
        st.integers(0, 11),
        st.integers(1, 4),
    ),
    min_size=30,  # short runs never reach eviction, back-pressure or ghost hits
    max_size=150,
)


@settings(max_examples=250, deadline=None)
@given(
    ops=OPS,
    policy=st.sampled_from(["lru", "fifo", "s3fifo"]),
    mode=st.sampled_from(list(OffloadMode)),
    cap_blocks=st.integers(1, 6),
)
def test_random_ops_keep_invariants(
    ops: list[tuple[str, int, int]], policy: str, mode: OffloadMode, cap_blocks: int
) -> None:
    """Capacity, refcount balance and data integrity hold under any op sequence."""
    slab = make_slab(12)
    q = OffloadQueue(2 * BS)
    c = L1Cache(
        slab,
        capacity_bytes=cap_blocks * BS,
        policy=policy,
        offload=mode,
        offload_queue=q if mode is not OffloadMode.NONE else None,
    )
    held: list[int] = []
    # Keys whose entries readers hold: they must stay resident (never evicted)
    # unless removed explicitly (drop, digest mismatch).
    pinned: dict[int, bytes] = {}
    taken: list[OffloadItem] = []
    # Large enough that a few pending offers hit the queue bound (drops happen).
    sizes = {key(i): BS // 2 + (i * 13) % (BS // 2 + 1) for i in range(12)}
    try:
        for op, i, n in ops:
            k = key(i)
            if op == "put":
                try:
                    c.put(k, data(k, sizes[k]), digest(k))
                except SlabExhausted:
                    # Only allowed when nothing evictable is left.
                    live = [e.handle for e in c._entries.values()]
                    assert all(slab.refcount(h) > 1 for h in live)
            elif op == "get":
                h = c.get(k, digest(k))
                if h is not None:
                    assert read(slab, c, h) == data(k, sizes[k])
                    held.append(h)
                    pinned[h] = k
            elif op == "get_bad":
                assert c.get(k, b"\x00" * 16) is None
                assert not c.contains(k)
                pinned = {h: x for h, x in pinned.items() if x != k}
            elif op == "acquire":
                ks = [key((i + j) % 12) for j in range(n)]
                hs = c.acquire_prefix(ks, [digest(x) for x in ks])
                for x, h in zip(ks, hs, strict=False):
                    assert read(slab, c, h) == data(x, sizes[x])
                    pinned[h] = x
                held.extend(hs)
            elif op == "release" and held:
                c.release(held[:n])
                del held[:n]
                pinned = {h: x for h, x in pinned.items() if h in held}
            elif op == "drop":
                c.drop(k)
                pinned = {h: x for h, x in pinned.items() if x != k}
            elif op == "take" and mode is not OffloadMode.NONE:
                for it in q.take(n):
                    assert bytes(slab.view(it.handle, it.nbytes)) == data(it.key, it.nbytes)
                    taken.append(it)
            elif op == "done" and taken:
                q.done(taken[:n])
                del taken[:n]
            # Invariants.
            assert c.used_bytes <= c.capacity_bytes
            pending = q.accepted - q.drained
            total_refs = sum(slab.refcount(h) for h in range(slab.num_blocks))
            assert total_refs == len(c) + c.held_handles + pending
            assert c.held_handles == len(held)
            assert all(c.contains(x) for x in pinned.values())
        # Give everything back: only resident entries remain.
        c.release(held)
        q.done(taken)
        q.done(q.take(1000))
        c.poll_offload()
        assert slab.used_blocks == len(c)
        assert sum(slab.refcount(h) for h in range(slab.num_blocks)) == len(c)
        if isinstance(c.policy, S3FIFOPolicy):
            assert len(c.policy.ghost_keys()) <= c.policy.ghost_limit
    finally:
        slab.close()


@pytest.mark.parametrize("mode", ["all", "hot", "cold"])
def test_blocks_from_remote_are_never_offloaded_back(slab: Slab, mode: str) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, capacity_bytes=2 * BS, policy="lru", offload=mode, offload_queue=q)
    for i in range(2):
        h = c.allocate()
        slab.view(h)[:] = data(key(i))
        assert c.insert(key(i), h, BS, digest(key(i)), from_remote=True)
        got = c.get(key(i))  # a hit: would be hot
        assert got is not None
        c.release([got])
    c.put(key(5), data(key(5)), digest(key(5)), from_remote=True)  # evicts key 0: would be cold
    assert len(q) == 0 and c.stats.offloads == 0
    assert c.stats.evictions == 1
    c.put(key(6), data(key(6)), digest(key(6)))  # a local block still follows the mode
    if mode == "all":
        assert [it.key for it in q.take(10)] == [key(6)]
    elif mode == "cold":
        assert [it.key for it in q.take(10)] == []  # victim key 1 came from remote
    assert slab.used_blocks == len(c)  # nothing pinned outside the cache
