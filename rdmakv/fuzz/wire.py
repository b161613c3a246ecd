"""Raw frames for the fuzzer: requests as the strategies describe them, and a socket
that sends any bytes while reading whatever the node answers.

A :class:`Req` is one request frame *plus what it means* (the keys, items
or ids it carries, or why it is malformed), so the model can say what the node
must answer. Its bytes are built here with encoders that, unlike
:mod:`rdmakv.wire`'s, accept hostile values (keys of length 0 or 513,
counts that disagree with the items, header lengths that lie).

:class:`Conn` never blocks on one direction while the other is full: sending
and receiving interleave through ``select``, so pipelined requests whose
answers carry bulk cannot deadlock against the node. Every byte the node sends
is parsed as response frames; anything that is not one (a header announcing
more than the limits, a partial frame before a clean FIN, a request opcode)
is a :class:`FuzzFailure`.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rdmakv.errors import RdmakvError
from rdmakv.wire.format import (
    ALLOC_ITEM,
    HEADER,
    LOOKUP_ENTRY,
    MAX_BULK_BYTES,
    MAX_ERROR_MESSAGE,
    MAX_PAYLOAD,
    RESPONSE_BIT,
    U16,
    U32,
    Header,
    Status,
)

AllocItem = tuple[bytes, int, bytes, tuple[int, ...]]
"""(key, size, digest, the item's further fields: see ALLOC_EXTRA)."""
EXCHANGE_TIMEOUT_S = 20.0
"""How long one exchange may go without the node finishing its answers. Every
frame the fuzzer sends is complete (or followed by a half-close), so a node
that stays silent this long is hung, not waiting for input."""
RECV_CHUNK = 1 << 20


class FuzzFailure(RdmakvError):
    """The node misbehaved: died, hung, answered a malformed frame, or broke an invariant."""


@dataclass(repr=False)
class Req:
    """One request frame and its meaning.

    ``kind`` names the payload encoding (``keys``, ``commit``, ``alloc``,
    ``put`` (ALLOC's items; ``bulk``: their values), ``get``, ``ids``,
    ``stats``, ``hello``, ``raw``). ``expect`` is set
    when the frame is malformed on purpose and the status it must get is known
    without the model (``BAD_REQUEST``, ``LIMIT_EXCEEDED``, ``UNKNOWN_OPCODE``,
    ``FRAME_TOO_LARGE``...); None means the model decides. ``fatal``: the node
    must answer and close the connection. ``keys`` / ``items`` / ``ids``
    (and COMMIT's ``sums``, GET's ``digests``) are the decoded contents
    of a well-formed payload.
    """

    opcode: int
    payload: bytes = b""
    kind: str = "raw"
    flags: int = 0
    bulk: bytes = b""
    req_id: int = 0
    status_field: int = 0
    payload_len: int | None = None  # header value when it lies about the payload
    bulk_len: int | None = None  # header value when it lies about the bulk
    expect: Status | None = None
    fatal: bool = False
    keys: list[bytes] | None = None
    items: list[AllocItem] | None = None
    ids: list[int] | None = None
    sums: list[int] | None = None
    digests: list[bytes] | None = None  # GET: the digest asked for with each key
    note: str = ""
    send_payload: bool = True  # False: only the header goes out (an oversize announcement)

    def __repr__(self) -> str:
        return f"Req({self.describe()})"

    def header(self) -> bytes:
        plen = len(self.payload) if self.payload_len is None else self.payload_len
        blen = len(self.bulk) if self.bulk_len is None else self.bulk_len
        return HEADER.pack(self.opcode, self.flags, self.status_field, plen, blen, self.req_id)

    def to_bytes(self) -> bytes:
        if not self.send_payload:
            return self.header()
        return self.header() + self.payload + self.bulk

    def describe(self) -> str:
        """One line for a transcript: opcode, header fields, size, and the frame's
        first bytes in hex (enough to rebuild it with the same strategy)."""
        raw = self.to_bytes()
        head = raw[:96].hex()
        more = f"...(+{len(raw) - 96} bytes)" if len(raw) > 96 else ""
        what = f" [{self.note}]" if self.note else ""
        return (
            f"op={self.opcode} flags={self.flags} req_id={self.req_id} "
            f"len={len(raw)} expect={self.expect.name if self.expect else 'model'}"
            f"{' fatal' if self.fatal else ''}{what}: {head}{more}"
        )


@dataclass
class Resp:
    """One response frame as read off the socket."""

    header: Header
    payload: bytes
    bulk: bytes = b""

    @property
    def status(self) -> int:
        return self.header.status


@dataclass
class Exchange:
    """What one exchange brought back: the frames, and how the stream ended."""

    frames: list[Resp] = field(default_factory=list)
    eof: bool = False  # the node closed (FIN)
    reset: bool = False  # the node reset the connection (RST), possibly losing frames
    send_failed: bool = False  # the node closed before taking every byte we sent


def parse_frames(buf: bytearray, out: list[Resp]) -> None:
    """Move every complete response frame at the front of ``buf`` into ``out``."""
    while len(buf) >= HEADER.size:
        hdr = Header(*HEADER.unpack_from(buf))
        if not hdr.opcode & RESPONSE_BIT:
            raise FuzzFailure(f"node sent a frame without the response bit: {hdr}")
        if hdr.payload_len > MAX_PAYLOAD or hdr.bulk_len > MAX_BULK_BYTES:
            raise FuzzFailure(f"node sent a frame over the protocol limits: {hdr}")
        try:
            Status(hdr.status)
        except ValueError:
            raise FuzzFailure(f"node sent an unknown status {hdr.status}: {hdr}") from None
        if hdr.status != Status.OK:
            if hdr.bulk_len:
                raise FuzzFailure(f"error response carries {hdr.bulk_len} bulk bytes: {hdr}")
            if hdr.payload_len > MAX_ERROR_MESSAGE:
                raise FuzzFailure(f"error message of {hdr.payload_len} bytes: {hdr}")
        end = HEADER.size + hdr.payload_len + hdr.bulk_len
        if len(buf) < end:
            return
        payload = bytes(buf[HEADER.size : HEADER.size + hdr.payload_len])
        bulk = bytes(buf[HEADER.size + hdr.payload_len : end])
        del buf[:end]
        out.append(Resp(hdr, payload, bulk))


class Conn:
    """One fuzzer connection to the node (``cid`` is the model's name for it)."""

    def __init__(self, address: tuple[str, int], cid: int) -> None:
        self.cid = cid
        self.sock = socket.create_connection(address, timeout=EXCHANGE_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.authenticated = False
        self.closed = False  # we know the node ended this session (or we did)
        self._buf = bytearray()

    def exchange(self, data: bytes, want: int, *, half_close: bool = False) -> Exchange:
        """Send ``data``, then read until ``want`` frames arrived or the node closed.

        With ``half_close`` the write side is shut after ``data`` and everything
        is read until the node closes (``want`` is ignored).
        """
        ex = Exchange()
        view = memoryview(data)
        sent = 0
        shut = False
        deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
        sock = self.sock
        while True:
            parse_frames(self._buf, ex.frames)
            sending = sent < len(view) and not ex.send_failed
            if not sending and half_close and not shut and not ex.send_failed:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                shut = True
            if not sending and not half_close and len(ex.frames) >= want:
                return ex
            left = deadline - time.monotonic()
            if left <= 0:
                raise FuzzFailure(
                    f"node hung: {len(ex.frames)} of {want if not half_close else 'all'} "
                    f"answers after {EXCHANGE_TIMEOUT_S:.0f}s ({sent} of {len(view)} bytes "
                    "taken by the node)"
                )
            r, w, _ = select.select([sock], [sock] if sending else [], [], min(left, 1.0))
            if w:
                try:
                    sent += sock.send(view[sent : sent + RECV_CHUNK])
                except BlockingIOError:
                    pass
                except OSError:  # EPIPE / ECONNRESET: the node closed on us
                    ex.send_failed = True
            if r:
                try:
                    chunk = sock.recv(RECV_CHUNK)
                except BlockingIOError:
                    continue
                except OSError as e:
                    if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                        raise
                    ex.reset = True
                    self._end(ex)
                    return ex
                if not chunk:
                    ex.eof = True
                    self._end(ex)
                    return ex
                self._buf += chunk

    def exchange_quiet(self, data: bytes, quiet_s: float) -> Exchange:
        """Send ``data`` and collect answers until none came for ``quiet_s`` (replays:
        the number of answers is not known)."""
        ex = Exchange()
        self.sock.settimeout(EXCHANGE_TIMEOUT_S)
        try:
            self.sock.sendall(data)
        except OSError:
            ex.send_failed = True
        self.sock.setblocking(False)
        while True:
            r, _, _ = select.select([self.sock], [], [], quiet_s)
            if not r:
                parse_frames(self._buf, ex.frames)
                return ex
            try:
                chunk = self.sock.recv(RECV_CHUNK)
            except OSError:
                ex.reset = True
                self._end(ex)
                return ex
            if not chunk:
                ex.eof = True
                self._end(ex)
                return ex
            self._buf += chunk

    def _end(self, ex: Exchange) -> None:
        parse_frames(self._buf, ex.frames)
        if self._buf and not ex.reset:
            raise FuzzFailure(
                f"node closed after a partial frame ({len(self._buf)} bytes: "
                f"{bytes(self._buf[:48]).hex()})"
            )
        self._buf.clear()
        self.closed = True

    def close_and_wait(self) -> Exchange:
        """Half-close and read until the node closes: on return the node has
        ended the session (store reclaim runs before it closes the socket)."""
        if self.closed:
            self.close()
            return Exchange(eof=True)
        ex = self.exchange(b"", 0, half_close=True)
        self.close()
        return ex

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


# -- hostile payload encoders -----------------------------------------------------------


def _items(count: int | None, n: int, body: bytes) -> bytes:
    return U32.pack(n if count is None else count) + body


def raw_keys(keys: Sequence[bytes], count: int | None = None, *, repeat: int = 1) -> bytes:
    """``keys`` (repeated ``repeat`` times) as a key list, any lengths allowed;
    ``count`` overrides the u32 count."""
    body = b"".join(U16.pack(len(k) & 0xFFFF) + k for k in keys)
    return _items(count, len(keys) * repeat, body * repeat)


ALLOC_EXTRA = len(ALLOC_ITEM.unpack(bytes(ALLOC_ITEM.size))) - 2
"""Fields of an ALLOC item after size and digest (none since protocol v3, which
moved the value checksum to COMMIT): taken from rdmakv.wire, so the fuzzer
follows the format wherever it goes."""
LOOKUP_EXTRA = len(LOOKUP_ENTRY.unpack(bytes(LOOKUP_ENTRY.size))) - 6
"""Fields of a LOOKUP entry after found, addr, len, rkey, lease id and digest."""


def raw_alloc(items: Sequence[AllocItem], count: int | None = None, *, repeat: int = 1) -> bytes:
    body = b"".join(
        U16.pack(len(k) & 0xFFFF) + k + ALLOC_ITEM.pack(size & 0xFFFFFFFF, digest, *extra)
        for k, size, digest, extra in items
    )
    return _items(count, len(items) * repeat, body * repeat)


def raw_commit(
    keys: Sequence[bytes], sums: Sequence[int], count: int | None = None, *, repeat: int = 1
) -> bytes:
    """COMMIT's payload: ``keys`` as :func:`raw_keys` gives them, then one u64
    checksum per key (both repeated ``repeat`` times)."""
    tail = b"".join(struct.pack("<Q", c & 0xFFFFFFFFFFFFFFFF) for c in sums)
    return raw_keys(keys, count, repeat=repeat) + tail * repeat


def raw_get(
    keys: Sequence[bytes], digests: Sequence[bytes], count: int | None = None, *, repeat: int = 1
) -> bytes:
    """GET's payload: each key (any length, as :func:`raw_keys` writes it) followed
    by its digest, repeated ``repeat`` times; ``count`` overrides the u32 count."""
    body = b"".join(U16.pack(len(k) & 0xFFFF) + k + d for k, d in zip(keys, digests, strict=True))
    return _items(count, len(keys) * repeat, body * repeat)


def raw_ids(ids: Sequence[int], count: int | None = None, *, repeat: int = 1) -> bytes:
    body = b"".join(struct.pack("<Q", i & 0xFFFFFFFFFFFFFFFF) for i in ids)
    return _items(count, len(ids) * repeat, body * repeat)

