"""The batched payloads of the wire, a whole batch at a time (formats in :mod:`rdmakv.wire.format`).

ALLOC / PUT items, GET requests and answers, COMMIT, extent and lookup tables,
flag lists and REPORT are encoded and decoded here, with numpy or the native
core's scans, so a batch of thousands of keys costs a few calls rather than a
Python loop per key. Decoders check every count and length against the frame
before they trust it: a peer's bytes never index past what it sent.
"""

from __future__ import annotations

import copy
import functools
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rdmakv import native_core
from rdmakv.errors import (
    ProtocolError,
)
from rdmakv.wire.format import (
    ALLOC_ITEM,
    ALLOC_ITEM_CODES,
    DIGEST_LEN,
    EXTENT,
    EXTENT_DTYPE,
    GET_ENTRY_BYTES,
    LOOKUP_ENTRY,
    LOOKUP_ENTRY_DTYPE,
    MAX_BULK_BYTES,
    MAX_KEY_LEN,
    MAX_KEYS_PER_REQUEST,
    RESPONSE_BIT,
    U16,
    U32,
    U64,
    AllocResult,
    AllocStatus,
    Buffer,
    Extent,
    LookupResult,
    Reader,
    check_digest,
    check_key,
)

_FIRST, _SECOND = itemgetter(0), itemgetter(1)

# -- client reports (REPORT) ---------------------------------------------------------
MAX_REPORT_TEXT = 1024
"""Longest namespace label or reason a REPORT may carry (characters)."""

MAX_REPORTED_NAMESPACES = 256
"""Reported namespaces a node remembers; the oldest report goes first."""

REPORT_QUARANTINED = "quarantined"

REPORT_CLEARED = "cleared"


def encode_report(label: str, reason: str | None) -> bytes:
    """A REPORT payload: ``label`` quarantined for ``reason``, or cleared (None)."""
    doc = (
        {REPORT_CLEARED: label}
        if reason is None
        else {REPORT_QUARANTINED: label, "reason": reason[:MAX_REPORT_TEXT]}
    )
    return json.dumps(doc).encode()


def decode_report(payload: Buffer) -> tuple[str, str | None]:
    """``(label, reason)`` of a REPORT payload (reason None: cleared); ProtocolError if bad."""
    doc = decode_json(payload, "REPORT")
    label = doc.get(REPORT_QUARANTINED, doc.get(REPORT_CLEARED))
    reason = doc.get("reason") if REPORT_QUARANTINED in doc else None
    if not isinstance(label, str) or not 0 < len(label) <= MAX_REPORT_TEXT:
        raise ProtocolError(
            f"REPORT: {REPORT_QUARANTINED!r} or {REPORT_CLEARED!r} must name a namespace "
            f"(1..{MAX_REPORT_TEXT} characters)"
        )
    if REPORT_QUARANTINED in doc and (
        not isinstance(reason, str) or len(reason) > MAX_REPORT_TEXT
    ):
        raise ProtocolError(f"REPORT: reason must be a string of <= {MAX_REPORT_TEXT} characters")
    return label, reason


def _uniform_len(items: Sequence[bytes], lo: int, hi: int) -> int | None:
    """The length ``n`` of ``items`` when there are some and every one is
    ``bytes`` of that one length, ``lo <= n <= hi`` (an engine's keys are one
    digest size), checked in C-level passes; None sends an encoder to its
    per-key path, which names a bad item."""
    if not items or set(map(type, items)) != {bytes}:
        return None
    lengths = set(map(len, items))
    if len(lengths) != 1:
        return None
    (n,) = lengths
    return n if lo <= n <= hi else None


def encode_uniform_keys(keys: Sequence[bytes]) -> bytes | None:
    """:func:`encode_keys` of keys that are all ``bytes`` of one valid length
    (C-level passes and one join, no per-key Python); None for any other
    list, which the caller checks and sends to :func:`encode_keys`. A client
    that checks its keys anyway checks them here once, not twice."""
    n = _uniform_len(keys, 1, MAX_KEY_LEN)
    if n is None:
        return None
    prefix = U16.pack(n)
    return U32.pack(len(keys)) + prefix + prefix.join(keys)


def encode_keys(keys: Sequence[bytes]) -> bytes:
    uniform = encode_uniform_keys(keys)
    if uniform is not None:
        return uniform
    parts = [U32.pack(len(keys))]
    pack = U16.pack
    for k in keys:
        n = len(k)
        if type(k) is not bytes or not 0 < n <= MAX_KEY_LEN:
            check_key(k)  # raises for anything but a bytearray of a valid length
        parts.append(pack(n))
        parts.append(k)
    return b"".join(parts)


def _uniform_key_len(buf: bytes, n: int, trailer: int) -> int | None:
    """The one key length of ``n`` keys (each followed by ``trailer`` bytes) when
    all have the first one's length and the payload is exactly their size; None
    sends the caller to :func:`_scan_keys`.

    An engine's keys are all one digest size, so this is the common case: the
    length fields are checked with two strided slices, not per key.
    """
    if n == 0 or len(buf) < U32.size + U16.size:
        return None
    klen: int = U16.unpack_from(buf, U32.size)[0]
    stride = U16.size + klen + trailer
    if not 0 < klen <= MAX_KEY_LEN or len(buf) != U32.size + n * stride:
        return None
    first = U32.size
    if buf[first::stride] != bytes((klen & 0xFF,)) * n or buf[first + 1 :: stride] != bytes(
        (klen >> 8,)
    ) * n:
        return None
    return klen


@functools.lru_cache(maxsize=64)
def _uniform_items(klen: int, trailer: str) -> struct.Struct:
    """Layout of one key of ``klen`` bytes and its ``trailer`` fields (struct
    codes), minus the length field already checked by :func:`_uniform_key_len`:
    ``iter_unpack`` then splits a whole payload in C, no per-key Python."""
    return struct.Struct(f"<{U16.size}x{klen}s{trailer}")


def _iter_uniform(buf: bytes, klen: int, trailer: str) -> Iterator[tuple[Any, ...]]:
    return _uniform_items(klen, trailer).iter_unpack(memoryview(buf)[U32.size :])


def _scan_keys(buf: bytes, n: int, trailer: int, what: str) -> Iterator[tuple[bytes, int]]:
    """Yield (key, offset of the ``trailer`` bytes after it) for ``n`` keys from offset 4.

    The hot decoder of every batched request: one bounds check per field,
    no per-key objects beyond the key itself.
    """
    pos = U32.size
    end = len(buf)
    unpack = U16.unpack_from
    for _ in range(n):
        if pos + U16.size > end:
            raise ProtocolError(f"{what}: payload truncated in a key length at offset {pos}")
        (klen,) = unpack(buf, pos)
        pos += U16.size
        if klen == 0 or klen > MAX_KEY_LEN:
            raise ProtocolError(f"{what}: key length {klen} outside [1, {MAX_KEY_LEN}]")
        stop = pos + klen
        if stop + trailer > end:
            raise ProtocolError(f"{what}: payload truncated in a key at offset {pos}")
        yield buf[pos:stop], stop
        pos = stop + trailer
    if pos != end:
        raise ProtocolError(f"{what}: {end - pos} unexpected trailing payload bytes")


def decode_keys(payload: Buffer, what: str) -> list[bytes]:
    return decode_keys_request(payload, what).keys


@functools.lru_cache(maxsize=16)
def _keyed_items_dtype(klen: int, sized: bool, digest: bool = True) -> np.dtype[np.void]:
    """An ALLOC item (``sized``: with its size field), a GET item, or (no
    ``digest``) a bare key item with a ``klen``-byte key, as numpy lays it out
    (the same bytes)."""
    size = [("size", "<u4")] if sized else []
    tail = [("digest", f"V{DIGEST_LEN}")] if digest else []
    return np.dtype([("klen", "<u2"), ("key", f"V{klen}"), *size, *tail])


def encode_alloc(keys: Sequence[bytes], sizes: Sequence[int], digests: Sequence[bytes]) -> bytes:
    """ALLOC's (and PUT's) payload: each key followed by its value's size and digest.
    An engine's batch (keys of one length) is laid out in a few C-level passes
    (:class:`BatchEncoder`), anything else per key."""
    return BatchEncoder(keys, digests, sizes).alloc(0, len(keys))


def _encode_alloc_per_key(
    keys: Sequence[bytes], sizes: Sequence[int], digests: Sequence[bytes]
) -> bytes:
    """:func:`encode_alloc` one key at a time, naming a bad key or digest."""
    parts = [U32.pack(len(keys))]
    pack_len, pack_item = U16.pack, ALLOC_ITEM.pack
    for k, size, d in zip(keys, sizes, digests, strict=True):
        n = len(k)
        if type(k) is not bytes or not 0 < n <= MAX_KEY_LEN:
            check_key(k)
        if type(d) is not bytes or len(d) != DIGEST_LEN:
            d = check_digest(d)  # raises unless a bytearray of the right length
        parts.append(pack_len(n))
        parts.append(k)
        parts.append(pack_item(size, d))
    return b"".join(parts)


class BatchEncoder:
    """Request payloads for sub-batches ``[start, end)`` of one client call's
    keys: what :func:`encode_alloc`, :func:`encode_get` and
    :func:`encode_keys` return for ``keys[start:end]`` (and the same slices
    of ``digests`` and ``sizes``), byte for byte.

    Why: a call is sent as several sub-batches, and each per-request encoder
    would check its keys and digests again and join them again, on the
    client's CPU, which is what a small put waits for on a busy host. Here
    the checks run once per call (measured: bench/README.md, "Measurements
    moved from code comments (issue 58)").

    Invariants: the records are laid out (once, for the whole call, per kind
    on first use) only when every key is ``bytes`` of one length in
    ``1..MAX_KEY_LEN``, every digest ``DIGEST_LEN`` bytes and every size an
    int that fits its field (an engine's batches); :attr:`uniform` says so,
    and a client's argument checks rely on it rather than make the same
    passes again. Otherwise each payload comes from the per-key encoder,
    which also names a bad item. The caller must not change ``keys``,
    ``digests`` or ``sizes`` meanwhile.
    :func:`encode_alloc` and :func:`encode_get` are this for one whole batch.
    :meth:`part` is this for a contiguous run of the keys, laid out with the
    whole (a batch split across connections is checked and joined once).
    """

    __slots__ = (
        "_base",
        "_digest_blob",
        "_digests",
        "_distinct_sizes",
        "_end",
        "_key_blob",
        "_key_len",
        "_keys",
        "_sizes",
        "_tables",
    )

    def __init__(
        self,
        keys: Sequence[bytes],
        digests: Sequence[bytes] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        self._keys = keys
        self._digests = digests
        self._sizes = sizes
        self._tables: dict[str, npt.NDArray[np.void]] = {}
        self._key_len: int | None = None
        self._key_blob = self._digest_blob = b""
        self._distinct_sizes: set[int] = set()
        self._base, self._end = 0, len(keys)
        """This encoder's keys are ``_keys[_base:_end]`` (a :meth:`part`'s, a run of them)."""
        self._lay_out()

    def part(self, start: int, end: int) -> BatchEncoder:
        """The encoder of keys ``[start, end)`` of this one: its payloads are
        this one's for the same keys, byte for byte, from the same laid-out
        records (a part shares them, and lays out a kind not yet used for
        the whole batch; two parts on two threads may then both lay it out,
        to the same bytes, and one keeps its table)."""
        n = self._end - self._base
        if not 0 <= start <= end <= n:
            raise ProtocolError(f"part [{start}, {end}) of an encoder of {n} keys")
        part = copy.copy(self)  # shallow: the keys, blobs and tables dict are shared
        part._base, part._end = self._base + start, self._base + end
        return part

    def _lay_out(self) -> None:
        """Set ``_key_len`` (and the joined keys and digests) when the fast path holds."""
        keys, digests, sizes = self._keys, self._digests, self._sizes
        n = len(keys)
        if digests is not None:
            joined = _join_uniform(digests, DIGEST_LEN, DIGEST_LEN)
            if joined is None or len(digests) != n:
                return
            self._digest_blob = joined[1]
        if sizes is not None:
            distinct = _distinct_sizes(sizes, n)
            if distinct is None:
                return
            self._distinct_sizes = distinct
        joined = _join_uniform(keys, 1, MAX_KEY_LEN)
        if joined is None:
            return
        self._key_len, self._key_blob = joined

    @property
    def uniform(self) -> bool:
        """True when the fast path holds: the keys, the digests (if given) and
        the sizes (if given) are all valid, as the invariants above state."""
        return self._key_len is not None

    def _table(self, kind: str) -> npt.NDArray[np.void]:
        table = self._tables.get(kind)
        if table is None:
            assert self._key_len is not None
            sized, digest = kind == "alloc", kind != "keys"
            dtype = _keyed_items_dtype(self._key_len, sized, digest)
            table = np.empty(len(self._keys), dtype=dtype)
            table["klen"] = self._key_len
            table["key"] = np.frombuffer(self._key_blob, dtype=table.dtype["key"])
            if digest:
                table["digest"] = np.frombuffer(self._digest_blob, dtype=table.dtype["digest"])
            if sized:
                assert self._sizes is not None
                _fill_sizes(table, self._sizes, self._distinct_sizes)
            self._tables[kind] = table
        return table

    def _records(self, kind: str, start: int, end: int) -> bytes:
        return U32.pack(end - start) + self._table(kind)[start:end].tobytes()

    def alloc(self, start: int, end: int) -> bytes:
        """ALLOC's (and PUT's) payload: needs ``digests`` and ``sizes``."""
        start, end = start + self._base, end + self._base
        if self._key_len is not None and self._sizes is not None and self._digests is not None:
            return self._records("alloc", start, end)
        if self._digests is None or self._sizes is None:
            raise ProtocolError("an ALLOC payload needs the keys' digests and sizes")
        return _encode_alloc_per_key(self._keys[start:end], self._sizes[start:end],
                                     self._digests[start:end])

    def get(self, start: int, end: int) -> bytes:
        """GET's payload: needs ``digests``."""
        start, end = start + self._base, end + self._base
        if self._key_len is not None and self._digests is not None:
            return self._records("get", start, end)
        if self._digests is None:
            raise ProtocolError("a GET payload needs the keys' digests")
        return _encode_get_per_key(self._keys[start:end], self._digests[start:end])

    def keys(self, start: int, end: int) -> bytes:
        """The payload of COMMIT (up to its checksums), LOOKUP, DELETE, EXISTS."""
        start, end = start + self._base, end + self._base
        if self._key_len is not None:
            return self._records("keys", start, end)
        return encode_keys(self._keys[start:end])


def _join_uniform(items: Sequence[bytes], lo: int, hi: int) -> tuple[int, bytes] | None:
    """``(n, b"".join(items))`` when there are some items and every one is
    ``bytes`` of one length ``n``, ``lo <= n <= hi``; else None. One native
    pass for a list or tuple (rk_call.c's ``join_uniform``), else (another
    sequence) C-level passes of Python's."""
    if type(items) in (list, tuple):
        return _native_join_uniform(items, lo, hi)  # type: ignore[no-any-return]
    n = _uniform_len(items, lo, hi)
    return None if n is None else (n, b"".join(items))


def _distinct_sizes(sizes: Sequence[int], n: int) -> set[int] | None:
    """The distinct sizes of ``n`` (a batch has one, as a rule), when each is an
    int that fits ALLOC's u32 field; else None."""
    if n == 0 or len(sizes) != n:
        return None
    try:
        distinct = set(sizes)
    except TypeError:  # an unhashable size: the per-key path names it
        return None
    if set(map(type, distinct)) == {int} and min(distinct) >= 0 and max(distinct) <= 0xFFFFFFFF:
        return distinct
    return None


def _fill_sizes(items: npt.NDArray[np.void], sizes: Sequence[int], distinct: set[int]) -> None:
    # one size (full blocks): a scalar store, not a conversion of the list
    items["size"] = next(iter(distinct)) if len(distinct) == 1 else sizes


class _KeyedRequest:
    """A request's ``count`` items, each a u16 key length, the key and a
    fixed-size trailer, decoded as far as a node needs. ``key_len`` is the one
    length of every key when they share it (an engine's batches), else None.
    Then :attr:`records` are the items where they lie in the payload, which
    the native index reads without splitting them into objects; subclasses
    split them on first use (:meth:`_split_uniform`)."""

    __slots__ = ("_payload", "count", "key_len")

    def __init__(self, payload: bytes, count: int, key_len: int | None) -> None:
        self._payload = payload
        self.count = count
        self.key_len = key_len

    @property
    def records(self) -> memoryview:
        return memoryview(self._payload)[U32.size :]

    def _split_uniform(self, trailer: str, what: str) -> list[tuple[Any, ...]]:
        """The records as (key, *trailer fields) tuples (struct codes ``trailer``)."""
        return list(self._iter_records(trailer, what))

    def _iter_records(self, trailer: str, what: str) -> Iterator[tuple[Any, ...]]:
        if self.key_len is None:  # the decoder splits these itself
            raise ProtocolError(f"{what} request of keys of several lengths, never split")
        return _iter_uniform(self._payload, self.key_len, trailer)


class AllocRequest(_KeyedRequest):
    """An ALLOC or PUT request's ``count`` (key, size, digest) items, decoded
    as far as a node needs: like :class:`GetRequest`, with ``key_len`` the one
    length of every key when they share it, and then :attr:`records` the items
    where they lie in the payload -- per item its u16 key length, the key,
    its u32 size, its digest -- which the native index reserves without
    splitting them into objects. :attr:`items`, the split list, is made on
    first use; a payload whose keys differ in length is split when decoded.
    :meth:`of_items` wraps items made elsewhere (no records then)."""

    __slots__ = ("_items",)

    def __init__(
        self, payload: bytes, count: int, key_len: int | None,
        items: list[tuple[bytes, int, bytes]] | None = None,
    ) -> None:
        super().__init__(payload, count, key_len)
        self._items = items

    @classmethod
    def of_items(cls, items: Sequence[tuple[bytes, int, bytes]]) -> AllocRequest:
        return cls(b"", len(items), None, list(items))

    @property
    def items(self) -> list[tuple[bytes, int, bytes]]:
        if self._items is None:
            self._items = self._split_uniform(ALLOC_ITEM_CODES, "ALLOC")
        return self._items

    def total_bytes(self) -> int:
        """The sum of the items' sizes (what a PUT's bulk must carry)."""
        if self._items is not None or self.key_len is None:
            return sum(map(_SECOND, self.items))
        items = np.frombuffer(self.records, dtype=_keyed_items_dtype(self.key_len, True))
        return int(items["size"].sum(dtype=np.uint64))


def decode_alloc_request(payload: Buffer, what: str = "ALLOC") -> AllocRequest:
    """An ALLOC (or PUT) request's payload, checked whole (bounds, key
    lengths, no trailing bytes); split into key objects only where the keys
    differ in length."""
    buf = bytes(payload)
    n = Reader(buf, what).count(MAX_KEYS_PER_REQUEST, U16.size + 1 + ALLOC_ITEM.size, "keys")
    klen = _uniform_key_len(buf, n, ALLOC_ITEM.size)
    if klen is not None:
        return AllocRequest(buf, n, klen)
    unpack = ALLOC_ITEM.unpack_from
    out = []
    for k, pos in _scan_keys(buf, n, ALLOC_ITEM.size, what):
        size, digest = unpack(buf, pos)
        out.append((k, size, digest))
    return AllocRequest(buf, n, None, out)


def decode_alloc(payload: Buffer, what: str = "ALLOC") -> list[tuple[bytes, int, bytes]]:
    """(key, size, digest) items of an ALLOC (or PUT) request."""
    return decode_alloc_request(payload, what).items


def encode_get(keys: Sequence[bytes], digests: Sequence[bytes]) -> bytes:
    """GET's payload: each key followed by the digest it must be stored with
    (laid out as :func:`encode_alloc` lays its items out)."""
    return BatchEncoder(keys, digests).get(0, len(keys))


def _encode_get_per_key(keys: Sequence[bytes], digests: Sequence[bytes]) -> bytes:
    """:func:`encode_get` one key at a time, naming a bad key or digest."""
    parts = [U32.pack(len(keys))]
    pack_len = U16.pack
    for k, d in zip(keys, digests, strict=True):
        n = len(k)
        if type(k) is not bytes or not 0 < n <= MAX_KEY_LEN:
            check_key(k)
        if type(d) is not bytes or len(d) != DIGEST_LEN:
            check_digest(d)  # raises unless a bytearray of the right length
        parts.append(pack_len(n))
        parts.append(k)
        parts.append(d)
    return b"".join(parts)


class GetRequest(_KeyedRequest):
    """A GET request's ``count`` (key, digest) items, decoded as far as a node needs.

    ``key_len`` is the one length of every key when they share it (an
    engine's batches), else None. Then :attr:`records` are the items where
    they lie in the payload -- per item its u16 key length, the key, the
    digest -- which the native index looks keys up in without splitting them
    into objects; :attr:`keys` and :attr:`digests`, the split lists, are made
    on first use. A payload whose keys differ in length is split (and
    checked) when decoded.
    """

    __slots__ = ("_split",)

    def __init__(
        self, payload: bytes, count: int, key_len: int | None,
        split: tuple[list[bytes], list[bytes]] | None = None,
    ) -> None:
        super().__init__(payload, count, key_len)
        self._split = split

    def _pairs(self) -> tuple[list[bytes], list[bytes]]:
        if self._split is None:
            pairs = self._split_uniform(f"{DIGEST_LEN}s", "GET")
            self._split = list(map(_FIRST, pairs)), list(map(_SECOND, pairs))
        return self._split

    @property
    def keys(self) -> list[bytes]:
        return self._pairs()[0]

    @property
    def digests(self) -> list[bytes]:
        return self._pairs()[1]


def decode_get_request(payload: Buffer) -> GetRequest:
    """A GET request's payload, checked whole (bounds, key lengths, no
    trailing bytes); split into key objects only where the keys differ in length."""
    buf = bytes(payload)
    n = Reader(buf, "GET").count(MAX_KEYS_PER_REQUEST, U16.size + 1 + DIGEST_LEN, "keys")
    klen = _uniform_key_len(buf, n, DIGEST_LEN)
    if klen is not None:
        return GetRequest(buf, n, klen)
    keys, digests = [], []
    for k, pos in _scan_keys(buf, n, DIGEST_LEN, "GET"):
        keys.append(k)
        digests.append(buf[pos : pos + DIGEST_LEN])
    return GetRequest(buf, n, None, (keys, digests))


class KeysRequest(_KeyedRequest):
    """A request of ``count`` keys and nothing else (EXISTS, DELETE, ...),
    decoded as far as a node needs: like :class:`GetRequest`, with ``key_len``
    the one length of every key when they share it, and then :attr:`records`
    the items where they lie in the payload -- per item its u16 key length and
    the key -- which the native index looks up without splitting them into
    objects. :attr:`keys`, the split list, is made on first use; a payload
    whose keys differ in length is split when decoded."""

    __slots__ = ("_keys",)

    def __init__(
        self, payload: bytes, count: int, key_len: int | None, keys: list[bytes] | None = None
    ) -> None:
        super().__init__(payload, count, key_len)
        self._keys = keys

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:  # straight from the records, no list of tuples between
            self._keys = list(map(_FIRST, self._iter_records("", "keys")))
        return self._keys

    def key_bytes(self) -> bytes:
        """Keys of one length back to back, cut out of the records (two numpy
        passes, no object per key): what the native index takes."""
        if self.key_len is None:
            raise ProtocolError("keys request of keys of several lengths, never joined")
        records = np.frombuffer(self.records, count=self.count,
                                dtype=_keyed_items_dtype(self.key_len, False, False))
        return records["key"].tobytes()


def decode_keys_request(payload: Buffer, what: str) -> KeysRequest:
    """A keys-only request's payload, checked whole (bounds, key lengths, no
    trailing bytes); split into key objects only where the keys differ in length."""
    buf = bytes(payload)
    if len(buf) >= U32.size:  # an engine's request, checked whole without a cursor first
        n = U32.unpack_from(buf)[0]
        klen = _uniform_key_len(buf, n, 0) if n <= MAX_KEYS_PER_REQUEST else None
        if klen is not None:
            return KeysRequest(buf, n, klen)
    # Not one key length (the check above saw this count): the cursor names
    # what is wrong, or the keys are split.
    n = Reader(buf, what).count(MAX_KEYS_PER_REQUEST, U16.size + 1, "keys")
    return KeysRequest(buf, n, None, [k for k, _ in _scan_keys(buf, n, 0, what)])


def decode_get(payload: Buffer) -> tuple[list[bytes], list[bytes]]:
    """(keys, digests) of a GET request."""
    request = decode_get_request(payload)
    return request.keys, request.digests


def encode_get_answer(lengths: Sequence[int], checksums: Sequence[int]) -> bytes:
    """A GET answer's payload: per key its value length (0 = miss), then per
    key the value's checksum (0 for a miss); the hits' bytes follow as bulk."""
    n = len(lengths)
    if len(checksums) != n:
        raise ProtocolError(f"GET answer of {n} lengths with {len(checksums)} checksums")
    return U32.pack(n) + struct.pack(f"<{n}I{n}Q", *lengths, *checksums)


def decode_get_answer(payload: Buffer, expected: int) -> tuple[list[int], list[int]]:
    """(lengths, checksums) of a GET answer for ``expected`` keys."""
    lengths, checksums = decode_get_answer_arrays(payload, expected)
    return lengths.tolist(), checksums.tolist()


def get_answer_entries(payload: Buffer, expected: int) -> bytes:
    """A GET answer's entries for ``expected`` keys, its framing checked: the
    ``expected`` little-endian u32 lengths, then as many u64 checksums (what
    the native core reads, ``rk_tcp_get_answer_layout``)."""
    return _per_key_entries(payload, "GET response", GET_ENTRY_BYTES, expected, "entries")


def decode_get_answer_arrays(
    payload: Buffer, expected: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64]]:
    """:func:`decode_get_answer` as two arrays over the answer's bytes: what a
    client reads a batch's hits with, without a Python int per key."""
    return get_answer_columns(get_answer_entries(payload, expected))


def check_get_answer_layout(
    lengths: npt.NDArray[np.uint32], bulk_len: int, block: int
) -> int:
    """The bytes a GET answer's hits name in all, once checked against its
    bulk: ProtocolError where a value is longer than the reader's
    ``block``-byte blocks (its bytes would overrun them) or the bulk is not
    exactly the hits' bytes."""
    if len(lengths) and int(lengths.max()) > block:
        raise ProtocolError(f"GET response names a value longer than the {block}-byte blocks")
    total = int(lengths.sum(dtype=np.uint64))
    if bulk_len != total:
        raise ProtocolError(f"GET response carries {bulk_len} bytes, its entries name {total}")
    return total


def get_answer_columns(
    entries: bytes,
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64]]:
    """The lengths and the checksums of :func:`get_answer_entries`, as arrays
    over its bytes."""
    n = len(entries) // GET_ENTRY_BYTES
    lengths = np.frombuffer(entries, dtype="<u4", count=n)
    return lengths, np.frombuffer(entries, dtype="<u8", count=n, offset=n * U32.size)


def encode_put_answer(statuses: Sequence[int]) -> bytes:
    """PUT's answer: per item its :class:`AllocStatus`."""
    return U32.pack(len(statuses)) + bytes(statuses)


def decode_put_answer(payload: Buffer, expected: int) -> list[AllocStatus]:
    raw = _per_key_entries(payload, "PUT response", 1, expected, "statuses")
    if raw and raw[0] in _ALLOC_STATUSES and raw.count(raw[:1]) == len(raw):
        return [_ALLOC_STATUSES[raw[0]]] * len(raw)  # one status for all: the rule
    try:
        return [_ALLOC_STATUSES[b] for b in raw]
    except KeyError as e:
        raise ProtocolError(f"PUT response: unknown status {e.args[0]}") from None


def encode_commit(keys: Sequence[bytes], checksums: Sequence[int]) -> bytes:
    """COMMIT's payload: the keys, then each value's checksum (same order)."""
    if len(checksums) != len(keys):
        raise ProtocolError(f"COMMIT of {len(keys)} keys with {len(checksums)} checksums")
    return encode_keys(keys) + struct.pack(f"<{len(keys)}Q", *checksums)


class CommitRequest(NamedTuple):
    """A COMMIT request, decoded as far as a node needs: its keys as a
    :class:`KeysRequest` (records where they lie, when of one length) and
    their checksums as little-endian ``uint64`` over the payload, in key order."""

    keys: KeysRequest
    checksums: npt.NDArray[np.uint64]


def decode_commit_request(payload: Buffer) -> CommitRequest:
    """A COMMIT payload, checked whole (the count before the split, the keys'
    bounds and lengths, no trailing bytes), without a Python object per key
    when the keys share one length."""
    buf = bytes(payload)
    n = Reader(buf, "COMMIT").count(MAX_KEYS_PER_REQUEST, U16.size + 1 + U64.size, "keys")
    split = len(buf) - n * U64.size
    keys = decode_keys_request(buf[:split], "COMMIT")
    return CommitRequest(keys, np.frombuffer(buf, dtype="<u8", count=n, offset=split))


def decode_commit(payload: Buffer) -> tuple[list[bytes], list[int]]:
    """(keys, checksums) of a COMMIT payload (see :func:`decode_commit_request`)."""
    request = decode_commit_request(payload)
    return request.keys.keys, request.checksums.tolist()


def encode_extents(results: Sequence[AllocResult]) -> bytes:
    parts = [U32.pack(len(results))]
    for st, ext in results:
        if ext is None:
            parts.append(EXTENT.pack(st, 0, 0, 0))
        else:
            parts.append(EXTENT.pack(st, ext.addr, ext.length, ext.rkey))
    return b"".join(parts)


def encode_extent_table(table: npt.NDArray[np.void]) -> bytes:
    """:func:`encode_extents` of an :data:`EXTENT_DTYPE` array (the same bytes)."""
    if table.dtype != EXTENT_DTYPE or table.ndim != 1:
        raise ProtocolError(f"an extent table is a 1-d array of EXTENT_DTYPE, got {table.dtype}")
    return U32.pack(len(table)) + table.tobytes()


_ALLOC_STATUSES = {int(v): v for v in AllocStatus}

_KNOWN_ALLOC_STATUS = np.zeros(256, dtype=bool)

_KNOWN_ALLOC_STATUS[sorted(_ALLOC_STATUSES)] = True
"""Per status byte: is it an :class:`AllocStatus` (one gather checks a whole answer)."""


def _per_key_entries(payload: Buffer, what: str, size: int, expected: int, name: str) -> bytes:
    """The body of a reply with one ``size``-byte entry per key asked: its
    count must be ``expected`` and nothing may follow the entries."""
    if (
        len(payload) == U32.size + expected * size
        and expected <= MAX_KEYS_PER_REQUEST
        and U32.unpack_from(payload)[0] == expected
    ):  # the well-formed answer, checked whole: no cursor on the hot path
        return bytes(memoryview(payload)[U32.size :])
    r = Reader(payload, what)
    n = r.count(MAX_KEYS_PER_REQUEST, size, name)
    if n != expected:
        raise ProtocolError(f"{what}: {n} entries for {expected} keys")
    raw = r.raw(n * size)
    r.done()
    return raw


def decode_extents(payload: Buffer, expected: int) -> list[AllocResult]:
    raw = _per_key_entries(payload, "ALLOC response", EXTENT.size, expected, "extents")
    out = []
    for st, addr, length, rkey in EXTENT.iter_unpack(raw):
        status = _ALLOC_STATUSES.get(st)
        if status is None:
            raise ProtocolError(f"ALLOC response: unknown status {st}")
        out.append(AllocResult(status, Extent(addr, length, rkey) if st == 0 else None))
    return out


def encode_flags(values: Sequence[bool]) -> bytes:
    return encode_flag_bytes(bytes(map(bool, values)))


def encode_flag_bytes(flags: bytes) -> bytes:
    """A flags answer of flags already one byte each (0 or 1)."""
    return U32.pack(len(flags)) + flags


def decode_flags(payload: Buffer, expected: int, what: str) -> list[bool]:
    return list(map(bool, _per_key_entries(payload, what, 1, expected, "flags")))


_NO_DIGEST = bytes(DIGEST_LEN)


def encode_lookup_results(results: Sequence[LookupResult | None]) -> bytes:
    parts = [U32.pack(len(results))]
    for res in results:
        if res is None:
            parts.append(LOOKUP_ENTRY.pack(0, 0, 0, 0, 0, _NO_DIGEST, 0))
        else:
            e = res.extent
            parts.append(
                LOOKUP_ENTRY.pack(
                    1, e.addr, e.length, e.rkey, res.lease_id, res.digest, res.checksum
                )
            )
    return b"".join(parts)


def decode_extent_table(payload: Buffer, expected: int) -> npt.NDArray[np.void]:
    """:func:`decode_extents` as one array of :data:`EXTENT_DTYPE` records (the
    extent fields are meaningful where ``status`` is OK): what a client builds
    an op table from without a Python object per key."""
    raw = _per_key_entries(payload, "ALLOC response", EXTENT.size, expected, "extents")
    table = np.frombuffer(raw, dtype=EXTENT_DTYPE)
    unknown = ~_KNOWN_ALLOC_STATUS[table["status"]]
    if unknown.any():
        raise ProtocolError(f"ALLOC response: unknown status {table['status'][unknown][0]}")
    return table


def decode_lookup_table(payload: Buffer, expected: int) -> npt.NDArray[np.void]:
    """:func:`decode_lookup_results` as one array of :data:`LOOKUP_ENTRY_DTYPE`
    records (a key was found where ``found`` is not 0)."""
    raw = _per_key_entries(payload, "LOOKUP response", LOOKUP_ENTRY.size, expected, "entries")
    return np.frombuffer(raw, dtype=LOOKUP_ENTRY_DTYPE)


def decode_lookup_results(payload: Buffer, expected: int) -> list[LookupResult | None]:
    raw = _per_key_entries(payload, "LOOKUP response", LOOKUP_ENTRY.size, expected, "entries")
    return [
        LookupResult(Extent(addr, length, rkey), lease, digest, checksum) if found else None
        for found, addr, length, rkey, lease, digest, checksum in LOOKUP_ENTRY.iter_unpack(raw)
    ]


def encode_u64_list(values: Sequence[int]) -> bytes:
    return U32.pack(len(values)) + struct.pack(f"<{len(values)}Q", *values)


def decode_u64_list(payload: Buffer, what: str) -> list[int]:
    r = Reader(payload, what)
    n = r.count(MAX_KEYS_PER_REQUEST, U64.size, "ids")
    out = list(struct.unpack(f"<{n}Q", r.raw(n * U64.size)))
    r.done()
    return out


def encode_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True).encode("utf-8")


def decode_json(payload: Buffer, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{what}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _configured_native_call() -> Any:
    """The native call module (:data:`rdmakv.native_core.CALL`), configured
    with the wire's numbers (:mod:`rdmakv.wire.format`)."""
    module = native_core.CALL
    module.configure(RESPONSE_BIT, MAX_KEY_LEN, MAX_BULK_BYTES)
    return module


NATIVE_CALL: Any = _configured_native_call()
"""native/rk_call.c's functions, configured once: this module's scans and
:class:`~rdmakv.wire.channel.Channel`'s one-call lookup and get use it."""

_native_join_uniform: Callable[..., Any] = NATIVE_CALL.join_uniform
