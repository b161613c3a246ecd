"""Session: one client connection of a node, from HELLO to its close.

A session reads the connection's requests in order, answers each through its
node's handlers (or the native request loop), and closes by one rule
(:meth:`Session.fail`: any error before a good HELLO; afterwards only a
status in ``FATAL_STATUSES``). What it needs of its node is
:class:`SessionHost`; :class:`~rdmakv.node.server.KVNode` is that host.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from rdmakv.errors import (
    ConnectionLost,
    ProtocolError,
    RdmakvError,
    UnsupportedTransport,
)
from rdmakv.node.admission import Admission
from rdmakv.node.native_loop import Outcome, RequestLoop
from rdmakv.node.store import KVStore
from rdmakv.transport import NodeHandler
from rdmakv.transport.base import PinnedValues, ReceivingValues
from rdmakv.wire.batches import (
    AllocRequest,
    GetRequest,
)
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    BULK_REQUEST_OPCODES,
    FATAL_STATUSES,
    MAX_ERROR_MESSAGE,
    PROTOCOL_VERSION,
    RECV_AHEAD_BYTES,
    RESPONSE_BIT,
    FrameTooLarge,
    Header,
    LimitExceeded,
    NodeInfo,
    Op,
    Status,
    decode_hello,
    encode_node_info,
    version_mismatch,
)

log = logging.getLogger("rdmakv.node")

POLL_INTERVAL = 0.2
"""How often idle sessions and the accept loop look at the stop flag (seconds)."""

IO_TIMEOUT = 30.0
"""Once a frame has started, each read of the rest of it must return within this (seconds)."""

HELD_FOR = frozenset({Op.ALLOC, Op.COMMIT, Op.ABORT, Op.LOOKUP, Op.RELEASE, Op.DELETE, Op.STATS})
"""Next requests an answer that may wait is held back for (:meth:`Session.reply`):
the node's own handlers, which carry no bulk and answer through
:meth:`Session.reply`, whose send takes the held answer along. Not EXISTS or
GET, which the native loop may answer with sends of its own."""


class SessionHost(Protocol):
    """What a :class:`Session` uses of its node (:class:`~rdmakv.node.server.KVNode`).

    The host outlives its sessions: it stops them (``stopping``) before it
    closes the store, and each session tells it when it ended.
    """

    admission: Admission
    store: KVStore
    token: bytes | None
    handlers: dict[int, NodeHandler]
    native_get: bool
    request_timers: dict[int, Callable[[float], None]]

    @property
    def stopping(self) -> bool: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def refuse(self, reason: str) -> None: ...

    def info(self, session_id: int) -> NodeInfo: ...

    def session_ended(self, session: Session) -> None: ...


class Session:
    """One client connection; implements the NodeSession protocol for data paths.

    The admission fields (:class:`~rdmakv.node.admission.Tracked`) are written
    by the session's own thread and read by the accept loop under the node's
    lock; a stale read only delays a sweep by one interval.
    """

    def __init__(
        self, node: SessionHost, session_id: int, sock: socket.socket, source: str, port: int
    ) -> None:
        self.node = node
        self.session_id = session_id
        self.channel = Channel(sock)
        self.source = source
        self.peer = f"{source}:{port}"
        self.one_sided = False
        """True while an RDMA data path has a QP for this session (set by it)."""
        self.opened = self.last_active = time.monotonic()
        self.authenticated = False
        self._serving = False
        self._native: RequestLoop | None = None
        self.closing = False
        self.requests = 0
        self._poller = select.poll()
        """The session thread's own (a poll object is not shared across threads)."""
        self._poller.register(sock, select.POLLIN)

    @property
    def busy(self) -> bool:
        """Serving a request: in Python, or in the native loop sending a GET's
        answer (its other waits are for a request: idle)."""
        return self._serving or (self._native is not None and self._native.sending)

    def shed(self) -> None:
        """Close the connection from another thread: the session's blocked read returns."""
        with contextlib.suppress(OSError):
            self.channel.sock.shutdown(socket.SHUT_RDWR)

    def has_input(self) -> bool:
        if self.channel.buffered:
            return True
        # A zero-timeout poll from the accept loop reads nothing, so the session's
        # own reads are untouched (a recv with MSG_PEEK would first wait the
        # socket's timeout: Python polls before every call on such a socket).
        poller = select.poll()
        try:
            poller.register(self.channel.sock, select.POLLIN)
        except (OSError, ValueError):  # closed meanwhile: nothing to protect
            return False
        return bool(poller.poll(0))

    # -- NodeSession -------------------------------------------------------------
    def pin_values(self, request: GetRequest) -> PinnedValues:
        return self.node.store.pin_values(request)

    def alloc_received(self, request: AllocRequest) -> ReceivingValues:
        return self.node.store.alloc_received(self.session_id, request)

    def abort(self, keys: Sequence[bytes]) -> list[bool]:
        return self.node.store.abort(self.session_id, keys)

    def reply(
        self, req: Header, payload: bytes = b"", bulk: Sequence[memoryview] = (), *,
        may_wait: bool = False,
    ) -> None:
        self.channel.send(
            req.opcode | RESPONSE_BIT,
            payload,
            req_id=req.req_id,
            bulk=bulk,
            bulk_len=sum(map(len, bulk)) if bulk else 0,
            hold=may_wait and not bulk and self._next_answered_here(),
        )

    def _next_answered_here(self) -> bool:
        """Whether the next request is already whole in the read-ahead buffer
        and one this session answers in Python through :meth:`reply` (see
        :data:`HELD_FOR`): an answer that may wait is then held back and goes
        out with that one's. A put's PUT and COMMIT answers then leave in one
        system call, and the client, which reads them together, wakes once,
        which saves it CPU per put (measured: bench/README.md, "Measurements
        moved from code comments (issue 58)")."""
        hdr = self.channel.next_frame_here()
        return hdr is not None and hdr.opcode in HELD_FOR

    def reply_error(self, req: Header, status: Status, message: str) -> None:
        data = message.encode("utf-8", errors="replace")[:MAX_ERROR_MESSAGE]
        self.channel.send(req.opcode | RESPONSE_BIT, data, status=status, req_id=req.req_id)

    def fail(self, req: Header, status: Status, message: str) -> bool:
        """Answer ``req`` with an error; whether the connection keeps serving.

        The one rule for closing: never before a good HELLO (a session starts
        only with a good handshake), and not after a status of
        :data:`FATAL_STATUSES` (the stream can no longer be trusted)."""
        self.reply_error(req, status, message)
        return self.authenticated and status not in FATAL_STATUSES

    def _refused(self, req: Header, status: Status, message: str) -> bool:
        """:meth:`fail` for a request past the handshake, counted in the metrics."""
        self.node.count("protocol_errors")
        self.node.refuse(_REFUSAL_REASON.get(status, "bad_frame"))
        return self.fail(req, status, message)

    # -- loop -------------------------------------------------------------------------
    def _wait_readable(self, limit: float | None) -> bool:
        """Block until a frame starts, the node stops (False) or ``limit`` passes (False)."""
        if self.channel.buffered:  # a pipelined request already read ahead
            return True
        deadline = None if limit is None else time.monotonic() + limit
        while not self.node.stopping:
            if self._poller.poll(POLL_INTERVAL * 1000):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
        return False

    def run(self) -> None:
        sock = self.channel.sock
        try:
            sock.settimeout(IO_TIMEOUT)
            limits = self.node.admission.limits
            if not self._wait_readable(limits.handshake_timeout_s) or not self._handshake():
                return
            timers = self.node.request_timers
            native = self._native = self.node.store.request_loop(
                RECV_AHEAD_BYTES, timed=Op.EXISTS in timers or Op.GET in timers,
                get=self.node.native_get,
            )
            while True:
                # with an answer held, the next request is whole in the buffer:
                # its answer takes the held one along
                if not self.channel.held:
                    if not self._serve_natively(native):
                        return
                    if not self.channel.buffered:  # its turn came with nothing for us
                        if self.node.stopping:
                            return
                        continue
                self._serving = True
                if not self._serve_one():
                    return
                self._serving = False
                self.requests += 1
                self.last_active = time.monotonic()
        except (OSError, ConnectionLost) as e:
            log.debug("session %d (%s) ended: %s", self.session_id, self.peer, e)
        finally:
            self.node.session_ended(self)

    def _serve_natively(self, native: RequestLoop) -> bool:
        """Let the native loop answer EXISTS (and GET) requests until another
        frame comes (left in the channel's read-ahead buffer for
        :meth:`_serve_one`) or its turn ends; False when the connection has ended."""
        fd = self.channel.sock.fileno()
        served = self.channel.fill_ahead(
            lambda ahead, have: native.serve(fd, ahead, have, POLL_INTERVAL, IO_TIMEOUT)
        )
        self.node.store.settle_native_gets(served.gets)  # whatever the outcome
        if served.answered:
            self.requests += served.answered
            self.last_active = time.monotonic()
            if served.answered > served.gets.sent:  # the store counts the GETs itself
                self.node.count("exists_native", served.answered - served.gets.sent)
            timers = self.node.request_timers
            for opcode, seconds in served.timed:
                observe = timers.get(opcode)
                if observe is not None:
                    observe(seconds)
        if served.outcome == Outcome.CLOSED:
            log.debug("session %d (%s) ended: closed by the peer", self.session_id, self.peer)
            return False
        if served.outcome == Outcome.ERRNO:
            raise OSError(served.errno, os.strerror(served.errno))
        if served.outcome == Outcome.TIMEOUT:
            raise TimeoutError(f"no room to send an answer for {IO_TIMEOUT:.0f} s")
        return True

    def _handshake(self) -> bool:
        ch = self.channel
        try:
            hdr = ch.recv_header()
        except FrameTooLarge as e:
            self.node.refuse("bad_frame")
            return self.fail(Header(Op.HELLO, 0, 0, 0, 0, 0), Status.FRAME_TOO_LARGE, str(e))
        payload = ch.recv_payload(hdr)
        if hdr.opcode != Op.HELLO:
            self.node.refuse("bad_frame")
            return self.fail(hdr, Status.NOT_AUTHENTICATED, "the first frame must be HELLO")
        if hdr.bulk_len:  # HELLO carries none: the stream cannot be trusted
            self.node.refuse("bad_frame")
            return self.fail(hdr, Status.BAD_REQUEST, "HELLO carries no bulk data")
        try:
            version, token = decode_hello(payload)
        except ProtocolError as e:  # a HELLO over a limit too: it is no HELLO this node reads
            self.node.refuse("bad_frame")
            return self.fail(hdr, Status.BAD_REQUEST, str(e))
        if version != PROTOCOL_VERSION:
            self.node.refuse("bad_frame")
            return self.fail(hdr, Status.BAD_VERSION, version_mismatch(PROTOCOL_VERSION, version))
        expected = self.node.token
        if expected is not None and not hmac.compare_digest(expected, token):
            log.warning("session %d (%s): wrong or missing token", self.session_id, self.peer)
            self.node.refuse("bad_token")
            return self.fail(hdr, Status.AUTH_FAILED, "wrong or missing shared-secret token")
        # Authenticated before the answer leaves: once the client has it, it may
        # send a request at once, and admission must never mistake this session
        # for one still in its handshake (the oldest of those get shed).
        self.authenticated = True
        self.last_active = time.monotonic()
        self.reply(hdr, encode_node_info(self.node.info(self.session_id)))
        return True

    def _serve_one(self) -> bool:
        """Serve one request; False when the connection must close."""
        ch = self.channel
        try:
            hdr = ch.recv_header()
        except FrameTooLarge as e:  # no request to name, and its bulk cannot be skipped
            return self._refused(Header(0, 0, 0, 0, 0, 0), status_for(e), str(e))
        payload = ch.recv_payload(hdr)
        handler = self.node.handlers.get(hdr.opcode)
        if handler is None:
            ch.skip_bulk()
            return self._refused(hdr, Status.UNKNOWN_OPCODE, f"unknown opcode {hdr.opcode}")
        if hdr.bulk_len and hdr.opcode not in BULK_REQUEST_OPCODES:
            # Its bulk would otherwise be read as the next request.
            ch.skip_bulk()
            return self._refused(
                hdr, Status.BAD_REQUEST, f"opcode {hdr.opcode} carries no bulk data"
            )
        timers = self.node.request_timers  # empty when metrics are off: no clock read then
        started = time.perf_counter() if timers else 0.0
        try:
            handler(self, hdr, payload)
        except (OSError, ConnectionLost):
            raise
        except RdmakvError as e:
            ch.skip_bulk()
            return self._refused(hdr, status_for(e), str(e))
        except Exception as e:  # a bug must not take the node down with it
            log.exception("session %d: internal error in opcode %d", self.session_id, hdr.opcode)
            ch.skip_bulk()
            return self.fail(hdr, Status.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        else:
            observe = timers.get(hdr.opcode) if timers else None
            if observe is not None:
                observe(time.perf_counter() - started)
        return True


_REFUSAL_REASON = {
    Status.LIMIT_EXCEEDED: "over_limit",
}
"""Refusal reason (a metrics label) per error status; every other status is a bad frame."""

_STATUS_BY_ERROR: tuple[tuple[type[RdmakvError], Status], ...] = (
    (LimitExceeded, Status.LIMIT_EXCEEDED),
    (UnsupportedTransport, Status.UNSUPPORTED),
    (FrameTooLarge, Status.FRAME_TOO_LARGE),
)
"""The status a refused request is answered with, by its error's type (the
first that matches); whether the connection then closes is the status's
(:meth:`Session.fail`)."""


def status_for(e: RdmakvError) -> Status:
    """The status a request that raised ``e`` is answered with: by type
    (:data:`_STATUS_BY_ERROR`), else BAD_REQUEST."""
    for kind, status in _STATUS_BY_ERROR:
        if isinstance(e, kind):
            return status
    return Status.BAD_REQUEST
