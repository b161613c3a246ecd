"""The client's native calls (native/rk_call.c) against a real node.

* The lookup call (``Channel.call_flags``): on an open connection EXISTS and
  DELETE go out and come back in one call; keys it leaves to Python get the
  same answers, and bad ones the same errors, with the connection kept.
* The get call (``Channel.call_get``): a get of one request on an open
  connection goes out, lands in the slab and is checked in one call, with
  the same sizes and bytes as the per-answer Python path.
* Its value receive is rk_tcp.c's: it waits as the process's receive spin
  says and counts in its wait counts (against a fake node, conftest's
  ``fake_node``, that sends a value in two parts).

Answers that do not fit their request are covered against a lying node in
test_client_hostile_node.py. Which path answered is read from what the real
native call returned (a list or tuple: answered; None: left to Python),
recorded by a wrapper around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import NodeProcess, Script, declined_call
from test_client_hostile_node import GOOD_INFO

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import MIN_SUB_BATCH, PIPELINE_WINDOW, KVClient
from rdmakv.errors import ConfigError
from rdmakv.transport.base import REQUEST_BYTES_AHEAD
from rdmakv.transport.tcp import loop as tcp
from rdmakv.wire import channel
from rdmakv.wire.batches import decode_get, encode_flags, encode_get_answer
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    GET_ENTRY_BYTES,
    MAX_KEY_LEN,
    NATIVE_CALL_FRAME_BYTES,
    RECV_AHEAD_BYTES,
    RESPONSE_BIT,
    Header,
    NodeInfo,
    Op,
    value_checksum,
)

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 * 1024
DIGEST = b"d" * 16

REST_WITHHELD_S = 2.0
"""The longest a fake node withholds the rest of a value for a receive to wait
(under the client's timeout, so that a receive that never waits fails on its
counts, not on a timeout)."""


def _record(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """What each call of the native function ``channel.<name>`` returns, in order."""
    real = getattr(channel, name)
    assert real is not None
    out: list[Any] = []

    def recording(*args: Any) -> Any:
        got = real(*args)
        out.append(got)
        return got

    monkeypatch.setattr(channel, name, recording)
    return out


@pytest.fixture
def returned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What each native lookup call returned, in order."""
    yield _record(monkeypatch, "_native_flags_call")


@pytest.fixture
def got_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What each native get call returned, in order."""
    yield _record(monkeypatch, "_native_get_call")


def _client_with(node: NodeProcess, slab: Slab, keys: list[bytes]) -> KVClient:
    c = KVClient(*node.address, slab)
    src = slab.alloc_many(len(keys))
    assert c.put(keys, src, BLOCK, [DIGEST] * len(keys)) == [True] * len(keys)
    return c


def test_exists_and_delete_on_an_open_connection_are_one_native_call(
    node: NodeProcess, client_slab: Slab, returned: list[Any]
) -> None:
    keys = [b"native-%02d" % i for i in range(3)]
    with _client_with(node, client_slab, keys) as c:
        asked = [keys[0], b"absent-00", keys[1], keys[2]]
        assert c.exists(asked) == [True, False, True, True]
        assert returned == [[True, False, True, True]]
        assert c.delete([keys[1], b"absent-00"]) == [True, False]
        assert c.exists(tuple(asked)) == [True, False, False, True]
        assert returned[1:] == [[True, False], [True, False, False, True]]


def test_keys_the_native_call_leaves_to_python_get_the_same_answers(
    node: NodeProcess, client_slab: Slab, returned: list[Any]
) -> None:
    """Keys of several lengths, a bytearray key, and a request whose frame is
    over NATIVE_CALL_FRAME_BYTES are framed in Python, nothing sent natively."""
    keys = [b"short", b"a-longer-key", b"k" * 32]
    with _client_with(node, client_slab, keys) as c:
        assert c.exists([b"short", b"absent", b"a-longer-key"]) == [True, False, True]
        assert c.exists([bytearray(b"short"), b"nope!"]) == [True, False]
        many = [b"%032d" % i for i in range(NATIVE_CALL_FRAME_BYTES // 34 + 1)] + [b"k" * 32]
        assert c.exists(many) == [False] * (len(many) - 1) + [True]
        assert returned == [None, None, None]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([b"fine", "text"], f"key #1 must be 1..{MAX_KEY_LEN} bytes, got str 'text'"),
        ([b""], "key #0 must be 1.."),
        ([b"fine", b"x" * (MAX_KEY_LEN + 1)], "key #1 must be 1.."),
    ],
)
def test_bad_keys_on_an_open_connection_are_named_and_keep_it(
    node: NodeProcess, client_slab: Slab, returned: list[Any], bad: list[Any], error: str
) -> None:
    op: Callable[[list[Any]], list[bool]]
    with _client_with(node, client_slab, [b"fine"]) as c:
        for op in (c.exists, c.delete):
            reconnects = c.reconnects
            with pytest.raises(ConfigError, match=error):
                op(bad)
            assert c.exists([b"fine"]) == [True]
            assert c.reconnects == reconnects
        assert returned == [None, [True], None, [True]]


def _filled(slab: Slab, handles: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for h in handles:
        slab.numpy(h)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)


def test_a_small_get_on_an_open_connection_is_one_native_call(
    node: NodeProcess, client_slab: Slab, got_back: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hits of whole and partial blocks and misses (an absent key, a digest
    of other tokens), in one native call; the per-answer Python path
    (the native call declining) gets the same sizes and bytes. A get of
    several requests is one call too; one whose answers are too big for the
    call is answered in Python."""
    keys = [b"get-%02d" % i for i in range(3)]
    with KVClient(*node.address, client_slab) as c:
        src = client_slab.alloc_many(3)
        _filled(client_slab, src, 7)
        assert c.put(keys[:2], src[:2], BLOCK, [DIGEST] * 2) == [True, True]
        assert c.put(keys[2:], src[2:], 1000, [DIGEST]) == [True]
        asked = [keys[2], b"absent", keys[0], keys[1], keys[0]]
        digests = [DIGEST, DIGEST, DIGEST, DIGEST, b"e" * 16]
        want = [1000, None, BLOCK, BLOCK, None]
        for native in (True, False):
            dst = client_slab.alloc_many(len(asked))
            for h in dst:
                client_slab.numpy(h)[:] = 0xEE
            with monkeypatch.context() as mp:
                if not native:
                    mp.setattr(channel, "_native_get_call", declined_call)
                assert c.get_sizes(asked, dst, digests) == want
            assert bytes(client_slab.view(dst[0])[:1000]) == bytes(client_slab.view(src[2])[:1000])
            assert (client_slab.numpy(dst[0])[1000:] == 0xEE).all()  # nothing past the value
            assert bytes(client_slab.view(dst[2])) == bytes(client_slab.view(src[0]))
            assert bytes(client_slab.view(dst[3])) == bytes(client_slab.view(src[1]))
            for miss in (dst[1], dst[4]):
                assert (client_slab.numpy(miss) == 0xEE).all()
            for h in dst:
                client_slab.free(h)
        assert got_back == [(want, [], None)]
        got_back.clear()
        # several requests (MIN_SUB_BATCH keys each), their answers read in the same call
        many = [keys[0], keys[1], b"absent"] * MIN_SUB_BATCH
        dst = client_slab.alloc_many(len(many))
        assert c.get(many, dst, [DIGEST] * len(many)) == [True, True, False] * MIN_SUB_BATCH
        for i in range(0, len(many), 3):
            assert bytes(client_slab.view(dst[i])) == bytes(client_slab.view(src[0]))
            assert bytes(client_slab.view(dst[i + 1])) == bytes(client_slab.view(src[1]))
        assert got_back == [([BLOCK, BLOCK, None] * MIN_SUB_BATCH, [], None)]
        for h in dst:
            client_slab.free(h)
        # requests whose answers' entries are over the read-ahead buffer: left to Python
        small = 4096  # room for the 1000-byte value, and the slab stays small
        with Slab(small * (RECV_AHEAD_BYTES // GET_ENTRY_BYTES * PIPELINE_WINDOW + 1),
                  small, lock=False) as big:
            many = [b"absent-%05d" % i for i in range(big.num_blocks - 1)] + [keys[2]]
            with KVClient(*node.address, big) as c2:
                got = c2.get_sizes(many, big.alloc_many(len(many)), [DIGEST] * len(many))
            assert got == [None] * (len(many) - 1) + [1000]
        assert got_back[1:] == [None]
        assert c.reconnects == 0


def test_a_get_naming_a_block_twice_is_refused_before_anything_is_sent(
    node: NodeProcess, client_slab: Slab
) -> None:
    """Two values cannot land in one block: the second would overwrite the
    first before its checksum is checked, and the first, a good value, would
    be reported corrupt and deleted on the node."""
    with _client_with(node, client_slab, [b"one", b"two"]) as c:
        h, h2 = client_slab.alloc_many(2)
        with pytest.raises(ConfigError, match=rf"block handle {h} is named twice \(#0 and #2\)"):
            c.get([b"one", b"two", b"one"], [h, h2, h], [DIGEST] * 3)
        assert c.get([b"one", b"two"], [h, h2], [DIGEST] * 2) == [True, True]
        assert c.checksum_mismatches == 0


def test_a_get_of_requests_over_the_flow_control_window_is_one_native_call(
    node: NodeProcess, client_slab: Slab, got_back: list[Any]
) -> None:
    """Requests of long keys, each over REQUEST_BYTES_AHEAD on its own, all
    answered in the one call (that each goes out only once the answer
    before it is in is checked against a fake node in
    test_client_hostile_node.py)."""
    long_keys = [b"%0*d" % (MAX_KEY_LEN, i) for i in range(3 * MIN_SUB_BATCH)]
    assert MIN_SUB_BATCH * (MAX_KEY_LEN + 18) > REQUEST_BYTES_AHEAD
    with KVClient(*node.address, client_slab) as c:
        src = client_slab.alloc_many(2)
        _filled(client_slab, src, 11)
        stored = [long_keys[5], long_keys[-1]]
        assert c.put(stored, src, BLOCK, [DIGEST] * 2) == [True, True]
        dst = client_slab.alloc_many(len(long_keys))
        got = c.get_sizes(long_keys, dst, [DIGEST] * len(long_keys))
        want: list[int | None] = [None] * len(long_keys)
        want[5] = want[-1] = BLOCK
        assert got == want
        assert bytes(client_slab.view(dst[5])) == bytes(client_slab.view(src[0]))
        assert bytes(client_slab.view(dst[-1])) == bytes(client_slab.view(src[1]))
        assert got_back == [(want, [], None)]


def test_the_native_get_receives_with_the_process_receive_spin_setting(
    fake_node: Callable[[NodeInfo, Script], tuple[str, int]], got_back: list[Any]
) -> None:
    """rk_call.c and rk_tcp.c are one shared object (rdmakv._native), so the
    get call's value receive obeys tcp.set_recv_spin_us and counts in
    tcp.recv_wait_counts. The node sends the answer's head and half the
    value, and the rest only once a receive of this process has slept for
    it: however loaded the host, the value's receive has to wait (the head's
    own wait, in rk_call.c, is not counted)."""
    value = np.random.default_rng(3).integers(0, 256, GOOD_INFO.block_size, np.uint8).tobytes()
    half = len(value) // 2

    def script(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        if hdr.opcode == Op.EXISTS:
            ch.send(hdr.opcode | RESPONSE_BIT, encode_flags([True]), req_id=hdr.req_id)
            return True
        assert decode_get(payload)[0] == [b"spin"]
        slept = tcp.recv_wait_counts().slept  # the client waits for the head: not counted
        ch.send(hdr.opcode | RESPONSE_BIT,
                encode_get_answer([len(value)], [value_checksum(value)]), req_id=hdr.req_id,
                bulk=[memoryview(value[:half])], bulk_len=len(value))
        # a receive that never counts its wait gets the rest all the same, late
        # (and the assertions below fail, not the get)
        given_up = time.monotonic() + REST_WITHHELD_S
        while tcp.recv_wait_counts().slept == slept and time.monotonic() < given_up:
            time.sleep(0.001)
        ch.sock.sendall(value[half:])
        return True

    before_us = tcp.recv_spin_us()
    with Slab(2 * GOOD_INFO.block_size, GOOD_INFO.block_size, lock=False) as slab, \
            KVClient(*fake_node(GOOD_INFO, script), slab) as c:
        assert c.exists([b"spin"]) == [True]  # the get goes out on an open connection
        h = slab.alloc()
        tcp.set_recv_spin_us(0)
        try:
            before = tcp.recv_wait_counts()
            assert c.get([b"spin"], [h], [DIGEST]) == [True]
            after = tcp.recv_wait_counts()
        finally:
            tcp.set_recv_spin_us(before_us)
        assert len(got_back) == 1 and got_back[0] is not None  # the native call answered
        assert bytes(slab.view(h)) == value
    assert after.slept > before.slept  # its waits are the process's ...
    assert after.spun == before.spun  # ... and none spun with spinning off
    assert tcp.receives_in_flight() == 0
