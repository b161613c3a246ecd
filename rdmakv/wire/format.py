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

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np
import xxhash

from rdmakv.errors import (
    AuthError,
    ConfigError,
    ProtocolError,
    RemoteError,
    UnknownOpcode,
    VersionMismatch,
)

Buffer = bytes | bytearray | memoryview

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


class FrameTooLarge(ProtocolError):
    """A header announced more payload or bulk than the protocol allows."""
