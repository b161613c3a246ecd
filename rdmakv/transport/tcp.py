"""The ``tcp`` transport: puts and gets by key over the control connection.

A get needs no addresses: ``get`` sends one GET per sub-batch (keys and the
digests they must be stored with) and the node answers with each hit's
length and checksum followed by the values, which land straight in their
slab blocks -- lookup and read in one round trip, no lease to release (the
node pins the blocks only while it sends them). A put needs none either:
``put`` sends one PUT per sub-batch (the ALLOC items, the values right
behind them as bulk) and its COMMIT right behind that; the node receives
each value it could allocate straight into its extent and drops the bytes of
the others. Bytes move with scatter-gather socket calls straight between the
socket and slab/pool blocks: no intermediate ``bytes``.

The requests share the control socket, so control and data stay ordered.
Because the node sees every written byte, it marks an extent *written* only
once the whole value arrived; the client queues ``COMMIT`` (with
``COMMIT_FLAG_REQUIRE_WRITTEN``) right behind its PUT, and a value whose
bytes did not all arrive is never published.

The per-block loop runs in the native core (native/rk_tcp.c, in
``rdmakv._native``: plain libc, no libibverbs): one C call moves a whole
request's bulk -- ``sendmsg`` / ``readv`` of up to 1024 blocks and 512 KiB
per system call (``RK_TCP_WINDOW``: fewer, bigger calls measured slower over
loopback), resuming after short transfers, waiting with ``poll`` on EAGAIN -- with
the GIL released, so the client's and the node's Python threads keep running.
The same loop hashes each block with XXH3 (the protocol's value checksum)
a system call's bytes at a time, so that the hash and the kernel's copy read
each block from memory once between them: the writer's checksums for COMMIT
and the reader's verification come from that pass instead of one more read
of every block. A receive hashes each call's bytes right after the copy wrote
them. A send moves 128 KiB or 512 KiB per call and hashes each right before
or right after it, as the process's plan says (:data:`SEND_PLANS`: a default,
or the configuration's ``tcp.send_plan``, set once at start-up; which costs
the sending thread least depends on the CPU, rk_tcp.h says why).
A receive that runs out of bytes mid-list polls for the rest without sleeping
for up to 100 us before it sleeps, while its process has fewer receives in
flight than CPUs: the sender then need not wake it for every segment
(:func:`set_recv_spin_us`, ``RDMAKV_TCP_RECV_SPIN_US``; rk_tcp.h says why).
The figures behind both: bench/README.md, section "Measurements moved from
code comments (issue 58)".
Waits keep the socket's timeout semantics (no progress for ``timeout`` seconds
raises ``TimeoutError``, mapped to ``TransportTimeout``; a peer that closes
mid-transfer raises ``ConnectionLost``).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from rdmakv import native_core
from rdmakv.defaults import DEFAULT_TCP_SEND_PLAN
from rdmakv.errors import ConfigError, ConnectionLost, ProtocolError, RdmakvError, RemoteError
from rdmakv.protocol import (
    COMMIT_FLAG_REQUIRE_WRITTEN,
    HEADER,
    MAX_BULK_BYTES,
    RESPONSE_BIT,
    U32,
    U64,
    AllocRequest,
    AllocStatus,
    BatchEncoder,
    Channel,
    Header,
    LimitExceeded,
    NodeInfo,
    Op,
    Reply,
    Status,
    check_get_answer_layout,
    decode_alloc_request,
    decode_flags,
    decode_get_request,
    decode_put_answer,
    encode_commit,
    encode_keys,
    encode_put_answer,
    get_answer_columns,
    get_answer_entries,
    value_checksum,
    wrap_socket_errors,
)
from rdmakv.slab import Slab
from rdmakv.transport.base import (
    REQUEST_BYTES_AHEAD,
    Fetched,
    NodeDataPath,
    NodeHandler,
    NodeSession,
    ReceivingValues,
    Stored,
    Transport,
    iov_at,
    sub_batches,
)
from rdmakv.transport.checksum import HASHER

PUT_DRAIN_BYTES = 1024 * 1024
"""Scratch a PUT's refused values are received into (and dropped), at most."""

ENV_RECV_SPIN = native_core.ENV_RECV_SPIN
"""Microseconds a native receive polls for more bytes before it sleeps
(:func:`set_recv_spin_us`; 0 never spins), read when the native core loads."""

_ffi, _lib = native_core.ffi, native_core.lib

_HASHER_ADDRESS = 0 if HASHER is None else int(_ffi.cast("uintptr_t", HASHER))
"""The address of :data:`~rdmakv.transport.checksum.HASHER`, which
:meth:`Channel.call_get` hashes with (0: none). The struct lives as long as
this process: the checksum module holds it."""

_RK_TCP_OK = 0
_RK_TCP_TIMEOUT = 1
_RK_TCP_CLOSED = 2
_RK_TCP_ERRNO = 3
_RK_TCP_EINTR = 4
_RK_TCP_MISSED = 0  # per key of a GET answer (rk_tcp_get_answer_check; the Python path's too)
_RK_TCP_CORRUPT = -1
assert (_lib.RK_TCP_MISSED, _lib.RK_TCP_CORRUPT) == (_RK_TCP_MISSED, _RK_TCP_CORRUPT)


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
    most :data:`~rdmakv.protocol.RECV_AHEAD_BYTES`): they are copied in, and
    the native loop reads the rest straight from the socket.
    """
    channel.check_bulk(total)
    chunk = channel.take_buffered(total)
    if chunk:
        _lib.rk_tcp_copy_in(_ffi.cast("const uint64_t *", _ffi.from_buffer(iov)), len(iov),
                            _ffi.from_buffer(chunk), len(chunk))
    recv_iov(channel.sock, iov, len(chunk), checksums)
    channel.bulk_pending = 0


def _u64(values: Sequence[int]) -> np.ndarray:
    """Python ints as a uint64 array (array.array converts in C; faster than numpy)."""
    return np.frombuffer(array.array("Q", values), dtype=np.uint64)


def _address_of(buf: bytes | bytearray | np.ndarray) -> int:
    """Where ``buf``'s bytes are (valid while the caller holds ``buf``)."""
    return int(_ffi.cast("uintptr_t", _ffi.from_buffer(buf)))


def _await_answer(ch: Channel, reply: Reply) -> RdmakvError | None:
    """Read answers in order up to ``reply``'s; the node's refusal of it (the
    stream stays in sync and the refusal stays with the reply), or None. A
    stream out of sync raises."""
    try:
        ch.wait(reply)
    except ProtocolError:
        raise
    except RdmakvError as e:
        return e
    return None


class TcpTransport(Transport):
    """Client side, over the control channel: puts and gets by key (PUT, GET).

    On a socket failure the channel is unusable and the error raised; the
    owner (KVClient) drops the connection and reconnects on the next call.
    """

    name = "tcp"

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch = channel
        self._info = info
        self._timeout = timeout
        self._slab: Slab | None = None

    def register_local(self, slab: Slab) -> None:
        self._slab = slab

    def get(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        digests: Sequence[bytes],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Fetched:
        """One GET per sub-batch (split so its hits fit one answer's bulk), sent
        ahead while earlier answers are still arriving, but never more than
        :data:`~rdmakv.transport.base.REQUEST_BYTES_AHEAD` of requests behind
        an unread answer (the node may be blocked sending it). Each answer's
        values land straight in their slab blocks; a value whose bytes fail
        its checksum is a miss and reported in ``corrupt``.

        On an idle connection the whole get runs in one native call
        (:meth:`Channel.call_get`, the same requests, flow control and
        checks): no Python per answer, and the GIL released throughout."""
        slab = self._slab
        if slab is None:
            raise ProtocolError("get before register_local")
        bs = slab.block_size
        per_answer = max(1, self._info.max_bulk // bs)
        handle_table = np.asarray(handles, dtype=np.uint64)
        # a GET's answer carries the values: no ramp (see sub_batch_sizes)
        batches = sub_batches(len(keys), self._info.max_keys, ramp=False)
        requests = [(s, min(end, s + per_answer))
                    for start, end in batches for s in range(start, end, per_answer)]
        at_once = self._get_at_once(slab, keys, handle_table, encoder, requests, timeout)
        if at_once is not None:
            return at_once
        out: list[int | None] = [None] * len(keys)
        corrupt: list[bytes] = []
        refused: list[RemoteError] = []
        ahead: list[tuple[Reply, int]] = []  # sent, answer not yet read; request bytes
        ch = self._ch

        def collect() -> None:
            reply, _ = ahead.pop(0)
            err = _await_answer(ch, reply)
            if isinstance(err, RemoteError):
                refused.append(err)
            elif err is not None:
                raise err

        try:
            ch.set_timeout(timeout)
            for s, e in requests:
                payload = encoder.get(s, e)
                while ahead and sum(n for _, n in ahead) + len(payload) > REQUEST_BYTES_AHEAD:
                    collect()
                receiver = _GetReceiver(ch, slab, keys, handle_table, s, e, out, corrupt)
                receiver.reply = ch.submit(Op.GET, payload, "GET", on_ok=receiver)
                ahead.append((receiver.reply, len(payload) + HEADER.size))
            while ahead:
                collect()
        except OSError as e:
            raise wrap_socket_errors("GET", e) from e
        return Fetched(out, corrupt, refused[0] if refused else None)

    def _get_at_once(
        self,
        slab: Slab,
        keys: Sequence[bytes],
        handle_table: npt.NDArray[np.uint64],
        encoder: BatchEncoder,
        requests: Sequence[tuple[int, int]],
        timeout: float,
    ) -> Fetched | None:
        """:meth:`get` of ``requests`` (each a run of keys) in one native
        call; None where that call does not take it (nothing was sent then)."""
        if not native_checksums():  # its hasher is the one _HASHER_ADDRESS names
            return None
        ch = self._ch
        try:
            ch.set_timeout(timeout)
            got = ch.call_get([encoder.get(s, e) for s, e in requests],
                              [e - s for s, e in requests], handle_table, slab.base_addr,
                              slab.block_size, _HASHER_ADDRESS, REQUEST_BYTES_AHEAD, timeout)
        except OSError as e:
            raise wrap_socket_errors("GET", e) from e
        if got is None:
            return None
        sizes, corrupt, refused = got
        return Fetched(sizes, [keys[j] for j in corrupt], refused)

    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        sizes: Sequence[int],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Stored:
        """One PUT per sub-batch (split so its values fit one request's bulk), the
        values sent straight from the slab and hashed on the way out, then its
        COMMIT with those checksums (the node commits only values it received
        in full). Answers are read only once more than
        :data:`~rdmakv.transport.base.REQUEST_BYTES_AHEAD` of them are due,
        so they always fit this end's receive buffer while it keeps sending.

        With the native loop every PUT and COMMIT up to that point goes out
        in ONE call (see :class:`_PutFrames`): the bytes never stop between
        sub-batches, and the node never waits for this end's Python."""
        slab = self._slab
        if slab is None:
            raise ProtocolError("put before register_local")
        bs = slab.block_size
        per_request = max(1, self._info.max_bulk // bs)
        # a PUT carries its values: no round trip to hide behind a ramp
        batches = sub_batches(len(keys), self._info.max_keys, ramp=False)
        out = [False] * len(keys)
        refused: list[RemoteError] = []
        due: list[_PutStage] = []  # sent (or in `frames`), answers not yet read
        ch = self._ch
        frames: _PutFrames | None = None
        if _PutFrames.usable():  # every value's (address, length), laid out once
            frames = _PutFrames(iov_at(slab.base_addr, _u64(handles) * np.uint64(bs),
                                        _u64(sizes)))
        try:
            ch.set_timeout(timeout)
            for start, end in batches:
                for s in range(start, end, per_request):
                    e = min(end, s + per_request)
                    while due and sum(st.answer_bytes for st in due) > REQUEST_BYTES_AHEAD:
                        if frames is not None:  # before any wait (Channel.enqueue);
                            frames.send(ch.sock)  # a no-op once nothing is queued
                        due.pop(0).settle(ch, keys, out, refused)
                    ns = sizes[s:e]
                    payload = encoder.alloc(s, e)
                    if frames is not None:
                        put, put_hdr = ch.enqueue(Op.PUT, len(payload), "PUT", bulk_len=sum(ns))
                        named = encoder.keys(s, e)  # COMMIT's payload up to its checksums
                        commit, commit_hdr = ch.enqueue(
                            Op.COMMIT, len(named) + U64.size * (e - s), "COMMIT",
                            flags=COMMIT_FLAG_REQUIRE_WRITTEN,
                        )
                        frames.add(put_hdr + payload, s, e, commit_hdr + named)
                    else:
                        buf = slab.buffer
                        views = [buf[h * bs : h * bs + n] for h, n in zip(handles[s:e], ns,
                                                                        strict=True)]
                        put = ch.submit(Op.PUT, payload, "PUT", bulk=views, bulk_len=sum(ns))
                        sums = [value_checksum(v) for v in views]
                        commit = ch.submit(Op.COMMIT, encode_commit(keys[s:e], sums), "COMMIT",
                                           flags=COMMIT_FLAG_REQUIRE_WRITTEN)
                    due.append(_PutStage(s, e, put, commit))
            if frames is not None:
                frames.send(ch.sock)
            while due:
                due.pop(0).settle(ch, keys, out, refused)
        except OSError as e:
            raise wrap_socket_errors("PUT", e) from e
        except BaseException:
            if frames is not None:  # their replies are queued: they must go out, or
                with contextlib.suppress(OSError):  # the channel's next wait never ends
                    frames.send(ch.sock)
            raise
        return Stored(out, refused[0] if refused else None)

    def close(self) -> None:
        self._slab = None


class _PutFrames:
    """PUT and COMMIT frames of several sub-batches, sent in ONE native call.

    Per sub-batch the rows are: the PUT's header and items, its values (slab
    blocks), the COMMIT's header and keys, and the COMMIT's checksums. That
    last row points into the call's own ``hashes`` array, at the entries of
    the value rows before it: the native loop sends such a row only once
    every row before it has gone out and been hashed (rk_tcp.h), so those
    entries hold the values' checksums by the time the row is sent. The
    checksums are made on the way out, with no pass of their own, and
    nothing stops between a PUT and its COMMIT. The COMMIT carries them
    little-endian, as numpy's uint64 holds them only on a little-endian host:
    elsewhere :meth:`usable` is False and the caller hashes in Python.

    The replies are queued (``Channel.enqueue``) as the frames are added:
    :meth:`send` must run before anything else is sent or awaited.
    ``values``: the whole put's (address, length) rows, one per key.
    """

    def __init__(self, values: np.ndarray) -> None:
        self._values = values
        self._parts: list[tuple[bytes, np.ndarray, bytes]] = []

    @staticmethod
    def usable() -> bool:
        return native_checksums() and sys.byteorder == "little"

    def add(self, put_head: bytes, start: int, end: int, commit_head: bytes) -> None:
        """Sub-batch ``[start, end)``: PUT header + items, the keys' values,
        COMMIT header + keys."""
        self._parts.append((put_head, self._values[start:end], commit_head))

    def send(self, sock: socket.socket) -> None:
        """Send every frame added since the last call, in order."""
        parts, self._parts = self._parts, []
        if not parts:
            return
        rows = sum(len(values) + 3 for _, values, _ in parts)
        table = np.empty((rows, 2), dtype=np.uint64)
        hashes = np.empty(rows, dtype=np.uint64)
        at = _address_of(hashes)
        r = 0
        for put_head, values, commit_head in parts:
            n = len(values)
            table[r] = (_address_of(put_head), len(put_head))
            table[r + 1 : r + 1 + n] = values
            table[r + 1 + n] = (_address_of(commit_head), len(commit_head))
            table[r + 2 + n] = (at + U64.size * (r + 1), U64.size * n)  # hashes of the values
            r += n + 3
        send_iov(sock, table, hashes)  # `parts` and `hashes` live until it returns


@dataclasses.dataclass
class _PutStage:
    """One PUT sent with its COMMIT behind it, answers not yet read."""

    start: int
    end: int
    put: Reply
    commit: Reply

    @property
    def answer_bytes(self) -> int:
        return 2 * (HEADER.size + U32.size + self.end - self.start)

    def settle(
        self, ch: Channel, keys: Sequence[bytes], out: list[bool], refused: list[RemoteError]
    ) -> None:
        """Read both answers: a key is stored when committed, or present already.
        Extents allocated but not committed are given back (ABORT)."""
        n = self.end - self.start
        err = _await_answer(ch, self.put)
        statuses = None if err is not None else decode_put_answer(self.put.payload, n)
        commit_err = _await_answer(ch, self.commit)
        committed = (
            [False] * n if commit_err is not None
            else decode_flags(self.commit.payload, n, "COMMIT")
        )
        for err_ in (err, commit_err):
            if isinstance(err_, RemoteError):
                refused.append(err_)
            elif err_ is not None:
                raise err_
        if all(committed):  # the rule: every key stored, nothing to give back
            out[self.start : self.end] = committed
            return
        leftover = []
        for j in range(n):
            status = None if statuses is None else statuses[j]
            out[self.start + j] = committed[j] or status == AllocStatus.EXISTS
            if status == AllocStatus.OK and not committed[j]:
                leftover.append(keys[self.start + j])
        if leftover:  # give the node its extents back
            ch.send_nowait(Op.ABORT, encode_keys(leftover))


class _GetReceiver:
    """Reads one GET answer's values into the slab (a :class:`Reply`'s on_ok):
    hits of keys ``[start, end)`` go to their ``handles`` blocks (a uint64
    array of the whole get), and those whose bytes match their checksum are
    written into ``out`` as their lengths; the keys of those that do not are
    added to ``corrupt`` (a miss, never wrong KV).

    With native checksums the entries are laid out and the checksums compared
    in C, one call each side of the receive: the Python left per answer is
    a few calls, and per hit none when every key of the answer matched (the
    rule). Without them, numpy does the same per answer."""

    def __init__(
        self,
        ch: Channel,
        slab: Slab,
        keys: Sequence[bytes],
        handles: npt.NDArray[np.uint64],
        start: int,
        end: int,
        out: list[int | None],
        corrupt: list[bytes],
    ) -> None:
        self.ch, self.slab, self.keys, self.handles = ch, slab, keys, handles
        self.start, self.end, self.out, self.corrupt = start, end, out, corrupt
        self.reply: Reply | None = None

    def __call__(self, hdr: Header) -> None:
        assert self.reply is not None
        entries = get_answer_entries(self.reply.payload, self.end - self.start)
        if native_checksums():
            sizes, matched = self._receive_native(hdr, entries)
        else:
            sizes, matched = self._receive(hdr, entries)
        s, out = self.start, self.out
        if matched == len(sizes):  # every key a hit whose bytes match: the rule
            out[s : self.end] = sizes
            return
        for j, n in enumerate(sizes, s):
            if n > 0:
                out[j] = n
            elif n == _RK_TCP_CORRUPT:  # corrupted on the way or in the pool
                self.corrupt.append(self.keys[j])

    def _receive_native(self, hdr: Header, entries: bytes) -> tuple[list[int], int]:
        """Per key its length (a match), :data:`_RK_TCP_MISSED` or :data:`_RK_TCP_CORRUPT`;
        and the number of matches."""
        m, slab = self.end - self.start, self.slab
        raw = _ffi.from_buffer(entries)
        iov = np.empty((m, 2), dtype=np.uint64)
        hit = _ffi.from_buffer("uint32_t[]", np.empty(m, dtype=np.uint32))  # holds the array
        total, bad = _ffi.new("uint64_t *"), _ffi.new("size_t *")
        slots = _ffi.from_buffer(self.handles[self.start : self.end])
        hits = _lib.rk_tcp_get_answer_layout(
            raw, m, _ffi.cast("uint64_t *", slots), slab.base_addr, slab.block_size,
            _ffi.cast("uint64_t *", _ffi.from_buffer(iov)), hit, total, bad,
        )
        if hits < 0 or total[0] != hdr.bulk_len:  # the check names what is wrong
            check_get_answer_layout(get_answer_columns(entries)[0], hdr.bulk_len,
                                    slab.block_size)
        got = np.empty(hits, dtype=np.uint64)
        recv_iov_from(self.ch, iov[:hits], total[0], got)  # the slab is mapped while we run
        sizes = np.empty(m, dtype=np.int64)
        matched = _lib.rk_tcp_get_answer_check(
            raw, m, hit, hits,
            _ffi.cast("uint64_t *", _ffi.from_buffer(got)),
            _ffi.cast("int64_t *", _ffi.from_buffer(sizes)),
        )
        return sizes.tolist(), int(matched)

    def _receive(self, hdr: Header, entries: bytes) -> tuple[list[int], int]:
        """:meth:`_receive_native` without the native checksums: numpy lays the
        answer out, the bytes move through the native loop, and Python hashes
        them."""
        bs = self.slab.block_size
        lengths, sums = get_answer_columns(entries)
        total = check_get_answer_layout(lengths, hdr.bulk_len, bs)
        hits = np.flatnonzero(lengths)
        sizes = lengths[hits]
        offsets = self.handles[self.start + hits] * np.uint64(bs)
        recv_iov_from(self.ch, iov_at(self.slab.base_addr, offsets, sizes), total)
        buf = self.slab.buffer
        pairs = list(zip(offsets.tolist(), sizes.tolist(), strict=True))
        got = np.array([value_checksum(buf[o : o + n]) for o, n in pairs], dtype=np.uint64)
        ok = got == sums[hits]
        out = lengths.astype(np.int64)
        out[hits[~ok]] = _RK_TCP_CORRUPT
        return out.tolist(), int(ok.sum())


class TcpNodeDataPath(NodeDataPath):
    """Node side: PUT receives values straight into pool extents, GET sends
    them from there (both name keys; the store picks the extents)."""

    name = "tcp"

    @property
    def native_get(self) -> bool:
        return True

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.GET: self._get, Op.PUT: self._put}

    def _get(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_get_request(payload)
        found = session.pin_values(request)
        try:
            if found.nbytes > MAX_BULK_BYTES:  # the answer would be over the frame limit
                raise LimitExceeded(
                    f"GET of {request.count} keys finds {found.nbytes} bytes, more than "
                    f"{MAX_BULK_BYTES} in one answer"
                )
            answer = found.answer
            # header, answer and the values in one system call: the client wakes once
            head = HEADER.pack(
                req.opcode | RESPONSE_BIT, 0, Status.OK, len(answer), found.nbytes, req.req_id
            ) + answer
            table = found.iov
            table[0] = (_address_of(head), len(head))
            # the pins keep the blocks; the pool stays mapped
            session.channel.flush()  # answers held back go first (Channel.send)
            send_iov(session.channel.sock, table)
        finally:
            found.unpin()

    def _put(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_alloc_request(payload, "PUT")
        total = request.total_bytes()
        if total != req.bulk_len:
            raise ProtocolError(
                f"PUT items name {total} bytes but the frame carries {req.bulk_len}"
            )
        values = session.alloc_received(request)
        try:
            self._receive_values(session.channel, request, values, total)
        except BaseException:  # nothing half-written stays allocated
            session.abort([key for (key, _, _), st in
                           zip(request.items, values.statuses, strict=True)
                           if st == AllocStatus.OK])
            raise
        values.received()  # only now: every byte of every allocated value is in the pool
        # the client reads a PUT's answer with its COMMIT's, sent right behind it
        session.reply(req, encode_put_answer(values.statuses), may_wait=True)

    def _receive_values(
        self,
        ch: Channel,
        request: AllocRequest,
        values: ReceivingValues,
        total: int,
    ) -> None:
        """A PUT's bulk: each reserved value into its extent (``values.iov``),
        the bytes of the values refused into a scratch buffer."""
        extents = values.iov
        if len(extents) == request.count:  # the common case: nothing refused
            recv_iov_from(ch, extents, total)  # the store's extents: inside the pool
            return
        refused = total - int(extents[:, 1].sum())
        scratch = bytearray(min(refused, PUT_DRAIN_BYTES))
        step = len(scratch) or 1
        where = _address_of(scratch) if scratch else 0  # never a pool address
        reserved = iter(extents.tolist())
        rows: list[int] = []  # (address, length) pairs, flat
        for (_, size, _), st in zip(request.items, values.statuses, strict=True):
            if st == AllocStatus.OK:
                rows += next(reserved)  # an extent the store just handed out
                continue
            for s in range(0, size, step):
                rows += (where, min(step, size - s))
        recv_iov_from(ch, _u64(rows).reshape(-1, 2), total)  # `scratch` lives meanwhile
