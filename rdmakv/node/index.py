"""The node's index: key -> entry (pool block, value length, token digest), in LRU order.

Committed entries live in an ``OrderedDict`` whose order is recency (oldest
first), so eviction scans from the front. Uncommitted entries live apart, are
never visible to lookup/exists, and belong to the session that allocated them.
The index does not own pool memory: the store does the refcounting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

NO_CHECKSUM = 0
"""An uncommitted entry's checksum: the writer sends the real one with COMMIT."""


@dataclass(slots=True)
class Entry:
    """One value. ``block`` is a pool block handle; ``length`` <= block size."""

    key: bytes
    block: int
    length: int
    digest: bytes
    checksum: int  # the writer's value_checksum of the value bytes (opaque; set by COMMIT)
    owner: int  # session that allocated it; meaningful while uncommitted
    committed: bool = False
    written: bool = False  # the node received all ``length`` bytes through WRITE


class Index:
    """Committed entries in LRU order plus uncommitted entries by key. Not thread-safe."""

    def __init__(self) -> None:
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()
        self._pending: dict[bytes, Entry] = {}
        self.committed_bytes = 0

    @property
    def committed_map(self) -> dict[bytes, Entry]:
        """Committed entries by key, for membership tests in hot loops (read only)."""
        return self._lru

    @property
    def pending_map(self) -> dict[bytes, Entry]:
        """Uncommitted entries by key; the store adds new ones here directly."""
        return self._pending

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def get(self, key: bytes) -> Entry | None:
        """Committed entry for ``key`` (no recency change)."""
        return self._lru.get(key)

    def touch(self, key: bytes) -> Entry | None:
        """Committed entry for ``key``, marked most recently used."""
        e = self._lru.get(key)
        if e is not None:
            self._lru.move_to_end(key)
        return e

    def touch_all(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """:meth:`touch` of each key, in order: a batch's lookups in one pass of C
        dict gets, then the recency moves of the hits."""
        lru = self._lru
        found = list(map(lru.get, keys))
        move = lru.move_to_end
        for key, e in zip(keys, found, strict=True):
            if e is not None:
                move(key)
        return found

    def touch_matching(
        self, keys: Sequence[bytes], digests: Sequence[bytes]
    ) -> list[Entry | None]:
        """Per key, its committed entry when stored with that digest (else
        None), in order; only those hits become most recently used."""
        get, move = self._lru.get, self._lru.move_to_end
        found: list[Entry | None] = []
        add = found.append
        for key, digest in zip(keys, digests, strict=True):
            e = get(key)
            if e is None or e.digest != digest:
                add(None)
                continue
            move(key)
            add(e)
        return found

    def pending(self, key: bytes) -> Entry | None:
        return self._pending.get(key)

    def drop_pending(self, key: bytes) -> Entry:
        return self._pending.pop(key)

    def commit(self, key: bytes) -> Entry:
        e = self._pending.pop(key)
        e.committed = True
        self._lru[key] = e
        self.committed_bytes += e.length
        return e

    def remove(self, key: bytes) -> Entry | None:
        e = self._lru.pop(key, None)
        if e is not None:
            self.committed_bytes -= e.length
        return e

    def oldest_first(self) -> Iterator[Entry]:
        """Committed entries from least to most recently used.

        Live iterator: the caller must stop iterating before mutating the index.
        """
        return iter(self._lru.values())
