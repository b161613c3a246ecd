"""The node's native request loop (native/rk_serve.h): EXISTS and GET answered in C.

An engine's scheduler waits for EXISTS before every step, so what the node
spends per request is latency the engine sees. In Python the node spent about
as much per 64-key EXISTS on framing, dispatch and checks as the whole round
trip of a plain socket loop, and more per GET around its two native calls (pin,
send): bench/README.md, "Measurements moved from code comments (issue 58)".
:class:`RequestLoop` serves a session's EXISTS and GET requests in C with the
GIL released (read, look up under the store lock, answer; a GET's hits pinned
while their values are sent straight from the pool) and hands every other
frame back to the session's Python code, which serves it as before.

The C loop takes the store's lock, so the store's lock must be one C can
take: :class:`StoreLock`, which every :class:`~rdmakv.node.store.KVStore`
uses. GET is answered here only where the node's data path sends a GET's
answer natively too (the tcp one: :attr:`NodeDataPath.native_get
<rdmakv.transport.base.NodeDataPath.native_get>`).
"""

from __future__ import annotations

from array import array
from enum import IntEnum
from typing import Any, NamedTuple

from rdmakv import native_core
from rdmakv.errors import RdmakvError
from rdmakv.node.native_index import NativeIndex
from rdmakv.wire.format import (
    DIGEST_LEN,
    GET_ENTRY_BYTES,
    HEADER,
    MAX_BULK_BYTES,
    MAX_KEYS_PER_REQUEST,
    RESPONSE_BIT,
    U16,
    U32,
    Op,
)

_ffi, _lib = native_core.ffi, native_core.lib

MAX_SERVED_PER_CALL = 4096
"""Answers one call sends at most before the session's Python marks it active
(and, with metrics on, records their durations)."""


class Outcome(IntEnum):
    """How a call of :meth:`RequestLoop.serve` ended (``RK_SERVE_*``)."""

    IDLE = 0  # the caller's turn: nothing to answer for a while, or it answered for long
    OTHER = 1  # a frame the loop does not answer is in the read-ahead buffer
    CLOSED = 2  # the peer closed the connection
    ERRNO = 3  # a system call failed
    TIMEOUT = 4  # an answer could not be sent in time


class GetTally(NamedTuple):
    """What one call's GETs left for the caller (``rk_serve_tally``): the
    answers it sent whole, and ``last``, the blocks whose pin was their last
    reference, which the store must give back to its pool."""

    sent: int
    last: list[int]


NO_GETS = GetTally(0, [])


class GetCounts:
    """A store's counts of the GETs its sessions' native loops answered
    (``rk_serve_counts``): updated by C under the store's lock, read under it."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts = _ffi.new("rk_serve_counts *")

    @property
    def native(self) -> Any:
        return self._counts

    def read(self) -> dict[str, int]:
        """gets (answers sent whole), lookups (keys), hits, bytes (of the hits' values)."""
        c = self._counts
        return {"gets": int(c.gets), "lookups": int(c.lookups), "hits": int(c.hits),
                "bytes": int(c.bytes)}


class Served(NamedTuple):
    """One call's result: how it ended, the answers it sent, the bytes it left
    in the read-ahead buffer (a frame's start, the caller's now), per answer
    its request's opcode and time in seconds when asked for (else empty),
    and what its GET answers did."""

    outcome: Outcome
    answered: int
    have: int
    timed: list[tuple[int, float]]
    errno: int
    gets: GetTally


class StoreLock:
    """The store's lock as a C mutex, which the native loop takes too.

    Used as ``with lock:`` like ``threading.Lock`` (and, like it, not
    reentrant). Waiting for it releases the GIL (cffi does, around the call),
    and the C loop holds it without the GIL: so no thread waits for the GIL
    while holding it, and the two never deadlock. Freed when collected,
    after every :class:`RequestLoop` that references it.
    """

    __slots__ = ("_mutex",)

    def __init__(self) -> None:
        mutex = _lib.rk_store_lock_new()
        if mutex == _ffi.NULL:
            raise MemoryError("could not create the store's lock")
        self._mutex = _ffi.gc(mutex, _lib.rk_store_lock_free)

    @property
    def mutex(self) -> Any:
        return self._mutex

    def __enter__(self) -> None:
        _lib.rk_store_lock_acquire(self._mutex)

    def __exit__(self, *exc: object) -> None:
        _lib.rk_store_lock_release(self._mutex)


class GetSource(NamedTuple):
    """What a loop answers GET from: the store's pool refcounts (``int32``,
    which the pins go in), where its blocks lie (block b at ``base + b *
    block_size``), and the store's counts of what it answers."""

    refs: array[int]
    base: int
    block_size: int
    counts: GetCounts


class RequestLoop:
    """One session's native EXISTS (and GET) loop over its channel's read-ahead buffer.

    It keeps the index, the lock and the GET source it was made with alive
    (C holds their pointers), and its answer and block scratch are sized for
    the most keys a request that fits a read-ahead buffer of
    ``ahead_bytes`` can hold (a larger request is left to Python). ``get``
    None: every GET is left to Python. A GET is answered here only when
    its keys' values fit one answer whatever they hold (``max_bulk``). Used
    by the session's own thread only.
    """

    def __init__(self, index: NativeIndex, lock: StoreLock, ahead_bytes: int, timed: bool,
                 get: GetSource | None = None, max_bulk: int = MAX_BULK_BYTES) -> None:
        self._index, self._lock = index, lock  # outlive every call's use of their pointers
        max_keys = (ahead_bytes - HEADER.size - U32.size) // (U16.size + 1)
        if max_keys < 1:
            raise ValueError(f"a read-ahead buffer of {ahead_bytes} bytes holds no EXISTS request")
        self._answer = _ffi.new("uint8_t[]", HEADER.size + U32.size + max_keys)
        self._blocks = _ffi.new("int64_t[]", max_keys)
        ctx = self._ctx = _ffi.new("rk_serve_ctx *")
        ctx.ix = index.native_handle
        ctx.lock = lock.mutex
        ctx.opcode = Op.EXISTS
        ctx.response_bit = RESPONSE_BIT
        ctx.max_keys_per_request = MAX_KEYS_PER_REQUEST
        ctx.answer = self._answer
        ctx.blocks = self._blocks
        ctx.max_keys = max_keys
        self._get: tuple[Any, ...] = ()
        self._sending = _ffi.new("int *")
        if get is not None:
            self._get_scratch(index, get, ahead_bytes, max_bulk)
        self._durations = _ffi.new("uint64_t[]", MAX_SERVED_PER_CALL) if timed else _ffi.NULL
        self._ops = _ffi.new("uint8_t[]", MAX_SERVED_PER_CALL) if timed else _ffi.NULL
        self._have = _ffi.new("size_t *")
        self._served = _ffi.new("size_t *")
        self._tally = _ffi.new("rk_serve_tally *")
        self._errno = _ffi.new("int *")

    def _get_scratch(self, index: NativeIndex, get: GetSource, ahead_bytes: int,
                     max_bulk: int) -> None:
        """The ctx's GET fields: the columns, refcounts and scratch it answers from."""
        native = (_lib.RK_SERVE_HEADER, _lib.RK_SERVE_DIGEST, _lib.RK_SERVE_GET_ENTRY)
        if native != (HEADER.size, DIGEST_LEN, GET_ENTRY_BYTES):  # a build out of step
            raise RdmakvError(
                f"native/rk_serve.h lays GET out with header, digest and entry sizes {native}, "
                f"rdmakv/wire/ with {(HEADER.size, DIGEST_LEN, GET_ENTRY_BYTES)}"
            )
        smallest = U16.size + 1 + DIGEST_LEN  # a GET item of a one-byte key
        max_keys = min((ahead_bytes - HEADER.size - U32.size) // smallest,
                       max_bulk // get.block_size)
        if max_keys < 1:
            return  # no GET is answered here
        lengths, sums = index.get_columns()
        refs = _ffi.from_buffer("int32_t[]", get.refs)
        answer = _ffi.new("uint8_t[]", HEADER.size + U32.size + GET_ENTRY_BYTES * max_keys)
        iov = _ffi.new("uint64_t[]", 2 * (max_keys + 1))
        hit_blocks = _ffi.new("uint32_t[]", max_keys)
        last = _ffi.new("uint32_t[]", max_keys)
        # C holds pointers into these
        self._get = (lengths, sums, refs, answer, iov, hit_blocks, last, get.counts)
        ctx = self._ctx
        ctx.get_opcode = Op.GET
        ctx.lengths, ctx.sums, ctx.refs = lengths, sums, refs
        ctx.base, ctx.block_size = get.base, get.block_size
        ctx.max_get_keys = max_keys
        ctx.get_answer, ctx.iov, ctx.hit_blocks, ctx.last = answer, iov, hit_blocks, last
        ctx.counts = get.counts.native
        ctx.sending = self._sending

    @property
    def sending(self) -> bool:
        """Whether a GET's answer is going out now (any thread may ask: a stale
        answer only delays a shed by one sweep)."""
        return bool(self._sending[0])

    def serve(self, fd: int, ahead: bytearray, have: int, wait_s: float,
              io_timeout_s: float) -> Served:
        """Answer EXISTS (and GET) requests from ``fd`` until another frame,
        the end of the connection or the caller's turn (native/rk_serve.h).
        ``ahead`` holds ``have`` unread bytes at its front, and on return what
        the result's ``have`` says. The caller settles the result's ``gets``
        whatever the outcome."""
        self._have[0] = have
        code = _lib.rk_serve_requests(
            self._ctx, fd, _millis(wait_s), _millis(io_timeout_s), _ffi.from_buffer(ahead),
            len(ahead), self._have, self._durations, self._ops, MAX_SERVED_PER_CALL,
            self._served, self._tally, self._errno,
        )
        answered = int(self._served[0])
        timed = (list(zip(_ffi.unpack(self._ops, answered),
                          (d * 1e-9 for d in _ffi.unpack(self._durations, answered)),
                          strict=True))
                 if self._durations != _ffi.NULL and answered else [])
        t = self._tally
        gets = NO_GETS if not (t.sent or t.last) else GetTally(
            int(t.sent), _ffi.unpack(self._ctx.last, int(t.last)) if t.last else [],
        )
        return Served(Outcome(code), answered, int(self._have[0]), timed, int(self._errno[0]),
                      gets)


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))
