"""The node's index: key -> pool block in LRU order, and per block the value's row.

Committed keys live in an ``OrderedDict`` (key -> block) whose order is
recency (oldest first), so eviction scans from the front. A committed value's
length, token digest and checksum sit in per-block columns (Python lists
indexed by block), written at commit.

Why no object per committed key: bytes and ints are not tracked by Python's
cyclic garbage collector, an object per key is. With an ``Entry`` per key a
full collection walked every entry while each session of the node waited:
at 190k keys under churn, 4 full collections in 400k puts, the longest 40-50
ms (70 ms at 500k keys). ``rdmakv serve`` freezes its start-up heap, this
index's dict among it, so the collector does not walk the dict either.

Each column has one row more than the pool has blocks, the last, all zeros:
a miss is :data:`NO_BLOCK` (-1), so reading a batch's rows with one C-level
``map`` over its blocks reads a miss as length 0 and checksum 0.

Uncommitted values (ALLOC to COMMIT) are :class:`Entry` objects kept apart,
never visible to lookup/exists, each owned by the session that allocated it.
The index does not own pool memory: the store does the refcounting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

NO_BLOCK = -1
"""A miss, in the block lists lookups return: the columns' zero row."""
_NO_DIGEST = b""


@dataclass(slots=True)
class Entry:
    """One uncommitted value. ``block`` is a pool block handle; ``length`` <= block size."""

    key: bytes
    block: int
    length: int
    digest: bytes
    owner: int  # the session that allocated it: only it may write, commit or abort
    written: bool = False  # the node received all ``length`` bytes through WRITE


class Index:
    """Committed keys in LRU order with their rows, plus uncommitted entries by
    key. A block is in at most one of them. Not thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, Entry] = {}
        rows = num_blocks + 1  # the last: a miss's
        self._lengths = [0] * rows
        self._checksums = [0] * rows
        self._digests = [_NO_DIGEST] * rows
        self.committed_bytes = 0

    @property
    def committed_map(self) -> dict[bytes, int]:
        """Committed blocks by key, for membership tests in hot loops (read only)."""
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

    def lengths(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its value length; 0 for a miss."""
        return list(map(self._lengths.__getitem__, blocks))

    def checksums(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its writer's checksum; 0 for a miss."""
        return list(map(self._checksums.__getitem__, blocks))

    def digests(self, blocks: Sequence[int]) -> list[bytes]:
        """Per block (:data:`NO_BLOCK` allowed) its token digest; empty for a miss."""
        return list(map(self._digests.__getitem__, blocks))

    def touch_all(self, keys: Sequence[bytes]) -> list[int]:
        """Per key its committed block (:data:`NO_BLOCK`: none), in order; the
        hits become most recently used, in request order."""
        lru = self._lru
        found = [lru.get(key, NO_BLOCK) for key in keys]
        move = lru.move_to_end
        for key, block in zip(keys, found, strict=True):
            if block != NO_BLOCK:
                move(key)
        return found

    def touch_matching(self, keys: Sequence[bytes], digests: Sequence[bytes]) -> list[int]:
        """Per key its committed block when stored with that digest (else
        :data:`NO_BLOCK`), in order; only those hits become most recently used."""
        get, move, stored = self._lru.get, self._lru.move_to_end, self._digests
        found: list[int] = []
        add = found.append
        for key, digest in zip(keys, digests, strict=True):
            block = get(key, NO_BLOCK)
            if block == NO_BLOCK or stored[block] != digest:
                add(NO_BLOCK)
                continue
            move(key)
            add(block)
        return found

    def pending(self, key: bytes) -> Entry | None:
        return self._pending.get(key)

    def drop_pending(self, key: bytes) -> Entry:
        return self._pending.pop(key)

    def commit(self, e: Entry, checksum: int) -> None:
        """Make ``e`` -- taken out of :attr:`pending_map` by the caller --
        committed, visible and most recently used, with the writer's checksum."""
        b = e.block
        self._lengths[b] = e.length
        self._checksums[b] = checksum
        self._digests[b] = e.digest
        self._lru[e.key] = b
        self.committed_bytes += e.length

    def remove(self, key: bytes) -> int | None:
        """Forget committed ``key``; its block (None: not committed)."""
        block = self._lru.pop(key, None)
        if block is not None:
            self.committed_bytes -= self._lengths[block]
        return block

    def oldest_first(self) -> Iterator[tuple[bytes, int]]:
        """Committed (key, block) from least to most recently used.

        Live iterator: the caller must stop iterating before mutating the index.
        """
        return iter(self._lru.items())
