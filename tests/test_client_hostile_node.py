"""KVClient against a lying peer: a real socket server speaking the protocol badly.

The client must treat everything a node sends as remote input: refuse absurd
handshake numbers, never read past its slab blocks, and turn out-of-sync
replies into errors, all within its timeout.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import Script, declined_call

import rdmakv.transport as transport_registry
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import MIN_SUB_BATCH, KVClient
from rdmakv.errors import ProtocolError, RdmakvError, RemoteError, TransportTimeout
from rdmakv.transport import TransportSpec
from rdmakv.transport.base import REQUEST_BYTES_AHEAD, IoFuture, IoOp, Ops, io_ops
from rdmakv.transport.extents import ExtentTransport
from rdmakv.transport.tcp import loop as tcp
from rdmakv.transport.tcp.node_side import TcpNodeDataPath
from rdmakv.wire import channel
from rdmakv.wire.batches import (
    decode_get,
    decode_keys,
    encode_get,
    encode_get_answer,
    encode_lookup_results,
)
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    HEADER,
    MAX_KEY_LEN,
    PROTOCOL_VERSION,
    RECV_AHEAD_BYTES,
    RESPONSE_BIT,
    Extent,
    Header,
    LookupResult,
    NodeInfo,
    Op,
    Status,
    value_checksum,
)

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096
GOOD_INFO = NodeInfo(
    PROTOCOL_VERSION,
    0,
    BLOCK,
    1 << 40,
    1 << 20,
    b"n" * 16,
    1,
    1 << 20,
    1024,
    1 << 24,
    ("tcp",),
)

def never(ch: Channel, hdr: Header, payload: bytearray) -> bool:
    return False


@pytest.mark.parametrize("field", ["max_keys", "max_bulk", "block_size"])
def test_absurd_handshake_numbers_are_refused(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], field: str
) -> None:
    addr = fake_node(dataclasses.replace(GOOD_INFO, **{field: 0}), never)
    with pytest.raises(RdmakvError, match=f"{field}=0"):
        KVClient(*addr, None, connect_retries=1)


def test_wrong_version_in_handshake_is_refused(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
) -> None:
    addr = fake_node(dataclasses.replace(GOOD_INFO, version=PROTOCOL_VERSION + 1), never)
    with pytest.raises(RdmakvError, match="protocol version"):
        KVClient(*addr, None, connect_retries=1)


class RecordingReads(ExtentTransport):
    """The extent strategy (rdma's) against a fake node: its one-sided reads
    only record their ops (no bytes move), so a test sees what a get asked
    the device to read."""

    name = "recording"

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch, self._info, self._slab = channel, info, None
        self.ops: list[IoOp] = []

    def register_local(self, slab: Slab) -> None:
        self._slab = slab

    def write(self, ops: Ops, timeout: float) -> IoFuture:
        raise AssertionError("this test puts nothing")

    def read(self, ops: Ops, timeout: float) -> IoFuture:
        self.ops.extend(io_ops(ops))
        return IoFuture.completed()

    def close(self) -> None:
        pass


def test_oversized_lookup_extent_is_a_miss(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LOOKUP hit longer than a client block never becomes a read op (it
    would run past the block); the rest of the get goes on."""
    monkeypatch.setitem(transport_registry._REGISTRY, RecordingReads.name,
                        TransportSpec(RecordingReads.name, RecordingReads, TcpNodeDataPath))
    in_block = value_checksum(b"\x5a" * 100)  # what "ok"'s block already holds

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        if hdr.opcode == Op.LOOKUP:
            keys = decode_keys(payload, "LOOKUP")
            # key "big" claims more bytes than a client block holds; "ok" fits
            res = [
                LookupResult(
                    Extent(1 << 40, BLOCK * 4 if k == b"big" else 100, 0), 7, bytes(16),
                    in_block,
                )
                for k in keys
            ]
            ch.send(hdr.opcode | RESPONSE_BIT, encode_lookup_results(res), req_id=hdr.req_id)
            return True
        ch.send(hdr.opcode | RESPONSE_BIT, b"\x00\x00\x00\x00", req_id=hdr.req_id)
        return True

    addr = fake_node(dataclasses.replace(GOOD_INFO, transports=(RecordingReads.name,)), script)
    with Slab(4 * BLOCK, BLOCK, lock=False) as slab, KVClient(
        *addr, slab, transport=RecordingReads.name
    ) as c:
        h, h2 = slab.alloc(), slab.alloc()
        slab.numpy(h)[:] = 0x5A
        slab.numpy(h2)[:] = 0x5A
        assert c.get([b"big", b"ok"], [h, h2], [bytes(16)] * 2) == [False, True]
        tp = c._tp  # the test inspects the live transport
        assert isinstance(tp, RecordingReads)
        # the oversized one never became a read op: only "ok"'s 100 bytes were asked for
        assert tp.ops == [IoOp(slab.offset(h2), 1 << 40, 100, 0)]


GET_PATHS = ["native_call", "python"]
"""How a client reads a get of one request: in one native call
(``Channel.call_get``), or answer by answer in Python (the call declining)."""


def _get_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "native_call" and not tcp.native_checksums():
        pytest.skip("the xxhash module has no XXH3 C API for the native get call")
    if path == "python":
        monkeypatch.setattr(channel, "_native_get_call", declined_call)


@pytest.mark.parametrize("path", GET_PATHS)
@pytest.mark.parametrize("lie", ["too_long", "bulk_short", "bulk_long", "entries", "req_id"])
def test_lying_get_answers_are_errors_and_touch_no_other_block(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    lie: str,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _get_path(path, monkeypatch)
    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        if hdr.opcode != Op.GET:
            ch.send(hdr.opcode | RESPONSE_BIT, b"\x00\x00\x00\x00", req_id=hdr.req_id)
            return True
        keys, _ = decode_get(payload)
        lengths = [BLOCK * 4 if lie == "too_long" else 100 for _ in keys]
        sums = [0] * len(keys)
        if lie == "entries":
            lengths, sums = lengths[1:], sums[1:]
        bulk = sum(lengths) + {"bulk_short": -5, "bulk_long": 5}.get(lie, 0)
        ch.send(hdr.opcode | RESPONSE_BIT, encode_get_answer(lengths, sums),
                req_id=hdr.req_id + (lie == "req_id"), bulk=[memoryview(b"x" * bulk)],
                bulk_len=bulk)
        return True

    addr = fake_node(GOOD_INFO, script)
    error = "out of sync" if lie == "req_id" else "GET response"
    with Slab(4 * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        h, h2, other = slab.alloc(), slab.alloc(), slab.alloc()
        for b in (h, h2):
            slab.numpy(b)[:] = 0x5A
        slab.numpy(other)[:] = 0x33
        with pytest.raises(ProtocolError, match=error):
            c.get([b"a", b"b"], [h, h2], [bytes(16)] * 2)
        assert (slab.numpy(other) == 0x33).all()  # nothing landed outside the asked blocks
        for b in (h, h2):
            assert (slab.numpy(b)[100:] == 0x5A).all()
        assert c._ch is None  # the stream is out of step: dropped


@pytest.mark.parametrize("path", GET_PATHS)
@pytest.mark.parametrize("message", [0, RECV_AHEAD_BYTES - HEADER.size],
                         ids=["short", "fills_read_ahead"])
def test_a_refused_get_is_the_nodes_error_and_keeps_the_connection(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    message: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A get of two requests whose first is refused with an error answer
    (with bulk the client must skip; its message short, or as long as the
    client's read-ahead buffer): the second request's values land, the
    node's error is raised, and the connection stays in step for the next
    get."""
    _get_path(path, monkeypatch)
    gets = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal gets
        gets += 1
        keys, _ = decode_get(payload)
        if gets == 1:
            text = b"busy right now".ljust(message, b".")
            ch.send(hdr.opcode | RESPONSE_BIT, text, status=Status.INTERNAL,
                    req_id=hdr.req_id, bulk=[memoryview(b"y" * 7)], bulk_len=7)
            return True
        ch.send(hdr.opcode | RESPONSE_BIT, encode_get_answer([3] * len(keys), [
            value_checksum(b"abc")] * len(keys)), req_id=hdr.req_id,
            bulk=[memoryview(b"abc" * len(keys))], bulk_len=3 * len(keys))
        return True

    addr = fake_node(dataclasses.replace(GOOD_INFO, max_keys=MIN_SUB_BATCH), script)
    keys = [b"k%03d" % i for i in range(2 * MIN_SUB_BATCH)]
    with Slab((len(keys) + 1) * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        blocks = slab.alloc_many(len(keys))
        with pytest.raises(RemoteError, match="busy right now"):
            c.get(keys, blocks, [bytes(16)] * len(keys))
        for h in blocks[MIN_SUB_BATCH:]:  # the second request's values
            assert bytes(slab.view(h)[:3]) == b"abc"
        h = slab.alloc()
        assert c.get_sizes([b"a"], [h], [bytes(16)]) == [3]
        assert bytes(slab.view(h)[:3]) == b"abc"
        assert (gets, c.reconnects) == (3, 0)


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_get_sends_no_more_requests_than_the_flow_control_allows(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests of long keys, each over REQUEST_BYTES_AHEAD: the next one goes
    out only once the answer before it is read (a node blocked sending a
    big answer must not find its receive buffer filling up meanwhile). The
    node looks, before each answer, for bytes of a request after it."""
    _get_path(path, monkeypatch)
    early: list[int] = []
    answers = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal answers
        keys, _ = decode_get(payload)
        time.sleep(0.2)  # time for a request sent too early to arrive
        try:
            waiting = ch.buffered + len(ch.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            waiting = ch.buffered
        early.append(waiting)
        answers += 1
        ch.send(hdr.opcode | RESPONSE_BIT, encode_get_answer([0] * len(keys), [0] * len(keys)),
                req_id=hdr.req_id)
        return True

    info = dataclasses.replace(GOOD_INFO, max_keys=MIN_SUB_BATCH)
    addr = fake_node(info, script)
    keys = [b"%0*d" % (MAX_KEY_LEN, i) for i in range(3 * MIN_SUB_BATCH)]
    assert MIN_SUB_BATCH * (MAX_KEY_LEN + 18) > REQUEST_BYTES_AHEAD
    with Slab(len(keys) * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        assert c.get(keys, slab.alloc_many(len(keys)), [bytes(16)] * len(keys)) == (
            [False] * len(keys))
    assert (answers, early) == (3, [0, 0, 0])


def test_bytes_read_past_a_short_error_answer_are_the_next_answers(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
) -> None:
    """The native get call reads an answer's head in one call of the length it
    expects; an error answer is shorter, and that call may take what follows
    it: here the error's bulk, then the next answer's head and value, sent
    together. Each lands where it belongs (a request of one key after one of
    many, as the client's own sub-batches never are, reaches the value)."""
    if not tcp.native_checksums():
        pytest.skip("the xxhash module has no XXH3 C API for the native get call")
    first: list[int] = []

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        if hdr.opcode == Op.EXISTS:
            ch.send(hdr.opcode | RESPONSE_BIT, b"\x01\x00\x00\x00\x00", req_id=hdr.req_id)
            return True
        if not first:
            first.append(hdr.req_id)  # answered below, together with the next one
            return True
        refusal = HEADER.pack(hdr.opcode | RESPONSE_BIT, 0, Status.INTERNAL, 4, 7, first[0])
        answer = encode_get_answer([100], [value_checksum(b"w" * 100)])
        ch.sock.sendall(refusal + b"busy" + b"y" * 7 + HEADER.pack(
            hdr.opcode | RESPONSE_BIT, 0, 0, len(answer), 100, hdr.req_id) + answer + b"w" * 100)
        return True

    addr = fake_node(GOOD_INFO, script)
    many = [b"m%03d" % i for i in range(MIN_SUB_BATCH)]
    with Slab((len(many) + 1) * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        blocks = slab.alloc_many(len(many) + 1)
        assert c._ch is not None
        got = c._ch.call_get(
            [encode_get(many, [bytes(16)] * len(many)), encode_get([b"one"], [bytes(16)])],
            [len(many), 1], np.asarray(blocks, dtype=np.uint64), slab.base_addr, BLOCK,
            tcp.HASHER_ADDRESS, REQUEST_BYTES_AHEAD, 5.0)
        assert got is not None
        sizes, corrupt, refused = got
        assert (sizes, corrupt) == ([None] * len(many) + [100], [])
        assert isinstance(refused, RemoteError) and "busy" in str(refused)
        assert bytes(slab.view(blocks[-1])[:100]) == b"w" * 100
        assert c.exists([b"one"]) == [False]  # the stream is in step after it


def _a_value(ch: Channel, hdr: Header, fill: bytes, sent: int = 100) -> None:
    """Answer a 1-key GET with a 100-byte hit of ``fill``, of which only the
    first ``sent`` bytes are sent."""
    ch.send(hdr.opcode | RESPONSE_BIT, encode_get_answer([100], [value_checksum(fill * 100)]),
            req_id=hdr.req_id, bulk=[memoryview(fill * sent)], bulk_len=100)


def _gets_the_whole_value(c: KVClient, slab: Slab, h: int) -> None:
    """The next get of that key, on whichever connection, gets all of it."""
    assert c.get_sizes([b"a"], [h], [bytes(16)]) == [100]
    assert bytes(slab.view(h)[:100]) == b"w" * 100


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_node_that_stalls_mid_value_is_a_timeout_and_the_next_get_reconnects(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _get_path(path, monkeypatch)
    gate = threading.Event()
    gets = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal gets
        gets += 1
        if gets == 1:
            _a_value(ch, hdr, b"v", sent=50)
            gate.wait(30)  # the rest never comes while the test runs
            return False
        _a_value(ch, hdr, b"w")
        return True

    addr = fake_node(GOOD_INFO, script)
    with Slab(4 * BLOCK, BLOCK, lock=False) as slab, \
            KVClient(*addr, slab, timeout=0.5, connect_retries=1) as c:
        h = slab.alloc()
        with pytest.raises(TransportTimeout):
            c.get([b"a"], [h], [bytes(16)])
        gate.set()  # the fake node serves one connection at a time: let it take the next
        _gets_the_whole_value(c, slab, h)
        assert c.reconnects == 1
    gate.set()


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_node_that_closes_mid_value_is_asked_again_on_a_new_connection(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _get_path(path, monkeypatch)
    gets = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal gets
        gets += 1
        if gets == 1:
            _a_value(ch, hdr, b"v", sent=50)
            return False  # and closes the connection
        _a_value(ch, hdr, b"w")
        return True

    addr = fake_node(GOOD_INFO, script)
    with Slab(4 * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab, connect_retries=1) as c:
        h = slab.alloc()
        _gets_the_whole_value(c, slab, h)
        assert (gets, c.reconnects) == (2, 1)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("path", GET_PATHS)
def test_a_signal_handler_raising_mid_value_leaves_no_half_read_stream(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that raises while the get waits for the rest of a value
    (an engine's alarm) gets its exception through; the next get runs on a
    new connection, not on the half-read one (where the rest of the value
    arrives after the handler ran, and would be read as the next answer)."""
    _get_path(path, monkeypatch)
    gate = threading.Event()
    gets = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal gets
        gets += 1
        if gets == 1:
            _a_value(ch, hdr, b"v", sent=50)
            gate.wait(30)
            ch.sock.sendall(b"v" * 50)  # the rest of the value, late
            return True
        _a_value(ch, hdr, b"w")
        return True

    def alarm(signum: int, frame: object) -> None:
        raise _Interrupted

    addr = fake_node(GOOD_INFO, script)
    old = signal.signal(signal.SIGALRM, alarm)
    try:
        with Slab(4 * BLOCK, BLOCK, lock=False) as slab, \
                KVClient(*addr, slab, timeout=10, connect_retries=1) as c:
            h = slab.alloc()
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(_Interrupted):
                c.get([b"a"], [h], [bytes(16)])
            gate.set()  # as above: the next connection is served once this one ends
            _gets_the_whole_value(c, slab, h)
            assert c.reconnects == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        gate.set()


@pytest.mark.parametrize("path", ["native_call", "native", "native_loop_python_hash"])
def test_a_get_answer_value_whose_bytes_fail_their_checksum_is_a_miss(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node answers every ``good`` key with its value and checksum, every
    ``miss`` key as a miss and every ``bad`` key with bytes that are not the
    ones its checksum names. Each way the client may read an answer (the
    whole get in one native call; answer by answer, the native core laying
    it out and checking it; the native loop with Python hashing, as where
    the xxhash module has no C API) returns the good values and misses for
    the rest, and deletes the bad ones on the node."""
    if path == "native_call":
        _get_path(path, monkeypatch)
    else:
        monkeypatch.setattr(channel, "_native_get_call", declined_call)
    if path == "native" and not tcp.native_checksums():
        pytest.skip("native checksums unavailable: the xxhash module has no XXH3 C API")
    if path == "native_loop_python_hash":
        monkeypatch.setattr(tcp, "HASHER", None)
    deleted: list[bytes] = []

    def value(key: bytes) -> bytes:
        return key[-1:] * (64 + key[-1] % 7)  # a length of its own per key

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        if hdr.opcode in (Op.DELETE, Op.EXISTS):
            named = decode_keys(payload, "keys")
            if hdr.opcode == Op.DELETE:
                deleted.extend(named)
            flags = len(named).to_bytes(4, "little") + b"\x01" * len(named)
            ch.send(hdr.opcode | RESPONSE_BIT, flags, req_id=hdr.req_id)
            return True
        keys, _ = decode_get(payload)
        hits = [k for k in keys if not k.startswith(b"miss")]
        lengths = [0 if k.startswith(b"miss") else len(value(k)) for k in keys]
        sums = [value_checksum(value(k)) if k.startswith(b"good") else
                value_checksum(b"not " + value(k)) if k.startswith(b"bad") else 0 for k in keys]
        bulk = b"".join(value(k) for k in hits)
        ch.send(hdr.opcode | RESPONSE_BIT, encode_get_answer(lengths, sums), req_id=hdr.req_id,
                bulk=[memoryview(bulk)], bulk_len=len(bulk))
        return True

    addr = fake_node(GOOD_INFO, script)
    keys = [b"good1", b"miss2", b"bad3", b"good4", b"bad5"]
    with Slab(8 * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        blocks = slab.alloc_many(len(keys))
        got = c.get_sizes(keys, blocks, [bytes(16)] * len(keys))
        assert got == [len(value(b"good1")), None, None, len(value(b"good4")), None]
        for k, h, n in zip(keys, blocks, got, strict=True):
            if n is not None:
                assert bytes(slab.view(h)[:n]) == value(k)
        assert c.checksum_mismatches == 2
        # an answer of good values only (every key matched) fills the whole list
        assert c.get_sizes(keys[::3], blocks[:2], [bytes(16)] * 2) == [
            len(value(b"good1")), len(value(b"good4"))
        ]
        assert c.exists([b"good1"]) == [True]  # answered after the DELETE sent ahead
    assert sorted(deleted) == [b"bad3", b"bad5"]


@pytest.mark.parametrize("lie", [b"\x01\x00\x00\x00\x00", b"\x02\x00\x00\x00\x00\x09"])
def test_lying_put_answers_are_errors(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], lie: bytes
) -> None:
    """A PUT answered with too few statuses, or one no version defines."""

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        ch.skip_bulk()
        answer = lie if hdr.opcode == Op.PUT else b"\x02\x00\x00\x00\x01\x01"
        ch.send(hdr.opcode | RESPONSE_BIT, answer, req_id=hdr.req_id)
        return True

    addr = fake_node(GOOD_INFO, script)
    with Slab(4 * BLOCK, BLOCK, lock=False) as slab, KVClient(*addr, slab) as c:
        h = slab.alloc()
        with pytest.raises(ProtocolError, match="PUT response"):
            c.put([b"a", b"b"], [h, h], 100, [bytes(16)] * 2)


@pytest.mark.parametrize("open_first", [False, True], ids=["connecting", "open"])
def test_silent_node_times_out(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], open_first: bool
) -> None:
    """On the call that connects (framed in Python) and on an open connection
    (one native call, native/rk_call.c), a node that never answers is a
    TransportTimeout within the client's timeout."""
    gate = threading.Event()
    answers = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal answers
        answers += 1
        if open_first and answers == 1:
            ch.send(hdr.opcode | RESPONSE_BIT, b"\x01\x00\x00\x00\x00", req_id=hdr.req_id)
            return True
        gate.wait(30)  # never answers while the test runs
        return False

    addr = fake_node(GOOD_INFO, script)
    with KVClient(*addr, None, timeout=0.5, connect_retries=1) as c:
        if open_first:
            assert c.exists([b"k"]) == [False]
        with pytest.raises(TransportTimeout):
            c.exists([b"k"])
    gate.set()


def test_a_node_that_closes_an_open_connection_is_asked_again_on_a_new_one(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]],
) -> None:
    """The native call on an open connection finds it closed by the node (a
    restart, an idle timeout) after sending: the client asks again once on a
    fresh connection, as every call does after a restart."""
    answers = 0

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal answers
        answers += 1
        if answers == 2:
            return False  # closes the connection, the request unanswered
        ch.send(hdr.opcode | RESPONSE_BIT, b"\x01\x00\x00\x00\x01", req_id=hdr.req_id)
        return True

    addr = fake_node(GOOD_INFO, script)
    with KVClient(*addr, None, connect_retries=1) as c:
        assert c.exists([b"k"]) == [True]
        reconnects = c.reconnects
        assert c.exists([b"k"]) == [True]
        assert (answers, c.reconnects) == (3, reconnects + 1)


@pytest.mark.parametrize("open_first", [False, True], ids=["connecting", "open"])
@pytest.mark.parametrize(
    ("lie", "error"),
    [
        ("req_id", "out of sync"),
        ("opcode", "out of sync"),
        ("bulk", "unexpected 5 bulk bytes"),
        ("status", "no such thing"),
        ("count", "2 entries for 1 keys"),
    ],
)
def test_a_lookup_answer_that_does_not_fit_its_request_is_an_error(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], lie: str, error: str,
    open_first: bool,
) -> None:
    """A control call on an idle connection waits for its answer at once and
    checks it there (not through the pipelined queue): an answer to another
    request, or one with bulk no control op carries, or with another count of
    flags, is a ProtocolError and the connection is dropped; an error status
    is the node's error, and the stream stays in sync for the next call on the
    same connection. So on the call that connects (framed in Python) and on an
    open connection (one native call, which leaves any answer but the plain
    one to the same checks)."""
    answers = 0
    lie_at = 2 if open_first else 1

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        nonlocal answers
        answers += 1
        flags = b"\x01\x00\x00\x00\x01"
        if answers != lie_at:  # a true answer
            ch.send(hdr.opcode | RESPONSE_BIT, flags, req_id=hdr.req_id)
        elif lie == "count":
            ch.send(hdr.opcode | RESPONSE_BIT, b"\x02\x00\x00\x00\x01\x01",
                    req_id=hdr.req_id)
        elif lie == "req_id":
            ch.send(hdr.opcode | RESPONSE_BIT, flags, req_id=hdr.req_id + 1)
        elif lie == "opcode":
            ch.send(Op.DELETE | RESPONSE_BIT, flags, req_id=hdr.req_id)
        elif lie == "bulk":
            ch.send(hdr.opcode | RESPONSE_BIT, flags, req_id=hdr.req_id,
                    bulk=[memoryview(b"extra")], bulk_len=5)
        else:
            ch.send(hdr.opcode | RESPONSE_BIT, b"no such thing", status=Status.BAD_REQUEST,
                    req_id=hdr.req_id)
        return True

    addr = fake_node(GOOD_INFO, script)
    with KVClient(*addr, None, connect_retries=1) as c:
        if open_first:
            assert c.exists([b"k"]) == [True]
        expected = RemoteError if lie == "status" else ProtocolError
        with pytest.raises(expected, match=error):
            c.exists([b"k"])
        reconnects = c.reconnects
        assert c.exists([b"k"]) == [True]
        # a lie about the stream drops the connection; an error answer keeps it
        assert c.reconnects == reconnects + (0 if lie == "status" else 1)
