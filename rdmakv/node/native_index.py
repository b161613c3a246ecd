"""NativeIndex: the node's keys in C (native/rk_index.c, in ``rdmakv._native``).

The index of :class:`~rdmakv.node.index.IndexBase`, with the key -> block
table, the LRU list and the pending keys in C (native/rk_index.h). Each
batch crosses into C once, its keys joined into one buffer with an array of
their lengths, so a GET, a PUT's reserve or a COMMIT of a thousand keys is
one call, not a thousand dict operations under the store lock. The C side
hashes a batch ahead of its lookups and prefetches, so a cold batch (a
node's usual: the values it just sent have flushed the caches) waits for its
misses in parallel.

Only ``array`` and ``bytes.join`` build a call's arguments: numpy's per-call
overhead, with its code cold as well, cost more than the lookups did. The one
numpy array is a GET's send table (:meth:`NativeIndex.pin_request`), which the
native send takes as it is.

Its C memory is freed when the index is collected (``ffi.gc``): a session
thread that outlives a node's shutdown still holds the store, so no call can
reach freed memory.
"""

from __future__ import annotations

import secrets
import sys
from array import array
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from rdmakv import native_core
from rdmakv.errors import RdmakvError
from rdmakv.node.index import NO_BLOCK, IndexBase, Refcounts, Reserved
from rdmakv.wire.batches import AllocRequest, GetRequest, KeysRequest
from rdmakv.wire.format import ALLOC_ITEM, DIGEST_LEN, GET_ENTRY_BYTES, U16, U32, AllocStatus

_ffi, _lib = native_core.ffi, native_core.lib

OLDEST_PAGE = 16
"""Blocks fetched per call when walking the LRU list from the oldest: eviction
almost always takes the first, and rarely needs more than a page."""

_ITEM_KEY, _ITEM_SIZE, _ITEM_DIGEST = itemgetter(0), itemgetter(1), itemgetter(2)

_MAX_OWNER = (1 << 64) - 1


class PinnedRequest(NamedTuple):
    """A GET served by :meth:`NativeIndex.pin_request`, as it is sent.

    ``answer`` is the answer's payload (:func:`~rdmakv.wire.batches.encode_get_answer`).
    ``iov`` is ``uint64`` (1 + hits, 2): row 0 zero, for the caller's frame
    head, then per hit in key order its value's (address, length). Each of
    ``blocks`` (the hits') holds one reference the caller must give back once
    the bytes are sent; ``nbytes`` is the hits' total length."""

    answer: bytearray
    iov: npt.NDArray[np.uint64]
    blocks: array[int]
    nbytes: int


class IndexCorrupt(RdmakvError):
    """The store asked the index for something its invariants forbid (a bug)."""


def _keys(keys: Sequence[bytes] | KeysRequest) -> tuple[Any, Any]:
    """The keys as a call takes them: their bytes back to back, and their
    lengths. A decoded request's keys of one length come straight from its
    records (:meth:`KeysRequest.key_bytes`), with no Python object per key."""
    if isinstance(keys, KeysRequest):
        if keys.key_len is None:
            return _keys(keys.keys)
        return (_ffi.from_buffer(keys.key_bytes()),
                _ffi.from_buffer("uint32_t[]", np.full(keys.count, keys.key_len, np.uint32)))
    lengths = array("I", map(len, keys))
    return _ffi.from_buffer(b"".join(keys)), _ffi.from_buffer("uint32_t[]", lengths)


_HIGH_BYTE = 7 if sys.byteorder == "little" else 0
"""Where the most significant byte of each int64 lies in a block list's bytes."""
_HIT_FLAG_OF_HIGH_BYTE = b"\x01" + bytes(255)
"""Table for ``bytes.translate``: a block list entry's high byte to its hit flag.
A block number's is 0 (a pool has far fewer than 2**56 blocks) and
:data:`NO_BLOCK`'s (-1) is 0xFF, so one strided slice and one translate turn
a whole list into an EXISTS answer's flags, with no Python per key: an order of
magnitude less than a list of ints and one of bools (bench/README.md,
"Measurements moved from code comments (issue 58)")."""


def _blocks_out(n: int) -> array[int]:
    return array("q", bytes(8 * n))


def _owner(owner: int) -> int:
    """A session id as C keeps it (0 means "anyone's" there)."""
    if not 0 < owner <= _MAX_OWNER:
        raise ValueError(f"owner {owner} is outside [1, 2**64)")
    return owner


class NativeIndex(IndexBase):
    """Keys in C: a seeded open-addressing table of blocks, committed and
    pending, and an LRU list through the committed ones (native/rk_index.h).
    Rows are the base's. Owners are session ids in [1, 2**64). Not
    thread-safe: the store calls it under its lock."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        ix = _lib.rk_index_new(num_blocks, secrets.randbits(64))
        if ix == _ffi.NULL:
            raise MemoryError(f"native index of {num_blocks} blocks")
        self._ix = _ffi.gc(ix, _lib.rk_index_free)
        # pending keys per owner: finding a session's takes a scan of every
        # block, which a session that leaves none (the usual) must not pay
        self._pending_of: dict[int, int] = {}

    def _count_pending(self, owner: int, n: int) -> None:
        left = self._pending_of.get(owner, 0) + n
        if left:
            self._pending_of[owner] = left
        else:
            self._pending_of.pop(owner, None)

    @property
    def native_handle(self) -> Any:
        """The C index (``rk_index *``), for native code that takes the store's
        lock itself (:mod:`rdmakv.node.native_loop`); valid while this lives."""
        return self._ix

    def get_columns(self) -> tuple[Any, Any]:
        """The per-block value lengths and checksums (``uint32_t[]``,
        ``uint64_t[]``) that a GET's answer is read from, as
        :meth:`pin_request` passes them to C, for native code that takes the
        store's lock itself; each keeps its column from being resized while
        it lives."""
        return (_ffi.from_buffer("uint32_t[]", self._lengths),
                _ffi.from_buffer("uint64_t[]", self._checksums))

    def __len__(self) -> int:
        return int(_lib.rk_index_count(self._ix))

    @property
    def pending_count(self) -> int:
        return int(_lib.rk_index_pending_count(self._ix))

    def _pending_blocks(self, owner: int, drop: bool) -> list[int]:
        """Owner's (0: anyone's) pending blocks; the scan stops once it found them all."""
        expected = self.pending_count if not owner else self._pending_of.get(owner, 0)
        if drop:
            self._pending_of.pop(owner, None)
        out = array("I", bytes(4 * expected))
        n = _lib.rk_index_pending_blocks(
            self._ix, owner, drop, _ffi.from_buffer("uint32_t[]", out), len(out)
        )
        return out[:n].tolist()

    def pending_blocks(self, owner: int | None = None) -> list[int]:
        return self._pending_blocks(0 if owner is None else _owner(owner), False)

    def abandon(self, owner: int) -> list[int]:
        return self._pending_blocks(_owner(owner), True)

    def abort(self, owner: int, keys: Sequence[bytes]) -> list[int]:
        blocks = _blocks_out(len(keys))
        gone = _lib.rk_index_abort(
            self._ix, *_keys(keys), len(keys), _owner(owner), _ffi.from_buffer("int64_t[]", blocks)
        )
        self._count_pending(owner, -gone)
        return blocks.tolist()

    def mark_written(self, owner: int, blocks: Sequence[int]) -> None:
        at = array("I", blocks)
        _lib.rk_index_mark_written(self._ix, _ffi.from_buffer("uint32_t[]", at), len(at),
                                   _owner(owner))

    def digests(self, blocks: Sequence[int]) -> list[bytes]:
        n = len(blocks)
        out = bytearray(DIGEST_LEN * n)
        at = array("q", blocks)
        if _lib.rk_index_digests(self._ix, _ffi.from_buffer("int64_t[]", at), n,
                                 _ffi.from_buffer("uint8_t[]", out)):
            raise IndexCorrupt(f"digests of blocks that hold no committed key: {blocks}")
        return [b"" if b == NO_BLOCK else bytes(out[i * DIGEST_LEN : (i + 1) * DIGEST_LEN])
                for i, b in enumerate(blocks)]

    def _reserve(
        self,
        owner: int,
        request: AllocRequest,
        max_size: int,
        spares: Sequence[int],
        refcounts: Refcounts,
    ) -> tuple[Reserved, int]:
        # C reads refs[block] for any committed block
        if not isinstance(refcounts, array) or refcounts.typecode != "i" \
                or len(refcounts) != self.num_blocks:
            raise ValueError(f"the native index needs the pool's {self.num_blocks} int32 "
                             "refcounts (a slab made with shared_refcounts)")
        n = request.count
        spare = array("I", spares)
        statuses = bytearray(n)
        blocks = _blocks_out(n)
        evicted = _ffi.new("uint64_t[2]")
        # the same arguments, after the items; the records' call or the split one
        tail = (
            max_size, _owner(owner), _ffi.from_buffer("uint32_t[]", spare), len(spare),
            _ffi.from_buffer("int32_t[]", refcounts),
            _ffi.from_buffer("uint32_t[]", self._lengths),
            _ffi.from_buffer("uint8_t[]", statuses), _ffi.from_buffer("int64_t[]", blocks),
            evicted, evicted + 1,
        )
        if request.key_len is not None:  # one key length: C reads the payload as it is
            key_len = request.key_len
            records = request.records
            if len(records) != n * (U16.size + key_len + ALLOC_ITEM.size):
                raise ValueError(f"ALLOC records: {len(records)} bytes for {n} items")
            used = _lib.rk_index_reserve_records(
                self._ix, _ffi.from_buffer(records), n, key_len, *tail
            )
        else:
            items = request.items
            # C-level passes (map), not a loop
            keys = list(map(_ITEM_KEY, items))
            digests = b"".join(map(_ITEM_DIGEST, items))
            if len(digests) != n * DIGEST_LEN:
                raise ValueError(f"reserve of {n} keys with {len(digests)} bytes of digests")
            sizes = array("Q", map(_ITEM_SIZE, items))
            used = _lib.rk_index_reserve(
                self._ix, *_keys(keys), n, _ffi.from_buffer("uint64_t[]", sizes),
                _ffi.from_buffer(digests), *tail
            )
        if used < 0:
            raise ValueError(f"spare block {spare[-1 - used]} is out of range or holds a key")
        self._count_pending(owner, statuses.count(AllocStatus.OK))
        return Reserved(statuses, blocks, used, int(evicted[0])), int(evicted[1])

    def _commit(
        self,
        owner: int,
        keys: Sequence[bytes] | KeysRequest,
        checksums: Sequence[int] | npt.NDArray[np.uint64],
        require_written: bool,
    ) -> tuple[list[int], int, int]:
        n = len(checksums)  # == the keys' count (checked by commit)
        sums = (np.ascontiguousarray(checksums, dtype=np.uint64)
                if isinstance(checksums, np.ndarray) else array("Q", checksums))
        blocks = _blocks_out(n)
        totals = _ffi.new("uint64_t[2]")
        committed = _lib.rk_index_commit(
            self._ix, *_keys(keys), n, _owner(owner), require_written,
            _ffi.from_buffer("uint64_t[]", sums), _ffi.from_buffer("uint32_t[]", self._lengths),
            _ffi.from_buffer("uint64_t[]", self._checksums), _ffi.from_buffer("int64_t[]", blocks),
            totals, totals + 1,
        )
        self._count_pending(owner, -committed)
        return blocks.tolist(), int(totals[0]), int(totals[1])

    def _lookup(self, keys: Sequence[bytes], touch: bool) -> array[int]:
        blocks = _blocks_out(len(keys))
        args = (self._ix, *_keys(keys), len(keys))
        if touch:
            _lib.rk_index_touch(*args, _ffi.NULL, _ffi.from_buffer("int64_t[]", blocks))
        else:
            _lib.rk_index_find(*args, _ffi.from_buffer("int64_t[]", blocks))
        return blocks

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return list(map(NO_BLOCK.__ne__, self._lookup(keys, touch=False)))

    def touch_all(self, keys: Sequence[bytes]) -> list[int]:
        return self._lookup(keys, touch=True).tolist()

    def touch_matching(self, keys: Sequence[bytes], digests: Sequence[bytes]) -> list[int]:
        n = len(keys)
        if len(digests) != n:
            raise ValueError(f"{n} keys with {len(digests)} digests")
        lengths = array("I", map(len, keys))
        joined = b"".join(digests)
        if len(joined) != n * DIGEST_LEN or (set(map(len, digests)) != {DIGEST_LEN} and n):
            # A digest of another length matches nothing stored: its key is
            # looked up as empty (never found), so it is neither a hit nor touched.
            for i, d in enumerate(digests):
                if len(d) != DIGEST_LEN:
                    lengths[i] = 0
            keys = [k if len(d) == DIGEST_LEN else b"" for k, d in zip(keys, digests, strict=True)]
            joined = b"".join(d if len(d) == DIGEST_LEN else bytes(DIGEST_LEN) for d in digests)
        blocks = _blocks_out(n)
        _lib.rk_index_touch(
            self._ix, _ffi.from_buffer(b"".join(keys)), _ffi.from_buffer("uint32_t[]", lengths),
            n, _ffi.from_buffer(joined), _ffi.from_buffer("int64_t[]", blocks),
        )
        return blocks.tolist()

    @staticmethod
    def unpin(refs: array[int], blocks: array[int]) -> array[int]:
        """Give back the references :meth:`pin_request` took on ``blocks``
        (its :attr:`PinnedRequest.blocks`) in ``refs``: every one that is not
        its block's last. The last ones come back, for the pool's
        ``decref_many`` (which frees those blocks)."""
        last = array("I", bytes(4 * len(blocks)))
        k = _lib.rk_index_unpin(
            _ffi.from_buffer("int32_t[]", refs), _ffi.from_buffer("uint32_t[]", blocks),
            len(blocks), _ffi.from_buffer("uint32_t[]", last),
        )
        return last[:k]

    @staticmethod
    def _records(request: GetRequest | KeysRequest) -> Any:
        """A one-key-length request's records, checked to be the size C reads."""
        records = request.records
        key_len = cast(int, request.key_len)
        what, trailer = ("GET", DIGEST_LEN) if isinstance(request, GetRequest) else ("keys", 0)
        stride = _lib.RK_INDEX_RECORD_HEAD + key_len + trailer
        if len(records) != request.count * stride:  # C reads exactly this many bytes
            raise ValueError(
                f"{what} records: {len(records)} bytes for {request.count} items of {stride}"
            )
        return _ffi.from_buffer(records)

    def _touch_blocks(self, request: GetRequest | KeysRequest, touch: Any) -> array[int]:
        """``touch`` (a records lookup of C) of a one-key-length request."""
        blocks = _blocks_out(request.count)
        touch(self._ix, self._records(request), request.count, request.key_len,
              _ffi.from_buffer("int64_t[]", blocks))
        return blocks

    def _touch_records(self, request: GetRequest | KeysRequest, touch: Any) -> list[int]:
        return self._touch_blocks(request, touch).tolist()

    def touch_keys(self, request: KeysRequest) -> list[int]:
        if request.key_len is None:  # keys of several lengths: split when decoded
            return super().touch_keys(request)
        return self._touch_records(request, _lib.rk_index_touch_key_records)

    def touch_keys_flags(self, request: KeysRequest) -> bytes:
        if request.key_len is None:
            return super().touch_keys_flags(request)
        blocks = self._touch_blocks(request, _lib.rk_index_touch_key_records)
        return blocks.tobytes()[_HIGH_BYTE::8].translate(_HIT_FLAG_OF_HIGH_BYTE)

    def touch_request(self, request: GetRequest) -> list[int]:
        if request.key_len is None:  # keys of several lengths: split when decoded
            return super().touch_request(request)
        return self._touch_records(request, _lib.rk_index_touch_records)

    def pin_request(
        self, request: GetRequest, refs: array[int], base: int, block_size: int
    ) -> PinnedRequest | None:
        """A GET whose keys share one length in one call (None for another:
        :meth:`touch_request` is the caller's path then): its hits touched
        as :meth:`touch_request` would, one reference taken on each hit's
        block in ``refs`` (the pool's refcounts, ``int32``; the caller gives
        them back), and its answer laid out as it is sent (:class:`PinnedRequest`).
        ``base`` and ``block_size`` place block b at ``base + b * block_size``."""
        if request.key_len is None:
            return None
        n = request.count
        records = self._records(request)
        if len(refs) != len(self._lengths) - 1:  # C writes refs[block] for any block
            raise ValueError(f"{len(refs)} refcounts for {len(self._lengths) - 1} blocks")
        answer = bytearray(U32.size + GET_ENTRY_BYTES * n)
        U32.pack_into(answer, 0, n)
        iov = np.zeros((n + 1, 2), dtype=np.uint64)
        hit_blocks = array("I", bytes(4 * n))
        nbytes = _ffi.new("uint64_t *")
        columns = _ffi.from_buffer("uint8_t[]", answer)
        hits = _lib.rk_index_get_records(
            self._ix, records, n, request.key_len,
            _ffi.from_buffer("uint32_t[]", self._lengths),
            _ffi.from_buffer("uint64_t[]", self._checksums),
            _ffi.from_buffer("int32_t[]", refs), base, block_size,
            columns + U32.size, columns + U32.size + U32.size * n,
            _ffi.from_buffer("uint64_t[]", iov[1:]),
            _ffi.from_buffer("uint32_t[]", hit_blocks), nbytes,
        )
        return PinnedRequest(answer, iov[: hits + 1], hit_blocks[:hits], int(nbytes[0]))

    def oldest_blocks(self) -> Iterator[int]:
        page = _ffi.new("uint32_t[]", OLDEST_PAGE)
        after = -1
        while True:
            got = _lib.rk_index_oldest(self._ix, after, OLDEST_PAGE, page)
            if not got:
                return
            yield from page[0:got]
            after = page[got - 1]

    def items(self) -> list[tuple[bytes, int]]:
        key = _ffi.new("uint8_t[]", _lib.RK_INDEX_MAX_KEY)
        out = []
        for block in list(self.oldest_blocks()):
            n = _lib.rk_index_key(self._ix, block, key)
            out.append((bytes(_ffi.buffer(key, n)), block))
        return out

    def _remove(self, keys: Sequence[bytes]) -> list[int]:
        blocks = _blocks_out(len(keys))
        _lib.rk_index_remove(
            self._ix, *_keys(keys), len(keys),
            _ffi.from_buffer("int64_t[]", blocks),
        )
        return blocks.tolist()

    def _remove_block(self, block: int) -> None:
        if _lib.rk_index_remove_block(self._ix, block):
            raise IndexCorrupt(f"block {block} holds no committed key")
