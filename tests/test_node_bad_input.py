"""Hostile and broken clients against a real node, speaking raw frames.

Each case must get a clear error (a status naming what was wrong), and the node
must keep serving its other clients with their data intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import IO_TIMEOUT_S, NodeProcess, Raw

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import ConfigError, ProtocolError, UnsupportedTransport
from rdmakv.node.session import status_for
from rdmakv.transport import get_transport, resolve_transport
from rdmakv.wire.batches import (
    decode_extents,
    decode_flags,
    decode_get_answer,
    decode_put_answer,
    encode_alloc,
    encode_commit,
    encode_get,
    encode_keys,
)
from rdmakv.wire.format import (
    FATAL_STATUSES,
    MAGIC,
    MAX_KEYS_PER_REQUEST,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    U16,
    U32,
    AllocStatus,
    FrameTooLarge,
    LimitExceeded,
    Op,
    Status,
    encode_hello,
    value_checksum,
)

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 * 1024


@pytest.fixture
def raw(node: NodeProcess) -> Iterator[Callable[[], Raw]]:
    conns: list[Raw] = []

    def make() -> Raw:
        r = Raw(node)
        conns.append(r)
        return r

    yield make
    for r in conns:
        r.close()


@pytest.fixture
def victim(node: NodeProcess, client_slab: Slab) -> Iterator[Callable[[], None]]:
    """A well-behaved client with data on the node; calling it checks the data is intact."""
    src = client_slab.alloc_many(4)
    for i, h in enumerate(src):
        client_slab.numpy(h)[:] = i + 1
    digests = [hashlib.blake2b(client_slab.view(h), digest_size=16).digest() for h in src]
    keys = [b"victim-%d" % i for i in range(4)]
    c = KVClient(*node.address, client_slab)
    assert c.put(keys, src, BLOCK, digests) == [True] * 4

    def check() -> None:
        dst = client_slab.alloc_many(4)
        assert c.get(keys, dst, digests) == [True] * 4
        for s, d in zip(src, dst, strict=True):
            assert bytes(client_slab.view(s)) == bytes(client_slab.view(d))
        for d in dst:
            client_slab.decref(d)

    yield check
    c.close()


def test_wrong_protocol_version_is_refused(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r = raw()
    status, msg, _ = r.call(Op.HELLO, encode_hello(None, version=PROTOCOL_VERSION + 41))
    assert status == Status.BAD_VERSION
    assert f"version {PROTOCOL_VERSION + 41}" in msg.decode()
    assert r.closed_by_peer()
    victim()


def test_bad_magic_and_request_before_hello(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r = raw()
    status, msg, _ = r.call(Op.HELLO, b"HTTP" + encode_hello(None)[4:])
    assert status == Status.BAD_REQUEST and b"magic" in msg
    assert r.closed_by_peer()
    r = raw()
    status, msg, _ = r.call(Op.EXISTS, encode_keys([b"victim-0"]))
    assert status == Status.NOT_AUTHENTICATED and b"HELLO" in msg
    assert r.closed_by_peer()
    victim()


def test_garbage_bytes_are_dropped(node: NodeProcess, victim: Callable[[], None]) -> None:
    with socket.create_connection(node.address, timeout=IO_TIMEOUT_S) as s:
        s.sendall(os.urandom(4096))
        # whatever the node answers, it closes the connection (FIN, or RST as it
        # drops our unread garbage) and stays up
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
    assert node.alive()
    victim()


def test_absurd_frame_lengths_close_only_that_connection(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r = raw()
    r.hello()
    r.frame(Op.EXISTS, b"", payload_len=MAX_PAYLOAD + 1)
    hdr, msg, _ = r.response()
    assert hdr.status == Status.FRAME_TOO_LARGE and str(MAX_PAYLOAD) in msg.decode()
    assert r.closed_by_peer()
    r = raw()
    r.hello()
    r.frame(Op.PUT, U32.pack(0), bulk_len=2**63)
    hdr, msg, _ = r.response()
    assert hdr.status == Status.FRAME_TOO_LARGE and b"bulk" in msg
    victim()


def test_malformed_payloads_keep_the_connection(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r = raw()
    r.hello()
    # count says 5 keys, payload holds one
    bad = U32.pack(5) + U16.pack(3) + b"abc"
    status, msg, _ = r.call(Op.EXISTS, bad)
    assert status == Status.BAD_REQUEST and b"cannot fit" in msg
    # a key of length zero
    status, msg, _ = r.call(Op.LOOKUP, U32.pack(1) + U16.pack(0) + b"x")
    assert status == Status.BAD_REQUEST and b"key length 0" in msg
    # trailing junk
    status, msg, _ = r.call(Op.DELETE, encode_keys([b"x"]) + b"junk")
    assert status == Status.BAD_REQUEST and b"trailing" in msg
    # absurd counts are refused before anything is allocated for them
    status, msg, _ = r.call(Op.EXISTS, U32.pack(2**32 - 1))
    assert status == Status.LIMIT_EXCEEDED and str(MAX_KEYS_PER_REQUEST).encode() in msg
    status, msg, _ = r.call(Op.PUT, U32.pack(MAX_KEYS_PER_REQUEST + 1), bulk=b"x" * 100)
    assert status == Status.LIMIT_EXCEEDED
    status, msg, _ = r.call(Op.STATS, b"x")
    assert status == Status.BAD_REQUEST
    # unknown opcode
    status, msg, _ = r.call(0x55, b"whatever", bulk=b"y" * 1000)
    assert status == Status.UNKNOWN_OPCODE and b"85" in msg
    # still in sync: a good request works on the same connection
    status, payload, _ = r.call(Op.EXISTS, encode_keys([b"victim-0", b"nope"]))
    assert status == Status.OK and decode_flags(payload, 2, "EXISTS") == [True, False]
    victim()


def test_get_answers_committed_values_with_their_digest_only(
    raw: Callable[[], Raw], victim: Callable[[], None], client_slab: Slab
) -> None:
    r = raw()
    r.hello()
    value = os.urandom(1000)
    status, payload, _ = r.call(Op.PUT, encode_alloc([b"g"], [1000], [b"d" * 16]), bulk=value)
    assert status == Status.OK and decode_put_answer(payload, 1) == [AllocStatus.OK]
    r.call(Op.COMMIT, encode_commit([b"g"], [value_checksum(value)]))
    status, payload, _ = r.call(Op.ALLOC, encode_alloc([b"pend"], [10], [b"d" * 16]))
    assert status == Status.OK and decode_extents(payload, 1)[0].extent is not None
    # a hit, a wrong digest, an uncommitted key, an unknown key, the hit again
    keys = [b"g", b"g", b"pend", b"none", b"g"]
    digests = [b"d" * 16, b"e" * 16, b"d" * 16, b"d" * 16, b"d" * 16]
    status, payload, bulk = r.call(Op.GET, encode_get(keys, digests))
    assert status == Status.OK
    lengths, sums = decode_get_answer(payload, len(keys))
    assert lengths == [1000, 0, 0, 0, 1000]
    assert sums == [value_checksum(value), 0, 0, 0, value_checksum(value)]
    assert bulk == value + value
    # bad GETs get a clear error and the connection stays in sync
    status, msg, _ = r.call(Op.GET, encode_get([b"g"], [b"d" * 16])[:-1])
    assert status == Status.BAD_REQUEST and b"GET" in msg
    status, msg, _ = r.call(Op.GET, encode_get([b"g"], [b"d" * 16]), bulk=b"x" * 64)
    assert status == Status.BAD_REQUEST and b"no bulk" in msg
    status, msg, _ = r.call(Op.GET, U32.pack(MAX_KEYS_PER_REQUEST + 1))
    assert status == Status.LIMIT_EXCEEDED
    status, payload, bulk = r.call(Op.GET, encode_get([b"victim-1"], [bytes(16)]))
    assert status == Status.OK and decode_get_answer(payload, 1) == ([0], [0]) and bulk == b""
    assert r.call(Op.STATS)[0] == Status.OK
    victim()


def test_put_receives_what_it_allocates_and_drops_the_rest(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r, other = raw(), raw()
    r.hello()
    other.hello()
    d = b"d" * 16
    assert other.call(Op.ALLOC, encode_alloc([b"theirs"], [10], [d]))[0] == Status.OK
    big = BLOCK * 40 + 3  # refused (over the block size); its bytes span several drains
    values = [os.urandom(1000), b"v" * 5, b"t" * 10, os.urandom(big), os.urandom(BLOCK)]
    keys = [b"p1", b"victim-0", b"theirs", b"huge", b"p2"]
    status, payload, _ = r.call(
        Op.PUT, encode_alloc(keys, [len(v) for v in values], [d] * 5), bulk=b"".join(values)
    )
    assert status == Status.OK, payload
    assert decode_put_answer(payload, 5) == [
        AllocStatus.OK, AllocStatus.EXISTS, AllocStatus.BUSY, AllocStatus.TOO_LARGE,
        AllocStatus.OK,
    ]
    sums = [value_checksum(v) for v in values]
    status, payload, _ = r.call(Op.COMMIT, encode_commit(keys, sums), flags=1)  # written only
    assert decode_flags(payload, 5, "COMMIT") == [True, False, False, False, True]
    status, payload, bulk = r.call(Op.GET, encode_get([b"p1", b"p2"], [d, d]))
    assert decode_get_answer(payload, 2) == ([1000, BLOCK], [sums[0], sums[4]])
    assert bulk == values[0] + values[4]  # the refused values' bytes went nowhere
    # bulk that does not match the items: refused, skipped, nothing allocated
    status, msg, _ = r.call(Op.PUT, encode_alloc([b"p3"], [100], [d]), bulk=b"x" * 99)
    assert status == Status.BAD_REQUEST and b"99" in msg
    status, msg, _ = r.call(Op.PUT, encode_alloc([b"p3"], [100], [d])[:-1], bulk=b"x" * 100)
    assert status == Status.BAD_REQUEST
    assert r.call(Op.EXISTS, encode_keys([b"p3"]))[1] == U32.pack(1) + b"\x00"
    assert json.loads(r.call(Op.STATS)[1])["pending"] == 1  # only the other client's
    victim()


def test_a_put_cut_off_mid_bulk_leaves_nothing_allocated(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r, watcher = raw(), raw()
    r.hello()
    watcher.hello()
    r.frame(Op.PUT, encode_alloc([b"cut"], [BLOCK], [b"d" * 16]), bulk=b"x" * 100,
            bulk_len=BLOCK)
    r.close()
    deadline = time.monotonic() + IO_TIMEOUT_S
    while json.loads(watcher.call(Op.STATS)[1])["pending"]:
        assert time.monotonic() < deadline, "the cut-off PUT's extent was never reclaimed"
        time.sleep(0.05)
    assert watcher.call(Op.EXISTS, encode_keys([b"cut"]))[1] == U32.pack(1) + b"\x00"
    victim()


def test_a_commit_of_keys_another_client_allocated_is_a_per_key_false(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r, other = raw(), raw()
    r.hello()
    other.hello()
    status, payload, _ = r.call(Op.ALLOC, encode_alloc([b"mine"], [1000], [bytes(16)]))
    assert status == Status.OK and decode_extents(payload, 1)[0].extent is not None
    # not an error: the node answers per key, and the extent stays the allocator's
    keys = [b"victim-0", b"nope", b"mine"]
    status, payload, _ = other.call(Op.COMMIT, encode_commit(keys, [0] * 3))
    assert status == Status.OK and decode_flags(payload, 3, "COMMIT") == [False] * 3
    status, payload, _ = r.call(Op.COMMIT, encode_commit([b"mine"], [0]))
    assert status == Status.OK and decode_flags(payload, 1, "COMMIT") == [True]
    victim()


def test_wrong_token_is_refused_in_constant_time_compare(
    node_factory: Callable[..., NodeProcess],
) -> None:
    node = node_factory(token=b"right-token")
    for token in (None, b"wrong-token", b"right-toke", b"right-token-plus"):
        r = Raw(node)
        status, msg, _ = r.call(Op.HELLO, encode_hello(token))
        assert status == Status.AUTH_FAILED and b"token" in msg
        assert r.closed_by_peer()
        r.close()
    r = Raw(node)
    r.hello(b"right-token")
    status, _, _ = r.call(Op.EXISTS, encode_keys([b"a"]))
    assert status == Status.OK
    r.close()


def test_oversized_token_and_hello_limits(raw: Callable[[], Raw]) -> None:
    r = raw()
    payload = struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, 60000) + b"t" * 10
    status, msg, _ = r.call(Op.HELLO, payload)
    assert status == Status.BAD_REQUEST and b"token length" in msg
    assert r.closed_by_peer()


def test_any_error_answer_to_hello_closes_later_ones_only_when_fatal(
    raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    """The one rule for closing (Session.fail): the same status (BAD_REQUEST,
    not in FATAL_STATUSES) closes a connection in its handshake and keeps one
    that has said HELLO."""
    assert Status.BAD_REQUEST not in FATAL_STATUSES
    r = raw()
    status, msg, _ = r.call(Op.HELLO, encode_hello(None), bulk=b"x" * 10)
    assert status == Status.BAD_REQUEST and b"no bulk" in msg
    assert r.closed_by_peer()
    r = raw()
    r.hello()
    status, msg, _ = r.call(Op.STATS, b"", bulk=b"x" * 10)
    assert status == Status.BAD_REQUEST and b"carries no bulk" in msg
    status, payload, _ = r.call(Op.EXISTS, encode_keys([b"victim-0"]))
    assert status == Status.OK and decode_flags(payload, 1, "EXISTS") == [True]
    victim()


def test_a_refused_request_is_answered_by_its_error_type_not_its_message() -> None:
    assert status_for(LimitExceeded("transport")) == Status.LIMIT_EXCEEDED
    assert status_for(FrameTooLarge("x")) == Status.FRAME_TOO_LARGE in FATAL_STATUSES
    assert status_for(UnsupportedTransport("x")) == Status.UNSUPPORTED
    # a message that names a transport makes no other error UNSUPPORTED
    assert status_for(ConfigError("transport 'tcp' claims opcode 5")) == Status.BAD_REQUEST
    assert status_for(ProtocolError("no transport here")) == Status.BAD_REQUEST
    # what the transport registry refuses is of that type
    with pytest.raises(UnsupportedTransport, match="unknown transport"):
        get_transport("carrier-pigeon")
    with pytest.raises(UnsupportedTransport, match="node offers only"):
        resolve_transport("tcp", ("rdma",))


def test_node_counts_refusals_and_keeps_serving(
    node: NodeProcess, raw: Callable[[], Raw], victim: Callable[[], None]
) -> None:
    r = raw()
    r.hello()
    r.call(Op.EXISTS, U32.pack(2**32 - 1))  # over a limit
    r.call(0x77)
    with KVClient(*node.address, None) as c:
        st = c.stats()
    assert st["refused_over_limit"] >= 1 and st["protocol_errors"] >= 2
    victim()
