"""The node's native request loop answering EXISTS (rdmakv/node/native_loop.py, native/rk_serve.c)
against real nodes: it answers what the Python handler would, in order with
every other frame on the connection, under the store's lock, and hands the
rest (other opcodes, malformed or oversized EXISTS, frames that come in
pieces) to the session's Python code.

Which path answered is read from the node's ``exists_native`` counter, which
both paths' answers are checked against. An EXISTS whose keys have several
lengths is the Python handler's, on every node: the tests that compare the
paths send one to reach it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable

import pytest
from conftest import NodeProcess, Raw
from test_metrics import scrape

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.wire.batches import decode_flags, decode_put_answer, encode_alloc, encode_keys
from rdmakv.wire.format import (
    HEADER,
    MAX_KEYS_PER_REQUEST,
    RESPONSE_BIT,
    U16,
    U32,
    AllocStatus,
    Op,
    Status,
)

pytestmark = pytest.mark.timeout(90)

BLOCK = 64 * 1024
DIGEST = b"d" * 16


def _stats(r: Raw) -> dict[str, int]:
    status, payload, _ = r.call(Op.STATS)
    assert status == Status.OK
    stats: dict[str, int] = json.loads(payload)
    return stats


def _frame(opcode: int, payload: bytes, req_id: int, bulk: bytes = b"") -> bytes:
    return HEADER.pack(opcode, 0, 0, len(payload), len(bulk), req_id) + payload + bulk


def _put_values(c: KVClient, slab: Slab, keys: list[bytes]) -> list[int]:
    """Put one block per key, each filled with a byte of its own; the source blocks."""
    src = slab.alloc_many(len(keys))
    for i, h in enumerate(src):
        slab.numpy(h)[:] = (i * 7 + 1) % 256
    assert c.put(keys, src, BLOCK, [DIGEST] * len(keys)) == [True] * len(keys)
    return src


def test_frames_pipelined_around_native_answers_are_answered_in_order(
    node: NodeProcess, client_slab: Slab
) -> None:
    """One send of EXISTS requests the loop answers mixed with ones it leaves to
    Python (keys of two lengths, a count that does not fit, an empty payload),
    other opcodes, and a PUT whose bulk follows in the same bytes: every answer
    comes back in order, each the right one, and the loop answered exactly the
    well-formed one-length EXISTS requests."""
    with KVClient(*node.address, client_slab) as c:
        _put_values(c, client_slab, [b"here-1", b"here-2"])
    r = Raw(node)
    r.hello()
    value = os.urandom(1000)
    frames = [
        (Op.EXISTS, encode_keys([b"here-1", b"gone-1", b"here-2"]), b""),   # native
        (Op.EXISTS, encode_keys([b"here-1", b"longer-key", b"x"]), b""),     # Python
        (Op.EXISTS, U32.pack(5) + U16.pack(3) + b"abc", b""),                # Python: error
        (Op.EXISTS, b"", b""),                                               # Python: error
        (Op.DELETE, encode_keys([b"here-2"]), b""),
        (Op.EXISTS, encode_keys([b"here-1", b"here-2"]), b""),               # native
        (Op.PUT, encode_alloc([b"put-1"], [len(value)], [DIGEST]), value),
        (Op.EXISTS, encode_keys([b"put-1"]), b""),                           # native: not committed
        (Op.EXISTS, encode_keys([b"here-1"] * 3), b""),                      # native
    ]
    first = r.rid + 1
    r.sock.sendall(b"".join(_frame(op, p, first + i, b) for i, (op, p, b) in enumerate(frames)))
    answers = []
    for i, (op, _, _) in enumerate(frames):
        hdr, payload, bulk = r.response()
        assert (hdr.opcode, hdr.req_id, bulk) == (op | RESPONSE_BIT, first + i, b""), i
        answers.append((hdr.status, payload))
    r.rid = first + len(frames) - 1
    ok = Status.OK
    assert answers[0] == (ok, U32.pack(3) + b"\x01\x00\x01")
    assert answers[1] == (ok, U32.pack(3) + b"\x01\x00\x00")
    assert answers[2][0] == Status.BAD_REQUEST and b"cannot fit" in answers[2][1]
    assert answers[3][0] == Status.BAD_REQUEST
    assert answers[4] == (ok, U32.pack(1) + b"\x01")
    assert answers[5] == (ok, U32.pack(2) + b"\x01\x00")
    assert answers[6][0] == ok
    assert decode_put_answer(answers[6][1], 1) == [AllocStatus.OK]
    assert answers[7] == (ok, U32.pack(1) + b"\x00")
    assert answers[8] == (ok, U32.pack(3) + b"\x01\x01\x01")
    assert _stats(r)["exists_native"] == 4
    r.close()


def test_an_exists_request_that_comes_in_pieces_is_answered(
    node: NodeProcess, client_slab: Slab
) -> None:
    """A request cut inside its header, then inside its payload, with pauses longer
    than the loop's turn (the node's poll interval) between the pieces: the loop
    hands the part it has to Python, which waits for the rest, and the next whole
    request is answered natively again."""
    with KVClient(*node.address, client_slab) as c:
        _put_values(c, client_slab, [b"piece-1"])
    r = Raw(node)
    r.hello()
    for cut in (10, HEADER.size + 7):
        r.rid += 1
        frame = _frame(Op.EXISTS, encode_keys([b"piece-1", b"piece-0"]), r.rid)
        r.sock.sendall(frame[:cut])
        time.sleep(0.5)
        r.sock.sendall(frame[cut:])
        hdr, payload, _ = r.response()
        assert (hdr.status, hdr.req_id, payload) == (Status.OK, r.rid, U32.pack(2) + b"\x01\x00")
    before = _stats(r)["exists_native"]
    status, payload, _ = r.call(Op.EXISTS, encode_keys([b"piece-1"]))
    assert (status, payload) == (Status.OK, U32.pack(1) + b"\x01")
    assert _stats(r)["exists_native"] == before + 1
    r.close()


def test_an_exists_request_larger_than_the_read_ahead_is_answered_in_python(
    node: NodeProcess, client_slab: Slab
) -> None:
    """The loop reads into the session's read-ahead buffer; a request that cannot
    fit it (16384 keys) is the Python handler's, answered the same way."""
    with KVClient(*node.address, client_slab) as c:
        _put_values(c, client_slab, [b"%015d" % 7])
    keys = [b"%015d" % i for i in range(MAX_KEYS_PER_REQUEST)]
    r = Raw(node)
    r.hello()
    status, payload, _ = r.call(Op.EXISTS, encode_keys(keys))
    assert status == Status.OK
    assert decode_flags(payload, len(keys), "EXISTS") == [i == 7 for i in range(len(keys))]
    assert _stats(r)["exists_native"] == 0
    r.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_exists_keeps_what_it_found_from_eviction(
    node_factory: Callable[..., NodeProcess], client_slab: Slab, native: bool,
) -> None:
    """EXISTS makes what it found the most recently used, natively as in Python:
    in a full pool, the keys asked for outlive older and newer ones that were not,
    when new puts evict. ``python``: each EXISTS also names a key of another
    length (a miss), so the Python handler answers it."""
    blocks = 16
    node = node_factory(pool_size=str(blocks * BLOCK))
    old = [b"old-%02d" % i for i in range(blocks)]
    other = [] if native else [b"another-length"]
    with KVClient(*node.address, client_slab) as c:
        for key in old:  # one at a time: their order is the LRU order
            _put_values(c, client_slab, [key])
        asked = old[: blocks // 2]
        assert c.exists(asked + other) == [True] * len(asked) + [False] * len(other)
        new = [b"new-%02d" % i for i in range(blocks // 2)]
        _put_values(c, client_slab, new)
        assert c.exists(old + new + other) == [True] * len(asked) + [False] * (blocks // 2) + [
            True
        ] * len(new) + [False] * len(other)
        stats = c.stats()
    assert stats["evictions"] == blocks // 2
    assert (stats["exists_native"] > 0) == native


def test_natively_answered_exists_is_timed_in_the_metrics(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(metrics_port="0")
    assert node.metrics_url is not None
    with KVClient(*node.address, client_slab) as c:
        for _ in range(5):
            assert c.exists([b"a", b"b"]) == [False, False]
        assert c.stats()["exists_native"] == 5
    m = scrape(node.metrics_url)
    assert m[("rdmakv_node_request_seconds_count", (("op", "exists"),))] == 5


def test_exists_during_puts_that_evict_from_other_sessions(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    """Sessions asking EXISTS (natively, under the store's lock, without the GIL)
    while others put into a full pool (evicting, under the same lock from
    Python): every call completes, and what EXISTS found a moment before a get
    is either still there with its own bytes or a miss, never wrong bytes."""
    blocks = 32
    node = node_factory(pool_size=str(blocks * BLOCK))
    errors: list[BaseException] = []
    rounds = 40

    def writer(w: int) -> None:
        slab = Slab(8 * BLOCK, BLOCK, lock=False)
        try:
            with KVClient(*node.address, slab) as c:
                for i in range(rounds):
                    keys = [b"w%d-%03d-%d" % (w, i, j) for j in range(4)]
                    src = slab.alloc_many(4)
                    for j, h in enumerate(src):
                        slab.numpy(h)[:] = hashlib.blake2b(keys[j], digest_size=1).digest()[0]
                    c.put(keys, src, BLOCK, [DIGEST] * 4)
                    for h in src:
                        slab.decref(h)
        except BaseException as e:
            errors.append(e)
        finally:
            slab.close()

    def reader(w: int) -> None:
        slab = Slab(8 * BLOCK, BLOCK, lock=False)
        try:
            with KVClient(*node.address, slab) as c:
                for i in range(rounds * 4):
                    keys = [b"w%d-%03d-%d" % (i % 2, i // 4, j) for j in range(4)]
                    found = c.exists(keys)
                    assert len(found) == 4
                    dst = slab.alloc_many(4)
                    got = c.get(keys, dst, [DIGEST] * 4)
                    for key, hit, h in zip(keys, got, dst, strict=True):
                        if hit:
                            fill = hashlib.blake2b(key, digest_size=1).digest()[0]
                            assert bytes(slab.view(h)) == bytes([fill]) * BLOCK, key
                        slab.decref(h)
        except BaseException as e:
            errors.append(e)
        finally:
            slab.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=reader, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(80)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    with KVClient(*node.address, client_slab) as c:
        stats = c.stats()
    assert stats["evictions"] > 0 and stats["exists_native"] > 0


def test_a_node_stops_cleanly_with_sessions_waiting_in_the_loop(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory()
    clients = [KVClient(*node.address, client_slab) for _ in range(3)]
    for c in clients:
        assert c.exists([b"k"]) == [False]  # each session now waits in the native loop
    assert node.terminate() == 0
    assert "node stopped" in node.stderr()
    for c in clients:
        c.close()
