"""KVClient against real `rdmakv serve` processes: data, leases, eviction, faults."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import NodeProcess
from hypothesis import given
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import MIN_SUB_BATCH, PIPELINE_WINDOW, KVClient, sub_batch_sizes
from rdmakv.errors import AuthError, ConfigError, RdmakvError, TransportError
from rdmakv.transport.base import REQUEST_BYTES_AHEAD
from rdmakv.transport.tcp.client_side import _PutFrames
from rdmakv.wire.batches import BatchEncoder, decode_lookup_results, encode_keys
from rdmakv.wire.format import HEADER, LOOKUP_FLAG_LEASE, MAX_KEYS_PER_REQUEST, Op

pytestmark = pytest.mark.timeout(60)

BLOCK = 64 * 1024
POLL_S = 0.05
WAIT_S = 20.0


def fill(slab: Slab, handles: list[int], seed: int) -> list[bytes]:
    """Random bytes in each block; returns each block's digest."""
    rng = np.random.default_rng(seed)
    out = []
    for h in handles:
        slab.numpy(h)[:] = rng.integers(0, 256, slab.block_size, dtype=np.uint8)
        out.append(hashlib.blake2b(slab.view(h), digest_size=16).digest())
    return out


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def wait_for(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(POLL_S)


def test_batched_put_get_roundtrip_bytes_verified(node: NodeProcess, client_slab: Slab) -> None:
    n = 100
    src = client_slab.alloc_many(n)
    dst = client_slab.alloc_many(n)
    digests = fill(client_slab, src, seed=1)
    keys = keys_for("rt", n)
    sizes = [BLOCK - 7 * i for i in range(n)]  # values shorter than a block too
    with KVClient(*node.address, client_slab) as c:
        assert c.transport_name == "tcp"
        assert c.put(keys, src, sizes, digests) == [True] * n
        got = c.get_sizes(keys, dst, digests)
    assert got == sizes
    for s, d, size in zip(src, dst, sizes, strict=True):
        assert bytes(client_slab.view(s, size)) == bytes(client_slab.view(d, size))


def test_exists_delete_unknown_keys(node: NodeProcess, client_slab: Slab) -> None:
    src = client_slab.alloc_many(3)
    digests = fill(client_slab, src, seed=2)
    keys = keys_for("ed", 3)
    with KVClient(*node.address, client_slab) as c:
        assert c.exists([*keys, b"never"]) == [False] * 4
        assert c.put(keys, src, BLOCK, digests) == [True] * 3
        assert c.exists([*keys, b"never"]) == [True, True, True, False]
        assert c.delete([keys[1], b"never"]) == [True, False]
        assert c.exists(keys) == [True, False, True]
        dst = client_slab.alloc_many(3)
        assert c.get([*keys[:2], b"never"], dst, [*digests[:2], bytes(16)]) == [True, False, False]
        # putting an existing key again is not an error: the node already has it
        assert c.put(keys[:1], src[:1], BLOCK, digests[:1]) == [True]


def test_digest_mismatch_is_a_miss_and_leaves_block_alone(
    node: NodeProcess, client_slab: Slab
) -> None:
    src, dst = client_slab.alloc_many(2)
    (digest,) = fill(client_slab, [src], seed=3)
    client_slab.numpy(dst)[:] = 0xAB
    with KVClient(*node.address, client_slab) as c:
        assert c.put([b"k"], [src], BLOCK, [digest]) == [True]
        wrong = bytes(b ^ 1 for b in digest)
        assert c.get([b"k"], [dst], [wrong]) == [False]
        assert (client_slab.numpy(dst) == 0xAB).all()
        assert c.stats()["leases_active"] == 0  # the mismatch's lease was given back


def test_bad_arguments_are_refused_before_anything_is_sent(
    node: NodeProcess, client_slab: Slab
) -> None:
    h = client_slab.alloc()
    with KVClient(*node.address, client_slab) as c:
        with pytest.raises(ConfigError, match="digest"):
            c.put([b"k"], [h], BLOCK, [b"short"])
        with pytest.raises(ConfigError, match="2 handles"):
            c.put([b"k"], [h, h], BLOCK, [bytes(16)])
        with pytest.raises(ConfigError, match="key #0"):
            c.get([b""], [h], [bytes(16)])
        with pytest.raises(RdmakvError, match=r"not allocated|out of range"):
            c.put([b"k"], [client_slab.num_blocks + 5], BLOCK, [bytes(16)])
        with pytest.raises(ConfigError, match="nbytes"):
            c.put([b"k"], [h], BLOCK + 1, [bytes(16)])
        assert c.stats()["allocs"] == 0
        with pytest.raises(ConfigError, match="unknown transport"):
            KVClient(*node.address, client_slab, transport="carrier-pigeon")


def test_a_batch_off_the_encoders_fast_path_is_checked_key_by_key(
    node: NodeProcess, client_slab: Slab
) -> None:
    """check_put/check_get leave an engine batch's key and digest checks to the
    encoder's passes; any other batch is checked item by item: the bad item
    is named, and a valid batch of mixed keys is stored and read back."""
    hs = client_slab.alloc_many(6)
    digests = fill(client_slab, hs[:3], seed=11)
    with KVClient(*node.address, client_slab) as c:
        ok = [b"k1", b"k2", b"k3"]
        with pytest.raises(ConfigError, match="digest #2"):
            c.put(ok, hs[:3], BLOCK, [*digests[:2], b"short"])
        with pytest.raises(ConfigError, match="key #2"):
            c.put([b"k1", b"k2", "k3"], hs[:3], BLOCK, digests)  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="digest #1"):
            c.get(ok, hs[3:], [digests[0], "x" * 16, digests[2]])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="key #1"):
            c.get([b"k1", b"", b"k3"], hs[3:], digests)
        assert c.stats()["allocs"] == 0
        mixed = [b"a", bytearray(b"bb"), b"ccc"]  # valid, but neither one length nor all bytes
        assert c.put(mixed, hs[:3], BLOCK, digests) == [True] * 3
        for h in hs[3:]:
            client_slab.numpy(h)[:] = 0
        assert c.get(mixed, hs[3:], digests) == [True] * 3
        for src, dst in zip(hs[:3], hs[3:], strict=True):
            assert (client_slab.numpy(src) == client_slab.numpy(dst)).all()


def test_value_larger_than_node_block_is_refused(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(block_size="16KiB")
    h = client_slab.alloc()
    with KVClient(*node.address, client_slab) as c:
        assert c.info is not None and c.info.block_size == 16 * 1024
        assert c.put([b"big", b"ok"], [h, h], [BLOCK, 1024], [bytes(16)] * 2) == [False, True]
        assert c.exists([b"big", b"ok"]) == [False, True]


def test_lru_eviction_when_the_pool_is_full(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(pool_size="512KiB")  # 8 blocks of 64 KiB
    src = client_slab.alloc_many(12)
    digests = fill(client_slab, src, seed=4)
    keys = keys_for("lru", 12)
    with KVClient(*node.address, client_slab) as c:
        assert c.put(keys[:8], src[:8], BLOCK, digests[:8]) == [True] * 8
        c.exists(keys[:1])  # exists does not refresh recency
        dst = client_slab.alloc_many(1)
        assert c.get(keys[:1], dst, digests[:1]) == [True]  # key 0 is now most recent
        assert c.put(keys[8:12], src[8:12], BLOCK, digests[8:12]) == [True] * 4
        assert c.exists(keys) == [True] + [False] * 4 + [True] * 7
        assert c.stats()["evictions"] == 4


def _lease(c: KVClient, keys: list[bytes]) -> list[int]:
    """Take leases the way get does, but keep them (a client that dies mid-get)."""
    payload = c._call(Op.LOOKUP, encode_keys(keys), "LOOKUP", flags=LOOKUP_FLAG_LEASE)
    found = decode_lookup_results(payload, len(keys))
    assert all(f is not None for f in found)
    return [f.lease_id for f in found if f is not None]


def test_leased_extent_is_not_evicted_and_expired_lease_is_reclaimed(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(pool_size="256KiB", lease_timeout="1.0")  # 4 blocks
    src = client_slab.alloc_many(8)
    digests = fill(client_slab, src, seed=5)
    keys = keys_for("lease", 8)
    with KVClient(*node.address, client_slab) as c, KVClient(*node.address, client_slab) as other:
        assert c.put(keys[:4], src[:4], BLOCK, digests[:4]) == [True] * 4
        _lease(c, keys[:1])  # key 0 leased, never released
        # 4 new keys need 4 blocks: three evictions, key 0 is pinned -> one fails
        assert other.put(keys[4:8], src[4:8], BLOCK, digests[4:8]) == [True] * 3 + [False]
        # (Not asked with exists: that would make key 0 most recent, and the
        # put below would evict another key whether or not the lease expired.)
        assert other.stats()["entries"] == 4 and other.stats()["evictions"] == 3
        wait_for(lambda: other.stats()["leases_active"] == 0, "the lease to expire")
        assert other.stats()["leases_expired"] == 1
        # the operator is told (a client's side of an expiry is only failing reads)
        assert "1 leases expired after 1 s unreleased" in node.stderr()
        # the extent is evictable again: the last put now succeeds by evicting it
        assert other.put(keys[7:8], src[7:8], BLOCK, digests[7:8]) == [True]
        assert c.exists(keys[:1]) == [False]


def test_uncommitted_extents_are_invisible_and_reclaimed_on_disconnect(
    node: NodeProcess, client_slab: Slab
) -> None:
    from rdmakv.wire.batches import decode_extents, encode_alloc

    with KVClient(*node.address, client_slab) as c, KVClient(*node.address, None) as watcher:
        payload = c._call(Op.ALLOC, encode_alloc([b"half"], [BLOCK], [bytes(16)]), "ALLOC")
        assert decode_extents(payload, 1)[0].extent is not None
        assert watcher.exists([b"half"]) == [False]
        assert watcher.stats()["pending"] == 1
        c.close()
        wait_for(lambda: watcher.stats()["pending"] == 0, "the uncommitted extent to be reclaimed")
        st = watcher.stats()
        assert st["reclaimed_on_disconnect"] == 1 and st["blocks_used"] == 0


def test_token_required_and_checked(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    node = node_factory(token=b"s3cret")
    with pytest.raises(AuthError, match="token"):
        KVClient(*node.address, client_slab, token=b"wrong")
    with pytest.raises(AuthError, match="token"):
        KVClient(*node.address, client_slab)
    with KVClient(*node.address, client_slab, token="s3cret") as c:
        assert c.exists([b"x"]) == [False]


def test_many_concurrent_clients_keep_their_data_apart(
    node_factory: Callable[..., NodeProcess],
) -> None:
    node = node_factory(pool_size="64MiB")
    errors: list[BaseException] = []

    def worker(wid: int) -> None:
        try:
            with (
                Slab(4 * 1024 * 1024, BLOCK, lock=False) as slab,
                KVClient(*node.address, slab) as c,
            ):
                src = slab.alloc_many(24)
                dst = slab.alloc_many(24)
                for rnd in range(3):
                    digests = fill(slab, src, seed=wid * 100 + rnd)
                    keys = keys_for(f"w{wid}-r{rnd}", 24)
                    assert c.put(keys, src, BLOCK, digests) == [True] * 24
                    assert c.get(keys, dst, digests) == [True] * 24
                    for s, d in zip(src, dst, strict=True):
                        assert bytes(slab.view(s)) == bytes(slab.view(d))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_kill_9_mid_batch_gives_errors_not_hangs(
    node_factory: Callable[..., NodeProcess],
) -> None:
    node = node_factory(pool_size="256MiB", block_size="1MiB")
    outcome: list[object] = []
    with Slab(64 * 1024 * 1024, 1024 * 1024, lock=False) as slab:
        src = slab.alloc_many(48)
        dst = slab.alloc_many(1)
        c = KVClient(*node.address, slab, timeout=2.0, connect_retries=2)

        def hammer() -> None:
            try:
                for i in range(10_000):
                    c.put(keys_for(f"kill{i}", 48), src, 1024 * 1024, [bytes(16)] * 48)
                outcome.append("finished")
            except TransportError as e:
                outcome.append(e)

        t = threading.Thread(target=hammer)
        t.start()
        wait_for(lambda: node.alive() and c.stats()["commits"] > 0, "puts to be flowing")
        node.kill()
        t.join(WAIT_S)
        assert not t.is_alive(), "put hung after the node died"
        assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
        with pytest.raises(TransportError):
            c.get([b"kill0-0"], dst, [bytes(16)])
        c.close()


def test_stalled_node_times_out(node: NodeProcess, client_slab: Slab) -> None:
    from rdmakv.errors import TransportTimeout

    h = client_slab.alloc()
    with KVClient(*node.address, client_slab, timeout=0.5, connect_retries=1) as c:
        assert c.put([b"k"], [h], BLOCK, [bytes(16)]) == [True]
        assert node.proc is not None
        node.pause()
        try:
            with pytest.raises(TransportTimeout):
                c.get([b"k"], [h], [bytes(16)])
        finally:
            node.resume()
        assert c.get([b"k"], [h], [bytes(16)]) == [True]  # reconnected after the timeout


def test_empty_exists_and_delete_ask_the_node_nothing(
    node: NodeProcess, client_slab: Slab
) -> None:
    """An empty batch answers at once: with the node stalled, a request would time out."""
    with KVClient(*node.address, client_slab, timeout=0.5, connect_retries=1) as c:
        assert c.exists([b"k"]) == [False]
        node.pause()
        try:
            assert c.exists([]) == []
            assert c.delete([]) == []
        finally:
            node.resume()
        assert c.exists([b"k"]) == [False]  # the same connection, still in sync


def test_restarted_node_is_reconnected(node: NodeProcess, client_slab: Slab) -> None:
    src = client_slab.alloc_many(2)
    digests = fill(client_slab, src, seed=7)
    with KVClient(*node.address, client_slab) as c:
        assert c.put([b"a"], src[:1], BLOCK, digests[:1]) == [True]
        first_id = c.info.node_id if c.info else b""
        node.restart()
        # the new node is empty; the client notices the old connection died and reconnects
        assert c.exists([b"a"]) == [False]
        assert c.info is not None and c.info.node_id != first_id
        assert c.put([b"b"], src[1:], BLOCK, digests[1:]) == [True]
        dst = client_slab.alloc_many(1)
        assert c.get([b"b"], dst, digests[1:]) == [True]
        assert bytes(client_slab.view(dst[0])) == bytes(client_slab.view(src[1]))


def test_dead_node_gives_error_within_timeout(node: NodeProcess, client_slab: Slab) -> None:
    c = KVClient(*node.address, client_slab, timeout=1.0, connect_retries=2)
    node.kill()
    with pytest.raises(TransportError):
        c.exists([b"x"])
    c.close()


def test_sigterm_shuts_down_cleanly_and_stats_cli(node: NodeProcess, client_slab: Slab) -> None:
    h = client_slab.alloc()
    with KVClient(*node.address, client_slab) as c:
        assert c.put([b"k"], [h], 100, [bytes(16)]) == [True]
    out = subprocess.run(
        [sys.executable, "-m", "rdmakv.cli", "stats", f"{node.host}:{node.port}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    stats = json.loads(out.stdout)
    assert stats["entries"] == 1 and stats["bytes_stored"] == 100
    assert stats["transports"] == ["tcp"]
    assert node.terminate() == 0
    assert "node stopped" in node.stderr()


def test_huge_batch_is_split_within_node_limits(
    node_factory: Callable[..., NodeProcess],
) -> None:
    """More keys than one request may carry: sub-batches must still move every
    byte to the right key."""
    n = MAX_KEYS_PER_REQUEST + 100
    size = 64
    node = node_factory(pool_size=str((n + 64) * 4096), block_size="4KiB")
    with Slab(n * 4096, 4096, lock=False) as slab, KVClient(*node.address, slab) as c:
        hs = slab.alloc_many(n)
        for i, h in enumerate(hs):
            slab.numpy(h)[:size] = np.frombuffer(i.to_bytes(8, "little") * (size // 8), np.uint8)
        keys = keys_for("huge", n)
        digests = [i.to_bytes(16, "little") for i in range(n)]
        assert c.put(keys, hs, size, digests) == [True] * n
        slab.array[:] = 0
        assert c.get(keys, hs, digests) == [True] * n
        for i, h in enumerate(hs):
            assert bytes(slab.view(h, size)) == i.to_bytes(8, "little") * (size // 8)
        assert c.stats()["entries"] == n


def test_sigterm_with_a_client_stalled_mid_frame(node: NodeProcess, client_slab: Slab) -> None:
    """A client that announced a payload and went silent must not hold up shutdown."""
    import socket as socket_mod

    from rdmakv.wire.format import encode_hello

    with socket_mod.create_connection(node.address, timeout=10) as s:
        hello = encode_hello(None)
        s.sendall(HEADER.pack(Op.HELLO, 0, 0, len(hello), 0, 1) + hello)
        s.recv(4096)
        s.sendall(HEADER.pack(Op.EXISTS, 0, 0, 1000, 0, 2) + b"\x01")  # 999 bytes never come
        idle = KVClient(*node.address, client_slab)
        assert idle.exists([b"x"]) == [False]
        assert node.terminate() == 0  # within STOP_TIMEOUT_S, far below the node's IO_TIMEOUT
        with pytest.raises(TransportError):
            idle.exists([b"x"])
        idle.close()


def test_leases_of_a_departed_client_are_released(node: NodeProcess, client_slab: Slab) -> None:
    h = client_slab.alloc()
    with KVClient(*node.address, client_slab) as c, KVClient(*node.address, None) as watcher:
        assert c.put([b"k"], [h], BLOCK, [bytes(16)]) == [True]
        _lease(c, [b"k"])
        assert watcher.stats()["leases_active"] == 1
        c.close()
        wait_for(lambda: watcher.stats()["leases_active"] == 0, "the lease to be released")
        assert watcher.stats()["leases_expired"] == 0  # released at disconnect, not expired


def test_auto_transport_falls_back_to_tcp_without_rdma(
    node: NodeProcess, client_slab: Slab
) -> None:
    with KVClient(*node.address, client_slab, transport="auto") as c:
        assert c.transport_name == "tcp"
        assert c.exists([b"x"]) == [False]


def test_a_get_of_sub_batches_over_the_flow_control_window_reads_every_byte_in_place(
    node_factory: Callable[..., NodeProcess],
) -> None:
    """12,000 small values: the GETs of the get (even sub-batches, no ramp)
    are larger than a caller may send behind unread answers. Every value must
    land in its own block."""
    n, block = 12_000, 512
    node = node_factory(block_size=block, pool_size=2 * n * block)
    plan = sub_batch_sizes(n, MAX_KEYS_PER_REQUEST, ramp=False)
    keys = [hashlib.sha256(k).digest() for k in keys_for("mix", n)]  # engine-like keys
    assert len(encode_keys(keys[: max(plan)])) > REQUEST_BYTES_AHEAD
    with Slab(2 * n * block, block, lock=False) as slab:
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        digests = fill(slab, src, seed=9)
        with KVClient(*node.address, slab) as c:
            assert all(c.put(keys, src, block, digests))
            for h in dst:
                slab.numpy(h)[:] = 0
            assert all(c.get(keys, dst, digests))
            # interleaved with the next call's traffic nothing stays unread
            assert c.exists(keys[:3]) == [True] * 3
        for s_, d in zip(src, dst, strict=True):
            assert slab.view(s_) == slab.view(d)


def test_a_put_whose_answers_outgrow_what_may_stay_unread_stores_every_value(
    node_factory: Callable[..., NodeProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40,000 small values: the PUT and COMMIT answers of the put's first
    sub-batches are more than may stay unread, so the native path sends its
    frames in several calls and reads the oldest answers in between (a
    COMMIT's checksums go out in the same call as its values). Every value
    must be stored with the right checksum: the get verifies each one."""
    sends: list[int] = []
    real_send = _PutFrames.send

    def counted(self: _PutFrames, sock: socket.socket) -> None:
        sends.append(len(self._parts))
        real_send(self, sock)

    monkeypatch.setattr(_PutFrames, "send", counted)
    n, block = 40_000, 256
    plan = sub_batch_sizes(n, MAX_KEYS_PER_REQUEST, ramp=False)  # a PUT's split
    assert sum(2 * (HEADER.size + 4 + k) for k in plan[:-1]) > REQUEST_BYTES_AHEAD
    node = node_factory(block_size=block, pool_size=2 * n * block)
    keys = [hashlib.sha256(k).digest() for k in keys_for("many", n)]
    with Slab(2 * n * block, block, lock=False) as slab:
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        digests = fill(slab, src, seed=11)
        with KVClient(*node.address, slab) as c:
            assert all(c.put(keys, src, block, digests))
            assert all(c.get(keys, dst, digests))
            assert c.exists(keys[-3:]) == [True] * 3
        for s_, d in zip(src, dst, strict=True):
            assert slab.view(s_) == slab.view(d)
    if _PutFrames.usable():
        assert len([k for k in sends if k]) >= 2, sends  # frames went out in several calls
        assert sum(sends) == len(plan)
    else:
        assert not any(sends)


def test_a_put_that_fails_between_sub_batches_leaves_the_connection_in_sync(
    node_factory: Callable[..., NodeProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure while the put lays out its third sub-batch (injected into the
    real encoder), after two sub-batches' frames were queued but not yet sent:
    they still go out, so the replies queued for them arrive and the next call
    on the connection works instead of waiting for answers never asked for."""
    n = 600
    plan = sub_batch_sizes(n, MAX_KEYS_PER_REQUEST, ramp=False)  # 4 x 150: a PUT's split
    node = node_factory(pool_size=2 * n * BLOCK)  # room for all: nothing evicted
    with Slab(n * BLOCK, BLOCK, lock=False) as slab:
        src = slab.alloc_many(n)
        digests = fill(slab, src, seed=12)
        keys = keys_for("fail", n)
        real = BatchEncoder.alloc
        calls = [0]

        def failing(self: BatchEncoder, start: int, end: int) -> bytes:
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("injected: cannot lay out this sub-batch")
            return real(self, start, end)

        monkeypatch.setattr(BatchEncoder, "alloc", failing)
        with KVClient(*node.address, slab, timeout=5.0) as c:
            with pytest.raises(ValueError, match="injected"):
                c.put(keys, src, BLOCK, digests)
            monkeypatch.setattr(BatchEncoder, "alloc", real)
            done = calls[0]
            stored = c.exists(keys)
            sent = sum(plan[:2])  # the two sub-batches queued before the failure
            assert stored == [True] * sent + [False] * (n - sent)
            assert all(c.put(keys, src, BLOCK, digests))
            assert c.exists(keys) == [True] * n
            assert done == 3


def test_put_of_present_repeated_and_new_keys(node: NodeProcess, client_slab: Slab) -> None:
    src = client_slab.alloc_many(4)
    digests = fill(client_slab, src, seed=4)
    with KVClient(*node.address, client_slab) as c:
        assert c.put([b"there"], src[:1], BLOCK, digests[:1]) == [True]
        keys = [b"there", b"twice", b"twice", b"new"]
        # "twice" is stored once: its second copy finds the first one uncommitted (busy)
        assert c.put(keys, src, [BLOCK, 100, 100, 7], digests) == [True, True, False, True]
        st = c.stats()
        assert (st["entries"], st["pending"]) == (3, 0)  # nothing left allocated
        dst = client_slab.alloc_many(3)
        assert c.get_sizes([b"there", b"twice", b"new"], dst, [digests[0], digests[1],
                                                              digests[3]]) == [BLOCK, 100, 7]
        assert client_slab.view(dst[1], 100) == client_slab.view(src[1], 100)
        assert client_slab.view(dst[2], 7) == client_slab.view(src[3], 7)


@given(n=st.integers(0, 200_000), max_keys=st.integers(1, 8192))
def test_sub_batches_cover_the_batch_within_the_node_limit(n: int, max_keys: int) -> None:
    sizes = sub_batch_sizes(n, max_keys)
    assert sum(sizes) == n
    assert all(0 < s <= max(max_keys, 1) for s in sizes)
    if n >= 4 * MIN_SUB_BATCH * PIPELINE_WINDOW and max_keys >= 2 * MIN_SUB_BATCH:
        # the round trips nothing overlaps (first ALLOC/LOOKUP, last COMMIT) stay short
        assert sizes[0] == sizes[-1] == MIN_SUB_BATCH


@given(n=st.integers(0, 200_000), max_keys=st.integers(1, 8192))
def test_sub_batches_without_a_ramp_are_even_and_few(n: int, max_keys: int) -> None:
    """A PUT or GET that carries its data (tcp) splits into as few, even
    sub-batches as the pipeline and the node's limit allow: no ramp."""
    sizes = sub_batch_sizes(n, max_keys, ramp=False)
    assert sum(sizes) == n
    assert all(0 < s <= max(max_keys, 1) for s in sizes)
    if sizes:
        assert max(sizes) - min(sizes) <= 1
    full = min(max_keys, max(MIN_SUB_BATCH, -(-n // PIPELINE_WINDOW)))
    assert len(sizes) == (-(-n // full) if n else 0)
    if MIN_SUB_BATCH * PIPELINE_WINDOW <= n <= max_keys * PIPELINE_WINDOW:
        assert len(sizes) == PIPELINE_WINDOW
