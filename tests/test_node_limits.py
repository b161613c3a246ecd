"""Connection and lease limits of a real node under slow, idle and hoarding clients.

A good client (the right token, a fresh connection each round, every byte
checked) must keep working while hostile connections hold the node; the
hostile ones must be closed by the limits (docs/security.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RemoteError
from rdmakv.wire.batches import encode_keys
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import HEADER, LOOKUP_FLAG_LEASE, Op, encode_hello
from tests.conftest import NodeProcess

pytestmark = pytest.mark.timeout(180)

TOKEN = b"limits-token"
BLOCK = 4096
DIGEST = b"q" * 16
CLOSE_WAIT_S = 15.0
"""Generous bound for the node to close a connection past a 1 s limit (sweeps every 0.5 s)."""


@pytest.fixture
def limited_node(
    tmp_path: Path, node_factory: Callable[..., NodeProcess]
) -> Callable[..., NodeProcess]:
    """``node_factory`` with a token, 4 KiB blocks and ``limits`` as a config file."""
    configs = itertools.count()

    def make(pool_blocks: int = 256, **limits: Any) -> NodeProcess:
        cfg = tmp_path / f"limits-{next(configs)}.yaml"
        cfg.write_text(yaml.safe_dump({"node": limits}))
        return node_factory(
            pool_size=pool_blocks * BLOCK,
            block_size=BLOCK,
            transport="tcp",
            token=TOKEN,
            config=str(cfg),
        )

    return make


def good_round(node: NodeProcess, tag: int) -> None:
    """A fresh authenticated client puts 4 blocks and reads them back, byte-checked."""
    slab = Slab(8 * BLOCK, BLOCK, lock=False)
    try:
        hs = [slab.alloc() for _ in range(8)]
        for i, h in enumerate(hs[:4]):
            slab.view(h)[:] = bytes([(tag * 4 + i) % 256]) * BLOCK
        keys = [b"good-%d-%d" % (tag, i) for i in range(4)]
        with KVClient(*node.address, slab=slab, transport="tcp", token=TOKEN, timeout=10) as c:
            assert c.put(keys, hs[:4], BLOCK, [DIGEST] * 4) == [True] * 4
            assert c.get(keys, hs[4:], [DIGEST] * 4) == [True] * 4
        for a, b in zip(hs[:4], hs[4:], strict=True):
            assert bytes(slab.view(a)) == bytes(slab.view(b))
    finally:
        slab.close()


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """True once the node has closed ``sock`` (EOF or reset), waiting up to ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], 0.2)
        if r:
            try:
                data = sock.recv(65536)
            except OSError:
                return True
            if data == b"":
                return True
    return False


def authenticated(node: NodeProcess) -> socket.socket:
    s = socket.create_connection(node.address)
    Channel(s).call(Op.HELLO, encode_hello(TOKEN), "HELLO")
    return s


def test_a_slow_handshake_flood_never_locks_out_a_good_client(
    limited_node: Callable[..., NodeProcess],
) -> None:
    node = limited_node(handshake_timeout_s=1.0, max_unauthenticated_per_source=16)
    slow: list[socket.socket] = []
    stop = threading.Event()

    def drip() -> None:  # one byte of a HELLO header every 0.3 s on every slow socket
        while not stop.wait(0.3):
            for s in list(slow):
                with contextlib.suppress(OSError):
                    s.send(b"\x01")

    dripper = threading.Thread(target=drip, daemon=True)
    try:
        for _ in range(200):
            s = socket.create_connection(node.address)
            s.send(b"\x01")
            slow.append(s)
        dripper.start()
        for tag in range(10):  # new connections while the flood drips
            good_round(node, tag)
            for _ in range(20):  # and the flood keeps coming
                s = socket.create_connection(node.address)
                s.send(b"\x01")
                slow.append(s)
        # every slow connection is closed: shed, or at the handshake deadline
        assert all(closed_by_peer(s, CLOSE_WAIT_S) for s in slow)
        with KVClient(*node.address, slab=None, transport="tcp", token=TOKEN) as c:
            st = c.stats()
        assert st["refused_over_limit"] + st["refused_timeout"] >= len(slow)
        assert st["refused_timeout"] >= 1
    finally:
        stop.set()
        for s in slow:
            s.close()


def test_idle_authenticated_connections_are_closed_and_never_fill_the_node(
    limited_node: Callable[..., NodeProcess],
) -> None:
    node = limited_node(idle_timeout_s=3.0, max_sessions=32, max_sessions_per_source=32)
    idle = [authenticated(node) for _ in range(32)]  # the node is full
    try:
        time.sleep(1.2)  # idle long enough to be shed for a newcomer
        for tag in range(5):
            good_round(node, tag)  # the first one is admitted by shedding the longest-idle
        assert sum(closed_by_peer(s, 0.5) for s in idle) >= 1
        # the rest go at the idle timeout
        assert all(closed_by_peer(s, CLOSE_WAIT_S) for s in idle)
        with KVClient(*node.address, slab=None, transport="tcp", token=TOKEN) as c:
            st = c.stats()
        assert st["refused_timeout"] >= 1 and st["refused_over_limit"] >= 1
    finally:
        for s in idle:
            s.close()


def test_unauthenticated_connections_are_shed_before_busy_authenticated_ones(
    limited_node: Callable[..., NodeProcess],
) -> None:
    node = limited_node(max_sessions=8, max_sessions_per_source=8)
    users = [authenticated(node) for _ in range(4)]
    strangers = [socket.create_connection(node.address) for _ in range(4)]
    try:
        good_round(node, 1)  # a full node: a stranger makes room
        assert sum(closed_by_peer(s, 2.0) for s in strangers) >= 1
        for s in users:  # the users were never touched: each still gets answers
            hdr, _ = Channel(s).call(Op.EXISTS, encode_keys([b"k"]), "EXISTS")
            assert hdr.status == 0
    finally:
        for s in users + strangers:
            s.close()


def test_lease_hoarding_is_refused_and_puts_still_find_room(
    limited_node: Callable[..., NodeProcess],
) -> None:
    blocks = 100
    node = limited_node(pool_blocks=blocks, lease_quota_bytes=blocks // 2 * BLOCK)
    slab = Slab(blocks * BLOCK, BLOCK, lock=False)
    try:
        hs = [slab.alloc() for _ in range(blocks)]
        keys = [b"hoard-%d" % i for i in range(blocks)]
        with KVClient(*node.address, slab=slab, transport="tcp", token=TOKEN) as c:
            assert all(c.put(keys[:90], hs[:90], BLOCK, [DIGEST] * 90))
        hoarder = Channel(authenticated(node))

        def lease(ks: list[bytes]) -> Any:
            return hoarder.call(Op.LOOKUP, encode_keys(ks), "LOOKUP", flags=LOOKUP_FLAG_LEASE)

        with pytest.raises(RemoteError, match=r"LIMIT_EXCEEDED.*quota"):
            lease(keys[:90])  # 90 blocks > 50: refused whole
        for _ in range(4):
            lease(keys[:1])  # up to the per-block cap (4 live leases) ...
        with pytest.raises(RemoteError, match="holds 4 live leases"):
            lease(keys[:1])  # ... and not one more
        for i in range(1, 47, 9):
            lease(keys[i : min(i + 9, 47)])  # 4 + 46 blocks: exactly the quota
        with pytest.raises(RemoteError, match="over its quota"):
            lease(keys[47:48])
        # 47 distinct blocks pinned (at most half the pool): a good client's 50-key
        # put fits in the 10 free blocks plus the 43 evictable ones
        new = [b"fresh-%d" % i for i in range(50)]
        for i, h in enumerate(hs[:50]):
            slab.view(h)[:] = bytes([i]) * BLOCK
        with KVClient(*node.address, slab=slab, transport="tcp", token=TOKEN) as c:
            assert c.put(new, hs[:50], BLOCK, [DIGEST] * 50) == [True] * 50
            st = c.stats()
        assert st["lease_refusals"] >= 3 and st["refused_over_limit"] >= 3
        hoarder.sock.close()
    finally:
        slab.close()


def test_raw_header_bytes_count_toward_the_handshake_deadline(
    limited_node: Callable[..., NodeProcess],
) -> None:
    """A client that sends a complete header and then stalls is closed too."""
    node = limited_node(handshake_timeout_s=1.0)
    s = socket.create_connection(node.address)
    try:
        hello = encode_hello(TOKEN)
        s.sendall(HEADER.pack(Op.HELLO, 0, 0, len(hello), 0, 1))  # payload never follows
        assert closed_by_peer(s, CLOSE_WAIT_S)
    finally:
        s.close()
    good_round(node, os.getpid() % 7)


def test_a_manager_keeps_hitting_through_slow_and_idle_floods(
    limited_node: Callable[..., NodeProcess], tmp_path: Path
) -> None:
    """The engine's view: puts and fetches through KVCacheManager while 150 slow and 48
    idle connections hold a small node: every block comes back exact, nothing raises."""
    import numpy as np

    from rdmakv.blocks.keys import KeyNamespace
    from rdmakv.engine.manager import KVCacheManager

    node = limited_node(
        pool_blocks=512, handshake_timeout_s=1.0, max_sessions=64, max_sessions_per_source=64,
        max_unauthenticated_per_source=16,
    )
    slow = [socket.create_connection(node.address) for _ in range(150)]
    for s in slow:
        s.send(b"\x01")
    idle = [authenticated(node) for _ in range(48)]
    time.sleep(1.2)  # the idle ones are now sheddable
    token = tmp_path / "engine-token"
    token.write_bytes(TOKEN)

    def manager() -> KVCacheManager:
        return KVCacheManager(
            namespace=KeyNamespace(model="m", dtype="float16", kv_layout="NHD"),
            block_tokens=16, block_bytes=BLOCK, l1_bytes=64 * BLOCK, node=node.endpoint,
            transport="tcp", offload="all", max_pending_offload_bytes=64 * BLOCK,
            token=TOKEN, timeout=10.0, lock_slab=False,
        )

    try:
        tokens = np.arange(32 * 16, dtype=np.int32)
        with manager() as writer:
            hs = writer.allocate_for(32)
            for i, h in enumerate(hs):
                writer.block_view(h)[:] = i
            writer.put(tokens, hs)
            assert writer.flush(30)
            assert writer.offloader is not None and writer.offloader.sent_blocks == 32
        with manager() as reader:  # empty L1: all 32 from the node
            got = reader.acquire(tokens)
            assert got.num_blocks == 32 and got.l2_blocks == 32
            for i, h in enumerate(got.handles):
                assert (reader.block_view(h) == i).all(), i
            reader.release(got)
            assert reader.stats.l2_errors == 0
    finally:
        for s in slow + idle:
            s.close()
