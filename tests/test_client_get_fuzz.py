"""A TCP get against mangled answers: never wrong KV, never a byte outside the asked blocks.

A fake node (a real socket server speaking the protocol) answers each GET of
a get with a well-formed answer of values it derives from the keys (misses
among them), except one answer that Hypothesis mangles: a byte changed
anywhere in it (header, entries or values), the answer cut short, bytes
added after it, or an error answer with its own message and bulk in its
place; then the node closes the connection. The client, on the native get
call and on the per-answer Python path, must return only values whose bytes
are the node's (a value it cannot vouch for is a miss) or raise an
RdmakvError, within its timeout, and leave every block it was not asked to
fill as it was. A new connection after the close gets plain answers, as a
client that retries on one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import declined_call
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmakvError
from rdmakv.transport.tcp import loop as tcp
from rdmakv.wire import channel
from rdmakv.wire.batches import decode_get, encode_get_answer
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    HEADER,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    NodeInfo,
    Op,
    Status,
    encode_node_info,
    value_checksum,
)

pytestmark = pytest.mark.timeout(300)

BLOCK = 2048
MAX_KEYS = 4
"""The fake node's keys per request: a get of up to 10 keys is up to 3 GETs."""
INFO = NodeInfo(version=PROTOCOL_VERSION, rkey=0, block_size=BLOCK, pool_base=1 << 40,
                pool_len=1 << 20, node_id=b"n" * 16, session_id=1, max_payload=1 << 20,
                max_keys=MAX_KEYS, max_bulk=1 << 24, transports=("tcp",))
GUARD = 0x5A
"""What the blocks no key names hold, before and after."""


def value(key: bytes, length: int) -> bytes:
    """The node's value of ``key``: ``length`` bytes derived from it."""
    seed = hashlib.sha256(key).digest()
    return (seed * (length // len(seed) + 1))[:length]


@dataclasses.dataclass
class Plan:
    """One example: each key's value length (0: a miss) and the mangling of answer ``which``."""

    lengths: dict[bytes, int]
    which: int
    how: str
    at: int
    data: bytes
    connections: int = 0


class FakeNode:
    """Serves one connection at a time, each after the other, by the current plan."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.address = self.ls.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.ls.accept()
            except OSError:
                return
            try:
                self._serve(Channel(conn))
            except (OSError, RdmakvError):
                pass
            finally:
                conn.close()

    def _serve(self, ch: Channel) -> None:
        hdr = ch.recv_header()
        ch.recv_payload(hdr)
        ch.send(Op.HELLO | RESPONSE_BIT, encode_node_info(INFO), req_id=hdr.req_id)
        plan = self.plan
        assert plan is not None
        plan.connections += 1
        mangle = plan.connections == 1  # a retry on a new connection gets plain answers
        answered = 0
        while True:
            hdr = ch.recv_header()
            payload = ch.recv_payload(hdr)
            if hdr.opcode != Op.GET:  # DELETE of keys the client found corrupt
                n = int.from_bytes(payload[:4], "little")
                ch.send(hdr.opcode | RESPONSE_BIT, n.to_bytes(4, "little") + bytes(n),
                        req_id=hdr.req_id)
                continue
            keys, _ = decode_get(payload)
            lengths = [plan.lengths[k] for k in keys]
            bulk = b"".join(value(k, n) for k, n in zip(keys, lengths, strict=True))
            entries = encode_get_answer(lengths, [
                value_checksum(value(k, n)) if n else 0 for k, n in zip(keys, lengths, strict=True)
            ])
            frame = HEADER.pack(hdr.opcode | RESPONSE_BIT, 0, Status.OK, len(entries), len(bulk),
                                hdr.req_id) + entries + bulk
            if not mangle or answered != plan.which:
                ch.sock.sendall(frame)
                answered += 1
                continue
            ch.sock.sendall(_mangled(frame, hdr.req_id, plan))
            return  # and closes the connection


def _mangled(frame: bytes, req_id: int, plan: Plan) -> bytes:
    at = plan.at % len(frame)
    if plan.how == "byte":
        return frame[:at] + bytes([frame[at] ^ plan.data[0]]) + frame[at + 1 :]
    if plan.how == "cut":
        return frame[:at]
    if plan.how == "extra":
        return frame + plan.data
    bulk = plan.data[: plan.at % 40]
    return HEADER.pack(Op.GET | RESPONSE_BIT, 0, Status.INTERNAL, len(plan.data), len(bulk),
                       req_id) + plan.data + bulk


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeNode]:
    node = FakeNode()
    yield node
    node.ls.close()


plans = st.builds(
    Plan,
    lengths=st.just({}),
    which=st.integers(0, 2),
    how=st.sampled_from(["byte", "cut", "extra", "error"]),
    at=st.integers(0, 1 << 20),
    data=st.binary(min_size=1, max_size=64).filter(lambda b: b[0] != 0),
)


@pytest.mark.parametrize("path", ["native_call", "python"])
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans, lengths=st.lists(st.integers(0, BLOCK), min_size=1, max_size=10))
def test_a_get_of_mangled_answers_returns_only_the_nodes_values(
    fake: FakeNode, path: str, plan: Plan, lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "native_call" and not tcp.native_checksums():
        pytest.skip("the xxhash module has no XXH3 C API for the native get call")
    with monkeypatch.context() as mp:
        if path == "python":
            mp.setattr(channel, "_native_get_call", declined_call)
        _one_get(fake, plan, lengths)


def _one_get(fake: FakeNode, plan: Plan, lengths: list[int]) -> None:
    keys = [b"key-%02d" % i for i in range(len(lengths))]
    plan.lengths = dict(zip(keys, lengths, strict=True))
    plan.which %= -(-len(keys) // MAX_KEYS)  # one of the get's requests
    fake.plan = plan
    with Slab(2 * len(keys) * BLOCK, BLOCK, lock=False) as slab:
        blocks = slab.alloc_many(2 * len(keys))
        asked, guards = blocks[::2], blocks[1::2]  # every asked block between two guards
        for h in guards:
            slab.numpy(h)[:] = GUARD
        got: Any
        try:
            with KVClient(*fake.address, slab, timeout=0.5, connect_retries=1) as c:
                got = c.get_sizes(keys, asked, [bytes(16)] * len(keys))
        except RdmakvError as e:
            got = e
        for h in guards:
            assert (slab.numpy(h) == GUARD).all(), f"a block no key names was written ({got!r})"
        if isinstance(got, RdmakvError):
            return
        for k, h, n in zip(keys, asked, got, strict=True):
            if n is not None:  # a hit: exactly the node's value, never other bytes
                assert n == plan.lengths[k]
                assert bytes(slab.view(h)[:n]) == value(k, n)
