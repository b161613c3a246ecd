"""Tests for rdmakv.engine.hybrid: per-group hit rules and the fixed-point longest common hit."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.engine.hybrid import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    hit_alignment,
    longest_common_hit,
    longest_hit,
)
from rdmakv.errors import ConfigError, RdmakvError

BLOCK_SIZES = (16, 32, 64)
MAX_BLOCKS_OF_SMALLEST = 40  # bitmaps up to 40 * 16 = 640 tokens


def _present(hits: Sequence[bool], block: int) -> bool:
    return 0 <= block < len(hits) and bool(hits[block])


def reference_is_hit(spec: KVCacheSpec, hits: Sequence[bool], length: int) -> bool:
    """Hit at ``length`` checked token by token, straight from the definition."""
    if length == 0:
        return True
    b = spec.block_size
    if isinstance(spec, FullAttentionSpec):
        needed_tokens = range(0, length)
    elif isinstance(spec, SlidingWindowSpec):
        needed_tokens = range(max(0, length - (spec.window - 1)), length)
    else:
        # The state after the last token of the prefix lives in the block holding that token.
        needed_tokens = range(length - 1, length)
    return all(_present(hits, t // b) for t in needed_tokens)


def reference_longest_common_hit(
    groups: Sequence[KVCacheGroup], hits: Sequence[Sequence[bool]], max_tokens: int
) -> int:
    """Brute force: the largest multiple of the lcm <= max_tokens that every group hits."""
    step = math.lcm(*(g.block_size for g in groups))
    for length in range(max_tokens - max_tokens % step, -1, -step):
        if all(reference_is_hit(g.spec, h, length) for g, h in zip(groups, hits, strict=True)):
            return length
    raise AssertionError("length 0 is always a hit")


def bits(pattern: str) -> list[bool]:
    """'11.1' -> [True, True, False, True]."""
    return [c == "1" for c in pattern]


# --- per-group rules -------------------------------------------------------------------------


def test_full_attention_is_downward_closed_and_stops_at_first_gap() -> None:
    spec = FullAttentionSpec(16)
    hits = bits("111.11")
    assert longest_hit(spec, hits, 6 * 16) == 3 * 16
    assert longest_hit(spec, hits, 2 * 16) == 2 * 16
    assert longest_hit(spec, hits, 2 * 16 + 5) == 2 * 16  # limit not aligned -> rounded down


def test_sliding_window_needs_only_the_last_blocks() -> None:
    # window 33 tokens, block 16: needs ceil(32/16) = 2 blocks before the hit end.
    spec = SlidingWindowSpec(16, 33)
    assert spec.window_blocks == 2
    hits = bits("1..11.")
    assert longest_hit(spec, hits, 6 * 16) == 5 * 16  # blocks 3,4 present
    assert longest_hit(spec, hits, 4 * 16) == 16  # block 3 alone is not enough for L=64
    assert spec.required_blocks(5 * 16) == range(3, 5)


def test_sliding_window_of_exactly_one_block_plus_one_token() -> None:
    # window 17 needs ceil(16/16) = 1 block; window 18 needs 2 blocks.
    hits = bits(".1.1")
    assert longest_hit(SlidingWindowSpec(16, 17), hits, 64) == 64
    assert longest_hit(SlidingWindowSpec(16, 18), hits, 64) == 0


def test_sliding_window_larger_than_prefix_behaves_like_full_attention() -> None:
    spec = SlidingWindowSpec(16, 10_000)
    hits = bits("111.111")
    assert longest_hit(spec, hits, 7 * 16) == 3 * 16
    assert spec.required_blocks(3 * 16) == range(0, 3)  # clamped at block 0


def test_window_of_one_token_needs_no_block() -> None:
    spec = SlidingWindowSpec(16, 1)
    assert spec.window_blocks == 0
    assert longest_hit(spec, [], 160) == 160
    assert longest_hit(spec, bits("...."), 64) == 64


def test_state_needs_exactly_the_block_ending_at_the_hit() -> None:
    spec = StateSpec(16)
    hits = bits("..1.1.")
    assert longest_hit(spec, hits, 6 * 16) == 5 * 16
    assert longest_hit(spec, hits, 4 * 16) == 3 * 16
    assert longest_hit(spec, hits, 2 * 16) == 0
    assert spec.required_blocks(5 * 16) == range(4, 5)
    assert spec.required_blocks(0) == range(0)


def test_state_with_coarser_alignment_skips_unaligned_blocks() -> None:
    # Block 2 (tokens [32,48)) present, but a 32-token alignment only allows L in {0,32,64,...}.
    hits = bits("..1.")
    assert longest_hit(StateSpec(16), hits, 64, align=32) == 0
    assert longest_hit(StateSpec(16), bits("...1"), 64, align=32) == 64


def test_bitmap_shorter_than_limit_means_missing_blocks() -> None:
    assert longest_hit(FullAttentionSpec(16), bits("11"), 1000) == 32
    assert longest_hit(StateSpec(16), bits("11"), 1000) == 32


# --- longest common hit: edge cases ----------------------------------------------------------


def _mixed_groups() -> list[KVCacheGroup]:
    return [
        KVCacheGroup(0, FullAttentionSpec(16)),
        KVCacheGroup(1, SlidingWindowSpec(32, 64)),
        KVCacheGroup(2, StateSpec(64)),
    ]


def test_no_hit_anywhere_is_zero() -> None:
    groups = _mixed_groups()
    assert longest_common_hit(groups, [[], [], []], 512) == 0
    assert longest_common_hit(groups, [bits("." * 32), bits("." * 16), bits("." * 8)], 512) == 0


def test_full_hit_is_max_tokens_aligned_down_to_lcm() -> None:
    groups = _mixed_groups()
    assert hit_alignment(groups) == 64
    hits = [bits("1" * 32), bits("1" * 16), bits("1" * 8)]
    assert longest_common_hit(groups, hits, 512) == 512
    assert longest_common_hit(groups, hits, 511) == 448


def test_max_tokens_zero_is_zero() -> None:
    assert longest_common_hit(_mixed_groups(), [bits("1"), bits("1"), bits("1")], 0) == 0


def test_fixed_point_needs_several_rounds() -> None:
    # full/16 holds up to 256. Round 1: the window (32 tokens/block, 2 blocks needed) misses
    # block 7 -> 192; the state group (64) misses the block ending at 192 -> 128. Round 2: the
    # window misses block 3 -> 64, where everyone hits. Round 3 changes nothing.
    groups = _mixed_groups()
    full = bits("1" * 16)
    swa = bits("1110111.")
    state = bits("11.1")
    assert longest_common_hit(groups, [full, swa, state], 256) == 64
    assert reference_longest_common_hit(groups, [full, swa, state], 256) == 64


def test_state_only_at_exact_end() -> None:
    groups = [KVCacheGroup(0, FullAttentionSpec(16)), KVCacheGroup(1, StateSpec(16))]
    full = bits("1" * 10)
    assert longest_common_hit(groups, [full, bits("." * 9 + "1")], 160) == 160
    assert longest_common_hit(groups, [full, bits("." * 9 + "1")], 144) == 0
    assert longest_common_hit(groups, [full, bits("....1.....")], 160) == 80


def test_window_larger_than_prefix_requires_whole_prefix() -> None:
    groups = [KVCacheGroup(0, SlidingWindowSpec(16, 4096)), KVCacheGroup(1, StateSpec(32))]
    assert longest_common_hit(groups, [bits("1.11"), bits("11")], 64) == 0
    assert longest_common_hit(groups, [bits("1111"), bits(".1")], 64) == 64


def test_numpy_bitmaps_are_accepted() -> None:
    groups = _mixed_groups()
    hits = [
        np.ones(16, dtype=bool),
        np.array(bits("1110111.")),
        np.array([1, 1, 0, 1], dtype=np.uint8),
    ]
    assert longest_common_hit(groups, hits, 256) == 64
    with pytest.raises(ConfigError, match=r"hits\[0\] must be 1-D"):
        longest_common_hit(groups, [np.ones((2, 8), dtype=bool), *hits[1:]], 256)


def test_inputs_are_not_modified() -> None:
    groups = _mixed_groups()
    hits = [bits("1" * 8), bits("1.1."), bits("1.")]
    before = [list(h) for h in hits]
    longest_common_hit(groups, hits, 128)
    assert hits == before


# --- keys -----------------------------------------------------------------------------------


def test_group_is_part_of_the_key() -> None:
    a = KVCacheGroup(0, FullAttentionSpec(16))
    b = KVCacheGroup(1, FullAttentionSpec(16))
    c = KVCacheGroup(0, SlidingWindowSpec(16, 128))
    d = KVCacheGroup(0, SlidingWindowSpec(16, 256))
    extras = {g.key_extra(b"lora") for g in (a, b, c, d)}
    assert len(extras) == 4
    assert a.key_extra() != a.key_extra(b"x")
    assert a.key_extra(None) == a.key_extra(b"")
    assert a.key_extra(b"x") == KVCacheGroup(0, FullAttentionSpec(16)).key_extra(b"x")


def test_key_extra_is_unambiguous_with_a_namespace_prefix() -> None:
    # group 1 with extra b"0..." must not collide with group 10 (namespace "...:10:...").
    g1 = KVCacheGroup(1, StateSpec(16))
    g10 = KVCacheGroup(10, StateSpec(16))
    assert g1.key_extra(b"0") != g10.key_extra()
    assert not g10.key_extra().startswith(g1.key_extra())


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        (lambda: FullAttentionSpec(0), "block_size"),
        (lambda: StateSpec(-16), "block_size"),
        (lambda: SlidingWindowSpec(16, 0), "window"),
        (lambda: SlidingWindowSpec(True, 4), "block_size"),
        (lambda: FullAttentionSpec(16.0), "block_size"),  # type: ignore[arg-type]
        (lambda: KVCacheGroup(-1, StateSpec(16)), "group_id"),
        (lambda: KVCacheGroup(0, "full"), "spec"),  # type: ignore[arg-type]
    ],
)
def test_bad_specs_are_rejected_by_name(factory: Callable[[], object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        factory()


def test_bad_arguments_to_longest_common_hit() -> None:
    groups = _mixed_groups()
    ok = [bits("1"), bits("1"), bits("1")]
    with pytest.raises(ConfigError, match="at least one"):
        longest_common_hit([], [], 64)
    with pytest.raises(ConfigError, match="one bitmap per group"):
        longest_common_hit(groups, ok[:2], 64)
    with pytest.raises(ConfigError, match="max_tokens"):
        longest_common_hit(groups, ok, -1)
    with pytest.raises(ConfigError, match="duplicate"):
        longest_common_hit([groups[0], groups[0]], ok[:2], 64)
    with pytest.raises(ConfigError, match=r"hits\[1\]"):
        longest_common_hit(groups, [ok[0], "11", ok[2]], 64)  # type: ignore[list-item]
    # ConfigError is an RdmakvError, so a connector can turn it into a miss.
    with pytest.raises(RdmakvError):
        longest_common_hit(groups, ok, -1)


def test_bad_arguments_to_longest_hit_and_required_blocks() -> None:
    with pytest.raises(ConfigError, match="align"):
        longest_hit(FullAttentionSpec(16), [True], 64, align=24)
    with pytest.raises(ConfigError, match="limit"):
        longest_hit(FullAttentionSpec(16), [True], -16)
    with pytest.raises(ConfigError, match="multiple of the block size"):
        FullAttentionSpec(16).required_blocks(17)


# --- property test against the brute-force reference ---------------------------------------


def windows(block: int) -> st.SearchStrategy[int]:
    """Any window, or one within 2 tokens of a block boundary (where ceil((W-1)/B) changes)."""
    at_boundary = st.builds(
        lambda k, d: max(1, k * block + d), st.integers(0, 4), st.integers(-2, 2)
    )
    return st.one_of(st.integers(1, 300), at_boundary)


@st.composite
def hybrid_case(draw: st.DrawFn) -> tuple[list[KVCacheGroup], list[list[bool]], int]:
    n_groups = draw(st.integers(2, 4))
    groups: list[KVCacheGroup] = []
    hits: list[list[bool]] = []
    max_len_tokens = MAX_BLOCKS_OF_SMALLEST * min(BLOCK_SIZES)
    # A shared, mostly present prefix makes long common hits likely; holes punched into it
    # and random blocks after it exercise the gaps that make each group shorten the candidate.
    shared_prefix = draw(st.integers(0, max_len_tokens))
    hole_rate = draw(st.sampled_from([0.0, 0.05, 0.2]))
    tail_density = draw(st.sampled_from([0.3, 0.7, 1.0]))
    for gid in range(n_groups):
        block = draw(st.sampled_from(BLOCK_SIZES))
        kind = draw(st.sampled_from(["full", "swa", "state"]))
        spec: KVCacheSpec
        if kind == "full":
            spec = FullAttentionSpec(block)
        elif kind == "swa":
            spec = SlidingWindowSpec(block, draw(windows(block)))
        else:
            spec = StateSpec(block)
        groups.append(KVCacheGroup(gid, spec))
        n_blocks = draw(st.integers(shared_prefix // block, max_len_tokens // block))
        draws = draw(st.lists(st.floats(0, 1), min_size=n_blocks, max_size=n_blocks))
        hits.append(
            [
                x >= hole_rate if (i + 1) * block <= shared_prefix else x < tail_density
                for i, x in enumerate(draws)
            ]
        )
    # Mostly at or past the shared prefix (where the interesting cut-offs are), sometimes anywhere.
    max_tokens = draw(
        st.one_of(
            st.integers(shared_prefix, max_len_tokens + 64), st.integers(0, max_len_tokens + 64)
        )
    )
    return groups, hits, max_tokens


@settings(max_examples=400, deadline=None)
@given(hybrid_case())
def test_fixed_point_equals_brute_force(
    case: tuple[list[KVCacheGroup], list[list[bool]], int],
) -> None:
    groups, hits, max_tokens = case
    got = longest_common_hit(groups, hits, max_tokens)
    assert got == reference_longest_common_hit(groups, hits, max_tokens)
    assert got % hit_alignment(groups) == 0
    assert 0 <= got <= max_tokens


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(BLOCK_SIZES),
    st.integers(1, 300),
    st.sampled_from(["full", "swa", "state"]),
    st.lists(st.booleans(), max_size=30),
    st.integers(0, 2048),
    st.integers(1, 4),
)
def test_per_group_longest_hit_equals_brute_force(
    block: int, window: int, kind: str, hits: list[bool], limit: int, align_mult: int
) -> None:
    spec: KVCacheSpec = (
        FullAttentionSpec(block)
        if kind == "full"
        else SlidingWindowSpec(block, window)
        if kind == "swa"
        else StateSpec(block)
    )
    align = block * align_mult
    got = longest_hit(spec, hits, limit, align=align)
    expected = next(
        length
        for length in range(limit - limit % align, -1, -align)
        if reference_is_hit(spec, hits, length)
    )
    assert got == expected
    # required_blocks agrees with the token-level definition at the answer.
    assert all(_present(hits, i) for i in spec.required_blocks(got))
