"""Ends of different protocol versions refuse each other at HELLO, clearly.

Protocol version 5 retired TCP WRITE / READ (opcodes 16, 17) and ``max_ops``
in the HELLO answer. A version-4 client against a version-5 node, and a
version-5 client against a version-4 node, must each get a version error that
names both versions and which end to upgrade, not a confusing decode error,
and a client must not retry it (it cannot succeed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from conftest import NodeProcess, Raw, Script

from rdmakv.client.node_client import KVClient
from rdmakv.errors import ProtocolError, VersionMismatch
from rdmakv.wire.batches import decode_flags, encode_keys
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    RETIRED_OPCODES,
    U32,
    Header,
    NodeInfo,
    Op,
    Status,
    decode_hello,
    encode_hello,
    encode_node_info,
)

pytestmark = pytest.mark.timeout(60)

V4 = 4
"""The version before WRITE / READ were retired."""
INFO = NodeInfo(PROTOCOL_VERSION, 0, 4096, 1 << 40, 1 << 20, b"n" * 16, 1, 1 << 20, 1024,
                1 << 24, ("tcp",))

FakeNode = Callable[[Script], tuple[str, int]]
"""conftest's ``fake_node`` with a Script that answers HELLO itself."""


def _greeted(seen: list[int], answer: Callable[[Channel, int, int], None]) -> Script:
    """A HELLO answer that records the client's version in ``seen``, has
    ``answer(channel, request id, client version)`` reply, and closes."""

    def hello(ch: Channel, hdr: Header, payload: bytearray) -> bool:
        version = decode_hello(payload)[0]
        seen.append(version)
        answer(ch, hdr.req_id, version)
        return False

    return hello


def test_a_version_4_client_is_refused_naming_both_versions(node: NodeProcess) -> None:
    r = Raw(node)
    try:
        status, msg, _ = r.call(Op.HELLO, encode_hello(None, version=V4))
        assert status == Status.BAD_VERSION
        assert msg.decode() == (
            f"node speaks protocol version {PROTOCOL_VERSION}, client protocol version {V4}: "
            "upgrade rdmakv on the client (both ends must speak the same version)"
        )
        assert r.closed_by_peer()  # BAD_VERSION is fatal
    finally:
        r.close()
    # the node serves clients of its own version as before
    with KVClient(*node.address, None) as c:
        assert c.exists([b"k"]) == [False]


def test_a_version_5_client_refused_by_a_version_4_node_says_so_at_once(
    fake_node: FakeNode,
) -> None:
    """A version-4 node answers BAD_VERSION in its own words: the client
    raises it as a VersionMismatch on the first attempt, not after retrying
    as if the node were starting."""

    def old_node(ch: Channel, req_id: int, version: int) -> None:
        ch.send(Op.HELLO | RESPONSE_BIT,
                f"client speaks protocol version {version}, this node speaks {V4}".encode(),
                status=Status.BAD_VERSION, req_id=req_id)

    seen: list[int] = []
    addr = fake_node(_greeted(seen, old_node))
    with pytest.raises(VersionMismatch) as e:
        KVClient(*addr, None, connect_retries=3)
    assert str(e.value) == (
        f"node refused HELLO: BAD_VERSION: client speaks protocol version {PROTOCOL_VERSION}, "
        f"this node speaks {V4}"
    )
    assert isinstance(e.value, ProtocolError)  # callers that catch ProtocolError still do
    assert seen == [PROTOCOL_VERSION]  # one attempt: no retry


@pytest.mark.parametrize(("version", "upgrade"), [(V4, "node"), (PROTOCOL_VERSION + 1, "client")])
def test_a_node_that_answers_another_version_is_refused_by_the_client(
    fake_node: FakeNode, version: int, upgrade: str,
) -> None:
    """The client checks the node's version too (a node that let a HELLO of
    another version through), before it reads anything else of the answer."""

    def answer(ch: Channel, req_id: int, client_version: int) -> None:
        info = dataclasses.replace(INFO, version=version)
        ch.send(Op.HELLO | RESPONSE_BIT, encode_node_info(info), req_id=req_id)

    seen: list[int] = []
    addr = fake_node(_greeted(seen, answer))
    with pytest.raises(VersionMismatch) as e:
        KVClient(*addr, None, connect_retries=3)
    assert str(e.value) == (
        f"node speaks protocol version {version}, client protocol version {PROTOCOL_VERSION}: "
        f"upgrade rdmakv on the {upgrade} (both ends must speak the same version)"
    )
    assert seen == [PROTOCOL_VERSION]


def test_the_retired_opcodes_are_unknown_and_never_reused(node: NodeProcess) -> None:
    """16 and 17 (WRITE and READ until version 4) name no request: a node
    refuses them as unknown, skips their bulk and keeps serving."""
    assert not set(RETIRED_OPCODES) & {int(op) for op in Op}
    r = Raw(node)
    try:
        r.hello()
        for opcode in RETIRED_OPCODES:
            payload = U32.pack(1) + bytes(12)  # what a WRITE / READ of one op carried
            status, msg, _ = r.call(opcode, payload, bulk=b"x" * 100)
            assert status == Status.UNKNOWN_OPCODE and str(opcode).encode() in msg
        status, payload, _ = r.call(Op.EXISTS, encode_keys([b"k"]))
        assert status == Status.OK and decode_flags(payload, 1, "EXISTS") == [False]
    finally:
        r.close()
