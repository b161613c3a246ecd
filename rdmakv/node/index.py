"""The node's index: key -> pool block in LRU order, and per block the value's row.

:class:`IndexBase` holds what every index keeps the same way: a committed
value's length, token digest and checksum in per-block columns (indexed by
block, written at commit: lengths and checksums in C arrays that the native
index reads, digests in a list), and the uncommitted entries. Where the
committed keys live is the subclass's: :class:`Index` keeps them in an
``OrderedDict`` (key -> block) whose order is recency (oldest first), so
eviction scans from the front; :class:`~rdmakv.node.native_index.NativeIndex`
keeps them in C (``rdmakv._native_index``), one call per batch. The store uses
the native one when it is built. Both take and return the same things, so the
store has one code path.

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

from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rdmakv.protocol import GetRequest

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


class IndexBase(ABC):
    """Committed keys (the subclass's) with their rows, plus uncommitted
    entries by key. A block is in at most one of them. Not thread-safe: the
    store calls it under its lock."""

    def __init__(self, num_blocks: int) -> None:
        self._pending: dict[bytes, Entry] = {}
        rows = num_blocks + 1  # the last: a miss's
        # C arrays, not lists: the native index reads them in GET's one call
        self._lengths = array("I", [0]) * rows
        self._checksums = array("Q", [0]) * rows
        self._digests = [_NO_DIGEST] * rows
        self.committed_bytes = 0

    @property
    def pending_map(self) -> dict[bytes, Entry]:
        """Uncommitted entries by key; the store adds new ones here directly."""
        return self._pending

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def pending(self, key: bytes) -> Entry | None:
        return self._pending.get(key)

    def drop_pending(self, key: bytes) -> Entry:
        return self._pending.pop(key)

    def lengths(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its value length; 0 for a miss."""
        return list(map(self._lengths.__getitem__, blocks))

    def checksums(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its writer's checksum; 0 for a miss."""
        return list(map(self._checksums.__getitem__, blocks))

    def digests(self, blocks: Sequence[int]) -> list[bytes]:
        """Per block (:data:`NO_BLOCK` allowed) its token digest; empty for a miss."""
        return list(map(self._digests.__getitem__, blocks))

    def commit(self, entries: Sequence[Entry], checksums: Sequence[int]) -> None:
        """Make ``entries`` -- taken out of :attr:`pending_map` by the caller,
        distinct keys none of which is committed -- committed and most recently
        used (in order), each with its writer's checksum."""
        lengths, sums, digests = self._lengths, self._checksums, self._digests
        for e, checksum in zip(entries, checksums, strict=True):
            b = e.block
            lengths[b] = e.length
            sums[b] = checksum
            digests[b] = e.digest
            self.committed_bytes += e.length
        self._insert(entries)

    def _forget_rows(self, blocks: Sequence[int]) -> None:
        """Account for committed ``blocks`` (no :data:`NO_BLOCK`) just removed."""
        self.committed_bytes -= sum(map(self._lengths.__getitem__, blocks))

    def remove(self, keys: Sequence[bytes]) -> list[int]:
        """Forget committed ``keys``; per key its block (:data:`NO_BLOCK`: it was
        not committed, or named earlier in the batch)."""
        blocks = self._remove(keys)
        self._forget_rows([b for b in blocks if b != NO_BLOCK])
        return blocks

    def remove_block(self, block: int) -> None:
        """Forget the committed key that ``block`` holds (it must hold one)."""
        self._remove_block(block)
        self._forget_rows([block])

    @abstractmethod
    def __len__(self) -> int:
        """Committed keys."""

    @abstractmethod
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed. The LRU order is unchanged."""

    @abstractmethod
    def touch_all(self, keys: Sequence[bytes]) -> list[int]:
        """Per key its committed block (:data:`NO_BLOCK`: none), in order; the
        hits become most recently used, in request order."""

    @abstractmethod
    def touch_matching(self, keys: Sequence[bytes], digests: Sequence[bytes]) -> list[int]:
        """Per key its committed block when stored with that digest (else
        :data:`NO_BLOCK`), in order; only those hits become most recently used."""

    def touch_request(self, request: GetRequest) -> list[int]:
        """:meth:`touch_matching` of a GET request's keys and digests."""
        return self.touch_matching(request.keys, request.digests)

    @abstractmethod
    def oldest_blocks(self) -> Iterator[int]:
        """Committed blocks from least to most recently used.

        Live iterator: the caller must stop iterating before mutating the index.
        """

    @abstractmethod
    def items(self) -> list[tuple[bytes, int]]:
        """Committed (key, block), least recently used first (introspection)."""

    @abstractmethod
    def _insert(self, entries: Sequence[Entry]) -> None:
        """Add each entry's key -> block as the most recently used, in order."""

    @abstractmethod
    def _remove(self, keys: Sequence[bytes]) -> list[int]:
        """Drop keys (see :meth:`remove`); their rows are the base's."""

    @abstractmethod
    def _remove_block(self, block: int) -> None:
        """Drop the key ``block`` holds."""


class Index(IndexBase):
    """Committed keys in an ``OrderedDict`` (key -> block) in LRU order, oldest
    first. The index of hosts without ``rdmakv._native_index``."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._keys = [b""] * (num_blocks + 1)  # per block: its key (remove_block)

    def __len__(self) -> int:
        return len(self._lru)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return list(map(self._lru.__contains__, keys))

    def touch_all(self, keys: Sequence[bytes]) -> list[int]:
        lru = self._lru
        found = [lru.get(key, NO_BLOCK) for key in keys]
        move = lru.move_to_end
        for key, block in zip(keys, found, strict=True):
            if block != NO_BLOCK:
                move(key)
        return found

    def touch_matching(self, keys: Sequence[bytes], digests: Sequence[bytes]) -> list[int]:
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

    def oldest_blocks(self) -> Iterator[int]:
        return iter(self._lru.values())

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._lru.items())

    def _insert(self, entries: Sequence[Entry]) -> None:
        lru, keys = self._lru, self._keys
        for e in entries:
            lru[e.key] = e.block
            keys[e.block] = e.key

    def _remove(self, keys: Sequence[bytes]) -> list[int]:
        pop = self._lru.pop
        return [pop(key, NO_BLOCK) for key in keys]

    def _remove_block(self, block: int) -> None:
        del self._lru[self._keys[block]]

