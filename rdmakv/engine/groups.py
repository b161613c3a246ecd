"""HybridKVCacheManager: one prefix cache over several KV cache groups (issue 5 item 3).

Hybrid models keep one KV cache *group* per kind of layer (full attention,
sliding window, mamba-style state), each with its own block size in tokens and
its own block bytes. This class runs one :class:`~rdmakv.engine.manager.KVCacheManager`
per group (own slab, own L1, own node connections) over the same node, and
combines their hits with :func:`~rdmakv.engine.hybrid.longest_common_hit`:

1. **Lookup** (:meth:`HybridKVCacheManager.exists`): per group, a hit bitmap of
   its blocks up to the request length -- the L1 index plus ONE batched node
   ``exists`` for the blocks L1 lacks (so at most one node call per group) --
   then the fixed point of :func:`~rdmakv.engine.hybrid.longest_common_hit`.
2. **Acquire** (:meth:`HybridKVCacheManager.acquire`): the same lookup, then for
   the common hit ``L`` exactly the blocks each group needs to restore ``L``
   (``spec.required_blocks(L)``: the whole prefix for full attention, only the
   last window blocks for a sliding window, only the block ending at ``L`` for
   a state group), L1 first and one batched node fetch per group for the rest.
   A needed block may turn out missing at fetch time (evicted since the lookup,
   digest mismatch, node failure): it is cleared from its bitmap, everything
   held is released, and the fixed point is recomputed on the updated bitmaps
   -- no new lookup. Each retry clears at least one bit, so ``L`` only shrinks;
   after :data:`MAX_ACQUIRE_ATTEMPTS` attempts the answer is a miss (``L = 0``).
   Blocks fetched by an abandoned attempt stay in L1, so the next attempt
   finds them there.

The group is part of every block key: group ``g``'s keys are chained with
``extra = g.key_extra(request_extra)`` (see :class:`~rdmakv.engine.hybrid.KVCacheGroup`),
so equal tokens in two groups never share a key.

This is the one class that keeps "a manager per KV cache group": the vLLM
connector's :class:`~rdmakv.connectors.group_stores.GroupStores` holds one too and adds
only what is the connector's (paged copies, audits, metrics).

Ownership: this class builds its managers (and through them their node
clients) in ``__init__`` -- if one fails, those already built are closed
before the error propagates -- and owns them until :meth:`close`, which closes
every one and leaves :attr:`HybridKVCacheManager.managers` empty (closing twice
is harmless). :meth:`acquire` hands the caller one slab reference per block in
:class:`HybridAcquired` (per group, block index -> handle), held until
:meth:`release`; :meth:`acquire_blocks` hands out handles of one group, which the
caller gives back with that group's ``manager(group_id).release``. Only full
blocks of each group are cached (partial blocks never are), and hits are
multiples of the lcm of the block sizes. Single-threaded, like the managers it
wraps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.defaults import DEFAULT_OFFLOAD, DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.engine.hybrid import KVCacheGroup, hit_alignment, longest_common_hit
from rdmakv.engine.l1 import KeepHint, OffloadMode
from rdmakv.engine.manager import KVCacheManager, Tokens
from rdmakv.errors import ConfigError

MAX_ACQUIRE_ATTEMPTS = 4
"""Fixed-point recomputations an acquire may make when needed blocks vanish
between lookup and fetch; past that the request is treated as a miss."""


@dataclass(frozen=True)
class GroupLayout:
    """One group as the manager stores it: its spec and its bytes.

    ``block_bytes`` is the size of one block of this group (all its layers);
    ``l1_bytes`` the L1 capacity given to the group;
    ``max_pending_offload_bytes`` its offload back-pressure bound (default: a
    quarter of ``l1_bytes``, as in :class:`KVCacheManager`).
    """

    group: KVCacheGroup
    block_bytes: int
    l1_bytes: int
    max_pending_offload_bytes: int | None = None


@dataclass
class HybridStats:
    lookups: int = 0
    acquires: int = 0
    retries: int = 0
    gave_up: int = 0


@dataclass
class HybridAcquired:
    """A common hit of ``num_tokens`` tokens, held until :meth:`HybridKVCacheManager.release`.

    ``blocks[k]`` maps block index -> slab handle for the ``k``-th group (in the
    manager's group order): exactly the blocks that group needs to restore
    ``num_tokens`` tokens.
    """

    num_tokens: int
    blocks: list[dict[int, int]] = field(default_factory=list)


class HybridKVCacheManager:
    """Prefix cache over several KV cache groups; see the module docstring.

    Invariants: ``managers[k]`` serves ``groups[k]`` (the order of ``groups``
    as given), group ids are unique, and every key of group ``g`` is made with
    ``g.key_extra(extra)``; the managers are this object's until :meth:`close`.
    Options other than ``groups`` are those of :class:`KVCacheManager` and
    apply to every group (``streams`` included).
    """

    def __init__(
        self,
        *,
        namespace: KeyNamespace,
        groups: Sequence[GroupLayout],
        node: str | None = None,
        transport: str = "auto",
        policy: str = "lru",
        offload: OffloadMode | str = DEFAULT_OFFLOAD,
        offload_budget: float | None = None,
        token: bytes | str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        lock_slab: bool = True,
        replication: int = DEFAULT_REPLICATION,
        streams: int | None = None,
    ) -> None:
        for gl in groups:
            if not isinstance(gl, GroupLayout):
                raise ConfigError(f"groups must hold GroupLayout objects, got {type(gl).__name__}")
        ids = [gl.group.group_id for gl in groups]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"KV cache group ids must be unique, got {ids}")
        self.groups = [gl.group for gl in groups]
        self.align = hit_alignment(self.groups)  # also refuses an empty list
        self.stats = HybridStats()
        self.managers: list[KVCacheManager] = []
        try:
            for gl in groups:
                self.managers.append(
                    KVCacheManager(
                        namespace=namespace,
                        block_tokens=gl.group.block_size,
                        block_bytes=gl.block_bytes,
                        l1_bytes=gl.l1_bytes,
                        max_pending_offload_bytes=gl.max_pending_offload_bytes,
                        node=node,
                        transport=transport,
                        policy=policy,
                        offload=offload,
                        offload_budget=offload_budget,
                        token=token,
                        timeout=timeout,
                        lock_slab=lock_slab,
                        replication=replication,
                        streams=streams,
                    )
                )
        except BaseException:
            self.close()
            raise

    def _index(self, group_id: int) -> int:
        for k, g in enumerate(self.groups):
            if g.group_id == group_id:
                return k
        raise ConfigError(
            f"unknown KV cache group id {group_id}; groups are {[g.group_id for g in self.groups]}"
        )

    def manager(self, group_id: int) -> KVCacheManager:
        """The per-group manager (its L1, slab and node clients)."""
        return self.managers[self._index(group_id)]

    # -- writing -----------------------------------------------------------------------
    def allocate_for(self, group_id: int, num_blocks: int) -> list[int]:
        """Slab blocks of group ``group_id`` for the caller to fill (caller owns them)."""
        return self.manager(group_id).allocate_for(num_blocks)

    def put(
        self,
        group_id: int,
        tokens: Tokens,
        handles: Sequence[int],
        *,
        extra: bytes | None = None,
        first_block: int = 0,
        keep: KeepHint = None,
    ) -> int:
        """Cache blocks ``first_block..`` of group ``group_id`` (takes over the handles).

        ``keep``: the request's reuse hint, as in :meth:`KVCacheManager.put`.
        """
        k = self._index(group_id)
        return self.managers[k].put(
            tokens,
            handles,
            extra=self.groups[k].key_extra(extra),
            first_block=first_block,
            keep=keep,
        )

    # -- reading -----------------------------------------------------------------------
    def hit_bitmaps(
        self, tokens: Tokens, *, extra: bytes | None = None, max_tokens: int | None = None
    ) -> list[list[bool]]:
        """Per group, which of its blocks up to ``max_tokens`` are present (L1 or node).

        One L1 index pass plus at most one batched node ``exists`` per group.
        """
        return self.batch_hit_bitmaps([(tokens, extra, max_tokens)])[0]

    def batch_hit_bitmaps(
        self, prompts: Sequence[tuple[Tokens, bytes | None, int | None]]
    ) -> list[list[list[bool]]]:
        """:meth:`hit_bitmaps` of several ``(tokens, extra, max_tokens)`` at once:
        per prompt, per group, with one batched node ``exists`` per group for all.

        Real bitmaps, not leading runs: a sliding-window or state group may hit
        after a hole (its early blocks were never saved or were evicted).
        """
        limits = [self._limit(tokens, max_tokens) for tokens, _, max_tokens in prompts]
        per_group = [
            m.hit_bitmaps(
                [
                    (tokens, g.key_extra(extra), limit // g.block_size)
                    for (tokens, extra, _), limit in zip(prompts, limits, strict=True)
                ]
            )
            for g, m in zip(self.groups, self.managers, strict=True)
        ]
        return [[bitmaps[p] for bitmaps in per_group] for p in range(len(prompts))]

    def exists(
        self, tokens: Tokens, *, extra: bytes | None = None, max_tokens: int | None = None
    ) -> int:
        """How many leading tokens every group could restore (no references taken)."""
        self.stats.lookups += 1
        limit = self._limit(tokens, max_tokens)
        bitmaps = self.hit_bitmaps(tokens, extra=extra, max_tokens=limit)
        return longest_common_hit(self.groups, bitmaps, limit)

    def acquire_blocks(
        self, group_id: int, tokens: Tokens, indices: Sequence[int], *, extra: bytes | None = None
    ) -> list[int | None]:
        """Hold blocks ``indices`` of group ``group_id`` (L1, then one batched node fetch):
        a handle or None each, as :meth:`KVCacheManager.acquire_blocks`; give the
        handles back with ``manager(group_id).release``."""
        k = self._index(group_id)
        return self.managers[k].acquire_blocks(
            tokens, indices, extra=self.groups[k].key_extra(extra)
        )

    def acquire(
        self, tokens: Tokens, *, extra: bytes | None = None, max_tokens: int | None = None
    ) -> HybridAcquired:
        """Hold, per group, exactly the blocks needed for the longest common hit."""
        self.stats.acquires += 1
        limit = self._limit(tokens, max_tokens)
        bitmaps = self.hit_bitmaps(tokens, extra=extra, max_tokens=limit)
        for _ in range(MAX_ACQUIRE_ATTEMPTS):
            length = longest_common_hit(self.groups, bitmaps, limit)
            held = self._try_acquire(tokens, extra, length, bitmaps)
            if held is not None:
                return HybridAcquired(length, held)
            self.stats.retries += 1
        self.stats.gave_up += 1
        return HybridAcquired(0, [{} for _ in self.groups])

    def _try_acquire(
        self, tokens: Tokens, extra: bytes | None, length: int, bitmaps: list[list[bool]]
    ) -> list[dict[int, int]] | None:
        """Every group's required blocks for ``length``, or None (all released, the
        missing blocks cleared in ``bitmaps``) if one turned out missing."""
        held: list[dict[int, int]] = []
        for k, g in enumerate(self.groups):
            need = list(g.spec.required_blocks(length))
            got = self.acquire_blocks(g.group_id, tokens, need, extra=extra)
            blocks = {i: h for i, h in zip(need, got, strict=True) if h is not None}
            held.append(blocks)
            if len(blocks) < len(need):
                for i, h in zip(need, got, strict=True):
                    if h is None:
                        bitmaps[k][i] = False
                self._release_all(held)
                return None  # later groups need not be fetched: the length will change
        return held

    def release(self, acquired: HybridAcquired) -> None:
        """Give back every block of an :meth:`acquire`."""
        self._release_all(acquired.blocks)
        acquired.blocks = [{} for _ in self.groups]

    def _release_all(self, held: Sequence[dict[int, int]]) -> None:
        for m, blocks in zip(self.managers, held, strict=False):
            if blocks:
                m.release(list(blocks.values()))

    def block_view(self, group_id: int, handle: int) -> np.ndarray[Any, Any]:
        """Zero-copy uint8 view of a held or allocated block of group ``group_id``."""
        return self.manager(group_id).block_view(handle)

    def _limit(self, tokens: Tokens, max_tokens: int | None) -> int:
        if max_tokens is None:
            return len(tokens)
        if max_tokens < 0:
            raise ConfigError(f"max_tokens must be >= 0, got {max_tokens}")
        return min(len(tokens), max_tokens)

    # -- lifetime ----------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for every group's pending offloads; False if any did not finish in time."""
        return all([m.flush(timeout) for m in self.managers])

    def close(self) -> None:
        """Close every group's manager (and its node clients); idempotent."""
        for m in self.managers:
            m.close()
        self.managers = []

    def __enter__(self) -> HybridKVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "MAX_ACQUIRE_ATTEMPTS",
    "GroupLayout",
    "HybridAcquired",
    "HybridKVCacheManager",
    "HybridStats",
]
