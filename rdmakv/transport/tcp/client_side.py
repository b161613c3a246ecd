"""The client side of the ``tcp`` transport: :class:`TcpTransport`, puts and gets by key.

A get sends one GET per sub-batch and receives each hit's value straight
into its slab block; a put sends one PUT per sub-batch with its values as
bulk and queues its COMMIT right behind it (the package docstring,
:mod:`rdmakv.transport.tcp`, has the whole exchange).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from rdmakv import native_core
from rdmakv.blocks.slab import Slab
from rdmakv.errors import ProtocolError, RdmakvError, RemoteError
from rdmakv.transport.base import (
    REQUEST_BYTES_AHEAD,
    Fetched,
    Stored,
    Transport,
    iov_at,
    sub_batches,
)
from rdmakv.transport.tcp.loop import (
    HASHER_ADDRESS,
    RK_TCP_CORRUPT,
    RK_TCP_MISSED,
    address_of,
    native_checksums,
    recv_iov_from,
    send_iov,
    u64_array,
)
from rdmakv.wire.batches import (
    BatchEncoder,
    check_get_answer_layout,
    decode_flags,
    decode_put_answer,
    encode_commit,
    encode_keys,
    get_answer_columns,
    get_answer_entries,
)
from rdmakv.wire.channel import Channel, Reply, wrap_socket_errors
from rdmakv.wire.format import (
    COMMIT_FLAG_REQUIRE_WRITTEN,
    HEADER,
    U32,
    U64,
    AllocStatus,
    Header,
    NodeInfo,
    Op,
    value_checksum,
)

_ffi, _lib = native_core.ffi, native_core.lib

assert (_lib.RK_TCP_MISSED, _lib.RK_TCP_CORRUPT) == (RK_TCP_MISSED, RK_TCP_CORRUPT)


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
        if not native_checksums():  # its hasher is the one HASHER_ADDRESS names
            return None
        ch = self._ch
        try:
            ch.set_timeout(timeout)
            got = ch.call_get([encoder.get(s, e) for s, e in requests],
                              [e - s for s, e in requests], handle_table, slab.base_addr,
                              slab.block_size, HASHER_ADDRESS, REQUEST_BYTES_AHEAD, timeout)
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
            frames = _PutFrames(iov_at(slab.base_addr, u64_array(handles) * np.uint64(bs),
                                        u64_array(sizes)))
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
        at = address_of(hashes)
        r = 0
        for put_head, values, commit_head in parts:
            n = len(values)
            table[r] = (address_of(put_head), len(put_head))
            table[r + 1 : r + 1 + n] = values
            table[r + 1 + n] = (address_of(commit_head), len(commit_head))
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
            elif n == RK_TCP_CORRUPT:  # corrupted on the way or in the pool
                self.corrupt.append(self.keys[j])

    def _receive_native(self, hdr: Header, entries: bytes) -> tuple[list[int], int]:
        """Per key its length (a match), :data:`RK_TCP_MISSED` or :data:`RK_TCP_CORRUPT`;
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
        out[hits[~ok]] = RK_TCP_CORRUPT
        return out.tolist(), int(ok.sum())
