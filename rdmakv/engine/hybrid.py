"""Hybrid KV cache groups: one longest common prefix hit across group kinds.

A hybrid model (full attention mixed with sliding-window attention and
mamba-style state layers) keeps one KV cache *group* per kind of layer. Each
group has its own block size (in tokens) and its own rule for what must be
cached for a prefix of ``L`` tokens to be restorable. The engine can only skip
computing a prefix that *every* group can restore, so the manager needs the
longest ``L`` that is a hit for all groups at once.

Terminology used throughout (all lengths in tokens):

* Block ``i`` of a group with block size ``B`` holds tokens ``[i*B, (i+1)*B)``.
  A group's *hit bitmap* is a ``Sequence[bool]``: entry ``i`` says whether block
  ``i`` is present (in L1 or on a node). Indices past the end of the bitmap are
  absent. Partial blocks are never cached, so ``L`` is always a multiple of ``B``.
* "Hit at ``L``" is a per-group predicate; ``L == 0`` is a hit for every group
  (nothing to restore). For ``L > 0``, with ``e = L // B`` the number of blocks
  before ``L``:

  - :class:`FullAttentionSpec`: every token in ``[0, L)`` is attended by later
    tokens, so blocks ``0 .. e-1`` must all be present. This predicate is
    *downward closed*: a hit at ``L`` implies a hit at every shorter
    block-aligned ``L'``.
  - :class:`SlidingWindowSpec` with window ``W``: the token at position ``L``
    attends to itself and the ``W - 1`` tokens before it, so tokens
    ``[max(0, L - (W - 1)), L)`` must be present, i.e. the last
    ``ceil((W - 1) / B)`` blocks before ``L`` (clamped at block 0). Blocks
    further back may be missing. Not downward closed.
  - :class:`StateSpec` (mamba-style recurrent state): the state *after* token
    ``L - 1`` summarises the whole prefix, so exactly block ``e - 1`` (the block
    ending at ``L``) must be present. Not downward closed.

* The common hit is aligned to the least common multiple of all block sizes,
  so it ends on a block boundary of every group.

:func:`longest_common_hit` finds the largest aligned ``L <= max_tokens`` that
is a hit for every group by fixed-point iteration: start from the aligned
``max_tokens``, let each group shorten the candidate to its own longest aligned
hit at or before it, and repeat until no group shortens it. The candidate never
drops below the true answer (each group's answer at or before the candidate is
at least the true answer), and when no group shortens it, it is a hit for all.

The group is part of the block key: :meth:`KVCacheGroup.key_extra` gives the
bytes to pass as ``extra`` to the key chain, so blocks of identical tokens in
two groups (different layers, different tensors) never share a key.

This module is pure logic: no I/O, no locks, no ownership of blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rdmakv.errors import ConfigError

# Prefix of the per-group key namespace; versioned so a change of the encoding
# below can never collide with keys written by an older release.
_GROUP_KEY_TAG = b"rdmakv.kvgroup.v1"
# Width of the length prefix that separates the group namespace from the
# caller's own ``extra`` bytes (keeps the concatenation unambiguous).
_EXTRA_LEN_BYTES = 4


def _check_positive_int(what: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1 (bools rejected), else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an int, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ConfigError(f"{what} must be >= 1, got {value}")
    return value


def _check_non_negative_int(what: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (bools rejected), else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an int, got {type(value).__name__}: {value!r}")
    if value < 0:
        raise ConfigError(f"{what} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention: a hit at ``L`` needs every block before ``L`` present."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive_int("FullAttentionSpec.block_size", self.block_size)

    @property
    def kind(self) -> str:
        """Short name of the group kind, used in the key namespace."""
        return "full"

    def required_blocks(self, length: int) -> range:
        """Block indices that must be present for a hit at ``length`` tokens."""
        return range(_blocks_before(self.block_size, length))


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention over ``window`` tokens (the current one included).

    A hit at ``L`` needs the last ``ceil((window - 1) / block_size)`` blocks
    before ``L`` present, clamped at block 0; ``window == 1`` needs no block.
    """

    block_size: int
    window: int

    def __post_init__(self) -> None:
        _check_positive_int("SlidingWindowSpec.block_size", self.block_size)
        _check_positive_int("SlidingWindowSpec.window", self.window)

    @property
    def kind(self) -> str:
        """Short name of the group kind, used in the key namespace."""
        return "swa"

    @property
    def window_blocks(self) -> int:
        """Blocks needed before a hit end: ``ceil((window - 1) / block_size)``."""
        return -(-(self.window - 1) // self.block_size)

    def required_blocks(self, length: int) -> range:
        """Block indices that must be present for a hit at ``length`` tokens."""
        end = _blocks_before(self.block_size, length)
        return range(max(0, end - self.window_blocks), end)


@dataclass(frozen=True)
class StateSpec:
    """Recurrent (mamba-style) state: a hit at ``L`` needs only the block ending at ``L``."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive_int("StateSpec.block_size", self.block_size)

    @property
    def kind(self) -> str:
        """Short name of the group kind, used in the key namespace."""
        return "state"

    def required_blocks(self, length: int) -> range:
        """Block indices that must be present for a hit at ``length`` tokens."""
        end = _blocks_before(self.block_size, length)
        return range(end - 1, end) if end > 0 else range(0)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | StateSpec
_SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, StateSpec)


def _blocks_before(block_size: int, length: int) -> int:
    """Number of blocks in ``[0, length)``; ``length`` must be block-aligned."""
    _check_non_negative_int("length", length)
    if length % block_size:
        raise ConfigError(
            f"length {length} is not a multiple of the block size {block_size} "
            "(partial blocks are never cached)"
        )
    return length // block_size


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: an id unique within a model plus its spec.

    ``group_id`` is the engine's index of the group (vLLM's
    ``kv_cache_groups`` position). It is mixed into every block key of the
    group through :meth:`key_extra`, together with the spec, so a block of one
    group can never be returned for another.
    """

    group_id: int
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        _check_non_negative_int("KVCacheGroup.group_id", self.group_id)
        if not isinstance(self.spec, _SPEC_TYPES):
            raise ConfigError(
                f"KVCacheGroup.spec must be one of "
                f"{', '.join(t.__name__ for t in _SPEC_TYPES)}, got {type(self.spec).__name__}"
            )

    @property
    def block_size(self) -> int:
        """Tokens per block of this group."""
        return self.spec.block_size

    @property
    def key_namespace(self) -> bytes:
        """Bytes that identify this group (id, kind, block size, window) in block keys."""
        parts = [
            _GROUP_KEY_TAG,
            str(self.group_id).encode(),
            self.spec.kind.encode(),
            str(self.spec.block_size).encode(),
        ]
        if isinstance(self.spec, SlidingWindowSpec):
            parts.append(str(self.spec.window).encode())
        return b":".join(parts)

    def key_extra(self, extra: bytes | None = None) -> bytes:
        """The ``extra`` bytes for this group's key chain, wrapping the caller's ``extra``.

        Encoded as ``len(namespace) || namespace || extra`` so that no pair of
        (group, extra) values produces the same bytes as another pair.
        """
        if extra is not None and not isinstance(extra, bytes):
            raise ConfigError(f"extra must be bytes or None, got {type(extra).__name__}")
        ns = self.key_namespace
        return len(ns).to_bytes(_EXTRA_LEN_BYTES, "little") + ns + (extra or b"")


class _GroupHits:
    """One group's hit bitmap, preprocessed so that "hit at L" is O(1).

    ``run_end[i]`` is the number of consecutive present blocks ending at block
    ``i`` (inclusive); ``leading`` is the number of present blocks from block 0.
    Only the first ``max_blocks`` entries of the bitmap are looked at.
    """

    def __init__(self, spec: KVCacheSpec, hits: Sequence[bool], max_blocks: int) -> None:
        self.spec = spec
        present = [bool(h) for h in hits[:max_blocks]]
        self.present = present
        run_end: list[int] = []
        run = 0
        for p in present:
            run = run + 1 if p else 0
            run_end.append(run)
        self.run_end = run_end
        self.leading = next((i for i, p in enumerate(present) if not p), len(present))

    def is_hit(self, length: int) -> bool:
        """Whether a prefix of ``length`` tokens is a hit for this group (see module doc)."""
        spec = self.spec
        end = length // spec.block_size
        if end == 0:
            return True
        if end > len(self.present):
            # A block past the bitmap is absent; every kind needs block end-1
            # except a window that needs no block at all.
            return isinstance(spec, SlidingWindowSpec) and spec.window_blocks == 0
        if isinstance(spec, FullAttentionSpec):
            return self.leading >= end
        if isinstance(spec, SlidingWindowSpec):
            return self.run_end[end - 1] >= min(spec.window_blocks, end)
        return self.present[end - 1]

    def longest_at_or_before(self, limit: int, align: int) -> int:
        """Largest ``L <= limit``, ``L`` a multiple of ``align``, that is a hit (>= 0)."""
        candidate = limit - limit % align
        if isinstance(self.spec, FullAttentionSpec):
            # Downward closed: cap at the leading run, then align down.
            capped = min(candidate, self.leading * self.spec.block_size)
            return capped - capped % align
        while candidate > 0 and not self.is_hit(candidate):
            candidate -= align
        return candidate


def hit_alignment(groups: Sequence[KVCacheGroup]) -> int:
    """The lcm of the groups' block sizes: every common hit is a multiple of it."""
    if not groups:
        raise ConfigError("at least one KV cache group is required")
    return math.lcm(*(g.block_size for g in groups))


def _check_hits(what: str, hits: object) -> Sequence[bool]:
    """Accept a sequence of bools or a 1-D numpy array (as lookups produce them)."""
    if isinstance(hits, np.ndarray):
        if hits.ndim != 1:
            raise ConfigError(f"{what} must be 1-D, got an array of shape {hits.shape}")
        as_list: list[bool] = hits.astype(bool).tolist()
        return as_list
    if isinstance(hits, (str, bytes)) or not isinstance(hits, Sequence):
        raise ConfigError(f"{what} must be a sequence of bools, got {type(hits).__name__}")
    return hits


def longest_hit(
    spec: KVCacheSpec, hits: Sequence[bool] | np.ndarray, limit: int, align: int | None = None
) -> int:
    """Longest hit of one group ending at or before ``limit`` tokens.

    Returns the largest ``L <= limit`` that is a multiple of ``align``
    (default: the group's block size) and is a hit for ``spec`` given the
    ``hits`` bitmap; 0 when no positive length is. ``align`` must be a
    multiple of ``spec.block_size``.
    """
    if not isinstance(spec, _SPEC_TYPES):
        raise ConfigError(f"spec must be a KV cache spec, got {type(spec).__name__}")
    _check_non_negative_int("limit", limit)
    step = spec.block_size if align is None else _check_positive_int("align", align)
    if step % spec.block_size:
        raise ConfigError(f"align {step} is not a multiple of the block size {spec.block_size}")
    bitmap = _check_hits("hits", hits)
    return _GroupHits(spec, bitmap, limit // spec.block_size).longest_at_or_before(limit, step)


def longest_common_hit(
    groups: Sequence[KVCacheGroup],
    hits: Sequence[Sequence[bool] | np.ndarray],
    max_tokens: int,
) -> int:
    """Longest prefix (tokens) that is a hit for every group, by fixed-point iteration.

    ``hits[k]`` is the hit bitmap of ``groups[k]`` (blocks of that group's
    size). The result is the largest ``L <= max_tokens`` that is a multiple of
    :func:`hit_alignment` and is a hit for every group; 0 when none is.
    Group ids must be unique. Pure function: the bitmaps are not modified.
    """
    align = hit_alignment(groups)
    _check_non_negative_int("max_tokens", max_tokens)
    if isinstance(hits, (str, bytes)) or not isinstance(hits, Sequence) or len(hits) != len(groups):
        raise ConfigError(
            f"hits must be a sequence with one bitmap per group ({len(groups)} groups), "
            f"got {type(hits).__name__}"
            + (f" of length {len(hits)}" if isinstance(hits, Sequence) else "")
        )
    seen: set[int] = set()
    for g in groups:
        if not isinstance(g, KVCacheGroup):
            raise ConfigError(f"groups must hold KVCacheGroup objects, got {type(g).__name__}")
        if g.group_id in seen:
            raise ConfigError(f"duplicate KV cache group id {g.group_id}")
        seen.add(g.group_id)
    indexed = [
        _GroupHits(g.spec, _check_hits(f"hits[{k}]", h), max_tokens // g.block_size)
        for k, (g, h) in enumerate(zip(groups, hits, strict=True))
    ]

    candidate = max_tokens - max_tokens % align
    # Each pass lets every group shorten the candidate; a pass that shortens
    # nothing means the candidate is a hit for all groups. The candidate only
    # decreases and stays >= 0, so this terminates.
    changed = True
    while changed and candidate > 0:
        changed = False
        for group in indexed:
            shorter = group.longest_at_or_before(candidate, align)
            if shorter != candidate:
                candidate = shorter
                changed = True
    return candidate


__all__ = [
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "hit_alignment",
    "longest_common_hit",
    "longest_hit",
]
