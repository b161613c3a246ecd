"""Eviction policies for the L1 cache: LRU, FIFO and S3FIFO behind one protocol.

A policy orders resident keys and picks victims; it owns no memory. The cache
tells it about inserts, hits and removals, and asks for a victim with a
predicate ``can_evict(key)``: a key whose block is held (acquired by a reader,
or pending offload) is *skipped in place* -- it keeps its position and is
reconsidered on the next eviction. ``victim`` returns ``None`` when no resident
key can be evicted.

A policy reports a key as *hot* through the ``on_hot`` callback (used by the
HOT offload mode): LRU and FIFO on every re-access hit; S3FIFO when a key is
promoted from the small to the main queue, or hit while in main. The cache
deduplicates, so a callback may fire more than once per key.

Capacity is counted in entries (all L1 blocks have one size): S3FIFO needs it
to size its small and ghost queues; LRU and FIFO ignore it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from rdmakv.blocks.keys import BlockKey
from rdmakv.errors import ConfigError

HotCallback = Callable[[BlockKey], None]
CanEvict = Callable[[BlockKey], bool]

S3FIFO_SMALL_FRACTION = 0.1  # the paper's 10% small queue
S3FIFO_GHOST_FRACTION = 0.9  # ghost remembers as many keys as main holds
S3FIFO_MAX_FREQ = 3  # 2-bit saturating access counter
S3FIFO_PROMOTE_FREQ = 1  # accessed at least once while in small -> main


def _no_hot(_key: BlockKey) -> None:
    return None


class EvictionPolicy(Protocol):
    """What the L1 cache needs from an eviction policy."""

    name: str

    def insert(self, key: BlockKey) -> None:
        """``key`` became resident (it was not)."""

    def access(self, key: BlockKey) -> None:
        """A hit on resident ``key``."""

    def remove(self, key: BlockKey) -> None:
        """``key`` left the cache other than through :meth:`victim` (e.g. invalidated)."""

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        """Choose an evictable key, forget it, and return it; None if none can go."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first. Hits move a key to the most-recent end."""

    name = "lru"

    def __init__(self, capacity: int = 0, on_hot: HotCallback | None = None) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()
        self._on_hot = on_hot or _no_hot

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def access(self, key: BlockKey) -> None:
        self._order.move_to_end(key)
        self._on_hot(key)

    def remove(self, key: BlockKey) -> None:
        del self._order[key]

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def order(self) -> list[BlockKey]:
        """Keys from next-to-evict to most recent (for tests and debugging)."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class FIFOPolicy(LRUPolicy):
    """First in, first out. Hits do not change the order (but do report hot)."""

    name = "fifo"

    def access(self, key: BlockKey) -> None:
        if key not in self._order:
            raise KeyError(key)
        self._on_hot(key)


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): small and main FIFO queues plus a ghost queue.

    New keys enter *small*; a key evicted from small that was accessed there
    moves to *main* (promotion), otherwise it leaves and its key is remembered in
    *ghost*. A key inserted while in ghost goes straight to main. Main is a FIFO
    with reinsertion: a key with a non-zero counter is moved to the head with its
    counter decremented instead of being evicted.

    Eviction takes from small while small holds at least ``small_fraction`` of
    the capacity, else from main (falling back to the other queue when one has
    nothing evictable). The ghost is a FIFO of keys bounded by
    ``ghost_fraction`` of the capacity: it never grows past that bound.
    """

    name = "s3fifo"

    def __init__(
        self,
        capacity: int,
        on_hot: HotCallback | None = None,
        *,
        small_fraction: float = S3FIFO_SMALL_FRACTION,
        ghost_fraction: float = S3FIFO_GHOST_FRACTION,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(
                f"S3FIFO capacity must be a positive number of entries, got {capacity!r}"
            )
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        if not 0.0 <= ghost_fraction <= 1.0:
            raise ConfigError(f"ghost_fraction must be in [0, 1], got {ghost_fraction!r}")
        self.capacity = capacity
        self.small_target = max(1, round(small_fraction * capacity))
        self.ghost_limit = round(ghost_fraction * capacity)
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._freq: dict[BlockKey, int] = {}
        self._on_hot = on_hot or _no_hot

    # -- protocol ----------------------------------------------------------
    def insert(self, key: BlockKey) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def access(self, key: BlockKey) -> None:
        f = self._freq[key]
        if f < S3FIFO_MAX_FREQ:
            self._freq[key] = f + 1
        if key in self._main:
            self._on_hot(key)

    def remove(self, key: BlockKey) -> None:
        del self._freq[key]
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def victim(self, can_evict: CanEvict) -> BlockKey | None:
        if len(self._small) >= self.small_target or not self._main:
            return self._evict_small(can_evict) or self._evict_main(can_evict)
        return self._evict_main(can_evict) or self._evict_small(can_evict)

    # -- queues --------------------------------------------------------------
    def _evict_small(self, can_evict: CanEvict) -> BlockKey | None:
        promote: list[BlockKey] = []
        found: BlockKey | None = None
        for key in self._small:
            if self._freq[key] >= S3FIFO_PROMOTE_FREQ:
                promote.append(key)
            elif can_evict(key):
                found = key
                break
        for key in promote:
            del self._small[key]
            # Restart the counter: reinsertion credit in main is earned by hits
            # in main, so one burst while small does not also buy rounds there.
            self._freq[key] = 0
            self._main[key] = None
            self._on_hot(key)
        if found is not None:
            del self._small[found]
            del self._freq[found]
            self._remember(found)
        return found

    def _evict_main(self, can_evict: CanEvict) -> BlockKey | None:
        # Each pass decrements every counter it passes, so at most
        # S3FIFO_MAX_FREQ + 1 passes find a victim if any key is evictable.
        for _ in range(S3FIFO_MAX_FREQ + 1):
            reinsert: list[BlockKey] = []
            found: BlockKey | None = None
            for key in self._main:
                f = self._freq[key]
                if f > 0:
                    self._freq[key] = f - 1
                    reinsert.append(key)
                elif can_evict(key):
                    found = key
                    break
            for key in reinsert:
                self._main.move_to_end(key)
            if found is not None:
                del self._main[found]
                del self._freq[found]
                return found
            if not reinsert:
                return None
        return None

    def _remember(self, key: BlockKey) -> None:
        if self.ghost_limit <= 0:
            return
        self._ghost[key] = None
        while len(self._ghost) > self.ghost_limit:
            self._ghost.popitem(last=False)

    # -- introspection (tests, metrics) ---------------------------------------
    def small_keys(self) -> list[BlockKey]:
        return list(self._small)

    def main_keys(self) -> list[BlockKey]:
        return list(self._main)

    def ghost_keys(self) -> list[BlockKey]:
        return list(self._ghost)

    def freq(self, key: BlockKey) -> int:
        return self._freq[key]

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main


POLICIES = ("lru", "fifo", "s3fifo")


def make_policy(
    name: str,
    capacity: int,
    on_hot: HotCallback | None = None,
    *,
    small_fraction: float = S3FIFO_SMALL_FRACTION,
    ghost_fraction: float = S3FIFO_GHOST_FRACTION,
) -> EvictionPolicy:
    """The policy called ``name`` (case-insensitive) for ``capacity`` entries."""
    n = name.strip().lower() if isinstance(name, str) else name
    if n == "lru":
        return LRUPolicy(capacity, on_hot)
    if n == "fifo":
        return FIFOPolicy(capacity, on_hot)
    if n == "s3fifo":
        return S3FIFOPolicy(
            capacity, on_hot, small_fraction=small_fraction, ghost_fraction=ghost_fraction
        )
    raise ConfigError(f"unknown eviction policy {name!r}; expected one of: {', '.join(POLICIES)}")
