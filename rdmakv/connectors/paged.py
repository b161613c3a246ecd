"""Block copies between an engine's paged KV cache and rdmakv slab blocks.

An engine keeps KV in *paged* tensors: one page per (layer, block id). rdmakv
stores one slab block per (KV cache group, block of tokens), holding every
layer of the group. This module moves whole blocks between the two with torch
index operations (``index_select`` / ``index_copy_``), one per layer and
direction, on zero-copy tensor views of the slab.

Engine layouts understood (per layer tensor, logical shapes):

* :attr:`PagedFormat.BLOCK_FIRST` -- ``[num_blocks, num_heads, block_tokens,
  head_size + head_size_v]``: what vLLM 0.33 hands ``register_kv_caches`` (K
  and V concatenated on the last axis). The physical order may be "NHD" or
  "HND" (strides differ); index ops see the logical shape either way.
* :attr:`PagedFormat.FLASH_ATTN` -- ``(2, num_blocks, block_tokens, num_heads,
  head_size)``: the FlashAttention layout (K plane, V plane).

Slab block contents are layout independent: for each layer of the group in
order, the block's tokens as ``[block_tokens, num_heads, head_size +
head_size_v]`` (K then V on the last axis), contiguous, in the KV dtype. Two
engines with different physical layouts (or the two formats above) therefore
produce identical bytes for identical KV and can share blocks.

Invariants: a copy never writes outside the named slab blocks or engine block
ids (all indices are checked before anything is written); the caller holds a
slab reference on every handle for the duration of the call. Copies are
synchronous: when :meth:`PagedGroupCopier.save` returns, the slab holds the
bytes (a device->host copy has completed); when :meth:`load` returns, the
engine tensors hold them (for a CUDA device, on the current stream).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rdmakv.blocks.slab import Slab
from rdmakv.errors import ConfigError, InvalidHandle

if TYPE_CHECKING:
    import torch

FLASH_KV_PLANES = 2
"""Leading dimension of a FlashAttention-layout tensor: the K plane and the V plane."""
BLOCK_FIRST_DIMS = 4
FLASH_ATTN_DIMS = 5


class PagedFormat(enum.Enum):
    """How one layer's paged KV tensor is shaped (see the module docstring)."""

    BLOCK_FIRST = "block_first"
    FLASH_ATTN = "flash_attn"


@dataclass(frozen=True)
class PageSpec:
    """Shape of one layer's page: what an engine's KV cache spec says."""

    block_tokens: int
    num_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("block_tokens", "num_heads", "head_size", "head_size_v"):
            value = getattr(self, name)
            # head_size_v may be 0: MLA caches hold one latent vector, no separate V.
            low = 0 if name == "head_size_v" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"PageSpec.{name} must be an int >= {low}, got {value!r}")

    @property
    def channels(self) -> int:
        """K and V channels of one head of one token."""
        return self.head_size + self.head_size_v

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page of one block."""
        return self.block_tokens * self.num_heads * self.channels * self.dtype.itemsize


def detect_format(name: str, t: torch.Tensor, spec: PageSpec) -> PagedFormat:
    """The :class:`PagedFormat` of layer ``name``'s tensor, or ConfigError saying why none fits."""
    shape = tuple(t.shape)
    n, h, c = spec.block_tokens, spec.num_heads, spec.channels
    if t.dtype != spec.dtype:
        raise ConfigError(
            f"KV tensor of layer {name!r} has dtype {t.dtype}, spec says {spec.dtype}"
        )
    if len(shape) == BLOCK_FIRST_DIMS and shape[1:] == (h, n, c):
        return PagedFormat.BLOCK_FIRST
    if (
        len(shape) == FLASH_ATTN_DIMS
        and shape[0] == FLASH_KV_PLANES
        and shape[2:] == (n, h, spec.head_size)
        and spec.head_size == spec.head_size_v
    ):
        return PagedFormat.FLASH_ATTN
    raise ConfigError(
        f"KV tensor of layer {name!r} has shape {shape}; expected [num_blocks, {h}, {n}, {c}] "
        f"(vLLM block-first) or (2, num_blocks, {n}, {h}, {spec.head_size}) (FlashAttention)"
    )


class PagedGroupCopier:
    """Copies whole blocks of one KV cache group between engine tensors and a slab.

    ``layers`` are ``(name, tensor)`` pairs in the group's layer order; that
    order is part of the stored bytes, so every engine sharing blocks must use
    the same one (the engine's own group layer order). ``null_block`` is an
    engine block id that must never be read or written (vLLM's null block 0).
    The copier does not own the tensors or the slab.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        spec: PageSpec,
        *,
        null_block: int | None = None,
    ) -> None:
        if not layers:
            raise ConfigError("a KV cache group needs at least one layer tensor")
        self.spec = spec
        self.null_block = null_block
        self.names = [name for name, _ in layers]
        self.tensors = [t for _, t in layers]
        self.formats = [detect_format(name, t, spec) for name, t in layers]
        counts = {self._num_blocks(t, f) for t, f in zip(self.tensors, self.formats, strict=True)}
        devices = {t.device for t in self.tensors}
        if len(counts) != 1:
            raise ConfigError(f"layers of one group disagree on num_blocks: {sorted(counts)}")
        if len(devices) != 1:
            raise ConfigError(
                f"layers of one group live on several devices: {sorted(map(str, devices))}"
            )
        self.num_blocks: int = counts.pop()
        self.device = devices.pop()
        self.block_bytes = len(layers) * spec.page_bytes

    @staticmethod
    def _num_blocks(t: torch.Tensor, fmt: PagedFormat) -> int:
        return int(t.shape[0] if fmt is PagedFormat.BLOCK_FIRST else t.shape[1])

    # -- index checks (before anything is written) --------------------------------------
    def _block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        import torch

        seen: set[int] = set()
        for b in block_ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise ConfigError(f"engine block id {b!r} outside [0, {self.num_blocks})")
            if b == self.null_block:
                raise ConfigError(f"engine block id {b} is the null block: it is never copied")
            if b in seen:
                raise ConfigError(f"engine block id {b} named twice in one copy")
            seen.add(b)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _slab_view(self, slab: Slab, handles: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[slab blocks, layers, tokens, heads, channels]`` slab view, and the handle index."""
        import torch

        if slab.block_size < self.block_bytes:
            raise ConfigError(
                f"slab blocks of {slab.block_size} bytes cannot hold a group block of "
                f"{self.block_bytes} bytes ({len(self.tensors)} layers x {self.spec.page_bytes})"
            )
        seen: set[int] = set()
        for h in handles:
            if not slab.is_live(h):
                raise InvalidHandle(f"slab block handle {h!r} is not allocated")
            if h in seen:
                raise ConfigError(f"slab block handle {h} named twice in one copy")
            seen.add(h)
        if slab.block_size % self.spec.dtype.itemsize:
            raise ConfigError(
                f"slab block size {slab.block_size} is not a multiple of the {self.spec.dtype} "
                "item size"
            )
        raw = torch.from_numpy(slab.array).view(slab.num_blocks, slab.block_size)
        typed = raw[:, : self.block_bytes].view(self.spec.dtype)
        s = self.spec
        # Splits only the last axis, so this stays a view of the slab.
        blocks = typed.view(
            slab.num_blocks, len(self.tensors), s.block_tokens, s.num_heads, s.channels
        )
        return blocks, torch.tensor(list(handles), dtype=torch.long)

    def _check_pairs(self, handles: Sequence[int], block_ids: Sequence[int]) -> None:
        if len(handles) != len(block_ids):
            raise ConfigError(f"{len(handles)} slab handles but {len(block_ids)} engine block ids")

    def block_layers(self, slab: Slab, handle: int) -> torch.Tensor:
        """Slab block ``handle`` as a typed ``[layers, tokens, heads, channels]`` view."""
        blocks, h = self._slab_view(slab, [handle])
        return blocks[int(h[0])]

    # -- copies ---------------------------------------------------------------------------
    def save(self, slab: Slab, handles: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy engine blocks ``block_ids[i]`` (all layers) into slab blocks ``handles[i]``."""
        self._check_pairs(handles, block_ids)
        if not handles:
            return
        idx = self._block_index(block_ids)
        dst, h = self._slab_view(slab, handles)
        d = self.spec.head_size
        for layer, (t, fmt) in enumerate(zip(self.tensors, self.formats, strict=True)):
            out = dst[:, layer]
            if fmt is PagedFormat.BLOCK_FIRST:
                # [n, heads, tokens, C] -> [n, tokens, heads, C]
                out.index_copy_(0, h, t.index_select(0, idx).permute(0, 2, 1, 3).cpu())
            else:
                out[..., :d].index_copy_(0, h, t[0].index_select(0, idx).cpu())
                out[..., d:].index_copy_(0, h, t[1].index_select(0, idx).cpu())

    def load(self, slab: Slab, handles: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy slab blocks ``handles[i]`` into engine blocks ``block_ids[i]`` (all layers)."""
        self._check_pairs(handles, block_ids)
        if not handles:
            return
        idx = self._block_index(block_ids)
        src, h = self._slab_view(slab, handles)
        d = self.spec.head_size
        for layer, (t, fmt) in enumerate(zip(self.tensors, self.formats, strict=True)):
            rows = src[:, layer].index_select(0, h).to(self.device)  # [n, tokens, heads, C]
            if fmt is PagedFormat.BLOCK_FIRST:
                t.index_copy_(0, idx, rows.permute(0, 2, 1, 3))
            else:
                t[0].index_copy_(0, idx, rows[..., :d])
                t[1].index_copy_(0, idx, rows[..., d:])


__all__ = ["PageSpec", "PagedFormat", "PagedGroupCopier", "detect_format"]
