"""The node's index: its keys, committed (key -> pool block, in LRU order) and
pending (reserved by a PUT or ALLOC, not yet committed), and per block the
value's row.

:class:`IndexBase` holds what every index keeps the same way: a value's
length and writer's checksum in per-block columns (C arrays, indexed by
block, that the native index reads and writes: the length at reserve, the
checksum at commit), and the contract of the rest. Where the keys live is
the subclass's: the node's is :class:`~rdmakv.node.native_index.NativeIndex`,
which keeps them in C (native/rk_index.c), one call per batch, so a PUT's
reserve and its COMMIT cost one crossing each, as a GET does. (The tests
hold a plain-Python index of the same contract, ``tests/oracles/index.py``,
which the native one is checked against.)

A pending key belongs to the session (``owner``) that reserved it: only that
one may commit or abort it or write into its block, and until it commits
nobody finds it (lookups miss, reserve of its key answers BUSY). Reserve takes
its blocks from the spares the caller took from the pool and, when they run
out, evicts the least recently used committed key whose block only the index
references: the index reads the pool's refcounts for that and never changes
them, so the evicted block's one reference passes to the new pending key.
The index does not own pool memory: the store does the refcounting.

Each column has one row more than the pool has blocks, the last, all zeros:
a miss is :data:`NO_BLOCK` (-1), so reading a batch's rows with one C-level
``map`` over its blocks reads a miss as length 0 and checksum 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from rdmakv.wire.batches import AllocRequest, GetRequest, KeysRequest

NO_BLOCK = -1
"""A miss, in the block lists lookups return: the columns' zero row."""

AllocItem = tuple[bytes, int, bytes]
"""One item of a PUT or ALLOC: (key, size, digest)."""


class Refcounts(Protocol):
    """The pool's reference count of each block, as reserve reads them."""

    def __getitem__(self, block: int, /) -> int: ...


class Reserved(NamedTuple):
    """What :meth:`IndexBase.reserve` did with a batch of items."""

    statuses: bytearray
    """Per item its :class:`~rdmakv.wire.format.AllocStatus` (the wire's byte)."""
    blocks: array[int]
    """Per item the block it is pending in; :data:`NO_BLOCK` where refused."""
    spares_used: int
    """How many of the spares (the first ones) it took; the rest are the caller's."""
    evicted: int
    """Committed keys evicted to make room."""


class Committed(NamedTuple):
    """What :meth:`IndexBase.commit` did with a batch of keys."""

    blocks: list[int]
    """Per key its block, now committed; :data:`NO_BLOCK` where it was not."""
    committed: int
    one_sided: int
    """Bytes committed that were never marked written (they moved one-sided)."""


class IndexBase(ABC):
    """Committed and pending keys (the subclass's) with their rows. A block
    holds at most one key, a key at most one block. Not thread-safe: the store
    calls it under its lock."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        rows = num_blocks + 1  # the last: a miss's
        # C arrays, not lists: the native index reads and writes them in its calls
        self._lengths = array("I", [0]) * rows
        self._checksums = array("Q", [0]) * rows
        self.committed_bytes = 0

    @property
    def lengths_column(self) -> array[int]:
        """Every block's value length (``uint32``; one row more, a miss's), for
        numpy to gather from; the index's own, not to be written."""
        return self._lengths

    def lengths(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its value length; 0 for a miss."""
        return list(map(self._lengths.__getitem__, blocks))

    def checksums(self, blocks: Sequence[int]) -> list[int]:
        """Per block (:data:`NO_BLOCK` allowed) its writer's checksum; 0 for a miss."""
        return list(map(self._checksums.__getitem__, blocks))

    def reserve(
        self,
        owner: int,
        request: AllocRequest,
        max_size: int,
        spares: Sequence[int],
        refcounts: Refcounts,
    ) -> Reserved:
        """Make each (key, size, digest) item of ``request`` a pending key of ``owner``, in order,
        or say why not: TOO_LARGE (size outside 1..``max_size``, or a key
        length outside 1..MAX_KEY_LEN), EXISTS (committed), BUSY (pending, any
        owner's), NO_SPACE (no block left). Its block is the next of
        ``spares`` (free blocks the caller took from the pool, each with the
        one reference the pending key holds) or, once they are used up, that of
        the least recently used committed key whose ``refcounts`` is 1, which
        is evicted. An item sees what the items before it did: one may evict a
        key named later. Raises :class:`ValueError` for a spare that is out of
        range or holds a key, before changing anything."""
        reserved = self._reserve(owner, request, max_size, spares, refcounts)
        self.committed_bytes -= reserved[1]
        return reserved[0]

    def commit(
        self,
        owner: int,
        keys: Sequence[bytes] | KeysRequest,
        checksums: Sequence[int] | npt.NDArray[np.uint64],
        *,
        require_written: bool = False,
    ) -> Committed:
        """Commit ``owner``'s pending ``keys`` (a list, or a COMMIT's decoded
        keys), each with its writer's checksum: each becomes the most recently
        used, in order. Any other key is left alone (:data:`NO_BLOCK`): not
        pending, another owner's, named earlier in the batch, or, with
        ``require_written``, not marked written (its bytes may be stale)."""
        count = keys.count if isinstance(keys, KeysRequest) else len(keys)
        if len(checksums) != count:
            raise ValueError(f"commit of {count} keys with {len(checksums)} checksums")
        blocks, nbytes, one_sided = self._commit(owner, keys, checksums, require_written)
        self.committed_bytes += nbytes
        return Committed(blocks, len(blocks) - blocks.count(NO_BLOCK), one_sided)

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

    @property
    @abstractmethod
    def pending_count(self) -> int:
        """Pending keys."""

    @abstractmethod
    def pending_blocks(self, owner: int | None = None) -> list[int]:
        """The blocks of ``owner``'s pending keys (None: everyone's)."""

    @abstractmethod
    def abort(self, owner: int, keys: Sequence[bytes]) -> list[int]:
        """Forget ``owner``'s pending ``keys``; per key its block, for the
        caller to free (:data:`NO_BLOCK`: not ``owner``'s pending key)."""

    @abstractmethod
    def abandon(self, owner: int) -> list[int]:
        """Forget every pending key of ``owner`` (a session that ended); their
        blocks, for the caller to free."""

    @abstractmethod
    def mark_written(self, owner: int, blocks: Sequence[int]) -> None:
        """The node received every byte of the pending keys of ``owner`` in
        ``blocks`` (any other block is left alone: no longer ``owner``'s)."""

    @abstractmethod
    def digests(self, blocks: Sequence[int]) -> list[bytes]:
        """Per committed block (:data:`NO_BLOCK` allowed) its token digest;
        empty for a miss."""

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

    def touch_keys(self, request: KeysRequest) -> list[int]:
        """:meth:`touch_all` of a keys-only request's keys (EXISTS)."""
        return self.touch_all(request.keys)

    def touch_keys_flags(self, request: KeysRequest) -> bytes:
        """:meth:`touch_keys` as an EXISTS answer's flags: per key one byte, 1
        when committed."""
        return bytes(block != NO_BLOCK for block in self.touch_keys(request))

    @abstractmethod
    def oldest_blocks(self) -> Iterator[int]:
        """Committed blocks from least to most recently used.

        Live iterator: the caller must stop iterating before mutating the index.
        """

    @abstractmethod
    def items(self) -> list[tuple[bytes, int]]:
        """Committed (key, block), least recently used first (introspection)."""

    @abstractmethod
    def _reserve(
        self,
        owner: int,
        request: AllocRequest,
        max_size: int,
        spares: Sequence[int],
        refcounts: Refcounts,
    ) -> tuple[Reserved, int]:
        """:meth:`reserve`, and the bytes of the committed values it evicted."""

    @abstractmethod
    def _commit(
        self,
        owner: int,
        keys: Sequence[bytes] | KeysRequest,
        checksums: Sequence[int] | npt.NDArray[np.uint64],
        require_written: bool,
    ) -> tuple[list[int], int, int]:
        """:meth:`commit` (lengths checked): per key its block or
        :data:`NO_BLOCK`, the bytes committed, and those never marked written."""

    @abstractmethod
    def _remove(self, keys: Sequence[bytes]) -> list[int]:
        """Drop committed keys (see :meth:`remove`); their rows are the base's."""

    @abstractmethod
    def _remove_block(self, block: int) -> None:
        """Drop the committed key ``block`` holds."""
