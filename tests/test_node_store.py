"""KVStore (pool + index + leases + eviction) in-process, with a fake clock."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from oracles.index import Index

from rdmakv.blocks.slab import Slab
from rdmakv.errors import ConfigError
from rdmakv.node import native_index
from rdmakv.node.index import NO_BLOCK, IndexBase
from rdmakv.node.native_index import NativeIndex
from rdmakv.node.store import KVStore, LeaseQuotaExceeded
from rdmakv.transport.base import PinnedValues
from rdmakv.wire.batches import (
    AllocRequest,
    GetRequest,
    decode_alloc_request,
    decode_commit_request,
    decode_get_answer,
    decode_get_request,
    decode_keys_request,
    encode_alloc,
    encode_commit,
    encode_get,
    encode_keys,
)
from rdmakv.wire.format import ALLOC_ITEM, DIGEST_LEN, MAX_KEY_LEN, U16, AllocStatus

BLOCK = 4096
D = bytes(16)
KEYS = [b"a", b"b", b"c", b"d", b"e", b"f", b"g"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[Slab]:
    """The store's pool, with shared refcounts (the node's): the native index
    reads them, and a GET's one C call takes its pins in them."""
    slab = Slab(4 * BLOCK, BLOCK, lock=False, shared_refcounts=True)
    yield slab
    slab.close()


def put(store: KVStore, session: int, key: bytes, size: int = BLOCK) -> bool:
    (res,) = store.alloc(session, [(key, size, D)])
    if res.status != AllocStatus.OK:
        return False
    return store.commit(session, [key], [0]) == [True]


INDEXES = [pytest.param(Index, id="python"), pytest.param(NativeIndex, id="native")]
"""The node's index and its Python oracle (tests/oracles/index.py): each
contract test holds for both, so the oracle the native one is checked
against is itself checked."""


def _refs(blocks: int, pinned: Sequence[int] = ()) -> array[int]:
    """A pool's refcounts as the index reads them: every committed block
    referenced by the index alone (1), ``pinned`` ones by a reader too."""
    refs = array("i", [1]) * blocks
    for b in pinned:
        refs[b] = 2
    return refs


def _wire(items: Sequence[tuple[bytes, int, bytes]]) -> AllocRequest:
    """A PUT's or ALLOC's (key, size, digest) items as the node decodes them
    off the wire: records where the keys share one length, else split."""
    return decode_alloc_request(encode_alloc(*map(list, zip(*items, strict=True))))


def _add(
    idx: IndexBase, items: Sequence[tuple[bytes, int, int, bytes]], sums: Sequence[int],
    owner: int = 1,
) -> None:
    """Reserve and commit (key, block, length, digest) items, each in its block."""
    reserved = idx.reserve(owner, _wire([(k, n, d) for k, _, n, d in items]), BLOCK,
                           [b for _, b, _, _ in items], _refs(idx.num_blocks))
    assert reserved.statuses == bytes(len(items))
    assert idx.commit(owner, [k for k, _, _, _ in items], sums).committed == len(items)


def _index_of(kind: type[IndexBase], *keys: bytes) -> IndexBase:
    """An index with ``keys`` committed in order, key i in block i, value length i + 1."""
    idx = kind(8)
    _add(idx, [(k, block, block + 1, D) for block, k in enumerate(keys)],
         [100 + block for block in range(len(keys))])
    return idx


def _get(keys: list[bytes], digests: list[bytes]) -> GetRequest:
    """A GET request for ``keys``, as the node decodes it off the wire."""
    return decode_get_request(encode_get(keys, digests))


def _lru_keys(idx: IndexBase) -> list[bytes]:
    return [k for k, _ in idx.items()]


@pytest.mark.parametrize("kind", INDEXES)
def test_touch_all_finds_each_key_and_makes_hits_recent_in_request_order(
    kind: type[IndexBase],
) -> None:
    idx = _index_of(kind, b"a", b"b", b"c")
    found = idx.touch_all([b"b", b"zz", b"a", b"b"])
    assert found == [1, NO_BLOCK, 0, 1]
    assert _lru_keys(idx) == [b"c", b"a", b"b"]  # the last touch wins
    assert list(idx.oldest_blocks()) == [2, 0, 1]
    assert idx.touch_all([]) == []
    assert idx.present([b"c", b"zz", b""]) == [True, False, False]
    assert _lru_keys(idx) == [b"c", b"a", b"b"]  # present() touches nothing


@pytest.mark.parametrize("kind", INDEXES)
@pytest.mark.parametrize("keys", [[b"k1", b"k2", b"zz", b"k1"], [b"k1", b"long-k2", b"z"]],
                         ids=["one-length", "several-lengths"])
def test_commit_of_a_decoded_request_is_commit_of_its_keys(
    kind: type[IndexBase], keys: list[bytes]
) -> None:
    """COMMIT as the node decodes it (keys of one length cut out of the
    records, checksums an array over the payload) commits what the same keys
    and checksums as lists would, on a fresh index each."""
    answers = []
    for decoded in (False, True):
        idx = kind(8)
        pending = sorted(set(keys) - {b"zz", b"z"})  # the others were never reserved
        idx.reserve(1, _wire([(k, 10 + i, D) for i, k in enumerate(pending)]), BLOCK,
                    list(range(len(pending))), _refs(8))
        sums = [2**64 - 1 - i for i in range(len(keys))]
        request = decode_commit_request(encode_commit(keys, sums))
        assert (request.keys.key_len is not None) == (len(set(map(len, keys))) == 1)
        done = idx.commit(1, *request) if decoded else idx.commit(1, keys, sums)
        answers.append((done, idx.checksums([b for b in done.blocks if b != NO_BLOCK]),
                        _lru_keys(idx)))
    assert answers[0] == answers[1]
    assert answers[0][0].committed == len(set(keys) - {b"zz", b"z"})
    with pytest.raises(ValueError, match="commit of 2 keys with 1 checksums"):
        kind(8).commit(1, decode_keys_request(encode_keys([b"a", b"b"]), "COMMIT"), [1])


@pytest.mark.parametrize("kind", INDEXES)
def test_touch_keys_of_a_decoded_request_is_touch_all_of_its_keys(kind: type[IndexBase]) -> None:
    """EXISTS as the node decodes it: keys of one length are looked up where
    they lie in the payload (the native index's records), others split."""
    idx = _index_of(kind, b"a", b"b", b"c")
    one_len = decode_keys_request(encode_keys([b"b", b"z", b"a", b"b"]), "EXISTS")
    assert one_len.key_len == 1
    assert idx.touch_keys(one_len) == [1, NO_BLOCK, 0, 1]
    assert _lru_keys(idx) == [b"c", b"a", b"b"]  # the last touch wins
    several = decode_keys_request(encode_keys([b"c", b"zz", b"a"]), "EXISTS")
    assert several.key_len is None
    assert idx.touch_keys(several) == [2, NO_BLOCK, 0]
    assert _lru_keys(idx) == [b"b", b"c", b"a"]
    assert idx.touch_keys(decode_keys_request(encode_keys([]), "EXISTS")) == []


@pytest.mark.parametrize("kind", INDEXES)
def test_touch_keys_flags_are_one_byte_per_hit_whatever_the_block(kind: type[IndexBase]) -> None:
    """An EXISTS answer's flags straight from the index: 1 per committed key,
    0 per miss, for blocks whose low byte is 0xFF or 0x00 (the native index
    reads each block number's high byte) and keys of several lengths."""
    idx = kind(512)
    blocks = [0, 1, 255, 256, 511]
    keys = [b"k%03d" % b for b in blocks]
    _add(idx, [(k, b, 10, D) for k, b in zip(keys, blocks, strict=True)], [1] * len(keys))
    asked = [keys[2], b"miss", keys[3], keys[0], b"gone", keys[4], keys[1]]
    one_len = decode_keys_request(encode_keys(asked), "EXISTS")
    assert one_len.key_len == 4
    assert idx.touch_keys_flags(one_len) == bytes([1, 0, 1, 1, 0, 1, 1])
    assert _lru_keys(idx)[-1] == keys[1]  # touched as touch_keys touches
    several = decode_keys_request(encode_keys([b"zz", keys[2], b"k"]), "EXISTS")
    assert several.key_len is None
    assert idx.touch_keys_flags(several) == bytes([0, 1, 0])
    assert idx.touch_keys_flags(decode_keys_request(encode_keys([]), "EXISTS")) == b""


@pytest.mark.parametrize("kind", INDEXES)
def test_rows_hold_each_committed_value_and_a_miss_reads_as_zeros(kind: type[IndexBase]) -> None:
    idx = _index_of(kind, b"a", b"b", b"c")
    other = bytes(range(16))
    _add(idx, [(b"d", 5, 4000, other)], [7], owner=2)
    assert idx.lengths([5, 1, NO_BLOCK]) == [4000, 2, 0]
    assert idx.checksums([5, 1, NO_BLOCK]) == [7, 101, 0]
    assert idx.digests([5, 1]) == [other, D]
    assert idx.committed_bytes == 1 + 2 + 3 + 4000
    assert idx.remove([b"d", b"d", b"zz"]) == [5, NO_BLOCK, NO_BLOCK]
    assert idx.committed_bytes == 6 and len(idx) == 3
    assert idx.touch_all([b"d"]) == [NO_BLOCK]
    idx.remove_block(1)
    assert _lru_keys(idx) == [b"a", b"c"] and idx.committed_bytes == 4
    assert idx.touch_all([b"b"]) == [NO_BLOCK]


@pytest.mark.parametrize("kind", INDEXES)
def test_touch_matching_finds_keys_stored_with_the_digest_and_makes_only_those_recent(
    kind: type[IndexBase],
) -> None:
    idx = _index_of(kind, b"a", b"b", b"c")
    other = bytes(range(16))
    found = idx.touch_matching([b"a", b"b", b"zz", b"a"], [other, D, D, D])
    assert found == [NO_BLOCK, 1, NO_BLOCK, 0]
    # a's first naming had another digest (a miss: no touch); c was never a hit
    assert _lru_keys(idx) == [b"c", b"b", b"a"]
    with pytest.raises(ValueError):
        idx.touch_matching([b"a"], [])
    # an unknown key never matches the miss row's empty digest, nor a short one
    assert idx.touch_matching([b"zz", b"a"], [b"", D[:8]]) == [NO_BLOCK, NO_BLOCK]
    assert idx.touch_matching([b"c", b"b"], [D + b"x", D]) == [NO_BLOCK, 1]
    assert _lru_keys(idx) == [b"c", b"a", b"b"]


@pytest.mark.parametrize("kind", INDEXES)
def test_touch_request_reads_a_get_payload_like_touch_matching(kind: type[IndexBase]) -> None:
    other = bytes(range(16))
    for keys in ([b"aa", b"bb", b"cc"], [b"a", b"bbb", b"cc"]):  # one key length; several
        idx = _index_of(kind, *keys)
        asked = [keys[1], keys[0], b"zz", keys[2], keys[1]]
        request = _get(asked, [D, other, D, D, D])
        assert request.key_len == (2 if keys[0] == b"aa" else None)
        assert idx.touch_request(request) == [1, NO_BLOCK, NO_BLOCK, 2, 1]
        assert _lru_keys(idx) == [keys[0], keys[2], keys[1]]  # keys[0]: another digest
        assert idx.touch_request(_get([], [])) == []
    if kind is NativeIndex:  # records that do not fill the payload are refused, not read
        short = GetRequest(encode_get([b"aa"], [D])[:-1], 1, 2)
        with pytest.raises(ValueError, match="GET records"):
            idx.touch_request(short)


def test_the_native_index_and_the_wire_agree_on_sizes() -> None:
    lib = native_index._lib
    assert lib.RK_INDEX_DIGEST == DIGEST_LEN and lib.RK_INDEX_MAX_KEY == MAX_KEY_LEN
    assert U16.size == lib.RK_INDEX_RECORD_HEAD  # a GET or ALLOC item's key length field
    assert ALLOC_ITEM.size == lib.RK_INDEX_SIZE_BYTES + DIGEST_LEN  # an ALLOC item's size
    # reserve writes the wire's AllocStatus bytes as they are
    assert [lib.RK_INDEX_RESERVED, lib.RK_INDEX_EXISTS, lib.RK_INDEX_BUSY,
            lib.RK_INDEX_NO_SPACE, lib.RK_INDEX_TOO_LARGE] == [
        AllocStatus.OK, AllocStatus.EXISTS, AllocStatus.BUSY, AllocStatus.NO_SPACE,
        AllocStatus.TOO_LARGE]


@pytest.mark.parametrize("kind", INDEXES)
def test_an_index_refuses_a_spare_block_its_invariants_forbid_and_changes_nothing(
    kind: type[IndexBase],
) -> None:
    idx = _index_of(kind, b"a", b"b")
    idx.reserve(1, _wire([(b"p", 10, D)]), BLOCK, [2], _refs(8))
    for spare, why in ((1, "holds a key"), (2, "holds a key"), (8, "out of range")):
        with pytest.raises(ValueError, match=why):
            idx.reserve(1, _wire([(b"new", 10, D), (b"other", 10, D)]), BLOCK, [5, spare],
                        _refs(8))
    assert _lru_keys(idx) == [b"a", b"b"] and idx.pending_blocks() == [2]
    assert idx.reserve(1, _wire([(b"new", 10, D)]), BLOCK, [], _refs(8)).blocks.tolist() == [0]


def test_the_native_index_refuses_what_its_invariants_forbid() -> None:
    idx = _index_of(NativeIndex, b"a", b"b")
    with pytest.raises(native_index.IndexCorrupt, match="holds no committed key"):
        idx.remove_block(6)
    with pytest.raises(ValueError, match="shared_refcounts"):
        idx.reserve(1, _wire([(b"new", 10, D)]), BLOCK, [], [1] * 8)
    with pytest.raises(ValueError, match="owner 0"):
        idx.reserve(0, _wire([(b"new", 10, D)]), BLOCK, [5], _refs(8))
    assert _lru_keys(idx) == [b"a", b"b"] and idx.pending_count == 0


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("pcCawAtkxrbo"), st.integers(1, 3),
                              st.lists(st.integers(0, 20), max_size=8)), max_size=60))
def test_the_native_index_answers_like_the_python_one(
    ops: list[tuple[str, int, list[int]]],
) -> None:
    """Random batches of every operation, by three owners, against both
    indexes (8 blocks: a 16-slot table up to half full, so probe runs collide
    and deletions shift them; reserves run out of spares and evict, around
    pinned blocks): same answers, same LRU, same pending keys."""
    blocks = 8
    py, nat = Index(blocks), NativeIndex(blocks)
    free = list(range(blocks))
    pinned: set[int] = set()  # committed blocks a reader references too

    def key(i: int) -> bytes:
        # inline (2, 9: a partial last word) and heap (25, 64, 512 bytes) keys
        return (b"k%d-" % i * 128)[: (2, 9, 25, 64, MAX_KEY_LEN)[i % 5]]

    def digest(i: int) -> bytes:
        return bytes([i % 2]) * 16

    for op, owner, picks in ops:
        keys = [key(i) for i in picks]
        if op in "pc":  # reserve (a size 0 or over the block: refused), then maybe commit
            items = _wire([(k, (len(k) + 40 * i) % (BLOCK + 200), digest(i))
                           for k, i in zip(keys, picks, strict=True)] or [(b"k", 1, D)])
            spares = free[: items.count // 2]  # the rest by eviction
            refs = _refs(blocks, pinned)
            got = py.reserve(owner, items, BLOCK, spares, refs)
            assert nat.reserve(owner, items, BLOCK, spares, refs) == got
            del free[: got.spares_used]
            if op == "c" and owner == 2:  # a COMMIT as the node decodes it (records, or split)
                request = decode_commit_request(encode_commit(keys, [len(k) * 7 for k in keys]))
                assert nat.commit(owner, *request) == py.commit(owner, *request)
            elif op == "c":
                sums = [len(k) * 7 for k in keys]
                assert nat.commit(owner, keys, sums) == py.commit(owner, keys, sums)
        elif op == "C":  # commit only what the node received in full
            sums = list(range(len(keys)))
            assert nat.commit(owner, keys, sums, require_written=True) == py.commit(
                owner, keys, sums, require_written=True)
        elif op == "a":
            gone = py.abort(owner, keys)
            assert nat.abort(owner, keys) == gone
            free.extend(b for b in gone if b != NO_BLOCK)
        elif op == "w":  # some of the picks name blocks, owner's pending or not ("C" then
            # commits only what was marked, on both)
            written = [i % (blocks + 2) for i in picks if i % (blocks + 2) < blocks]
            py.mark_written(owner, written)
            nat.mark_written(owner, written)
        elif op == "A":
            gone = py.abandon(owner)
            assert sorted(nat.abandon(owner)) == sorted(gone)
            free.extend(gone)
        elif op == "t":
            found = py.touch_all(keys)
            assert nat.touch_all(keys) == found
            pinned.update(b for b in found[:1] if b != NO_BLOCK)  # a reader of the first
        elif op == "k":  # an EXISTS as the node decodes it: its records, or split keys
            request = decode_keys_request(encode_keys(keys), "EXISTS")
            assert nat.touch_keys(request) == py.touch_keys(request)
            assert nat.touch_keys_flags(request) == py.touch_keys_flags(request)
        elif op == "x":
            digests = [digest(i) for i in picks]
            assert nat.touch_matching(keys, digests) == py.touch_matching(keys, digests)
        elif op == "r":
            gone = py.remove(keys)
            assert nat.remove(keys) == gone
            free.extend(b for b in gone if b != NO_BLOCK)
            pinned.difference_update(gone)
        elif op == "b" and len(py):
            victim = list(py.oldest_blocks())[picks[0] % len(py) if picks else 0]
            py.remove_block(victim)
            nat.remove_block(victim)
            free.append(victim)
            pinned.discard(victim)
        else:
            assert nat.present(keys) == py.present(keys)
        assert nat.items() == py.items()
        assert len(nat) == len(py) and nat.committed_bytes == py.committed_bytes
        for who in (None, 1, 2, 3):
            assert sorted(nat.pending_blocks(who)) == sorted(py.pending_blocks(who))
        assert nat.pending_count == py.pending_count
        committed = [b for _, b in py.items()]
        assert nat.digests(committed) == py.digests(committed)
        assert nat.lengths(committed) == py.lengths(committed)
        assert nat.checksums(committed) == py.checksums(committed)
        # every block is free, committed or pending: none lost, none twice
        held = sorted(free + committed + py.pending_blocks())
        assert held == list(range(blocks))


def test_the_store_keeps_its_keys_in_the_native_index_on_a_pool_that_shares_refcounts(
    pool: Slab,
) -> None:
    assert type(KVStore(pool)._index) is NativeIndex
    # C reads the refcounts to pick eviction victims, and pins GETs in them
    with Slab(4 * BLOCK, BLOCK, lock=False) as unshared, \
            pytest.raises(ConfigError, match="shared_refcounts"):
        KVStore(unshared)


def test_alloc_statuses(pool: Slab) -> None:
    s = KVStore(pool)
    assert s.alloc(1, [(b"a", 0, D)])[0].status == AllocStatus.TOO_LARGE
    assert s.alloc(1, [(b"a", BLOCK + 1, D)])[0].status == AllocStatus.TOO_LARGE
    res = s.alloc(1, [(b"a", 10, D)])[0]
    assert res.status == AllocStatus.OK and res.extent is not None
    assert res.extent.addr == pool.base_addr + pool.offset(
        pool.handle_at(res.extent.addr - pool.base_addr)
    )
    assert s.alloc(2, [(b"a", 10, D)])[0].status == AllocStatus.BUSY
    assert s.exists([b"a"]) == [False]  # uncommitted is invisible
    assert s.lookup(2, [b"a"], lease=True) == [None]
    assert s.commit(2, [b"a"], [0]) == [False]  # not the owner
    assert s.commit(1, [b"a"], [0]) == [True]
    assert s.alloc(2, [(b"a", 10, D)])[0].status == AllocStatus.EXISTS


def test_a_commit_answers_per_key_when_only_some_keys_commit(pool: Slab) -> None:
    """All committed (the rule) and some not take different paths in commit."""
    s = KVStore(pool)
    assert [r.status for r in s.alloc(1, [(b"a", 10, D), (b"c", 10, D)])] == [AllocStatus.OK] * 2
    assert s.alloc(2, [(b"b", 10, D)])[0].status == AllocStatus.OK
    assert s.commit(1, [b"a", b"b", b"x", b"c"], [1, 2, 3, 4]) == [True, False, False, True]
    assert s.exists([b"a", b"b", b"c"]) == [True, False, True]
    assert s.commit(2, [b"b"], [2]) == [True]
    assert s.commit(1, [], []) == []
    assert s.exists([b"b"]) == [True]


def test_leased_and_uncommitted_extents_are_never_evicted(pool: Slab) -> None:
    s = KVStore(pool)
    for k in (b"a", b"b", b"c"):
        assert put(s, 1, k)
    (hit,) = s.lookup(1, [b"a"], lease=True)
    assert hit is not None
    assert s.alloc(1, [(b"pending", 10, D)])[0].status == AllocStatus.OK  # 4th block
    # pool full: new allocs evict b then c (LRU), never a (leased) or the pending one
    assert s.alloc(2, [(b"x", 10, D), (b"y", 10, D)])[1].status == AllocStatus.OK
    assert s.exists([b"a", b"b", b"c"]) == [True, False, False]
    assert s.alloc(2, [(b"z", 10, D)])[0].status == AllocStatus.NO_SPACE
    assert s.exists([b"a"]) == [True]  # the leased value survived the full pool
    assert s.stats()["no_space"] == 1
    assert s.release(1, [hit.lease_id]) == 1
    assert s.alloc(2, [(b"z", 10, D)])[0].status == AllocStatus.OK  # a is evictable now
    assert s.exists([b"a"]) == [False]


def test_exists_and_lookup_make_keys_recent_alloc_does_not(pool: Slab) -> None:
    s = KVStore(pool)
    for k in (b"a", b"b", b"c", b"d"):
        assert put(s, 1, k)
    assert s.exists([b"a", b"zz"]) == [True, False]  # a: asked by a scheduler, keep it
    assert s.alloc(1, [(b"b", 10, D)])[0].status == AllocStatus.EXISTS  # no touch
    assert put(s, 1, b"e")  # full: evicts b, now the least recent
    assert s.exists([b"a", b"b", b"c"]) == [True, False, True]
    assert s.lookup(2, [b"d"], lease=False)[0] is not None  # d recent too
    assert put(s, 1, b"f")  # evicts e, the least recent after the touches
    assert s.exists([b"e"]) == [False]


def test_lease_expiry_and_session_end_release_pins(pool: Slab) -> None:
    clock = Clock()
    s = KVStore(pool, lease_timeout=5.0, clock=clock)
    assert put(s, 1, b"a")
    (hit,) = s.lookup(7, [b"a"], lease=True)
    assert hit is not None
    blk = pool.handle_at(hit.extent.addr - pool.base_addr)
    assert pool.refcount(blk) == 2
    clock.now += 4.9
    s.expire_leases()
    assert pool.refcount(blk) == 2
    clock.now += 0.2
    s.expire_leases()
    assert pool.refcount(blk) == 1 and s.stats()["leases_expired"] == 1
    assert s.release(7, [hit.lease_id]) == 0  # already gone
    # a departed session's leases and uncommitted extents are reclaimed
    s.lookup(8, [b"a"], lease=True)
    s.alloc(8, [(b"half", 10, D)])
    assert pool.used_blocks == 2 and pool.refcount(blk) == 2
    s.session_closed(8)
    assert pool.used_blocks == 1 and pool.refcount(blk) == 1
    assert s.stats()["pending"] == 0


def test_release_only_own_leases(pool: Slab) -> None:
    s = KVStore(pool)
    assert put(s, 1, b"a")
    (hit,) = s.lookup(1, [b"a"], lease=True)
    assert hit is not None
    assert s.release(2, [hit.lease_id, 999]) == 0
    assert s.release(1, [hit.lease_id, hit.lease_id]) == 1


def test_pin_values_finds_by_key_and_digest_and_pins_until_unpin(pool: Slab) -> None:
    s = KVStore(pool)
    (res,) = s.alloc(1, [(b"a", 100, D)])
    assert res.extent is not None
    assert s.commit(1, [b"a"], [77]) == [True]
    assert s.alloc(1, [(b"p", 10, D)])[0].status == AllocStatus.OK  # uncommitted: invisible
    other = bytes(range(16))
    # keys of several lengths: the Python path (nothing stays pinned)
    mixed = s.pin_values(_get([b"a", b"zz"], [D, D]))
    assert decode_get_answer(mixed.answer, 2) == ([100, 0], [77, 0])
    assert mixed.iov.tolist() == [[0, 0], [res.extent.addr, 100]]  # row 0: the frame's head
    mixed.unpin()
    # one key length (an engine's): one C call
    found = s.pin_values(_get([b"a", b"a", b"p", b"z"], [D, other, D, D]))
    assert decode_get_answer(found.answer, 4) == ([100, 0, 0, 0], [77, 0, 0, 0])
    assert found.iov.tolist() == [[0, 0], [res.extent.addr, 100]]
    assert found.nbytes == 100
    stats = s.stats()
    assert (stats["hits"], stats["misses"], stats["bytes_read"]) == (2, 4, 200)
    # pinned: neither delete nor eviction frees the block while it is being sent
    assert s.delete([b"a"]) == [True]
    block = pool.handle_at(res.extent.addr - pool.base_addr)
    assert pool.refcount(block) == 1
    statuses = [r.status for r in s.alloc(2, [(k, 10, D) for k in KEYS[1:5]])]
    assert statuses.count(AllocStatus.NO_SPACE) == 2  # 4 blocks: pinned + pending + 2 new
    found.unpin()
    assert pool.refcount(block) == 0
    assert s.alloc(2, [(b"g", 10, D)])[0].status == AllocStatus.OK


def test_alloc_received_commits_only_after_every_byte_arrived(pool: Slab) -> None:
    s = KVStore(pool)
    assert put(s, 1, b"old")
    assert s.alloc(2, [(b"busy", 10, D)])[0].status == AllocStatus.OK
    items = [(b"a", 100, D), (b"old", 10, D), (b"busy", 10, D), (b"big", BLOCK + 1, D),
             (b"b", BLOCK, D)]
    statuses, iov, received = s.alloc_received(1, AllocRequest.of_items(items))
    assert list(statuses) == [AllocStatus.OK, AllocStatus.EXISTS, AllocStatus.BUSY,
                              AllocStatus.TOO_LARGE, AllocStatus.OK]
    assert iov[:, 1].tolist() == [100, BLOCK]  # the two reserved, in item order
    a, b = (iov[:, 0] - pool.base_addr).tolist()
    assert a != b and a % BLOCK == b % BLOCK == 0 and 0 <= a < pool.nbytes
    assert s.exists([b"a", b"b"]) == [False, False]  # uncommitted: invisible
    # not received yet: a commit that requires the bytes refuses, and keeps them pending
    assert s.commit(1, [b"a"], [5], require_written=True) == [False]
    received()
    assert s.commit(1, [b"a", b"b"], [5, 6], require_written=True) == [True, True]
    found = s.pin_values(_get([b"a", b"b"], [D, D]))
    assert (found.iov[1:, 0] - pool.base_addr).tolist() == [a, b]
    assert decode_get_answer(found.answer, 2) == ([100, BLOCK], [5, 6])
    found.unpin()
    assert s.stats()["bytes_written"] == 100 + BLOCK


def test_delete_of_leased_value_keeps_bytes_until_release(pool: Slab) -> None:
    s = KVStore(pool)
    assert put(s, 1, b"a")
    (hit,) = s.lookup(2, [b"a"], lease=True)
    assert hit is not None
    assert s.delete([b"a", b"a"]) == [True, False]
    leased = pool.handle_at(hit.extent.addr - pool.base_addr)
    assert pool.refcount(leased) == 1  # the lease's: the index let go of it
    assert put(s, 1, b"a")  # a new extent: the leased block is not reused
    (hit2,) = s.lookup(3, [b"a"], lease=False)
    assert hit2 is not None and hit2.extent.addr != hit.extent.addr
    s.release(2, [hit.lease_id])
    assert pool.used_blocks == 1


def test_strict_commit_needs_a_complete_write(pool: Slab) -> None:
    """COMMIT_FLAG_REQUIRE_WRITTEN: never publish an extent the node did not fill."""
    s = KVStore(pool)
    *_, done_a = s.alloc_received(1, AllocRequest.of_items([(b"a", 100, D)]))
    done_a()
    s.alloc_received(1, AllocRequest.of_items([(b"b", 100, D)]))  # bytes never all arrived
    assert s.alloc(1, [(b"c", 100, D)])[0].status == AllocStatus.OK  # one-sided: not seen
    done = s.commit(1, [b"a", b"b", b"c"], [0] * 3, require_written=True)
    assert done == [True, False, False]
    assert s.commit(1, [b"b", b"c"], [0, 0]) == [True, True]  # the trusting commit (rdma) works


def test_bad_lease_timeout() -> None:
    with Slab(BLOCK, BLOCK, lock=False) as p, pytest.raises(ConfigError, match="lease"):
        KVStore(p, lease_timeout=0)


class StoreMachine(RuleBasedStateMachine):
    """Random interleavings of every store op; refcounts must match the model."""

    def __init__(self) -> None:
        super().__init__()
        # small: eviction is common; shared refcounts: the native index reads
        # them, and serves a GET in its one C call
        self.pool = Slab(3 * BLOCK, BLOCK, lock=False, shared_refcounts=True)
        self.clock = Clock()
        self.store = KVStore(self.pool, lease_timeout=10.0, clock=self.clock)
        self.leases: dict[int, tuple[int, bytes, int]] = {}  # id -> (session, key, block)
        self.gets: list[tuple[PinnedValues, list[int]]] = []  # pinned, not yet sent: hits

    def teardown(self) -> None:
        for found, _ in self.gets:
            found.unpin()
        self.pool.close()

    def _block(self, addr: int) -> int:
        return (addr - self.pool.base_addr) // BLOCK

    @rule(
        session=st.integers(1, 3),
        keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True),
        commit=st.booleans(),
    )
    def alloc(self, session: int, keys: list[bytes], commit: bool) -> None:
        index = self.store._index
        before = dict(index.items())
        res = self.store.alloc(session, [(k, 100, D) for k in keys])
        leased = {blk for (_, _, blk) in self.leases.values()}
        for k, blk in before.items():
            if not index.present([k])[0]:  # evicted by this alloc
                assert blk not in leased, f"evicted {k!r} while its block {blk} was leased"
        ok = [k for k, r in zip(keys, res, strict=True) if r.status == AllocStatus.OK]
        if commit:
            assert self.store.commit(session, ok, [0] * len(ok)) == [True] * len(ok)

    @rule(session=st.integers(1, 3), key=st.sampled_from([b"a", b"b", b"c", b"d"]))
    def lookup(self, session: int, key: bytes) -> None:
        block = dict(self.store._index.items()).get(key)
        held = sum(1 for s, _, b in self.leases.values() if (s, b) == (session, block))
        try:
            (hit,) = self.store.lookup(session, [key], lease=True)
        except LeaseQuotaExceeded:
            # the one refusal this machine can provoke: one lease more than a
            # session may hold on one block
            assert block is not None and held == self.store.max_leases_per_block
            return
        if hit is not None:
            self.leases[hit.lease_id] = (session, key, self._block(hit.extent.addr))

    @rule(
        keys=st.lists(st.sampled_from([b"a", b"b", b"c", b"d"]), min_size=1, max_size=3),
        stored_digest=st.booleans(),
    )
    def get(self, keys: list[bytes], stored_digest: bool) -> None:
        """A GET's pins outlive later steps (the values are still being sent)."""
        committed = dict(self.store._index.items())
        found = self.store.pin_values(_get(keys, [D if stored_digest else b"x" * 16] * len(keys)))
        hit = [k in committed and stored_digest for k in keys]
        lengths, _ = decode_get_answer(found.answer, len(keys))
        assert lengths == [100 if h else 0 for h in hit]
        blocks = [committed[k] for k, h in zip(keys, hit, strict=True) if h]
        assert [self._block(a) for a in found.iov[1:, 0].tolist()] == blocks
        assert found.nbytes == 100 * len(blocks)
        self.gets.append((found, blocks))

    @rule(data=st.data())
    def sent(self, data: st.DataObject) -> None:
        if self.gets:
            found, _ = self.gets.pop(data.draw(st.integers(0, len(self.gets) - 1)))
            found.unpin()

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.leases:
            lid = data.draw(st.sampled_from(sorted(self.leases)))
            session = self.leases[lid][0]
            assert self.store.release(session, [lid]) == 1
            del self.leases[lid]

    @rule(key=st.sampled_from([b"a", b"b", b"c"]))
    def delete(self, key: bytes) -> None:
        self.store.delete([key])

    @rule(session=st.integers(1, 3))
    def disconnect(self, session: int) -> None:
        self.store.session_closed(session)
        self.leases = {i: v for i, v in self.leases.items() if v[0] != session}

    @rule()
    def time_passes(self) -> None:
        self.clock.now += 11.0
        self.store.expire_leases()
        self.leases.clear()

    @invariant()
    def refcounts_match_owners(self) -> None:
        """Each block's references = its entry (committed or pending) + its
        leases + the GETs still sending it."""
        index = self.store._index
        expected: dict[int, int] = {}
        blocks = [*(b for _, b in index.items()), *index.pending_blocks()]
        for block in blocks:
            expected[block] = expected.get(block, 0) + 1
        for _, _, blk in self.leases.values():
            expected[blk] = expected.get(blk, 0) + 1
        for _, pinned in self.gets:
            for blk in pinned:
                expected[blk] = expected.get(blk, 0) + 1
        pool = self.pool
        actual = {b: pool.refcount(b) for b in range(pool.num_blocks) if pool.refcount(b)}
        assert actual == expected
        assert pool.used_blocks == len(actual)  # a block whose last reference went is free
        assert self.store.stats()["leases_active"] == len(self.leases)


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30,
                                          deadline=None)
test_store_state_machine = StoreMachine.TestCase


def test_one_lease_covers_all_hits_of_a_lookup(pool: Slab) -> None:
    s = KVStore(pool)
    for k in (b"a", b"b", b"c"):
        assert put(s, 1, k)
    res = s.lookup(2, [b"a", b"zz", b"c"], lease=True)
    assert res[1] is None
    a, c = res[0], res[2]
    assert a is not None and c is not None and a.lease_id == c.lease_id != 0
    blocks = [pool.handle_at(r.extent.addr - pool.base_addr) for r in (a, c)]
    assert [pool.refcount(b) for b in blocks] == [2, 2]
    assert s.stats()["leases_active"] == 1 and s.stats()["leased_extents"] == 2
    assert s.release(2, [a.lease_id, c.lease_id]) == 1  # the same lease, ended once
    assert [pool.refcount(b) for b in blocks] == [1, 1]
    assert s.stats()["leases_active"] == 0 and s.stats()["leased_extents"] == 0


def test_lease_quota_refuses_a_lookup_that_would_pin_too_much(pool: Slab) -> None:
    s = KVStore(pool, lease_quota_bytes=2 * BLOCK)
    for k in KEYS[:4]:
        assert put(s, 1, k)
    with pytest.raises(LeaseQuotaExceeded, match="quota of 8192"):
        s.lookup(2, KEYS[:3], lease=True)  # 3 blocks > 2: refused whole, nothing pinned
    assert all(pool.refcount(b) == 1 for b in range(4))
    first = s.lookup(2, KEYS[:2], lease=True)
    with pytest.raises(LeaseQuotaExceeded):
        s.lookup(2, KEYS[2:3], lease=True)
    assert s.lookup(3, KEYS[2:4], lease=True)[0] is not None  # quotas are per session
    assert first[0] is not None
    assert s.release(2, [first[0].lease_id]) == 1
    assert s.lookup(2, KEYS[2:3], lease=True)[0] is not None  # room again after RELEASE
    assert s.lookup(2, KEYS, lease=False)[0] is not None  # unleased lookups are free
    assert s.stats()["lease_refusals"] == 2


def test_one_session_cannot_stack_leases_on_one_block(pool: Slab) -> None:
    s = KVStore(pool, max_leases_per_block=3, lease_quota_bytes=4 * BLOCK)
    assert put(s, 1, b"a")
    for _ in range(3):
        assert s.lookup(2, [b"a"], lease=True)[0] is not None
    with pytest.raises(LeaseQuotaExceeded, match="holds 3 live leases"):
        s.lookup(2, [b"a"], lease=True)
    assert s.lookup(3, [b"a"], lease=True)[0] is not None  # another session may


def test_re_leasing_never_pins_a_block_past_the_first_lease_timeout(pool: Slab) -> None:
    clock = Clock()
    s = KVStore(pool, lease_timeout=30.0, clock=clock)
    for k in KEYS[:4]:
        assert put(s, 1, k)
    s.lookup(2, [b"a"], lease=True)
    blk = s.lookup(9, [b"a"], lease=False)[0]
    assert blk is not None
    clock.now += 20
    s.lookup(2, [b"a"], lease=True)  # a renewal: ends with the first lease, at +30
    clock.now += 10.5
    # pool full and every other block evictable: the put takes a's block too,
    # because both of session 2's leases ended 30 s after its first one
    for k in KEYS[4:7]:
        assert put(s, 1, k)
    assert put(s, 1, b"z")
    assert s.exists([b"a"]) == [False]
    assert s.stats()["leases_expired"] == 2


def test_repeats_inside_one_lookup_count_toward_the_per_block_cap(pool: Slab) -> None:
    s = KVStore(pool, max_leases_per_block=4, lease_quota_bytes=8 * BLOCK)
    assert put(s, 1, b"a")
    with pytest.raises(LeaseQuotaExceeded, match="asks for 5 more"):
        s.lookup(2, [b"a"] * 5, lease=True)
    assert s.lookup(2, [b"a"] * 4, lease=True)[0] is not None


def test_lookup_gives_back_the_checksum_commit_stored(pool: Slab) -> None:
    """Protocol v3: ALLOC carries no checksum; COMMIT sets it, per key, in order."""
    s = KVStore(pool)
    s.alloc(1, [(b"a", 10, D), (b"b", 20, D)])
    assert s.commit(1, [b"b", b"a"], [2**64 - 1, 7]) == [True, True]
    found = s.lookup(1, [b"a", b"b"], lease=False)
    assert [r.checksum for r in found if r is not None] == [7, 2**64 - 1]
    s.alloc(1, [(b"c", 10, D), (b"d", 10, D)])
    with pytest.raises(ValueError, match="2 keys with 1 checksums"):
        s.commit(1, [b"c", b"d"], [1])
    assert s.exists([b"c", b"d"]) == [False, False]  # nothing was committed
