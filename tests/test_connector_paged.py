"""PagedGroupCopier: engine paged KV <-> slab blocks (no engine needed).

Layouts tested are the ones engines really hand over: vLLM 0.33's block-first
``[B, H, N, C]`` views in both physical orders ("HND" contiguous, "NHD"
strided, both views into one shared buffer as vLLM allocates them) and the
FlashAttention ``(2, B, N, H, D)`` layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.connectors.paged import PagedFormat, PagedGroupCopier, PageSpec, detect_format
from rdmakv.errors import ConfigError, InvalidHandle

# Engine KV caches are torch tensors (rdmakv[torch]; the dev extras install it).
torch = pytest.importorskip("torch")

N, H, D = 4, 2, 3  # tokens per block, heads, head size (small: many blocks per test)
NUM_BLOCKS = 12
SPEC = PageSpec(block_tokens=N, num_heads=H, head_size=D, head_size_v=D, dtype=torch.float32)


def block_first(layers: int, physical: str) -> list[torch.Tensor]:
    """vLLM-style views [B, H, N, 2D] of one shared buffer, "HND" or "NHD" physical order."""
    if physical == "HND":
        buf = torch.randn(layers, NUM_BLOCKS, H, N, 2 * D)
        return [buf[i] for i in range(layers)]
    buf = torch.randn(layers, NUM_BLOCKS, N, H, 2 * D)
    return [buf[i].permute(0, 2, 1, 3) for i in range(layers)]


def flash(layers: int) -> list[torch.Tensor]:
    return [torch.randn(2, NUM_BLOCKS, N, H, D) for _ in range(layers)]


@pytest.fixture
def slab() -> Iterator[Slab]:
    s = Slab(64 * 2 * SPEC.page_bytes, 2 * SPEC.page_bytes, lock=False)
    yield s
    s.close()


def named(ts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}", t) for i, t in enumerate(ts)]


def test_formats_detected_and_wrong_shapes_refused_by_name() -> None:
    assert detect_format("a", block_first(1, "NHD")[0], SPEC) is PagedFormat.BLOCK_FIRST
    assert detect_format("a", flash(1)[0], SPEC) is PagedFormat.FLASH_ATTN
    with pytest.raises(ConfigError, match=r"layer 'bad'.*shape"):
        detect_format("bad", torch.zeros(NUM_BLOCKS, N, H, 2 * D + 1), SPEC)
    with pytest.raises(ConfigError, match="dtype"):
        detect_format("half", torch.zeros(NUM_BLOCKS, H, N, 2 * D, dtype=torch.float16), SPEC)


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_block_first_round_trip_moves_exactly_the_named_blocks(physical: str, slab: Slab) -> None:
    src = block_first(2, physical)
    ref = [t.clone() for t in src]
    copier = PagedGroupCopier(named(src), SPEC, null_block=0)
    assert copier.block_bytes == 2 * SPEC.page_bytes
    handles = slab.alloc_many(3)
    copier.save(slab, handles, [3, 5, 7])
    dst = block_first(2, physical)
    before = [t.clone() for t in dst]
    PagedGroupCopier(named(dst), SPEC, null_block=0).load(slab, handles, [8, 1, 2])
    for layer in range(2):
        assert torch.equal(dst[layer][[8, 1, 2]], ref[layer][[3, 5, 7]])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (8, 1, 2)]
        assert torch.equal(dst[layer][untouched], before[layer][untouched])


def test_slab_bytes_are_layout_independent(slab: Slab) -> None:
    """HND, NHD and FlashAttention copies of the same KV give identical slab blocks."""
    kv = torch.randn(NUM_BLOCKS, N, H, 2 * D)  # logical [B, tokens, heads, K|V]
    hnd = kv.permute(0, 2, 1, 3).contiguous()
    nhd = kv.contiguous().permute(0, 2, 1, 3)
    fa = torch.stack([kv[..., :D], kv[..., D:]]).contiguous()
    h = slab.alloc_many(3)
    for handle, t in zip(h, (hnd, nhd, fa), strict=True):
        PagedGroupCopier([("x", t)], SPEC).save(slab, [handle], [4])
    n = SPEC.page_bytes
    blobs = [bytes(slab.view(x)[:n]) for x in h]
    assert blobs[0] == blobs[1] == blobs[2]


def test_flash_layout_round_trip(slab: Slab) -> None:
    src = flash(2)
    handles = slab.alloc_many(2)
    PagedGroupCopier(named(src), SPEC).save(slab, handles, [0, 11])
    dst = flash(2)
    PagedGroupCopier(named(dst), SPEC).load(slab, handles, [6, 7])
    for layer in range(2):
        assert torch.equal(dst[layer][:, [6, 7]], src[layer][:, [0, 11]])


def test_bad_indices_are_refused_before_anything_is_written(slab: Slab) -> None:
    dst = block_first(2, "NHD")
    before = [t.clone() for t in dst]
    copier = PagedGroupCopier(named(dst), SPEC, null_block=0)
    live = slab.alloc_many(2)
    cases: list[tuple[list[int], list[int], type[Exception], str]] = [
        (live, [1, NUM_BLOCKS], ConfigError, "outside"),
        (live, [1, -1], ConfigError, "outside"),
        (live, [0, 1], ConfigError, "null block"),
        (live, [2, 2], ConfigError, "twice"),
        ([live[0], live[0]], [1, 2], ConfigError, "twice"),
        (live[:1], [1, 2], ConfigError, "2 engine block ids"),
        ([live[0], slab.num_blocks + 5], [1, 2], InvalidHandle, "not allocated"),
    ]
    for handles, ids, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            copier.load(slab, handles, ids)
    for t, b in zip(dst, before, strict=True):
        assert torch.equal(t, b)


def test_slab_blocks_too_small_are_refused() -> None:
    small = Slab(16 * SPEC.page_bytes, SPEC.page_bytes, lock=False)
    try:
        copier = PagedGroupCopier(named(block_first(2, "HND")), SPEC)
        with pytest.raises(ConfigError, match="cannot hold"):
            copier.save(small, small.alloc_many(1), [1])
    finally:
        small.close()


def test_layers_must_agree() -> None:
    a = torch.zeros(NUM_BLOCKS, H, N, 2 * D)
    b = torch.zeros(NUM_BLOCKS + 1, H, N, 2 * D)
    with pytest.raises(ConfigError, match="num_blocks"):
        PagedGroupCopier([("a", a), ("b", b)], SPEC)
    with pytest.raises(ConfigError, match="at least one layer"):
        PagedGroupCopier([], SPEC)


@settings(max_examples=30, deadline=None)
@given(
    ids=st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=6, unique=True),
    physical=st.sampled_from(["HND", "NHD"]),
)
def test_random_block_sets_round_trip(ids: list[int], physical: str) -> None:
    s = Slab(16 * 2 * SPEC.page_bytes, 2 * SPEC.page_bytes, lock=False)
    try:
        src = block_first(2, physical)
        handles = s.alloc_many(len(ids))
        PagedGroupCopier(named(src), SPEC).save(s, handles, ids)
        dst = [torch.zeros_like(t) for t in src]
        PagedGroupCopier(named(dst), SPEC).load(s, handles, ids)
        for layer in range(2):
            assert torch.equal(dst[layer][ids], src[layer][ids])
    finally:
        s.close()
