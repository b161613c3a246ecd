"""Slab: bad input gives clear errors; the allocator never hands out a live block."""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.errors import (
    ConfigError,
    InvalidHandle,
    MemoryLockWarning,
    MissingExtra,
    SlabExhausted,
)

BS = 256


def make_slab(blocks: int, bs: int = BS, shared: bool = False) -> Slab:
    with warnings.catch_warnings():
        # The test machine may have a small memlock limit; locking is not under test.
        warnings.simplefilter("ignore", MemoryLockWarning)
        return Slab(blocks * bs, bs, shared_refcounts=shared)


SHARED = pytest.mark.parametrize("shared", [False, True], ids=["list-refs", "shared-refs"])
"""The refcounts as a list (the L1's slabs) and as the int32 array native code
updates (the node's pool): the slab behaves the same with either."""


@pytest.mark.parametrize(
    ("capacity", "block_size", "match"),
    [
        (4096, 0, "block_size must be a positive int, got 0"),
        (4096, -1, "block_size must be a positive int"),
        (0, 64, "slab capacity must be a positive int, got 0"),
        (-4096, 64, "slab capacity must be a positive int"),
        (100, 4096, "block_size 4096 is larger than the slab capacity 100"),
        (4096.0, 64, "slab capacity must be a positive int"),
    ],
)
def test_bad_geometry_is_rejected(capacity: int, block_size: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Slab(capacity, block_size)


def test_capacity_rounds_down_to_whole_blocks() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryLockWarning)
        s = Slab(1000, 300)
    assert s.num_blocks == 3 and s.nbytes == 900
    s.close()


@SHARED
def test_double_free_and_freed_handle_are_errors(shared: bool) -> None:
    s = make_slab(4, shared=shared)
    h = s.alloc()
    s.decref(h)
    with pytest.raises(InvalidHandle, match=f"block handle {h} is not allocated"):
        s.decref(h)
    with pytest.raises(InvalidHandle, match="not allocated"):
        s.view(h)
    with pytest.raises(InvalidHandle, match="not allocated"):
        s.incref(h)
    with pytest.raises(InvalidHandle, match="not allocated"):
        s.addr(h)
    # The failed calls changed nothing: the block is free exactly once.
    assert s.free_blocks == 4
    assert sorted(s.alloc_many(4)) == [0, 1, 2, 3]
    s.close()


@pytest.mark.parametrize("bad", [-1, 4, 10**9])
def test_out_of_range_handles_are_errors(bad: int) -> None:
    s = make_slab(4)
    with pytest.raises(InvalidHandle, match="out of range"):
        s.decref(bad)
    with pytest.raises(InvalidHandle, match="out of range"):
        s.refcount(bad)
    assert not s.is_live(bad)
    s.close()


def test_exhaustion_is_a_clear_error_and_recoverable() -> None:
    s = make_slab(3)
    hs = [s.alloc() for _ in range(3)]
    with pytest.raises(SlabExhausted, match="all 3 blocks of 256 bytes in use"):
        s.alloc()
    with pytest.raises(SlabExhausted, match="asked for 1 blocks, 0 of 3 free"):
        s.alloc_many(1)
    s.decref(hs[1])
    assert s.alloc() == hs[1]
    s.close()


def test_try_alloc_gives_none_instead_of_raising_when_full() -> None:
    s = make_slab(2)
    first, second = s.try_alloc(), s.try_alloc()
    assert first is not None and second is not None
    assert sorted((first, second)) == [0, 1]
    assert s.refcount(first) == s.refcount(second) == 1
    assert s.try_alloc() is None and s.free_blocks == 0
    s.decref(first)
    assert s.try_alloc() == first
    s.close()


def test_alloc_many_is_all_or_nothing() -> None:
    s = make_slab(4)
    s.alloc()
    with pytest.raises(SlabExhausted):
        s.alloc_many(4)
    assert s.free_blocks == 3
    with pytest.raises(ConfigError, match="negative"):
        s.alloc_many(-1)
    assert s.alloc_many(0) == []
    s.close()


@SHARED
def test_incref_many_and_decref_many_count_each_naming(shared: bool) -> None:
    s = make_slab(4, shared=shared)
    a, b = s.alloc_many(2)
    s.incref_many([a, a, b])  # a repeated handle counts once per naming
    assert (s.refcount(a), s.refcount(b)) == (3, 2)
    with pytest.raises(InvalidHandle):  # one dead handle: nothing changes
        s.incref_many([a, 3])
    with pytest.raises(InvalidHandle):
        s.incref_many([b, 99])
    assert (s.refcount(a), s.refcount(b), s.free_blocks) == (3, 2, 2)
    s.decref_many([a, b, a])
    assert (s.refcount(a), s.refcount(b), s.free_blocks) == (1, 1, 2)
    s.decref_many([a, b])  # the last references: both blocks are free again
    assert s.free_blocks == 4 and not s.is_live(a) and not s.is_live(b)
    with pytest.raises(InvalidHandle):
        s.decref_many([a])  # freed
    c = s.alloc()
    with pytest.raises(InvalidHandle, match="not allocated"):
        s.decref_many([c, c])  # named more often than it has references
    assert s.free_blocks == 4  # the one reference it had was dropped, never below 0
    s.close()


def test_shared_refcounts_are_the_slabs_own_counts() -> None:
    """What native code sees (and writes) is the count the slab keeps."""
    shared, plain = make_slab(4, shared=True), make_slab(4)
    assert plain.refcounts is None  # the L1's slabs: a list, nothing to share
    refs = shared.refcounts
    assert refs is not None and refs.itemsize == 4 and len(refs) == 4
    a, b = shared.alloc_many(2)
    shared.incref(a)
    assert (refs[a], refs[b]) == (2, 1)
    refs[b] += 1  # as the node's GET takes a pin in C
    assert shared.refcount(b) == 2
    shared.decref_many([a, a, b, b])
    assert shared.free_blocks == 4 and list(refs) == [0, 0, 0, 0]
    shared.close()
    plain.close()


def test_view_length_bounds_and_handle_at() -> None:
    s = make_slab(4)
    h = s.alloc()
    with pytest.raises(ConfigError, match="length 257 outside"):
        s.view(h, BS + 1)
    with pytest.raises(ConfigError, match="length -1 outside"):
        s.view(h, -1)
    assert len(s.view(h, 10)) == 10
    with pytest.raises(InvalidHandle, match="outside the 1024-byte slab"):
        s.handle_at(4 * BS)
    assert s.handle_at(s.offset(h) + BS - 1) == h
    s.close()


def test_views_alias_the_arena() -> None:
    s = make_slab(4)
    h = s.alloc()
    s.view(h)[:3] = b"abc"
    assert bytes(s.numpy(h)[:3]) == b"abc"
    assert bytes(s.buffer[s.offset(h) : s.offset(h) + 3]) == b"abc"
    assert s.numpy(h, np.uint32).size == BS // 4
    assert s.addr(h) == s.base_addr + s.offset(h)
    s.close()
    assert s.closed


def test_a_tensor_view_aliases_the_block() -> None:
    pytest.importorskip("torch")
    s = make_slab(4)
    h = s.alloc()
    s.view(h)[:3] = b"abc"
    t = s.torch(h)
    assert t.numel() == BS and bytes(t[:3].numpy()) == b"abc"
    t[3] = 7
    assert s.view(h)[3] == 7
    s.close()


def test_a_tensor_view_without_torch_names_the_extra_that_installs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules is Python's own "this module cannot be imported".
    monkeypatch.setitem(sys.modules, "torch", None)
    s = make_slab(2)
    h = s.alloc()
    with pytest.raises(MissingExtra, match=r"^Slab.torch needs torch, .*'rdmakv\[torch\]'$"):
        s.torch(h)
    with pytest.raises(ImportError) as info:  # and callers that catch ImportError still do
        s.torch(h)
    assert info.value.name == "torch"
    s.close()


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "alloc_many", "incref", "decref"]), st.integers(0, 50)),
        max_size=200,
    ),
    nblocks=st.integers(1, 12),
    shared=st.booleans(),
)
def test_allocator_never_hands_out_live_or_overlapping_blocks(
    ops: list[tuple[str, int]], nblocks: int, shared: bool
) -> None:
    """Random alloc/incref/decref against a refcount model."""
    s = make_slab(nblocks, 64, shared)
    refs: dict[int, int] = {}
    try:
        for op, n in ops:
            if op == "alloc":
                if len(refs) == nblocks:
                    with pytest.raises(SlabExhausted):
                        s.alloc()
                    continue
                h = s.alloc()
                assert h not in refs, f"handed out live block {h}"
                refs[h] = 1
            elif op == "alloc_many":
                k = n % (nblocks + 2)
                if k > nblocks - len(refs):
                    with pytest.raises(SlabExhausted):
                        s.alloc_many(k)
                    continue
                got = s.alloc_many(k)
                assert len(set(got)) == k and not set(got) & set(refs)
                refs.update(dict.fromkeys(got, 1))
            elif refs:
                h = sorted(refs)[n % len(refs)]
                if op == "incref":
                    s.incref(h)
                    refs[h] += 1
                else:
                    s.decref(h)
                    refs[h] -= 1
                    if refs[h] == 0:
                        del refs[h]
                        with pytest.raises(InvalidHandle):
                            s.decref(h)
            # Model and slab agree, and live blocks are disjoint in-range extents.
            assert s.used_blocks == len(refs)
            assert s.free_blocks == nblocks - len(refs)
            extents = sorted((s.offset(h), s.offset(h) + s.block_size) for h in refs)
            for (_a0, a1), (b0, _b1) in itertools.pairwise(extents):
                assert a1 <= b0
            assert all(a0 >= 0 and a1 <= s.nbytes for a0, a1 in extents)
            for h, c in refs.items():
                assert s.refcount(h) == c
    finally:
        s.close()


# -- slabs over foreign memory (Slab.over_buffer) ------------------------------------------


def test_over_buffer_blocks_are_the_buffers_bytes_in_place() -> None:
    owner = np.zeros(4 * BS, dtype=np.uint8)
    slab = Slab.over_buffer(owner, BS)
    assert slab.external and not slab.locked
    assert (slab.num_blocks, slab.nbytes) == (4, 4 * BS)
    assert slab.base_addr == owner.ctypes.data  # what a transport registers
    for h in range(4):
        assert slab.addr(h) == owner.ctypes.data + h * BS
    slab.view(2)[:3] = b"abc"  # writes land in the owner's memory...
    assert bytes(owner[2 * BS : 2 * BS + 3]) == b"abc"
    owner[3 * BS] = 7  # ...and the owner's writes are what the slab sees
    assert slab.numpy(3)[0] == 7 and slab.buffer[3 * BS] == 7
    assert bytes(slab.buffer[2 * BS : 2 * BS + 3]) == b"abc"


def test_over_buffer_borrowed_blocks_are_all_live_and_nothing_is_allocatable() -> None:
    slab = Slab.over_buffer(bytearray(3 * BS), BS)
    assert [slab.refcount(h) for h in range(3)] == [1, 1, 1]  # the owner's references
    assert slab.free_blocks == 0
    with pytest.raises(SlabExhausted):
        slab.alloc()
    slab.incref(1)  # an I/O pins a page like on any slab
    slab.decref(1)
    assert slab.refcount(1) == 1
    slab.decref(0)  # the owner gives page 0 up: now it is allocatable
    assert slab.alloc() == 0


def test_over_buffer_unborrowed_allocates_like_an_mmap_slab() -> None:
    raw = bytearray(4 * BS)
    slab = Slab.over_buffer(raw, BS, borrowed=False)
    assert slab.free_blocks == 4
    with pytest.raises(InvalidHandle, match="not allocated"):
        slab.offset(0)
    hs = slab.alloc_many(4)
    assert sorted(hs) == [0, 1, 2, 3]
    with pytest.raises(SlabExhausted):
        slab.alloc()
    slab.decref(hs[0])
    assert slab.alloc() == hs[0]


def test_over_buffer_accepts_tensors_of_any_dtype_and_multidim_arrays() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3, 8, dtype=torch.bfloat16)  # no numpy dtype: viewed as bytes
    slab = Slab.over_buffer(t, 3 * 8 * 2)
    assert (slab.num_blocks, slab.base_addr) == (2, t.data_ptr())
    slab.torch(1, torch.bfloat16)[:] = 1.5
    assert torch.equal(t[1], torch.full((3, 8), 1.5, dtype=torch.bfloat16))
    assert bool((t[0] == 0).all())
    a = np.zeros((4, 8), dtype=">i4")  # multi-dimensional, non-byte, non-native order
    s2 = Slab.over_buffer(a, 32)
    assert (s2.num_blocks, s2.base_addr) == (4, a.ctypes.data)


def test_over_buffer_keeps_the_owner_alive_and_close_does_not_free_it() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(64, dtype=torch.float32)
    slab = Slab.over_buffer(t, 64)
    addr = t.data_ptr()
    del t  # the slab's reference keeps the tensor's memory alive
    assert slab.numpy(0, np.float32)[3] == 3.0 and slab.base_addr == addr
    owner = np.arange(8 * BS, dtype=np.uint8)
    slab = Slab.over_buffer(owner, BS)
    slab.close()
    assert slab.closed
    slab.close()  # idempotent
    assert owner[BS + 5] == 5  # the memory is still the owner's, intact and usable
    owner[0] = 9


@pytest.mark.parametrize(
    ("make", "block_size", "match"),
    [
        (lambda: bytes(1024), 256, "read-only"),
        (lambda: np.zeros(1024, dtype=np.uint8)[::2], 256, "C-contiguous"),
        (lambda: np.zeros((8, 8), dtype=np.uint8).T, 8, "C-contiguous"),
        (lambda: bytearray(1000), 256, "not a whole number of 256-byte blocks"),
        (lambda: bytearray(0), 16, "empty buffer"),
        (lambda: [1, 2, 3], 1, "writable buffer .* got list"),
        (lambda: bytearray(1024), 0, "block_size must be a positive int"),
        (lambda: bytearray(1024), True, "block_size must be a positive int"),
        (lambda: bytearray(1024), 2048, "not a whole number"),
    ],
)
def test_over_buffer_bad_input_is_a_clear_error(make: Any, block_size: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Slab.over_buffer(make(), block_size)


def test_over_buffer_refuses_non_contiguous_tensors() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ConfigError, match="not contiguous"):
        Slab.over_buffer(torch.zeros(8, 8).t(), 32)
    ro = np.zeros(64, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        Slab.over_buffer(ro, 16)


@pytest.mark.timeout(60)
def test_kv_client_moves_bytes_straight_between_foreign_buffers_and_a_node(node: Any) -> None:
    """A real node: put from one foreign buffer's blocks, get into another's, no slab of ours."""
    from rdmakv.client.node_client import KVClient

    bs = 4096
    src = np.random.default_rng(1).integers(0, 256, 8 * bs, dtype=np.uint8)
    dst = np.zeros(8 * bs, dtype=np.uint8)
    keys = [bytes([k]) * 16 for k in range(3)]
    digests = [bytes([k]) * 16 for k in range(3)]
    with Slab.over_buffer(src, bs) as s_slab, Slab.over_buffer(dst, bs) as d_slab:
        with KVClient("127.0.0.1", node.port, s_slab, transport="tcp", timeout=5) as c:
            assert c.put(keys, [5, 0, 7], bs, digests) == [True, True, True]
        with KVClient("127.0.0.1", node.port, d_slab, transport="tcp", timeout=5) as c:
            assert c.get(keys, [1, 2, 3], digests) == [True, True, True]
    for got, sent in ((1, 5), (2, 0), (3, 7)):
        assert bytes(dst[got * bs : (got + 1) * bs]) == bytes(src[sent * bs : (sent + 1) * bs])
    assert not dst[: bs].any() and not dst[4 * bs :].any()  # nothing else was touched


def test_check_handles_names_the_first_bad_handle() -> None:
    with Slab(8 * 4096, 4096) as slab:
        hs = slab.alloc_many(4)
        slab.check_handles(hs)
        slab.check_handles([])
        slab.check_handles(np.array(hs))  # engines hand over index arrays
        freed = hs.pop()
        slab.free(freed)
        for bad, words in (
            ([*hs, freed], f"handle {freed} is not allocated"),
            ([*hs, -1], "out of range"),
            ([*hs, 8], "out of range"),
            ([*hs, 1.0], "not an integer"),
            ([*hs, "x"], "not an integer"),
        ):
            with pytest.raises(InvalidHandle, match=words):
                slab.check_handles(bad)  # type: ignore[arg-type]
