"""Slab: bad input gives clear errors; the allocator never hands out a live block."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.errors import ConfigError, InvalidHandle, MemoryLockWarning, SlabExhausted
from rdmakv.slab import Slab

BS = 256


def make_slab(blocks: int, bs: int = BS) -> Slab:
    with warnings.catch_warnings():
        # The test machine may have a small memlock limit; locking is not under test.
        warnings.simplefilter("ignore", MemoryLockWarning)
        return Slab(blocks * bs, bs)


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


def test_double_free_and_freed_handle_are_errors() -> None:
    s = make_slab(4)
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
    t = s.torch(h)
    assert t.numel() == BS and bytes(t[:3].numpy()) == b"abc"
    assert s.numpy(h, np.uint32).size == BS // 4
    assert s.addr(h) == s.base_addr + s.offset(h)
    s.close()
    assert s.closed


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "alloc_many", "incref", "decref"]), st.integers(0, 50)),
        max_size=200,
    ),
    nblocks=st.integers(1, 12),
)
def test_allocator_never_hands_out_live_or_overlapping_blocks(
    ops: list[tuple[str, int]], nblocks: int
) -> None:
    """Random alloc/incref/decref against a refcount model."""
    s = make_slab(nblocks, 64)
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
