"""InfiniStore as a remote tier, against a real InfiniStore server on the RDMA device.

The server (``infinistore``, from the ``rdmakv[infinistore]`` extra) refuses to
start without an RDMA device, so these tests live in the RDMA suite (soft-RoCE
``rxe0`` in the VM in CI). Each connection pins about 512 MiB on both sides, so
the VM runs with more memory (.ci/run) and the tests open one or two at a time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.tiers.infinistore_tier import InfiniStoreTier
from rdmakv.engine.manager import KVCacheManager

BLOCK = 64 * 1024
START_TIMEOUT = 300.0  # seconds: the server's imports and pool pinning, emulated CPU
CLIENT_TIMEOUT = 60.0  # seconds: connecting pins 512 MiB under emulation
NS = KeyNamespace(model="infinistore-test", dtype="bfloat16", kv_layout="test")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real InfiniStore server on the test device; its ``infinistore://`` address."""
    pytest.importorskip("infinistore", reason="pip install 'rdmakv[infinistore]'")
    port, manage = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("infinistore") / "server.log"
    exe = Path(sys.executable).with_name("infinistore")
    cmd = [str(exe), "--service-port", str(port), "--manage-port", str(manage),
           "--dev-name", os.environ.get("RDMAKV_TEST_DEVICE", "rxe0"),
           "--link-type", "Ethernet", "--prealloc-size", "1", "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # the data port opens before the server serves; the manage port after
            if proc.poll() is not None:
                pytest.fail(f"infinistore exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{manage}/kvmap_len", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"infinistore not up in {START_TIMEOUT} s: {log.read_text()}")
                time.sleep(1)
        yield f"infinistore://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def fill(slab: Slab, handles: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for h in handles:
        slab.numpy(h)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)


def test_round_trip_digests_misses_and_delete(server: str) -> None:
    host, port = server.removeprefix("infinistore://").rsplit(":", 1)
    slab = Slab(64 * BLOCK, BLOCK, lock=False)
    tier = InfiniStoreTier(host, int(port), slab, timeout=CLIENT_TIMEOUT)
    try:
        n = 16
        keys = [f"key-{i}".encode().ljust(16, b".") for i in range(n)]
        digests = [f"dig-{i}".encode().ljust(16, b"_") for i in range(n)]
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        fill(slab, src, 1)
        assert tier.put(keys, src, BLOCK, digests) == [True] * n
        assert tier.put(keys[:1], src[:1], BLOCK - 1, digests[:1]) == [False]  # not a whole block
        assert tier.get_sizes(keys, dst, digests) == [BLOCK] * n
        for s, d in zip(src, dst, strict=True):
            assert (slab.numpy(s) == slab.numpy(d)).all()
        missing = [b"missing-key-0000", b"missing-key-0001"]
        assert tier.exists([*keys[:2], *missing]) == [True, True, False, False]
        # A batch with misses in it: exactly the stored keys hit, the others are left as they were.
        fill(slab, dst, 2)
        before = [slab.numpy(h).copy() for h in dst]
        mixed = [keys[0], missing[0], keys[5], missing[1]]
        mixed_digests = [digests[0], digests[1], digests[5], digests[1]]
        assert tier.get(mixed, dst[:4], mixed_digests) == [True, False, True, False]
        assert (slab.numpy(dst[0]) == slab.numpy(src[0])).all()
        assert (slab.numpy(dst[1]) == before[1]).all() and (slab.numpy(dst[3]) == before[3]).all()
        # A value stored for other tokens is a miss, never wrong KV.
        wrong = b"other-tokens-dig"
        assert tier.get([keys[3]], [dst[3]], [wrong]) == [False]
        assert (slab.numpy(dst[3]) == before[3]).all()
        assert tier.delete([keys[7], missing[0]]) == [True, False]
        assert tier.exists([keys[7]]) == [False]
        assert tier.get([keys[7]], [dst[7]], [digests[7]]) == [False]
    finally:
        tier.close()
        slab.close()


def test_manager_over_infinistore_serves_a_fresh_engine(server: str) -> None:
    opts = {"namespace": NS, "block_tokens": 16, "block_bytes": BLOCK, "l1_bytes": 32 * BLOCK,
            "node": server, "timeout": CLIENT_TIMEOUT, "lock_slab": False}
    prompts = [np.arange(i * 1000, i * 1000 + 16 * 6, dtype=np.int32) for i in range(4)]
    # A whole L1 may be pending offload: nothing dropped by back-pressure.
    with KVCacheManager(  # type: ignore[arg-type]
        **opts, offload="all", max_pending_offload_bytes=32 * BLOCK
    ) as writer:
        assert writer.transport_name == "rdma"
        for i, tokens in enumerate(prompts):
            handles = writer.allocate_for(6)
            for j, h in enumerate(handles):
                writer.block_view(h)[:] = np.full(BLOCK, (i * 7 + j) % 251, dtype=np.uint8)
            writer.put(tokens, handles)
        assert writer.flush(CLIENT_TIMEOUT * 2)
        assert writer.l1.stats.offloads_dropped == 0
        assert writer.offloader is not None and writer.offloader.sent_blocks == 24
    with KVCacheManager(**opts, offload="none") as reader:  # type: ignore[arg-type]
        for i, tokens in enumerate(prompts):
            assert reader.exists(tokens) == len(tokens)
            got = reader.acquire(tokens)
            assert got.l2_blocks == 6
            for j, h in enumerate(got.handles):
                assert (np.asarray(reader.block_view(h)) == (i * 7 + j) % 251).all()
            reader.release(got)
        other = np.arange(500_000, 500_000 + 16 * 2, dtype=np.int32)
        assert reader.exists(other) == 0
