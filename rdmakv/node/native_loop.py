"""The node's native request loop (native/rk_serve.h): EXISTS answered in C.

An engine's scheduler waits for EXISTS before every step, so what the node
spends per request is latency the engine sees. In Python the node spent ~8 us
per 64-key EXISTS on framing, dispatch and checks, about as much as the whole
round trip of a plain socket loop. :class:`ExistsLoop` serves a session's
EXISTS requests in C with the GIL released (read, touch the keys under the
store lock, answer) and hands every other frame back to the session's Python
code, which serves it as before.

The C loop takes the store's lock, so the store's lock must be one C can
take: :class:`StoreLock`. A :class:`~rdmakv.node.store.KVStore` with the
native index uses one; ``RDMAKV_LOOP_NATIVE=0`` keeps every request in
Python (for comparison, and to test that path).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from rdmakv import native_core
from rdmakv.errors import RdmakvError
from rdmakv.node.native_index import NativeIndex
from rdmakv.protocol import HEADER, MAX_KEYS_PER_REQUEST, RESPONSE_BIT, U16, U32, Op

ENV_NATIVE_LOOP = "RDMAKV_LOOP_NATIVE"
"""Set to 0 to serve every request in Python even where the native loop is built."""

# the native index's module: the loop is built with it (native/build.py)
_ffi, _lib, NATIVE_ERROR = native_core.load("_native_index", "native index")

MAX_SERVED_PER_CALL = 4096
"""Answers one call sends at most before the session's Python marks it active
(and, with metrics on, records their durations)."""


class Outcome(IntEnum):
    """How a call of :meth:`ExistsLoop.serve` ended (``RK_SERVE_*``)."""

    IDLE = 0  # the caller's turn: nothing to answer for a while, or it answered for long
    OTHER = 1  # a frame the loop does not answer is in the read-ahead buffer
    CLOSED = 2  # the peer closed the connection
    ERRNO = 3  # a system call failed
    TIMEOUT = 4  # an answer could not be sent in time


class Served(NamedTuple):
    """One call's result: how it ended, the answers it sent, the bytes it left
    in the read-ahead buffer (a frame's start, the caller's now), and per
    answer its time in seconds when asked for (else empty)."""

    outcome: Outcome
    answered: int
    have: int
    durations_s: list[float]
    errno: int


def enabled() -> bool:
    """Whether a node may serve EXISTS natively: built and not turned off."""
    return _lib is not None and not native_core.switched_off(ENV_NATIVE_LOOP)


class StoreLock:
    """The store's lock as a C mutex, which the native loop takes too.

    Used as ``with lock:`` like ``threading.Lock`` (and, like it, not
    reentrant). Waiting for it releases the GIL (cffi does, around the call),
    and the C loop holds it without the GIL: so no thread waits for the GIL
    while holding it, and the two never deadlock. Freed when collected,
    after every :class:`ExistsLoop` that references it.
    """

    __slots__ = ("_mutex",)

    def __init__(self) -> None:
        if _lib is None:
            raise RdmakvError(NATIVE_ERROR or "the native index is not built")
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


class ExistsLoop:
    """One session's native EXISTS loop over its channel's read-ahead buffer.

    It keeps the index and the lock it was made with alive (C holds their
    pointers), and its answer and block scratch are sized for the most keys
    a request that fits a read-ahead buffer of ``ahead_bytes`` can hold (a
    larger request is left to Python). Used by the session's own thread
    only.
    """

    def __init__(self, index: NativeIndex, lock: StoreLock, ahead_bytes: int,
                 timed: bool) -> None:
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
        self._durations = _ffi.new("uint64_t[]", MAX_SERVED_PER_CALL) if timed else _ffi.NULL
        self._have = _ffi.new("size_t *")
        self._served = _ffi.new("size_t *")
        self._errno = _ffi.new("int *")

    def serve(self, fd: int, ahead: bytearray, have: int, wait_s: float,
              io_timeout_s: float) -> Served:
        """Answer EXISTS requests from ``fd`` until another frame, the end of
        the connection or the caller's turn (native/rk_serve.h). ``ahead``
        holds ``have`` unread bytes at its front, and on return what the
        result's ``have`` says."""
        self._have[0] = have
        code = _lib.rk_serve_exists(
            self._ctx, fd, _millis(wait_s), _millis(io_timeout_s), _ffi.from_buffer(ahead),
            len(ahead), self._have, self._durations, MAX_SERVED_PER_CALL, self._served,
            self._errno,
        )
        answered = int(self._served[0])
        durations = ([d * 1e-9 for d in _ffi.unpack(self._durations, answered)]
                     if self._durations != _ffi.NULL and answered else [])
        return Served(Outcome(code), answered, int(self._have[0]), durations, int(self._errno[0]))


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))
