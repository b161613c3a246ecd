"""The rdmakv wire protocol: the ONE place the format is defined and versioned.

Every connection between a client and a KV node is a TCP stream of *frames*.
The first frame a client sends is ``HELLO``; the node answers with its
:class:`NodeInfo` or an error status and closes. After that the client sends
requests and the node answers each one, **in order** (so a client may pipeline
requests and match responses by position; ``req_id`` is echoed as a check).

Frame layout (all integers little-endian)::

    header  (HEADER.size = 24 bytes)
      u8   opcode       request opcode; responses set RESPONSE_BIT
      u8   flags        per-opcode flags (LOOKUP_FLAG_LEASE)
      u16  status       0 in requests; Status in responses
      u32  payload_len  bytes of payload that follow (<= MAX_PAYLOAD)
      u64  bulk_len     raw data bytes after the payload (<= MAX_BULK_BYTES);
                        only PUT requests and GET responses carry bulk
      u64  req_id       chosen by the client, echoed in the response
    payload (payload_len bytes, opcode-specific, encoded below)
    bulk    (bulk_len bytes: block data, never copied through Python bytes)

An error response has a non-zero status and a UTF-8 reason as its payload.
After an error the connection keeps serving, except for the errors marked
*fatal* (bad handshake, oversize header fields) where the stream can no longer
be trusted: the node answers, then closes.

Payload encodings (``keys`` = u32 count, then per key u16 len + bytes)::

    HELLO     req: 4s magic, u16 version, u16 token_len, token
              resp: NodeInfo (see NODE_INFO)
    ALLOC     req: u32 n, n x (u16 klen, key, u32 size, 16s digest)
              resp: u32 n, n x EXTENT (u8 status AllocStatus, u64 addr, u32 len, u32 rkey)
    COMMIT    req: keys, then n x u64 checksum (flags: COMMIT_FLAG_REQUIRE_WRITTEN)
              resp: u32 n, n x u8 (1 = committed)
    ABORT     req: keys           resp: u32 n, n x u8 (1 = freed)
    LOOKUP    req: keys (flags: LOOKUP_FLAG_LEASE)
              resp: u32 n, n x LOOKUP_ENTRY (u8 found, u64 addr, u32 len, u32 rkey,
                                             u64 lease_id, 16s digest, u64 checksum)
              (the hits of one leased LOOKUP share one lease id)
    RELEASE   req: u32 n, n x u64 lease_id   resp: u32 released
    DELETE    req: keys           resp: u32 n, n x u8 (1 = deleted)
    EXISTS    req: keys           resp: u32 n, n x u8 (1 = present and committed)
    STATS     req: empty          resp: UTF-8 JSON object
    REPORT    req: UTF-8 JSON object, a client's report about a namespace:
                   {"quarantined": LABEL, "reason": TEXT} or {"cleared": LABEL}
              resp: empty
              (optional, added without a version change: no existing frame
              changed; a node that predates it answers UNKNOWN_OPCODE, which is
              not fatal and which a client reads as "not recorded". STATS shows
              the reported namespaces as ``quarantined_namespaces``)
    GET       req: u32 n, n x (u16 klen, key, 16s digest)
              resp: u32 n, n x u32 len (0 = miss), n x u64 checksum;
                    bulk = the hits' values, in request order
              (a lookup and a read in one round trip, tcp: a key is a hit when it
              is committed with that digest; no lease, the node pins the blocks
              while it sends them)
    PUT       req: as ALLOC; bulk = the n values' bytes, in order (sum of the sizes)
              resp: u32 n, n x u8 AllocStatus
              (an ALLOC and its values in one request, tcp: the node receives each
              value it could allocate straight into its extent, marks it written,
              and drops the bytes of the others; COMMIT with the checksums follows
              as usual)
    16, 17    retired in protocol version 5, never to be reused: they were WRITE
              and READ, tcp's bulk writes and reads by pool address (a node of
              version 5 answers them UNKNOWN_OPCODE)
    RDMA_*    reserved for the RDMA transport's connection exchange (QPN, PSN, GID,
              LID, MTU, rkey); a node data path registers handlers for them.

``digest`` is the writer's digest of the block's *tokens* (what the value is
of: a reader expecting other tokens treats it as a miss); ``checksum`` is
:func:`value_checksum` of the value's *bytes*, computed by the writer from its
own source block and checked by every reader on the bytes it received, so a
value corrupted anywhere between the two (on the wire, in the pool, by another
client's stray RDMA write) is a miss, never wrong KV. The node stores both
opaquely. The checksum travels with COMMIT, after the bytes: the writer hashes
each block as it sends it (tcp) or while the NIC reads it (rdma), not in a
pass of its own before ALLOC.

The native core writes some of these frames in C, each file naming this one
as its source: the tcp transport's GET answer (native/rk_tcp.h), the node's
EXISTS answers (native/rk_serve.h) and the client's EXISTS / DELETE / GET
requests and their answers (native/rk_call.c). A change here is a change there.

Version history: 1 = first release; 2 = ``checksum`` in ALLOC and LOOKUP;
3 = ``checksum`` moved from ALLOC to COMMIT; 4 = GET and PUT; 4 still: REPORT
(an optional opcode; see above); 5 = WRITE and READ retired (opcodes 16, 17
reserved) and, with them, ``max_ops`` left the HELLO answer (NODE_INFO).

Versions must match: a node answers a HELLO of another version BAD_VERSION
(fatal), naming both versions and which end to upgrade, and a client refuses
a HELLO answer of another version the same way (:class:`VersionMismatch`).

Addresses are ABSOLUTE virtual addresses inside the node's pool
(``pool_base + offset``) so an RDMA transport can use them as-is; no request
names one: the one-sided data path confines each connection to the extents
handed to it (memory windows, :mod:`rdmakv.transport.rdma`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import socket
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate
from operator import itemgetter
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import xxhash

from rdmakv import native_core
from rdmakv.errors import (
    AuthError,
    ConfigError,
    ConnectionLost,
    ProtocolError,
    RdmakvError,
    RemoteError,
    TransportTimeout,
    UnknownOpcode,
    VersionMismatch,
)

Buffer = bytes | bytearray | memoryview
log = logging.getLogger("rdmakv.protocol")

# -- versioning ---------------------------------------------------------------
MAGIC = b"RDKV"
PROTOCOL_VERSION = 5

# -- limits: every count and length is checked against these BEFORE allocating --
MAX_PAYLOAD = 8 * 1024 * 1024
"""Largest control payload (key lists, stats JSON)."""
MAX_KEYS_PER_REQUEST = 16384
MAX_KEY_LEN = 512
DIGEST_LEN = 16
MAX_TOKEN_LEN = 4096
MAX_BULK_BYTES = 256 * 1024 * 1024
"""Bulk bytes in one PUT request or GET answer."""
MAX_ERROR_MESSAGE = 4096

# Linux IOV_MAX: the most buffers one sendmsg / recvmsg_into call accepts.
IOV_MAX = 1024
# recvmsg_into/sendmsg gather at most this many bytes of buffers per call: about
# what one call can move through a loopback socket buffer, small enough that
# building the iovec stays cheap.
IO_CHUNK_BYTES = 2 * 1024 * 1024
RECV_AHEAD_BYTES = 8192
"""Bytes a :class:`Channel` reads ahead: a control frame (header and payload)
then arrives in one system call instead of two. At most this much of a frame's
bulk is copied out of the read-ahead buffer; the rest lands in place."""

RESPONSE_BIT = 0x80
NATIVE_CALL_FRAME_BYTES = 64 * 1024
"""The largest request :meth:`Channel.call_flags` frames in C (larger ones are
framed in Python): 64 KiB holds ~1900 keys of 32 bytes."""
LOOKUP_FLAG_LEASE = 0x01
COMMIT_FLAG_REQUIRE_WRITTEN = 0x01
"""Commit only extents the node itself received in full through PUT (tcp).
A client may then send COMMIT right behind its PUT without waiting: a value
whose bytes did not all arrive is refused instead of exposing stale pool bytes."""


class Op(IntEnum):
    HELLO = 1
    ALLOC = 2
    COMMIT = 3
    ABORT = 4
    LOOKUP = 5
    RELEASE = 6
    DELETE = 7
    EXISTS = 8
    STATS = 9
    REPORT = 10
    # 16, 17: RETIRED_OPCODES
    # the tcp transport's puts and gets by key
    GET = 18
    PUT = 19
    # reserved for the RDMA transport: QP info exchange and teardown
    RDMA_CONNECT = 32
    RDMA_DISCONNECT = 33


RETIRED_OPCODES = (16, 17)
"""Opcodes of earlier protocol versions, never to be reused: 16 and 17 were
WRITE and READ (tcp's bulk writes and reads by pool address) until version 5.
A node answers them UNKNOWN_OPCODE, as any opcode it does not serve."""

BULK_REQUEST_OPCODES = frozenset({Op.PUT})
"""The only requests that carry bulk; a node refuses bulk on any other (and skips it)."""


class Status(IntEnum):
    OK = 0
    BAD_REQUEST = 1  # malformed payload; connection keeps serving
    BAD_VERSION = 2  # fatal
    AUTH_FAILED = 3  # fatal
    LIMIT_EXCEEDED = 4  # a count or length over a named limit
    BAD_ADDRESS = 5  # retired in protocol version 5 with WRITE/READ; never reuse it
    UNKNOWN_OPCODE = 6
    NOT_AUTHENTICATED = 7  # fatal: request before HELLO
    INTERNAL = 8
    UNSUPPORTED = 9  # e.g. a transport this node does not offer
    FRAME_TOO_LARGE = 10  # fatal: header announces more than the limits


FATAL_STATUSES = frozenset(
    {Status.BAD_VERSION, Status.AUTH_FAILED, Status.NOT_AUTHENTICATED, Status.FRAME_TOO_LARGE}
)
"""Error statuses after which the node closes the connection (it answers
first): the stream can no longer be trusted, or the client may not go on.
Any error answer to a HELLO closes it too, whatever its status: a session
starts only with a good handshake. A client reads these as ProtocolError or
AuthError (:func:`raise_for_status`), every other error status as a
RemoteError."""


class AllocStatus(IntEnum):
    OK = 0
    EXISTS = 1  # committed already (same key = same content by construction)
    BUSY = 2  # another writer holds it uncommitted
    NO_SPACE = 3  # pool full of leased / uncommitted extents
    TOO_LARGE = 4  # size is 0 or above the node's block size


HEADER = struct.Struct("<BBHIQQ")
U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
HELLO_FIXED = struct.Struct("<4sHH")
ALLOC_ITEM_CODES = "I16s"
ALLOC_ITEM = struct.Struct(f"<{ALLOC_ITEM_CODES}")  # after the key: size, digest
EXTENT = struct.Struct("<BQII")
LOOKUP_ENTRY = struct.Struct("<BQIIQ16sQ")
EXTENT_DTYPE = np.dtype([("status", "u1"), ("addr", "<u8"), ("length", "<u4"), ("rkey", "<u4")])
"""An ALLOC answer's :data:`EXTENT` entries as numpy reads them (same bytes)."""
LOOKUP_ENTRY_DTYPE = np.dtype([
    ("found", "u1"), ("addr", "<u8"), ("length", "<u4"), ("rkey", "<u4"), ("lease", "<u8"),
    ("digest", "V16"), ("checksum", "<u8"),
])
"""A LOOKUP answer's :data:`LOOKUP_ENTRY` entries as numpy reads them (same bytes)."""
GET_ENTRY_BYTES = U32.size + U64.size
"""Answer bytes per key of a GET: its length, then (after all lengths) its checksum."""
NODE_INFO = struct.Struct("<HIQQQ16sQIIQ")


class Header(NamedTuple):
    opcode: int
    flags: int
    status: int
    payload_len: int
    bulk_len: int
    req_id: int


class Extent(NamedTuple):
    """A range of the node's pool: absolute address, length, remote key (0 on tcp)."""

    addr: int
    length: int
    rkey: int


class AllocResult(NamedTuple):
    status: AllocStatus
    extent: Extent | None


class LookupResult(NamedTuple):
    extent: Extent
    lease_id: int
    digest: bytes
    checksum: int


def value_checksum(value: Buffer) -> int:
    """The ``checksum`` of a value: XXH3-64 of its bytes (~20 GB/s on one core)."""
    return xxhash.xxh3_64_intdigest(value)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class NodeInfo:
    """What the node tells a client in its HELLO response."""

    version: int
    rkey: int
    block_size: int
    pool_base: int
    pool_len: int
    node_id: bytes  # random per node start: a change means "node restarted"
    session_id: int
    max_payload: int
    max_keys: int
    max_bulk: int
    transports: tuple[str, ...]


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


# -- payload codecs --------------------------------------------------------------


class Reader:
    """Bounds-checked cursor over a payload; any overrun is a ProtocolError."""

    __slots__ = ("_buf", "_pos", "_what")

    def __init__(self, buf: Buffer, what: str) -> None:
        self._buf = memoryview(buf)
        self._pos = 0
        self._what = what

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError(
                f"{self._what}: payload truncated (need {n} bytes at offset {self._pos}, "
                f"payload is {len(self._buf)} bytes)"
            )
        out = self._buf[self._pos : end]
        self._pos = end
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        pos = self._pos
        if pos + st.size > len(self._buf):
            self._take(st.size)  # raises with the full story
        self._pos = pos + st.size
        return st.unpack_from(self._buf, pos)

    def u8(self) -> int:
        return int(self.unpack(U8)[0])

    def u16(self) -> int:
        return int(self.unpack(U16)[0])

    def u32(self) -> int:
        return int(self.unpack(U32)[0])

    def u64(self) -> int:
        return int(self.unpack(U64)[0])

    def raw(self, n: int) -> bytes:
        return bytes(self._take(n))

    def count(self, limit: int, item_size: int, name: str) -> int:
        """Read a u32 count, refusing it before anything is allocated for it."""
        n = self.u32()
        if n > limit:
            raise LimitExceeded(f"{self._what}: {n} {name} exceeds the limit of {limit}")
        if n * item_size > len(self._buf) - self._pos:
            raise ProtocolError(
                f"{self._what}: {n} {name} cannot fit in the "
                f"{len(self._buf) - self._pos} remaining payload bytes"
            )
        return n

    def key(self) -> bytes:
        (n,) = self.unpack(U16)
        if n == 0 or n > MAX_KEY_LEN:
            raise ProtocolError(f"{self._what}: key length {n} outside [1, {MAX_KEY_LEN}]")
        pos = self._pos
        end = pos + n
        if end > len(self._buf):
            self._take(n)
        self._pos = end
        return bytes(self._buf[pos:end])

    def done(self) -> None:
        if self._pos != len(self._buf):
            raise ProtocolError(
                f"{self._what}: {len(self._buf) - self._pos} unexpected trailing payload bytes"
            )


class LimitExceeded(ProtocolError):
    """A count or length in a frame is above a named protocol limit."""


# -- the one key check and the one digest check ---------------------------------------
# What a caller may hand over as a key or a digest is what the wire carries:
# the encoders, the clients, the L1 cache and the key chain all check with these.


def check_key(key: object, what: str = "key", *, length: int | None = None) -> bytes:
    """``key`` as ``bytes`` if the wire carries it: ``bytes`` or ``bytearray``
    of 1..:data:`MAX_KEY_LEN` bytes, and exactly ``length`` bytes where the
    caller's keys have one size (block keys); else :class:`ConfigError`
    naming ``what`` and what it got."""
    if isinstance(key, bytes | bytearray) and 1 <= len(key) <= MAX_KEY_LEN and (
        length is None or len(key) == length
    ):
        return bytes(key)
    size = f"1..{MAX_KEY_LEN}" if length is None else str(length)
    raise ConfigError(f"{what} must be {size} bytes, got {_shown(key)}")


def check_digest(digest: object, what: str = "digest") -> bytes:
    """``digest`` as ``bytes`` if it is :data:`DIGEST_LEN` bytes (``bytes`` or
    ``bytearray``); else :class:`ConfigError` naming ``what`` and what it got."""
    if isinstance(digest, bytes | bytearray) and len(digest) == DIGEST_LEN:
        return bytes(digest)
    raise ConfigError(f"{what} must be {DIGEST_LEN} bytes, got {_shown(digest)}")


def check_keys(keys: Sequence[bytes]) -> None:
    """:func:`check_key` of every key; the error names the first bad one's position."""
    # C-level passes first: batches hold thousands of keys, all valid as a rule
    if set(map(type, keys)) <= {bytes} and all(
        1 <= n <= MAX_KEY_LEN for n in set(map(len, keys))  # usually one length
    ):
        return
    for i, k in enumerate(keys):
        check_key(k, f"key #{i}")


def check_digests(digests: Sequence[bytes]) -> None:
    """:func:`check_digest` of every digest; the error names the first bad one's position."""
    if set(map(type, digests)) <= {bytes} and set(map(len, digests)) <= {DIGEST_LEN}:
        return
    for i, d in enumerate(digests):
        check_digest(d, f"digest #{i}")


def _shown(value: object) -> str:
    """What a bad key or digest was, for its error: a length, or a type and value."""
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    return f"{type(value).__name__} {value!r:.40}"


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


_FIRST, _SECOND = itemgetter(0), itemgetter(1)


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


def version_mismatch(node: int, client: int) -> str:
    """What either end says of a HELLO between ends of different protocol
    versions: both versions, and which end to upgrade."""
    older = "client" if client < node else "node"
    return (
        f"node speaks protocol version {node}, client protocol version {client}: "
        f"upgrade rdmakv on the {older} (both ends must speak the same version)"
    )


def encode_hello(token: bytes | None, version: int = PROTOCOL_VERSION) -> bytes:
    tok = token or b""
    if len(tok) > MAX_TOKEN_LEN:
        raise ProtocolError(f"token is {len(tok)} bytes, limit {MAX_TOKEN_LEN}")
    return HELLO_FIXED.pack(MAGIC, version, len(tok)) + tok


def decode_hello(payload: Buffer) -> tuple[int, bytes]:
    """Return (version, token); a wrong magic is a ProtocolError."""
    r = Reader(payload, "HELLO")
    magic, version, tlen = r.unpack(HELLO_FIXED)
    if magic != MAGIC:
        raise ProtocolError(
            f"HELLO: bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an rdmakv client"
        )
    if tlen > MAX_TOKEN_LEN:
        raise LimitExceeded(f"HELLO: token length {tlen} exceeds {MAX_TOKEN_LEN}")
    token = r.raw(tlen)
    r.done()
    return int(version), token


def encode_node_info(info: NodeInfo) -> bytes:
    names = ",".join(info.transports).encode("ascii")
    return (
        NODE_INFO.pack(
            info.version,
            info.rkey,
            info.block_size,
            info.pool_base,
            info.pool_len,
            info.node_id,
            info.session_id,
            info.max_payload,
            info.max_keys,
            info.max_bulk,
        )
        + U16.pack(len(names))
        + names
    )


def decode_node_info(payload: Buffer) -> NodeInfo:
    r = Reader(payload, "HELLO response")
    (ver, rkey, bsize, base, plen, node_id, sid, mpay, mkeys, mbulk) = r.unpack(NODE_INFO)
    n = r.u16()
    names = r.raw(n).decode("ascii", errors="replace")
    r.done()
    return NodeInfo(
        version=ver,
        rkey=rkey,
        block_size=bsize,
        pool_base=base,
        pool_len=plen,
        node_id=bytes(node_id),
        session_id=sid,
        max_payload=mpay,
        max_keys=mkeys,
        max_bulk=mbulk,
        transports=tuple(t for t in names.split(",") if t),
    )


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


# -- status -> exception -------------------------------------------------------


def raise_for_status(hdr: Header, payload: Buffer, what: str) -> None:
    """Turn an error response into the matching exception."""
    if hdr.status == Status.OK:
        return
    msg = bytes(payload[:MAX_ERROR_MESSAGE]).decode("utf-8", errors="replace")
    try:
        name = Status(hdr.status).name
    except ValueError:
        name = f"status {hdr.status}"
    text = f"node refused {what}: {name}: {msg}"
    if hdr.status == Status.AUTH_FAILED:
        raise AuthError(text)
    if hdr.status == Status.BAD_VERSION:
        raise VersionMismatch(text)
    if hdr.status == Status.UNKNOWN_OPCODE:
        raise UnknownOpcode(text)
    if hdr.status in FATAL_STATUSES:
        raise ProtocolError(text)
    raise RemoteError(text)


# -- scatter-gather socket I/O ---------------------------------------------------


def _advance(bufs: list[memoryview], i: int, done: int) -> int:
    """Drop ``done`` transferred bytes from the front of ``bufs[i:]``; new ``i``."""
    while done:
        n = len(bufs[i])
        if done >= n:
            done -= n
            i += 1
        else:
            bufs[i] = bufs[i][done:]
            done = 0
    return i


SMALL_FRAME_BYTES = 8192
"""A frame without bulk whose payload is at most this size goes out as one
joined ``bytes`` in one ``os.write``: the copy costs less than a gather list's
Python through :func:`send_views` (measured: bench/README.md, "Measurements
moved from code comments (issue 58)")."""


def send_frame(
    sock: socket.socket, head: bytes, payload: Buffer, bulk: Sequence[Buffer] = ()
) -> None:
    """Send one frame: header, payload and bulk (see :data:`SMALL_FRAME_BYTES`)."""
    if bulk or len(payload) > SMALL_FRAME_BYTES:
        send_views(sock, [head, payload, *bulk])
        return
    data = b"".join((head, payload))
    try:
        sent = os.write(sock.fileno(), data)
    except BlockingIOError:  # a full socket buffer: wait for room under the timeout
        sent = 0
    if sent < len(data):
        send_views(sock, [memoryview(data)[sent:]])


def send_views(sock: socket.socket, views: Sequence[Buffer]) -> None:
    """Send every buffer in order with as few system calls as possible.

    Each call gathers at most IOV_MAX buffers / IO_CHUNK_BYTES: the window
    slides forward as bytes go out, so the work per call stays bounded however
    many small blocks a batch has. A socket with a timeout is non-blocking
    underneath, and Python polls it before every call; ``os.writev`` tries
    first without that poll, and only a full socket buffer waits (in
    ``sendmsg``, under the socket's timeout).
    """
    bufs = [memoryview(v).cast("B") for v in views if len(v)]
    n = len(bufs)
    fd = sock.fileno()
    i = end = window = 0
    while i < n:
        while end < n and end - i < IOV_MAX and window < IO_CHUNK_BYTES:
            window += len(bufs[end])
            end += 1
        try:
            sent = os.writev(fd, bufs[i:end])
        except BlockingIOError:
            sent = sock.sendmsg(bufs[i:end])
        window -= sent
        i = _advance(bufs, i, sent)


def _recv_some(sock: socket.socket, bufs: list[memoryview]) -> int:
    """One receive into ``bufs`` (at least one byte): first without Python's poll
    (see :func:`send_views`), waiting under the socket's timeout only when
    nothing has arrived."""
    try:
        got = os.readv(sock.fileno(), bufs)
    except BlockingIOError:
        got = sock.recvmsg_into(bufs)[0] if len(bufs) > 1 else sock.recv_into(bufs[0])
    if got == 0:
        raise ConnectionLost("peer closed the connection mid-frame")
    return got


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every writable buffer in order, straight from the socket (no copies)."""
    bufs = [v for v in views if len(v)]
    n = len(bufs)
    i = end = window = 0
    while i < n:
        while end < n and end - i < IOV_MAX and window < IO_CHUNK_BYTES:
            window += len(bufs[end])
            end += 1
        got = _recv_some(sock, bufs[i:end])
        window -= got
        i = _advance(bufs, i, got)


class Reply:
    """A request sent on a :class:`Channel` whose response has not been read yet.

    ``on_ok(header)`` runs when an OK response arrives, before anything after
    it is read: it must consume the response's bulk (GET puts it straight into
    slab blocks). An error response is stored in ``error`` and raised by
    :meth:`Channel.wait`; nobody waiting (``send_nowait``) means it is logged.
    """

    __slots__ = (
        "awaited",
        "done",
        "error",
        "header",
        "on_ok",
        "opcode",
        "payload",
        "req_id",
        "what",
    )

    def __init__(
        self, opcode: int, req_id: int, what: str, on_ok: Callable[[Header], None] | None
    ) -> None:
        self.opcode = opcode
        self.req_id = req_id
        self.what = what
        self.on_ok = on_ok
        self.awaited = True
        self.done = False
        self.error: RdmakvError | None = None
        self.header: Header | None = None
        self.payload = bytearray()


def _configured_native_call() -> Any:
    """The native call module (:data:`rdmakv.native_core.CALL`), configured
    with this module's numbers."""
    module = native_core.CALL
    module.configure(RESPONSE_BIT, MAX_KEY_LEN, MAX_BULK_BYTES)
    return module


_native_call = _configured_native_call()
_native_flags_call: Callable[..., Any] = _native_call.flags_call
_native_get_call: Callable[..., Any] = _native_call.get_call
_native_join_uniform: Callable[..., Any] = _native_call.join_uniform


class _HasHave(Protocol):
    @property
    def have(self) -> int: ...


_Filled = TypeVar("_Filled", bound=_HasHave)
"""What a :meth:`Channel.fill_ahead` filler returns: a result that says how
many unread bytes it left in the buffer."""


class Channel:
    """One framed connection (used by both the client and the node).

    Client side, requests are *pipelined*: :meth:`submit` sends a request and
    queues a :class:`Reply`; :meth:`wait` reads responses in order (the node
    answers in order) until the awaited one is complete. ``call`` is submit +
    wait, and on an idle channel (nothing queued or read ahead) one request
    and its answer with the same checks and nothing queued. Not thread-safe:
    its owner serialises use.

    ``bulk_pending`` counts the bulk bytes of the last received header not yet
    consumed, so a handler that fails early can :meth:`skip_bulk` and keep the
    stream in sync.

    Receiving reads ahead up to :data:`RECV_AHEAD_BYTES`, so the bytes after
    a header may already sit in the channel, not in the socket: whoever reads
    the stream past a header goes through the channel (:meth:`recv_payload`,
    :meth:`recv_bulk`, :meth:`take_buffered`), and whoever waits for the
    socket to become readable first checks :attr:`buffered`.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._ahead = bytearray(RECV_AHEAD_BYTES)
        self._ahead_view = memoryview(self._ahead)
        self._pos = 0
        """Next unread byte of ``_ahead``; ``_end`` is one past the last."""
        self._end = 0
        self.bulk_pending = 0
        self._next_id = 1
        self._queue: deque[Reply] = deque()
        self._frame: bytearray | None = None
        """A request framed by :meth:`call_flags` (allocated on its first use)."""
        self._held = bytearray()
        """Frames :meth:`send` was asked to hold back (``hold``): they go out
        ahead of the next frame sent, in the same system call, or at
        :meth:`flush`. Whoever holds one sends again before it waits for
        anything; whoever writes to the socket itself flushes first."""

    def set_timeout(self, timeout: float | None) -> None:
        """The socket's timeout for the waits that follow. ``settimeout`` is a
        system call (ioctl FIONBIO) even when nothing changes: skip it then."""
        if self.sock.gettimeout() != timeout:
            self.sock.settimeout(timeout)

    def next_req_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(
        self,
        opcode: int,
        payload: bytes = b"",
        *,
        flags: int = 0,
        status: int = 0,
        req_id: int = 0,
        bulk: Sequence[memoryview] = (),
        bulk_len: int = 0,
        hold: bool = False,
    ) -> None:
        hdr = HEADER.pack(opcode, flags, status, len(payload), bulk_len, req_id)
        if hold and not bulk:
            self._held += hdr
            self._held += payload
            return
        if self._held:  # in order, and in the same system call
            hdr = bytes(self._held + hdr)
            self._held.clear()
        send_frame(self.sock, hdr, payload, bulk)

    @property
    def held(self) -> int:
        """Bytes of frames held back by ``send(hold=True)``, not yet sent."""
        return len(self._held)

    def flush(self) -> None:
        """Send the frames held back, if any."""
        if self._held:
            data = bytes(self._held)
            self._held.clear()
            send_frame(self.sock, data, b"")

    def next_frame_here(self) -> Header | None:
        """The next frame's header when the frame is whole in the read-ahead
        buffer and carries no bulk, after at most one non-blocking read for
        more (nothing is consumed); else None. A socket with no timeout (a
        read on it would block) is left unread."""
        hdr = self._whole_frame()
        if hdr is None and self.sock.gettimeout() is not None:
            self._top_up()
            hdr = self._whole_frame()
        return hdr if hdr is not None and not hdr.bulk_len else None

    def _whole_frame(self) -> Header | None:
        """The next frame's header if its header and payload are buffered."""
        have = self._end - self._pos
        if have < HEADER.size:
            return None
        hdr = Header(*HEADER.unpack_from(self._ahead, self._pos))
        return hdr if hdr.payload_len <= have - HEADER.size else None

    def _compact(self) -> None:
        """Move the unread read-ahead bytes to the front of the buffer."""
        if self._pos:
            tail = self._end - self._pos
            self._ahead[:tail] = self._ahead_view[self._pos : self._end]
            self._pos, self._end = 0, tail

    def _top_up(self) -> None:
        """Whatever the socket has now, into the read-ahead buffer (no wait)."""
        self._compact()
        if self._end == len(self._ahead):
            return
        try:
            got = os.readv(self.sock.fileno(), [self._ahead_view[self._end :]])
        except OSError:  # nothing yet, or a failure the next read reports
            return
        self._end += got  # 0 at the end of the stream: the next read reports it

    @property
    def buffered(self) -> int:
        """Bytes already read from the socket and not yet consumed."""
        return self._end - self._pos

    def _read_ahead(self, need: int) -> None:
        """Read until at least ``need`` (<= RECV_AHEAD_BYTES) bytes are buffered."""
        if self._end - self._pos >= need:
            return
        self._compact()  # room for a whole frame start
        while self._end < need:
            self._end += _recv_some(self.sock, [self._ahead_view[self._end :]])

    def fill_ahead(self, fill: Callable[[bytearray, int], _Filled]) -> _Filled:
        """Let ``fill`` read into the read-ahead buffer and consume from it: it
        is called with the buffer, its unread bytes moved to the front, and
        their count, and returns a result whose ``have`` says how many unread
        bytes it left at the front (a node's native loop,
        :mod:`rdmakv.node.native_loop`). Returns that result."""
        self._compact()  # what is there if fill raises
        filled = fill(self._ahead, self._end)
        self._end = filled.have
        return filled

    def take_buffered(self, limit: int) -> memoryview:
        """Consume up to ``limit`` read-ahead bytes (a view valid until the next read)."""
        n = min(limit, self._end - self._pos)
        view = self._ahead_view[self._pos : self._pos + n]
        self._pos += n
        return view

    def _recv_into(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order: read-ahead bytes first, then straight from the socket."""
        rest = [v for v in views if len(v)]
        i = 0
        while i < len(rest) and self._pos < self._end:
            v = rest[i]
            chunk = self.take_buffered(len(v))
            v[: len(chunk)] = chunk
            if len(chunk) == len(v):
                i += 1
            else:
                rest[i] = v[len(chunk) :]
        if i < len(rest):
            recv_views(self.sock, rest[i:])

    def recv_header(self) -> Header:
        """Read one header and check its sizes against the limits."""
        self._read_ahead(HEADER.size)
        hdr = Header(*HEADER.unpack_from(self._ahead, self._pos))
        self._pos += HEADER.size
        if hdr.payload_len > MAX_PAYLOAD:
            raise FrameTooLarge(
                f"frame payload of {hdr.payload_len} bytes exceeds the limit of {MAX_PAYLOAD}"
            )
        if hdr.bulk_len > MAX_BULK_BYTES:
            raise FrameTooLarge(
                f"frame bulk of {hdr.bulk_len} bytes exceeds the limit of {MAX_BULK_BYTES}"
            )
        self.bulk_pending = hdr.bulk_len
        return hdr

    def recv_payload(self, hdr: Header) -> bytearray:
        n = hdr.payload_len
        if n <= RECV_AHEAD_BYTES:
            self._read_ahead(n)
            return bytearray(self.take_buffered(n))
        buf = bytearray(n)
        self._recv_into([memoryview(buf)])
        return buf

    def check_bulk(self, total: int) -> None:
        """ProtocolError unless the frame just received carries exactly ``total`` bulk bytes."""
        if total != self.bulk_pending:
            raise ProtocolError(
                f"bulk of {self.bulk_pending} bytes does not match the {total} bytes the ops name"
            )

    def recv_bulk(self, views: Sequence[memoryview]) -> None:
        self.check_bulk(sum(len(v) for v in views))
        self._recv_into(views)
        self.bulk_pending = 0

    def skip_bulk(self) -> None:
        """Drain unconsumed bulk bytes (bounded by MAX_BULK_BYTES) to stay in sync."""
        self.bulk_pending -= len(self.take_buffered(self.bulk_pending))
        scratch = memoryview(bytearray(min(self.bulk_pending, IO_CHUNK_BYTES) or 1))
        while self.bulk_pending:
            n = self.sock.recv_into(scratch, min(self.bulk_pending, len(scratch)))
            if n == 0:
                raise ConnectionLost("peer closed the connection mid-frame")
            self.bulk_pending -= n

    # -- client side: pipelined requests ---------------------------------------------
    def submit(
        self,
        opcode: int,
        payload: bytes = b"",
        what: str = "",
        *,
        flags: int = 0,
        bulk: Sequence[memoryview] = (),
        bulk_len: int = 0,
        on_ok: Callable[[Header], None] | None = None,
    ) -> Reply:
        """Send a request now; its response is read by a later :meth:`wait`."""
        reply, hdr = self.enqueue(opcode, len(payload), what, flags=flags, bulk_len=bulk_len,
                                  on_ok=on_ok)
        send_frame(self.sock, hdr, payload, bulk)
        return reply

    def enqueue(
        self,
        opcode: int,
        payload_len: int,
        what: str = "",
        *,
        flags: int = 0,
        bulk_len: int = 0,
        on_ok: Callable[[Header], None] | None = None,
    ) -> tuple[Reply, bytes]:
        """Queue a request's :class:`Reply` and return its header, for a caller
        that sends the header, payload and bulk itself, together with other
        frames in one system call. It must send them before it sends anything
        else on this channel or waits for any reply: the node answers in the
        order requests arrive, and replies are matched in the order queued."""
        reply = Reply(opcode, self.next_req_id(), what or f"opcode {opcode}", on_ok)
        self._queue.append(reply)
        return reply, HEADER.pack(opcode, flags, 0, payload_len, bulk_len, reply.req_id)

    def _read_response(self, opcode: int, req_id: int, what: str) -> tuple[Header, bytearray]:
        """The next response's header and payload, which must answer request
        ``req_id`` (``opcode``); an error response's bulk is skipped."""
        hdr = self.recv_header()
        payload = self.recv_payload(hdr)
        if hdr.opcode != opcode | RESPONSE_BIT or hdr.req_id != req_id:
            raise ProtocolError(
                f"{what}: response out of sync (opcode {hdr.opcode}, req_id "
                f"{hdr.req_id}; expected {opcode | RESPONSE_BIT}, {req_id})"
            )
        if hdr.status != Status.OK:
            self.skip_bulk()
        return hdr, payload

    def _check_consumed(self, what: str) -> None:
        if self.bulk_pending:
            raise ProtocolError(f"{what}: unexpected {self.bulk_pending} bulk bytes")

    def _read_next(self) -> None:
        reply = self._queue.popleft()
        hdr, payload = self._read_response(reply.opcode, reply.req_id, reply.what)
        reply.header, reply.payload = hdr, payload
        if hdr.status != Status.OK:
            try:
                raise_for_status(hdr, payload, reply.what)
            except RdmakvError as e:
                reply.error = e
        elif reply.on_ok is not None:
            reply.on_ok(hdr)
        self._check_consumed(reply.what)
        reply.done = True
        if reply.error is not None and not reply.awaited:
            log.debug("unawaited request failed: %s", reply.error)

    def wait(self, reply: Reply) -> tuple[Header, bytearray]:
        """Read responses in order until ``reply``'s is in; raise its error, if any."""
        while not reply.done:
            if not self._queue:
                raise ProtocolError(f"{reply.what}: waiting for a response never requested")
            self._read_next()
        if reply.error is not None:
            raise reply.error
        assert reply.header is not None
        return reply.header, reply.payload

    def call(
        self, opcode: int, payload: bytes, what: str, *, flags: int = 0
    ) -> tuple[Header, bytearray]:
        """One request/response round trip for a control op (no bulk)."""
        if not self._idle:  # earlier answers are read first, in order
            return self.wait(self.submit(opcode, payload, what, flags=flags))
        # An idle channel, as for a lookup a scheduler waits for: no Reply
        # queued, and a wait for the answer's first bytes at once (poll, then
        # one read), not through a read that fails first (BlockingIOError, a
        # cost of its own): nothing else is on its way, and the answer is
        # hardly ever in yet (bench/README.md, "Measurements moved from code
        # comments (issue 58)").
        what = what or f"opcode {opcode}"
        req_id = self.next_req_id()
        send_frame(self.sock, HEADER.pack(opcode, flags, 0, len(payload), 0, req_id), payload)
        self._pos = 0
        self._end = self._recv_waiting(self._ahead_view)
        return self._answer_to(opcode, req_id, what)

    @property
    def _idle(self) -> bool:
        """Nothing queued and nothing read ahead: the next bytes in are the
        answer to the next request sent."""
        return not self._queue and self._pos == self._end

    def _answer_to(self, opcode: int, req_id: int, what: str) -> tuple[Header, bytearray]:
        """The answer to request ``req_id`` on an idle channel, checked: an
        error status raises the node's error, and no bulk may follow."""
        hdr, answer = self._read_response(opcode, req_id, what)
        if hdr.status != Status.OK:
            raise_for_status(hdr, answer, what)
        self._check_consumed(what)
        return hdr, answer

    def call_flags(
        self, opcode: int, keys: Sequence[bytes], what: str, timeout: float | None
    ) -> list[bool] | None:
        """:meth:`call` of a keys request answered by one flag per key (EXISTS,
        DELETE), in one native call on an idle channel: the keys checked and
        framed, the request sent and its answer read, with the GIL released
        while it waits up to ``timeout`` per wait (native/rk_call.c). None,
        with nothing sent, where that call does not take it: the channel
        busy, keys that are not all ``bytes`` of one valid length, or a
        request over :data:`NATIVE_CALL_FRAME_BYTES`.
        An answer other than the plain one gets :meth:`call`'s checks."""
        call = _native_flags_call
        if not self._idle:
            return None
        if self._frame is None:
            self._frame = bytearray(NATIVE_CALL_FRAME_BYTES)
        req_id = self._next_id
        got = call(self.sock.fileno(), opcode, req_id, keys, self._frame, self._ahead,
                   -1 if timeout is None else max(1, round(timeout * 1000)))
        if got is None:
            return None
        self._next_id += 1
        if type(got) is list:
            self._pos = self._end = 0
            return got
        if got < 0:
            raise ConnectionLost("peer closed the connection mid-frame")
        self._pos, self._end = 0, got
        _, answer = self._answer_to(opcode, req_id, what or f"opcode {opcode}")
        return decode_flags(answer, len(keys), what)

    def call_get(
        self,
        payloads: Sequence[bytes],
        counts: Sequence[int],
        slots: npt.NDArray[np.uint64],
        base: int,
        block: int,
        hasher: int,
        ahead_limit: int,
        timeout: float | None,
    ) -> tuple[list[int | None], list[int], RemoteError | None] | None:
        """A get's GET requests (``payloads``, as :meth:`BatchEncoder.get` lays
        them out, ``counts[i]`` keys each) and their answers, in one native
        call on an idle channel (native/rk_call.c): requests go out under the
        tcp transport's flow control (at most ``ahead_limit`` bytes of them
        behind an unread answer), and each hit's value lands in its slab
        block (key j's at ``base + slots[j] * block``, ranges the caller has
        checked), hashed as it arrives with the ``rk_hasher`` at address
        ``hasher``, all with the GIL released.

        Returns per key its value length, None for a miss; the indices of
        the keys whose bytes failed their checksum (misses too); and the
        node's error for the first request it refused (its keys are misses),
        or None. None, with nothing sent, where the call does not take it:
        the channel busy, a request over
        :data:`NATIVE_CALL_FRAME_BYTES` or an answer's entries over the
        read-ahead buffer. An answer out of step or malformed is a
        :class:`ProtocolError` naming what is wrong; the rest of the stream
        is not read then, nor after a timeout or a signal handler that
        raised: the connection is the caller's to drop."""
        call = _native_get_call
        if not self._idle:
            return None
        if self._frame is None:
            self._frame = bytearray(NATIVE_CALL_FRAME_BYTES)
        first = self._next_id
        # array.array, not numpy: a tenth of the Python time for a 1-block get
        got = call(self.sock.fileno(), Op.GET, first, b"".join(payloads),
                   array("Q", accumulate(map(len, payloads))), array("I", counts), slots, base,
                   block, hasher, self._frame, self._ahead, ahead_limit,
                   -1 if timeout is None else max(1, round(timeout * 1000)))
        if got is None:
            return None
        self._next_id += len(payloads)
        if type(got) is int:
            raise ConnectionLost("peer closed the connection mid-frame")
        if len(got) == 3:
            self._pos = self._end = 0
            sizes, corrupt, refusal = got
            return sizes, corrupt, None if refusal is None else self._refusal(refusal)
        answered, have = got
        self._pos, self._end = 0, have
        hdr, answer = self._read_response(Op.GET, first + answered, "GET")
        if hdr.status != Status.OK:
            raise_for_status(hdr, answer, "GET")
        lengths, _ = get_answer_columns(get_answer_entries(answer, counts[answered]))
        check_get_answer_layout(lengths, hdr.bulk_len, block)
        raise ProtocolError("GET response not as asked")  # the checks above name every way

    @staticmethod
    def _refusal(frame: bytes) -> RemoteError:
        """The node's error in an error answer (header and payload)."""
        hdr = Header(*HEADER.unpack_from(frame))
        try:
            raise_for_status(hdr, frame[HEADER.size :], "GET")
        except RemoteError as e:
            return e
        raise ProtocolError(f"GET: status {hdr.status} names no error")

    def _recv_waiting(self, view: memoryview) -> int:
        """One receive into ``view`` that waits under the socket's timeout."""
        got = self.sock.recv_into(view)
        if got == 0:
            raise ConnectionLost("peer closed the connection mid-frame")
        return got

    def send_nowait(self, opcode: int, payload: bytes) -> None:
        """Send a request nobody waits for; its response is read (and a failure
        logged) on the way to a later awaited one. Only for requests whose
        failure changes nothing for the caller (RELEASE: leases also end on
        expiry or disconnect)."""
        self.submit(opcode, payload).awaited = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class FrameTooLarge(ProtocolError):
    """A header announced more payload or bulk than the protocol allows."""


def wrap_socket_errors(what: str, exc: BaseException) -> Exception:
    """Map a low-level socket failure to the rdmakv exception for it."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return TransportTimeout(f"{what}: timed out waiting for the node")
    if isinstance(exc, OSError):
        return ConnectionLost(f"{what}: connection to the node failed ({exc})")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))
