"""A connection's framed I/O: :class:`Channel` over one socket.

A channel sends requests and reads answers in order (pipelining, answers
matched by position and ``req_id``), moves bulk with scatter-gather socket
calls straight between the socket and slab blocks, and runs a lookup or a
whole TCP get in one native call (native/rk_call.c) where it can. Socket
errors become rdmakv's (:func:`wrap_socket_errors`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from rdmakv.errors import (
    ConnectionLost,
    ProtocolError,
    RdmakvError,
    RemoteError,
    TransportTimeout,
)
from rdmakv.wire.batches import (
    NATIVE_CALL,
    check_get_answer_layout,
    decode_flags,
    get_answer_columns,
    get_answer_entries,
)
from rdmakv.wire.format import (
    HEADER,
    IO_CHUNK_BYTES,
    IOV_MAX,
    MAX_BULK_BYTES,
    MAX_PAYLOAD,
    NATIVE_CALL_FRAME_BYTES,
    RECV_AHEAD_BYTES,
    RESPONSE_BIT,
    Buffer,
    FrameTooLarge,
    Header,
    Op,
    Status,
    raise_for_status,
)

log = logging.getLogger("rdmakv.protocol")

_native_flags_call: Callable[..., Any] = NATIVE_CALL.flags_call
"""A lookup (EXISTS / DELETE) in one native call (:meth:`Channel.call_flags`)."""
_native_get_call: Callable[..., Any] = NATIVE_CALL.get_call
"""A whole TCP get in one native call (:meth:`Channel.call_get`)."""


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


def wrap_socket_errors(what: str, exc: BaseException) -> Exception:
    """Map a low-level socket failure to the rdmakv exception for it."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return TransportTimeout(f"{what}: timed out waiting for the node")
    if isinstance(exc, OSError):
        return ConnectionLost(f"{what}: connection to the node failed ({exc})")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))
