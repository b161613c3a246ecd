"""The fault injector itself: faults land exactly at the stream offsets asked for.

The far end here is a plain socket server that sends a known stream and keeps
what it receives, so the proxy's bytes can be compared exactly.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from .wire_proxy import Direction, WireProxy

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(30)]

N = 1 << 20


class Peer:
    """Accepts one connection; sends ``out``, then reads until EOF into ``got``."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.out = os.urandom(N)
        self.got = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            sender = threading.Thread(target=lambda: _send(conn, self.out), daemon=True)
            sender.start()
            _recv_all(conn, self.got)
            sender.join(10)


def _send(s: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the proxy may cut the connection
        s.sendall(data)


def _recv_all(s: socket.socket, into: bytearray) -> None:
    try:
        while chunk := s.recv(1 << 16):
            into += chunk
    except OSError:
        pass


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.listener.close()


def exchange(proxy: WireProxy, payload: bytes) -> bytes:
    """Send ``payload`` through the proxy while reading what comes back."""
    got = bytearray()
    with socket.create_connection((proxy.host, proxy.port)) as c:
        reader = threading.Thread(target=_recv_all, args=(c, got), daemon=True)
        reader.start()
        _send(c, payload)
        with contextlib.suppress(OSError):
            c.shutdown(socket.SHUT_WR)
        reader.join(10)
    return bytes(got)


def test_clean_proxy_forwards_every_byte_both_ways(peer: Peer) -> None:
    payload = os.urandom(N)
    with WireProxy(peer.address) as proxy:
        back = exchange(proxy, payload)
        peer.thread.join(10)
    assert back == peer.out and bytes(peer.got) == payload


def test_flip_at_changes_exactly_one_bit_at_the_offset(peer: Peer) -> None:
    payload = os.urandom(N)
    with WireProxy(peer.address) as proxy:
        proxy.flip_at(Direction.UP, 123_456, bit=5)
        back = exchange(proxy, payload)
        peer.thread.join(10)
    want = bytearray(payload)
    want[123_456] ^= 1 << 5
    assert bytes(peer.got) == bytes(want) and back == peer.out
    assert [(f.direction, f.offset, f.bit) for f in proxy.flips] == [(Direction.UP, 123_456, 5)]


def test_cut_after_delivers_exactly_the_bytes_before_the_offset(peer: Peer) -> None:
    with WireProxy(peer.address) as proxy:
        proxy.cut_after(Direction.DOWN, 300_000)
        # Nothing goes up: bytes reaching the proxy's socket after the cut closed
        # it would draw a reset, which drops forwarded bytes still queued for the
        # client (a race the client loses under load), not what this test checks.
        back = exchange(proxy, b"")
    assert back == peer.out[:300_000]
