"""Offload policies: which L1 blocks are sent to the remote tier, and when.

The L1 cache consults its offload policy at three moments of a locally
computed block's life, and offers the block to the offload queue when the
policy says yes (see :mod:`rdmakv.engine.l1.offload` for the queue):

* ``on_insert(key, depth, keep)``: the block was just computed and inserted;
* ``on_hot(key, depth, keep)``: the eviction policy reports the resident block as hot (LRU,
  FIFO: any re-access; S3FIFO: promotion to main or a hit there);
* ``on_evict(key, depth, keep)``: the block leaves L1 (it is gone afterwards).

Invariants the cache guarantees to every policy: it asks only about blocks
computed locally (a block fetched from the remote tier is never sent back),
and never about a block it already offered successfully; a block whose offer
was refused by back-pressure may be asked about again. ``depth`` is the
block's index in its request's chain (0 = first block), ``keep`` the request's
hint: True (the engine or API says this prefix will be asked for again), False
(it will not), None (no hint). Every call is O(1) (amortised): it runs on the
engine thread for every block.

A prefix hit stops at the first block the remote tier lacks, so a block sent
without its parents is wasted bytes. Policies here keep chains closed: they
decide by depth (a parent is never deeper than its child) or by proven reuse
(a prefix lookup touches the parent before the child).

Modes: ``none``, ``all``, ``hot``, ``cold`` and ``reuse``. Which one to pick,
and the figures from a real trace behind that advice: ``docs/offload.md``.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from typing import Protocol

from rdmakv.blocks.keys import BlockKey
from rdmakv.errors import ConfigError

DEFAULT_REUSE_BUDGET = 1.0
"""``reuse``'s default byte budget, as a share of what ``all`` sends: everything
that no hint excludes (docs/offload.md says why, and when to lower it)."""
REUSE_GHOST_FACTOR = 4.0
"""Ghost keys remembered, as a multiple of the L1 capacity in blocks.

On the Mooncake conversation trace a ghost of 4x the L1 keeps 98% of an
unbounded ghost's extra hits; 1x keeps 60%.
"""
REUSE_WINDOW_DIVISOR = 8
"""The depth limit is recomputed every (L1 capacity / this) computed blocks..."""
REUSE_MIN_WINDOW = 64
"""...but not more often than every this many blocks."""
REUSE_MAX_DEPTH = 4096
"""Depths at or beyond this share one histogram bucket (bounds the window's work)."""
REUSE_DECAY = 0.5
"""Weight of the past at each window: the depth histogram tracks the last few windows."""
REUSE_SEEN_FACTOR = 64
"""Keys the *seen* filter remembers per generation, as a multiple of the L1 capacity.

The budget is a share of what ``all`` sends, which is every distinct block
once; a block this policy did not send and computes again is not in that base.
Recognising those recomputations needs a memory as long as the gap between
a block's uses, which on agent loops and re-read documents is far longer than
the ghost's (docs/offload.md)."""
SEEN_BITS_PER_KEY = 16
"""Bloom filter bits per remembered key: with 4 probes, ~0.25% false positives
per generation (a false positive under-counts the base by that share)."""
_SEEN_PROBES = 4  # 32-bit slices of a 16-byte key, each a probe
REUSE_CREDIT_WINDOWS = 8
"""Spending below the budget is carried forward for at most this many windows' budget:
enough to even out requests longer than a window, too little to bank a burst."""
HINTED, PROVEN, OPEN = 0, 1, 2
"""``reuse``'s candidate classes, best first (see :class:`ReuseOffload`)."""
CANDIDATE_CLASSES = 3


KeepHint = bool | int | None
"""A request's reuse hint, as callers give it (``KVCacheManager.put(keep=)``):

* ``True``: the request's prefix will be asked for again (a conversation that
  goes on, an agent loop); ``False``: it will not (a one-shot request);
  ``None``: unknown;
* an ``int`` N >= 0: *the first N tokens* will be asked for again (a system
  prompt, a shared document) and the rest will not. Blocks wholly inside the
  first N tokens get ``keep=True``, the others ``keep=False``
  (:func:`block_keep`).
"""


def check_keep_hint(keep: object) -> KeepHint:
    """``keep`` if it is a :data:`KeepHint`, else a :class:`ConfigError` naming it."""
    if keep is None or isinstance(keep, bool):
        return keep
    if isinstance(keep, int) and keep >= 0:
        return keep
    raise ConfigError(
        f"keep must be True, False, None or a token count >= 0 (the first N tokens "
        f"will be reused), got {keep!r}"
    )


def block_keep(keep: KeepHint, depth: int, block_tokens: int) -> bool | None:
    """The per-block hint the policies take, for the block at ``depth`` of a request."""
    if keep is None or isinstance(keep, bool):
        return keep
    return (depth + 1) * block_tokens <= keep


class OffloadMode(enum.Enum):
    """The built-in offload policies, by the name configs use."""

    NONE = "none"
    ALL = "all"  # every insert
    HOT = "hot"  # when the eviction policy first sees a resident block as hot
    COLD = "cold"  # the victim, at eviction time
    REUSE = "reuse"  # proven reuse + the chain prefix that fits a byte budget

    @classmethod
    def parse(cls, value: str | OffloadMode) -> OffloadMode:
        """``"all"``/``"hot"``/``"cold"``/``"reuse"``/``"none"`` (any case), or a member."""
        if isinstance(value, OffloadMode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown offload mode {value!r}; expected one of: {allowed}")


OFFLOAD_MODES = tuple(m.value for m in OffloadMode)


class OffloadPolicy(Protocol):
    """What the L1 cache asks an offload policy (see the module docstring)."""

    name: str
    needs_queue: bool
    """False only for a policy that never offloads (no queue, no node needed)."""

    def on_insert(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        """Offer the freshly computed block now?"""

    def on_hot(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        """Offer the resident block the eviction policy just reported hot?"""

    def on_evict(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        """Offer the block leaving L1 (its last chance)?"""


class NoOffload:
    """Never offload: an L1-only cache."""

    name = OffloadMode.NONE.value
    needs_queue = False

    def on_insert(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return False

    def on_hot(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return False

    def on_evict(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return False


class AllOffload(NoOffload):
    """Every computed block, at insert: the most bytes, every possible remote hit.

    A block whose offer back-pressure refused is not retried.
    """

    name = OffloadMode.ALL.value
    needs_queue = True

    def on_insert(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return True


class HotOffload(NoOffload):
    """A block when the eviction policy first reports it hot (reuse seen while resident).

    Loses every reuse that comes after the block left L1 without being hot.
    """

    name = OffloadMode.HOT.value
    needs_queue = True

    def on_hot(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return True


class ColdOffload(NoOffload):
    """Every computed block, at eviction: as many bytes as ``all`` in steady state.

    Sends later than ``all``, so other engines (and this one after a crash) see
    a block only once it left this L1.
    """

    name = OffloadMode.COLD.value
    needs_queue = True

    def on_evict(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return True


class ReuseOffload:
    """Hints, proven reuse, and the chain prefix, all within one byte budget.

    Every block the cache asks about is a *candidate* of one of three classes,
    best first:

    1. *hinted*: the request said ``keep=True``;
    2. *proven*: its key is in the ghost (it was evicted unsent and has now
       been computed again: its reuse is proven, and the next one will hit),
       or it turned hot while resident (reuse seen in L1);
    3. *open*: no hint, nothing proven. A ``keep=False`` block that is not
       proven is never a candidate.

    Candidates are ordered by (class, depth in the request's chain) and sent
    when they fall before a *limit* in that order: ``limit_class``,
    ``depth_limit`` and, exactly at the limit, the ``edge_share`` of keys
    (keys are uniform hashes, so that is a share of the blocks). Every
    ``window`` computed blocks the limit is recomputed from a decayed
    histogram of the candidates so that the blocks offered are ``budget`` of
    those ``all`` would send, whatever kind of candidate spends it.

    Within a class, depth is the order because a chain's reuse probability
    never grows with depth (a later request that reuses block ``d`` reuses
    every block before it), and a block is useful only with all its parents:
    for a given number of bytes per chain, its first blocks are the best ones
    to send, and only the edge level is split, so every chain sent stays
    closed up to one block short. When hints and proven reuse alone need
    more than the budget (a workload where nearly everything is reused:
    documents asked about again, agent loops re-sending their context), the
    limit moves into their class and they too are sent shallowest first,
    instead of overshooting the budget (docs/offload.md).

    ``budget >= 1`` sends every candidate at insert, like ``all`` less what
    hints exclude.

    Memory: the ghost holds at most ``ghost_limit`` keys (FIFO); the
    histograms 3 x (:data:`REUSE_MAX_DEPTH` + 1) floats. Single-threaded, like
    the L1 cache.
    """

    name = OffloadMode.REUSE.value
    needs_queue = True

    def __init__(
        self,
        capacity_blocks: int,
        budget: float = DEFAULT_REUSE_BUDGET,
        *,
        ghost_factor: float = REUSE_GHOST_FACTOR,
        window: int | None = None,
    ) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int):
            raise ConfigError(f"capacity_blocks must be an int, got {capacity_blocks!r}")
        if capacity_blocks <= 0:
            raise ConfigError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if isinstance(budget, bool) or not isinstance(budget, int | float):
            raise ConfigError(f"offload budget must be a number in (0, 1], got {budget!r}")
        if not 0.0 < budget <= 1.0:
            raise ConfigError(
                f"offload budget must be in (0, 1] (the share of the bytes 'all' would "
                f"send), got {budget!r}"
            )
        if not ghost_factor >= 0.0:
            raise ConfigError(f"ghost_factor must be >= 0, got {ghost_factor!r}")
        if window is not None and (isinstance(window, bool) or window <= 0):
            raise ConfigError(f"window must be a positive number of blocks, got {window!r}")
        self.budget = float(budget)
        self.ghost_limit = int(ghost_factor * capacity_blocks)
        self.window = window or max(REUSE_MIN_WINDOW, capacity_blocks // REUSE_WINDOW_DIVISOR)
        # Before the first window has been measured: hints and proven reuse, and
        # the first blocks of chains at the budget's share.
        self.limit_class = OPEN
        """Candidates of a better class than this are offered..."""
        self.depth_limit: float = 0
        """...and of this class, those shallower than this..."""
        self.edge_share = self.budget
        """...and this share of those exactly at the limit."""
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._seen = SeenFilter(REUSE_SEEN_FACTOR * capacity_blocks)
        self._hist = [[0.0] * (REUSE_MAX_DEPTH + 1) for _ in range(CANDIDATE_CLASSES)]
        self._deepest = 0  # highest histogram bucket ever used: bounds the window's scans
        # Decayed: blocks computed that 'all' would have computed too. A block
        # seen before is one computed again because this policy did not send
        # it, which 'all' would not have paid: the budget is a share of all's bytes.
        self._computed = 0.0
        # Integral term: offers beyond the budget so far, never forgotten (a
        # forgotten overshoot is bytes sent beyond the budget for good: where
        # all's base grows slowly, as on re-read documents, forgetting it per
        # window let the share drift 20% over). Credit for spending below the
        # budget is capped (REUSE_CREDIT_WINDOWS), so a stretch with nothing
        # worth sending cannot bank a large burst for later.
        self._debt = 0.0
        self._window_base = 0.0
        self._window_offered = 0
        self._until_update = self.window
        # Why blocks were offered (cumulative, for stats and tests).
        self.offered_hint = 0
        self.offered_ghost = 0
        self.offered_hot = 0
        self.offered_prefix = 0

    # -- the policy ---------------------------------------------------------------
    def on_insert(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        if self._seen.add(key):
            self._computed += 1.0
            self._window_base += 1.0
        offer = self._decide(key, depth, keep)
        self._window_offered += offer
        self._until_update -= 1
        if self._until_update <= 0:
            self._update_limit()
        return offer

    def _decide(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        proven = key in self._ghost
        if proven:
            del self._ghost[key]
        if keep is True:
            if self._admit(HINTED, key, depth):
                self.offered_hint += 1
                return True
        elif proven:
            if self._admit(PROVEN, key, depth):
                self.offered_ghost += 1
                return True
        elif keep is None and self._admit(OPEN, key, depth):
            self.offered_prefix += 1
            return True
        return False

    def _admit(self, cls: int, key: BlockKey, depth: int) -> bool:
        """Count the candidate; whether it falls before the limit."""
        bucket = depth if depth < REUSE_MAX_DEPTH else REUSE_MAX_DEPTH
        self._hist[cls][bucket] += 1.0
        if bucket > self._deepest:
            self._deepest = bucket
        if self.budget >= 1.0 or cls < self.limit_class:
            return True
        return cls == self.limit_class and (
            depth < self.depth_limit
            or (depth == self.depth_limit and _key_fraction(key) < self.edge_share)
        )

    def on_hot(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        offer = self._admit(HINTED if keep is True else PROVEN, key, depth)
        if offer:
            self.offered_hot += 1
            self._window_offered += 1
        return offer

    def on_evict(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        if self.ghost_limit:
            self._ghost[key] = None
            if len(self._ghost) > self.ghost_limit:
                self._ghost.popitem(last=False)
        return False

    # -- budget ---------------------------------------------------------------------
    def _update_limit(self) -> None:
        """The limit whose candidates, best first, fill what the budget allows."""
        self._until_update = self.window
        self._debt = max(
            self._debt + self._window_offered - self.budget * self._window_base,
            -self.budget * self.window * REUSE_CREDIT_WINDOWS,
        )
        self._window_offered = 0
        self._window_base = 0.0
        allowance = self.budget * self._computed - self._debt
        taken = 0.0
        self.limit_class, self.depth_limit, self.edge_share = OPEN, math.inf, 0.0
        for cls, hist in enumerate(self._hist):
            for d in range(self._deepest + 1):
                if taken + hist[d] > allowance:
                    self.limit_class, self.depth_limit = cls, d
                    self.edge_share = max(0.0, allowance - taken) / hist[d] if hist[d] else 0.0
                    break
                taken += hist[d]
            else:
                continue
            break
        self._computed *= REUSE_DECAY
        for hist in self._hist:
            for d in range(self._deepest + 1):
                hist[d] *= REUSE_DECAY

    @property
    def ghost_size(self) -> int:
        return len(self._ghost)

    def in_ghost(self, key: BlockKey) -> bool:
        return key in self._ghost


class SeenFilter:
    """Keys inserted lately, as two generations of a Bloom filter: "computed before?".

    :meth:`add` answers whether the key is new; each generation holds
    ``keys`` keys, then becomes the old one and a fresh one starts, so a key
    is remembered for at least ``keys`` and at most ``2 * keys`` insertions.
    Keys are uniform hashes, so the probes are slices of the key itself: O(1),
    no hashing. Memory: ``2 * keys * SEEN_BITS_PER_KEY`` bits.
    """

    def __init__(self, keys: int) -> None:
        self.keys = max(1, keys)
        self._bits = self.keys * SEEN_BITS_PER_KEY
        self._new = bytearray((self._bits + 7) // 8)
        self._old = bytearray(len(self._new))
        self._count = 0

    def _probes(self, key: BlockKey) -> list[int]:
        x = int.from_bytes(key[: 4 * _SEEN_PROBES], "little")
        return [((x >> (32 * i)) & 0xFFFFFFFF) % self._bits for i in range(_SEEN_PROBES)]

    def _has(self, probes: list[int]) -> bool:
        return any(all(g[p >> 3] >> (p & 7) & 1 for p in probes) for g in (self._new, self._old))

    def add(self, key: BlockKey) -> bool:
        """Remember ``key``; True when it was not remembered already."""
        probes = self._probes(key)
        if self._has(probes):
            return False
        if self._count >= self.keys:
            self._old, self._new = self._new, self._old
            self._new[:] = bytes(len(self._new))
            self._count = 0
        for p in probes:
            self._new[p >> 3] |= 1 << (p & 7)
        self._count += 1
        return True


def _key_fraction(key: BlockKey) -> float:
    """A key's first 8 bytes as a number in [0, 1): uniform, since keys are hashes."""
    return int.from_bytes(key[:8], "little") / 2.0**64


def make_offload_policy(
    spec: OffloadMode | str | OffloadPolicy,
    capacity_blocks: int,
    *,
    budget: float | None = None,
) -> OffloadPolicy:
    """The policy for ``spec``: a mode (name or member), or a policy object used as is.

    ``budget`` is ``reuse``'s byte budget (default :data:`DEFAULT_REUSE_BUDGET`);
    giving it with any other mode is an error, not silently ignored.
    """
    if not isinstance(spec, OffloadMode | str):
        if budget is not None:
            raise ConfigError("offload budget applies to the 'reuse' mode, not a policy object")
        return spec
    mode = OffloadMode.parse(spec)
    if budget is not None and mode is not OffloadMode.REUSE:
        raise ConfigError(
            f"offload budget {budget!r} applies only to offload mode 'reuse', not {mode.value!r}"
        )
    if mode is OffloadMode.REUSE:
        return ReuseOffload(
            capacity_blocks, DEFAULT_REUSE_BUDGET if budget is None else budget
        )
    policies: dict[OffloadMode, type[NoOffload]] = {
        OffloadMode.NONE: NoOffload,
        OffloadMode.ALL: AllOffload,
        OffloadMode.HOT: HotOffload,
        OffloadMode.COLD: ColdOffload,
    }
    return policies[mode]()
