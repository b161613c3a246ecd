"""The native per-block TCP loop (native/rk_tcp.c in ``rdmakv._native``) and its settings.

One C call moves a whole request's bulk -- ``sendmsg`` / ``readv`` of up to
1024 blocks and 512 KiB per system call (``RK_TCP_WINDOW``: fewer, bigger calls
measured slower over loopback), resuming after short transfers, waiting with
``poll`` on EAGAIN -- with the GIL released, so the client's and the node's
Python threads keep running. The same loop hashes each block with XXH3 (the
protocol's value checksum) a system call's bytes at a time, so that the hash
and the kernel's copy read each block from memory once between them: the
writer's checksums for COMMIT and the reader's verification come from that
pass instead of one more read of every block. A receive hashes each call's
bytes right after the copy wrote them. A send moves 128 KiB or 512 KiB per
call and hashes each right before or right after it, as the process's plan
says (:data:`SEND_PLANS`: a default, or the configuration's ``tcp.send_plan``,
set once at start-up; which costs the sending thread least depends on the
CPU, rk_tcp.h says why). A receive that runs out of bytes mid-list polls for
the rest without sleeping for up to 100 us before it sleeps, while its process
has fewer receives in flight than CPUs: the sender then need not wake it for
every segment (:func:`set_recv_spin_us`, ``RDMAKV_TCP_RECV_SPIN_US``; rk_tcp.h
says why). The figures behind both: bench/README.md, section "Measurements
moved from code comments (issue 58)".

Waits keep the socket's timeout semantics (no progress for ``timeout`` seconds
raises ``TimeoutError``, mapped to ``TransportTimeout``; a peer that closes
mid-transfer raises ``ConnectionLost``). Both sides of the transport use it.
"""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rdmakv import native_core
from rdmakv.defaults import DEFAULT_TCP_SEND_PLAN
from rdmakv.errors import ConfigError, ConnectionLost
from rdmakv.transport.checksum import HASHER
from rdmakv.wire.channel import Channel

_ffi, _lib = native_core.ffi, native_core.lib

ENV_RECV_SPIN = native_core.ENV_RECV_SPIN
"""Microseconds a native receive polls for more bytes before it sleeps
(:func:`set_recv_spin_us`; 0 never spins), read when the native core loads."""

HASHER_ADDRESS = 0 if HASHER is None else int(_ffi.cast("uintptr_t", HASHER))
"""The address of :data:`~rdmakv.transport.checksum.HASHER`, which
:meth:`Channel.call_get` hashes with (0: none). The struct lives as long as
this process: the checksum module holds it."""

_RK_TCP_OK = 0

_RK_TCP_TIMEOUT = 1

_RK_TCP_CLOSED = 2

_RK_TCP_ERRNO = 3

_RK_TCP_EINTR = 4

RK_TCP_MISSED = 0  # per key of a GET answer (rk_tcp_get_answer_check; the Python path's too)

RK_TCP_CORRUPT = -1


def native_checksums() -> bool:
    """True when the native loop also computes each block's value checksum as
    it moves (see :func:`send_iov`): it has the xxhash C API's hasher
    (:data:`~rdmakv.transport.checksum.HASHER`); False: callers hash the slab
    themselves."""
    return HASHER is not None


class HashedSendPlan(NamedTuple):
    """How this process's hashed sends move a list (:data:`SEND_PLANS`)."""

    window: int
    """Bytes per ``sendmsg``."""
    ahead: bool
    """Each window is hashed right before its ``sendmsg`` (True) or right after (False)."""


SEND_PLANS: dict[str, HashedSendPlan] = {
    "512k-ahead": HashedSendPlan(512 << 10, True),
    "512k-after": HashedSendPlan(512 << 10, False),
    "128k-ahead": HashedSendPlan(128 << 10, True),
    "128k-after": HashedSendPlan(128 << 10, False),
}
"""The plans a send that hashes as it goes may follow, by the name the
configuration's ``tcp.send_plan`` gives them (:data:`rdmakv.config.TcpSendPlan`
lists the same names). Which costs the sending thread least depends on the CPU
(native/rk_tcp.h); ``rdmakv doctor --tune`` times them on a host."""


def hashed_send_plan() -> HashedSendPlan | None:
    """The plan this process's hashed sends follow (:func:`set_send_plan`);
    None where sends do not hash as they go (:func:`native_checksums`)."""
    if not native_checksums():
        return None
    window = _ffi.new("uint64_t *")
    ahead = _ffi.new("int *")
    _lib.rk_tcp_hashed_send_plan(window, ahead)
    return HashedSendPlan(int(window[0]), bool(ahead[0]))


def send_plan_name() -> str | None:
    """:func:`hashed_send_plan`'s name in :data:`SEND_PLANS`; None where sends
    do not hash as they go."""
    plan = hashed_send_plan()
    return next((name for name, p in SEND_PLANS.items() if p == plan), None)


def set_send_plan(name: str) -> None:
    """Make ``name`` (a key of :data:`SEND_PLANS`) the plan of every hashed send
    this process starts from now on: once, at start-up (the commands and the
    connectors apply the configuration's ``tcp.send_plan``)."""
    plan = SEND_PLANS.get(name)
    if plan is None:
        raise ConfigError(
            f"tcp.send_plan: {name!r} is not one of {', '.join(SEND_PLANS)}"
        )
    _lib.rk_tcp_set_hashed_send_plan(plan.window, int(plan.ahead))


set_send_plan(DEFAULT_TCP_SEND_PLAN)  # until the configuration's is applied


class RecvWaitCounts(NamedTuple):
    """How this process's native receive waits ended (:func:`recv_wait_counts`)."""

    spun: int
    """The bytes came while the receive spun."""
    slept: int
    """It slept in ``poll``, after spinning or without."""


def recv_spin_us() -> int:
    """Microseconds a native receive that runs out of bytes mid-list polls
    for more before it sleeps (rk_tcp.h)."""
    return int(_lib.rk_tcp_recv_spin_us())


def set_recv_spin_us(us: int) -> None:
    """Set :func:`recv_spin_us` for this process, every native receive's
    (the tcp loop's and the client's get call's): 0 to
    ``RK_TCP_RECV_SPIN_MAX_US`` (0: always sleep at once)."""
    most = int(_lib.RK_TCP_RECV_SPIN_MAX_US)
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= most:
        raise ConfigError(
            f"receive spin must be an integer of 0 to {most} microseconds, got {us!r}"
        )
    _lib.rk_tcp_set_recv_spin_us(us)


def recv_wait_counts() -> RecvWaitCounts:
    """This process's native receive waits so far."""
    spun, slept = _ffi.new("uint64_t *"), _ffi.new("uint64_t *")
    _lib.rk_tcp_recv_wait_counts(spun, slept)
    return RecvWaitCounts(int(spun[0]), int(slept[0]))


def receives_in_flight() -> int:
    """Native receives running in this process now."""
    return int(_lib.rk_tcp_receives_in_flight())


def _timeout_ms(sock: socket.socket) -> int:
    t = sock.gettimeout()
    return -1 if t is None else max(0, int(t * 1000 + 0.999))


def _native_io(
    sock: socket.socket,
    iov: np.ndarray,
    sending: bool,
    skip: int = 0,
    checksums: np.ndarray | None = None,
) -> None:
    """Move every ``(addr, len)`` row of ``iov`` (from byte ``skip`` of the
    list on) through ``sock`` in one native call; with ``checksums`` (uint64,
    one per row) also store each row's :func:`value_checksum` there.

    The GIL is released for the call. A signal interrupting a wait returns
    here so Python runs its handlers (which may raise), then the call resumes.
    """
    n = len(iov)
    if not n:
        return
    # from_buffer, not .ctypes.data: numpy builds a ctypes helper object per access
    ptr = _ffi.cast("const uint64_t *", _ffi.from_buffer(iov))
    done = _ffi.new("uint64_t *")
    err = _ffi.new("int *")
    fd = sock.fileno()
    if checksums is None:
        fn = _lib.rk_tcp_sendv if sending else _lib.rk_tcp_recvv

        def call() -> int:
            return int(fn(fd, ptr, n, skip, _timeout_ms(sock), done, err))
    else:
        assert HASHER is not None and len(checksums) == n
        hfn = _lib.rk_tcp_sendv_hashed if sending else _lib.rk_tcp_recvv_hashed
        out = _ffi.cast("uint64_t *", _ffi.from_buffer(checksums, require_writable=True))
        hashed = _ffi.new("uint64_t *")

        def call() -> int:
            return int(hfn(fd, ptr, n, skip, _timeout_ms(sock), HASHER, out, hashed,
                           done, err))
    while True:
        rc = call()
        if rc == _RK_TCP_OK:
            return
        if rc == _RK_TCP_EINTR:
            skip = int(done[0])
            continue
        if rc == _RK_TCP_TIMEOUT:
            raise TimeoutError("timed out")
        if rc == _RK_TCP_CLOSED:
            raise ConnectionLost("peer closed the connection mid-frame")
        code = int(err[0])
        raise OSError(code, os.strerror(code))


def send_iov(sock: socket.socket, iov: np.ndarray, checksums: np.ndarray | None = None) -> None:
    """Send the bytes at each ``(addr, len)`` row of a C-contiguous uint64 (n, 2) table.

    With ``checksums`` (a uint64 array of n, only when :func:`native_checksums`),
    each row is hashed right after it is sent, while it is in cache; a row
    that points into ``checksums`` itself goes out only once every row before
    it is sent and hashed (rk_tcp.h).
    The caller keeps the memory alive (holds a view of it) until this returns.
    """
    _native_io(sock, iov, True, 0, checksums)


def recv_iov(
    sock: socket.socket, iov: np.ndarray, skip: int = 0, checksums: np.ndarray | None = None
) -> None:
    """Fill the memory at each ``(addr, len)`` row from ``sock``, from byte
    ``skip`` of the list on (see :func:`send_iov`; a row is hashed as soon as
    its last byte arrived)."""
    _native_io(sock, iov, False, skip, checksums)


def recv_iov_from(
    channel: Channel, iov: np.ndarray, total: int, checksums: np.ndarray | None = None
) -> None:
    """The native :meth:`Channel.recv_bulk`: fill the memory at each ``(addr, len)``
    row (``total`` bytes) with the bulk of the frame just received.

    The first bytes may already sit in the channel's read-ahead buffer (at
    most :data:`~rdmakv.wire.format.RECV_AHEAD_BYTES`): they are copied in, and
    the native loop reads the rest straight from the socket.
    """
    channel.check_bulk(total)
    chunk = channel.take_buffered(total)
    if chunk:
        _lib.rk_tcp_copy_in(_ffi.cast("const uint64_t *", _ffi.from_buffer(iov)), len(iov),
                            _ffi.from_buffer(chunk), len(chunk))
    recv_iov(channel.sock, iov, len(chunk), checksums)
    channel.bulk_pending = 0


def u64_array(values: Sequence[int]) -> np.ndarray:
    """Python ints as a uint64 array (array.array converts in C; faster than numpy)."""
    return np.frombuffer(array.array("Q", values), dtype=np.uint64)


def address_of(buf: bytes | bytearray | np.ndarray) -> int:
    """Where ``buf``'s bytes are (valid while the caller holds ``buf``)."""
    return int(_ffi.cast("uintptr_t", _ffi.from_buffer(buf)))
