"""GET answered by the node's native request loop (native/rk_serve.c,
rdmakv/node/native_loop.py) against real nodes: the same answers and bytes as
the Python handler, in order with every other frame on the connection, the
same counts in the node's stats and metrics, and the pins it takes hold a
value whose key is deleted while the value goes out, and are given back.

Which path answered is read from the node's ``get_native`` stat. A GET whose
keys have several lengths is the Python handler's, on every node: each test
that compares the paths runs its GETs both ways (``path``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import NodeProcess, Raw
from test_metrics import scrape

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.node.admission import MIN_IDLE_TO_SHED_S
from rdmakv.wire.batches import decode_get_answer, encode_get, encode_keys
from rdmakv.wire.format import DIGEST_LEN, GET_ENTRY_BYTES, HEADER, RESPONSE_BIT, U32, Op, Status

pytestmark = pytest.mark.timeout(90)

BLOCK = 64 * 1024
DIGEST = b"g" * DIGEST_LEN
PATHS = ["native", "python"]
"""Who answers a test's GETs: the native loop (keys of one length, an
engine's), or the Python handler (keys of two lengths, which the loop hands
to it)."""


def _keys(prefix: bytes, n: int, path: str) -> list[bytes]:
    """``n`` keys; for ``python``, every other one a byte longer."""
    return [b"%s-%03d" % (prefix, i) + (b"x" if path == "python" and i % 2 else b"")
            for i in range(n)]


def _stats(r: Raw) -> dict[str, int]:
    status, payload, _ = r.call(Op.STATS)
    assert status == Status.OK
    stats: dict[str, int] = json.loads(payload)
    return stats


def _values(c: KVClient, slab: Slab, keys: list[bytes], sizes: list[int]) -> dict[bytes, bytes]:
    """Put a random value of each size under each key; the values."""
    src = slab.alloc_many(len(keys))
    values = {}
    for key, h, n in zip(keys, src, sizes, strict=True):
        values[key] = os.urandom(n)
        slab.numpy(h)[:n] = memoryview(values[key])
    assert c.put(keys, src, sizes, [DIGEST] * len(keys)) == [True] * len(keys)
    for h in src:
        slab.free(h)
    return values


def _answer(payload: bytes, bulk: bytes, n: int) -> list[bytes | None]:
    """A GET answer's values, per key (None: a miss)."""
    lengths, _ = decode_get_answer(payload, n)
    out: list[bytes | None] = []
    at = 0
    for length in lengths:
        out.append(None if length == 0 else bulk[at : at + length])
        at += length
    assert at == len(bulk)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_a_get_is_answered_with_the_stored_values_and_counted(
    node_factory: Callable[..., NodeProcess], client_slab: Slab, path: str,
) -> None:
    """Whole and partial values, absent keys and a key asked with another
    digest (a miss), through a client and over a raw connection: the values
    as stored, and lookups, hits, misses and bytes counted as the Python
    handler counts them."""
    node = node_factory()
    keys = _keys(b"get", 40, path)
    sizes = [BLOCK if i % 3 else 1 + i * 997 for i in range(len(keys))]
    with KVClient(*node.address, client_slab) as c:
        values = _values(c, client_slab, keys, sizes)
        asked = [*keys[:20], b"get-999", *keys[20:]]
        digests = [DIGEST] * len(asked)
        digests[5] = b"x" * DIGEST_LEN  # stored under another digest: a miss
        dst = client_slab.alloc_many(len(asked))
        got = c.get_sizes(asked, dst, digests)
        want = [None if i == 5 or k not in values else len(values[k])
                for i, k in enumerate(asked)]
        assert got == want
        for k, h, n in zip(asked, dst, got, strict=True):
            if n is not None:
                assert bytes(client_slab.numpy(h)[:n]) == values[k]
        before = c.stats()
    r = Raw(node)
    r.hello()
    status, payload, bulk = r.call(Op.GET, encode_get(asked, digests))
    assert status == Status.OK
    assert _answer(payload, bulk, len(asked)) == [
        None if n is None else values[k] for k, n in zip(asked, want, strict=True)
    ]
    after = _stats(r)
    hits = sum(n is not None for n in want)
    assert after["lookups"] - before["lookups"] == len(asked)
    assert after["hits"] - before["hits"] == hits
    assert after["misses"] - before["misses"] == len(asked) - hits
    assert after["bytes_read"] - before["bytes_read"] == sum(filter(None, want))
    assert (after["get_native"] > before["get_native"]) == (path == "native")
    assert after["get_native"] - before["get_native"] == (1 if path == "native" else 0)
    r.close()


def test_frames_pipelined_around_native_gets_are_answered_in_order(
    node: NodeProcess, client_slab: Slab
) -> None:
    """One send of GETs the loop answers mixed with GETs it leaves to Python
    (keys of two lengths, a count that does not fit the payload, a GET with
    bulk), EXISTS and a DELETE: every answer comes back in order, each the
    right one, and the loop answered exactly the well-formed one-length GETs."""
    with KVClient(*node.address, client_slab) as c:
        values = _values(c, client_slab, [b"pipe-1", b"pipe-2"], [BLOCK, 300])
    r = Raw(node)
    r.hello()
    frames = [
        (Op.GET, encode_get([b"pipe-1", b"pipe-0", b"pipe-2"], [DIGEST] * 3), b""),  # native
        (Op.GET, encode_get([b"pipe-1", b"longer-key"], [DIGEST] * 2), b""),  # Python
        (Op.GET, U32.pack(5) + encode_get([b"pipe-1"], [DIGEST])[U32.size :], b""),  # error
        (Op.GET, encode_get([b"pipe-2"], [DIGEST]), b"bulk"),  # Python: error, bulk skipped
        (Op.EXISTS, encode_keys([b"pipe-1", b"pipe-2"]), b""),  # native EXISTS
        (Op.DELETE, encode_keys([b"pipe-2"]), b""),
        (Op.GET, encode_get([b"pipe-2", b"pipe-1"], [DIGEST] * 2), b""),  # native
    ]
    first = r.rid + 1
    r.sock.sendall(b"".join(
        HEADER.pack(op, 0, 0, len(p), len(b), first + i) + p + b
        for i, (op, p, b) in enumerate(frames)
    ))
    answers = []
    for i, (op, _, _) in enumerate(frames):
        hdr, payload, bulk = r.response()
        assert (hdr.opcode, hdr.req_id) == (op | RESPONSE_BIT, first + i), i
        answers.append((hdr.status, payload, bulk))
    r.rid = first + len(frames) - 1
    ok = Status.OK
    assert answers[0][0] == ok
    assert _answer(answers[0][1], answers[0][2], 3) == [values[b"pipe-1"], None,
                                                       values[b"pipe-2"]]
    assert answers[1][0] == ok
    assert _answer(answers[1][1], answers[1][2], 2) == [values[b"pipe-1"], None]
    assert answers[2][0] == Status.BAD_REQUEST and answers[2][2] == b""
    assert answers[3][0] == Status.BAD_REQUEST and b"carries no bulk" in answers[3][1]
    assert answers[4][:2] == (ok, U32.pack(2) + b"\x01\x01")
    assert answers[5][:2] == (ok, U32.pack(1) + b"\x01")
    assert answers[6][0] == ok
    assert _answer(answers[6][1], answers[6][2], 2) == [None, values[b"pipe-1"]]
    stats = _stats(r)
    assert (stats["get_native"], stats["exists_native"]) == (2, 1)
    r.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_value_deleted_while_it_goes_out_arrives_whole_and_its_block_is_freed_after(
    node_factory: Callable[..., NodeProcess], client_slab: Slab, path: str,
) -> None:
    """A GET of 8 MiB to a reader with a small receive buffer that reads only
    the answer's head: the node is held up mid-send with the values pinned.
    Meanwhile another client deletes every key and puts as many new ones. The
    reader then gets every value as it was (no pinned block was reused), and
    once the send is done the pins, the blocks' last references, are given
    back: the pool holds the new keys' blocks and no others."""
    node = node_factory(pool_size=str(512 * BLOCK))
    n = 128
    keys = _keys(b"held", n, path)
    with KVClient(*node.address, client_slab) as c:
        values = _values(c, client_slab, keys, [BLOCK] * n)
        r = Raw(node, rcvbuf=64 * 1024)
        r.hello()
        r.frame(Op.GET, encode_get(keys, [DIGEST] * n))
        hdr = r.ch.recv_header()
        assert (hdr.status, hdr.bulk_len) == (Status.OK, n * BLOCK)
        payload = bytes(r.ch.recv_payload(hdr))
        assert len(payload) == U32.size + GET_ENTRY_BYTES * n
        assert c.delete(keys) == [True] * n  # while the values are still going out
        fresh = [b"new-%03d" % i for i in range(n)]
        new_values = _values(c, client_slab, fresh, [BLOCK] * n)
        bulk = bytearray(hdr.bulk_len)
        r.ch.recv_bulk([memoryview(bulk)])
        assert _answer(payload, bytes(bulk), n) == [values[k] for k in keys]
        stats = _stats(r)  # the same session: its loop (if any) has settled
        assert stats["blocks_used"] == n
        assert stats["entries"] == n
        dst = client_slab.alloc_many(n)
        assert c.get(fresh, dst, [DIGEST] * n) == [True] * n
        assert all(bytes(client_slab.numpy(h)) == new_values[k]
                   for k, h in zip(fresh, dst, strict=True))
        assert (stats["get_native"] == 1) == (path == "native")
    r.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_session_sending_an_answer_is_not_shed_as_idle_from_a_full_node(
    node_factory: Callable[..., NodeProcess], client_slab: Slab, tmp_path: Path, path: str,
) -> None:
    """A node of two connection slots. A's 8 MiB GET is held mid-send by a
    reader that does not drain; B has asked one request and gone idle. Past
    the node's idle floor a third client connects: the node sheds B, and A's
    answer arrives whole. A session sending an answer is busy, not idle, in
    the native loop as in Python."""
    limits = tmp_path / "limits.yaml"
    limits.write_text(yaml.safe_dump({"node": {"max_sessions": 2,
                                               "max_sessions_per_source": 2}}))
    node = node_factory(pool_size=str(512 * BLOCK), config=str(limits))
    n = 128
    keys = _keys(b"busy", n, path)
    with KVClient(*node.address, client_slab) as c:
        values = _values(c, client_slab, keys, [BLOCK] * n)
    time.sleep(1.0)  # the client's session ends: its slot is free
    a = Raw(node, rcvbuf=64 * 1024)
    a.hello()
    a.frame(Op.GET, encode_get(keys, [DIGEST] * n))
    hdr = a.ch.recv_header()
    payload = bytes(a.ch.recv_payload(hdr))
    b = Raw(node)
    b.hello()
    _stats(b)
    time.sleep(MIN_IDLE_TO_SHED_S + 0.5)
    third = Raw(node)
    third.hello()  # a full node made room
    assert b.closed_by_peer()
    bulk = bytearray(hdr.bulk_len)
    a.ch.recv_bulk([memoryview(bulk)])
    assert _answer(payload, bytes(bulk), n) == [values[k] for k in keys]
    for r in (a, b, third):
        r.close()


def test_a_get_too_big_for_the_read_ahead_is_answered_in_python(
    node: NodeProcess, client_slab: Slab
) -> None:
    """The loop reads into the session's 8 KiB read-ahead buffer; a GET of 300
    keys (15 KB of items) is the Python handler's, answered the same way."""
    with KVClient(*node.address, client_slab) as c:
        values = _values(c, client_slab, [b"%031d" % 7], [BLOCK])
    keys = [b"%031d" % i for i in range(300)]
    r = Raw(node)
    r.hello()
    status, payload, bulk = r.call(Op.GET, encode_get(keys, [DIGEST] * len(keys)))
    assert status == Status.OK
    assert _answer(payload, bulk, len(keys)) == [values.get(k) for k in keys]
    assert _stats(r)["get_native"] == 0
    r.close()


def test_natively_answered_gets_are_timed_in_the_metrics(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(metrics_port="0")
    assert node.metrics_url is not None
    with KVClient(*node.address, client_slab) as c:
        _values(c, client_slab, [b"timed"], [BLOCK])
        dst = client_slab.alloc_many(1)
        for _ in range(5):
            assert c.get([b"timed"], dst, [DIGEST]) == [True]
        assert c.stats()["get_native"] == 5
    m = scrape(node.metrics_url)
    assert m[("rdmakv_node_request_seconds_count", (("op", "get"),))] == 5
    assert m[("rdmakv_node_lookups_total", ())] >= 5

