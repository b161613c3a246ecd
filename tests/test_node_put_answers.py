"""A PUT's answer held back for its COMMIT's (rdmakv/node/server.py,
``Session.reply(may_wait=True)``), against real nodes: when the COMMIT is
already here, both answers leave in one system call; the PUT's answer is
never held while nothing else is here (a client that waits for it gets it),
never behind an answer the native loop sends, never lost when the client
half-closes, and every answer stays in order with the right contents.

Each test runs with its EXISTS and GET answered by the native request loop
and by the Python handler (``path``: the keys of each such request then
have two lengths, which the loop hands to Python).
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable

import pytest
from conftest import NodeProcess, Raw

from rdmakv.wire.batches import (
    decode_flags,
    decode_get_answer,
    decode_put_answer,
    encode_alloc,
    encode_commit,
    encode_get,
    encode_keys,
)
from rdmakv.wire.format import (
    DIGEST_LEN,
    HEADER,
    RESPONSE_BIT,
    U32,
    AllocStatus,
    Op,
    Status,
    value_checksum,
)

pytestmark = pytest.mark.timeout(60)

DIGEST = b"p" * DIGEST_LEN
PATHS = ["native", "python"]
OTHER_LENGTH = b"absent-key-of-another-length"


@pytest.fixture(params=PATHS)
def extra(request: pytest.FixtureRequest) -> list[bytes]:
    """Keys added to each EXISTS and GET: none (the native loop answers),
    or a miss of another length (the Python handler answers)."""
    return [] if request.param == "native" else [OTHER_LENGTH]


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory()


def _put(key: bytes, value: bytes) -> tuple[Op, bytes, bytes]:
    return Op.PUT, encode_alloc([key], [len(value)], [DIGEST]), value


def _commit(key: bytes, value: bytes) -> tuple[Op, bytes, bytes]:
    return Op.COMMIT, encode_commit([key], [value_checksum(value)]), b""


def _send(r: Raw, frames: list[tuple[Op, bytes, bytes]]) -> int:
    """All frames in one send; the first one's req_id."""
    first = r.rid + 1
    r.sock.sendall(b"".join(HEADER.pack(op, 0, 0, len(p), len(b), first + i) + p + b
                            for i, (op, p, b) in enumerate(frames)))
    r.rid = first + len(frames) - 1
    return first


def _answers(
    r: Raw, frames: list[tuple[Op, bytes, bytes]], first: int
) -> list[tuple[bytes, bytes]]:
    """Every frame's answer, checked to be its own, OK and in order."""
    out = []
    for i, (op, _, _) in enumerate(frames):
        hdr, payload, bulk = r.response()
        assert (hdr.opcode, hdr.req_id, hdr.status) == (op | RESPONSE_BIT, first + i,
                                                         Status.OK), (i, payload)
        out.append((payload, bulk))
    return out


def test_a_put_and_its_commit_are_answered_in_one_send(
    node: NodeProcess, extra: list[bytes],
) -> None:
    """PUT and COMMIT sent together: the first read that finds anything
    finds both answers (they left in one system call), and they say the
    value was stored and committed."""
    r = Raw(node)
    r.hello()
    value = os.urandom(3000)
    frames = [_put(b"one-send", value), _commit(b"one-send", value)]
    first = _send(r, frames)
    assert select.select([r.sock], [], [], 10)[0]
    head = r.sock.recv(1 << 16)
    put_answer = HEADER.size + len(U32.pack(1)) + 1
    commit_answer = HEADER.size + len(U32.pack(1)) + 1
    assert len(head) == put_answer + commit_answer, head
    hdr = HEADER.unpack_from(head, 0)
    assert (hdr[0], hdr[5]) == (Op.PUT | RESPONSE_BIT, first)
    assert decode_put_answer(head[HEADER.size : put_answer], 1) == [AllocStatus.OK]
    hdr = HEADER.unpack_from(head, put_answer)
    assert (hdr[0], hdr[5]) == (Op.COMMIT | RESPONSE_BIT, first + 1)
    assert decode_flags(head[put_answer + HEADER.size :], 1, "COMMIT") == [True]
    status, _, bulk = r.call(Op.GET, encode_get([b"one-send", *extra],
                                                [DIGEST] * (1 + len(extra))))
    assert status == Status.OK and bulk == value
    r.close()


def test_a_put_alone_is_answered_before_its_commit_is_sent(
    node: NodeProcess, extra: list[bytes],
) -> None:
    """Nothing else here: the PUT's answer goes out at once (a client that
    waits for it before sending its COMMIT is not left hanging)."""
    r = Raw(node)
    r.hello()
    value = os.urandom(5000)
    op, payload, bulk = _put(b"alone", value)
    status, answer, _ = r.call(op, payload, bulk=bulk)
    assert status == Status.OK and decode_put_answer(answer, 1) == [AllocStatus.OK]
    op, payload, _ = _commit(b"alone", value)
    status, answer, _ = r.call(op, payload)
    assert status == Status.OK and decode_flags(answer, 1, "COMMIT") == [True]
    status, answer, _ = r.call(Op.EXISTS, encode_keys([b"alone", *extra]))
    assert status == Status.OK and answer == U32.pack(1 + len(extra)) + b"\x01" + bytes(len(extra))
    r.close()


def test_answers_around_held_ones_stay_in_order_to_a_client_that_half_closes(
    node: NodeProcess, extra: list[bytes],
) -> None:
    """Puts pipelined with what the native loop answers (EXISTS, GET), other
    control requests and a last PUT with nothing behind it, then the client
    shuts its sending side: every answer comes back in order and right, the
    last PUT's too, and then the node closes the connection."""
    r = Raw(node)
    r.hello()
    v = {k: os.urandom(n) for k, n in [(b"k1", 700), (b"k2", 20_000), (b"k3", 64), (b"k4", 9)]}
    frames = [
        _put(b"k1", v[b"k1"]), _commit(b"k1", v[b"k1"]),
        (Op.EXISTS, encode_keys([b"k1", b"k2", *extra]), b""),
        _put(b"k2", v[b"k2"]),
        # after a PUT: not held for it
        (Op.GET, encode_get([b"k1", *extra], [DIGEST] * (1 + len(extra))), b""),
        _commit(b"k2", v[b"k2"]),
        (Op.GET, encode_get([b"k2", b"k1", *extra], [DIGEST] * (2 + len(extra))), b""),
        _put(b"k3", v[b"k3"]), (Op.ABORT, encode_keys([b"k3"]), b""),
        (Op.STATS, b"", b""),
        _put(b"k4", v[b"k4"]),  # the last frame: nothing to hold it for
    ]
    first = _send(r, frames)
    r.sock.shutdown(socket.SHUT_WR)
    got = _answers(r, frames, first)
    ok = [AllocStatus.OK]
    assert decode_put_answer(got[0][0], 1) == ok
    assert decode_flags(got[1][0], 1, "COMMIT") == [True]
    assert got[2][0] == U32.pack(2 + len(extra)) + b"\x01\x00" + bytes(len(extra))
    assert decode_put_answer(got[3][0], 1) == ok
    assert decode_get_answer(got[4][0], 1 + len(extra))[0] == [len(v[b"k1"])] + [0] * len(
        extra) and got[4][1] == v[b"k1"]
    assert decode_flags(got[5][0], 1, "COMMIT") == [True]
    assert got[6][1] == v[b"k2"] + v[b"k1"]
    assert decode_put_answer(got[7][0], 1) == ok
    assert decode_flags(got[8][0], 1, "ABORT") == [True]
    assert b"protocol_version" in got[9][0]
    assert decode_put_answer(got[10][0], 1) == ok
    assert r.closed_by_peer()
    r.close()
