"""Prometheus metrics of a real node and of a real KVCacheManager, scraped over HTTP."""

from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import PIPELINE_WINDOW, KVClient
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import AuthError, RemoteError
from rdmakv.metrics.engine import ClientMetrics, start_http_server
from rdmakv.node import KVNode
from rdmakv.node.process import LocalNodeProcess
from rdmakv.wire.format import HEADER, U32, Op, encode_hello

BLOCK = 4096
DIGEST = b"d" * 16


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def node(tmp_path) -> Iterator[LocalNodeProcess]:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    n = LocalNodeProcess(
        {
            "pool-size": str(64 * BLOCK),
            "block-size": str(BLOCK),
            "transport": "tcp",
            "token-file": str(token),
            "metrics-port": "0",
        },
        extra_args=["--no-lock"],
    )
    try:
        yield n
    finally:
        n.terminate()


def test_node_counters_match_the_workload(node: LocalNodeProcess) -> None:
    assert node.metrics_url is not None
    slab = Slab(16 * BLOCK, BLOCK, lock=False)
    hs = [slab.alloc() for _ in range(16)]
    for i, h in enumerate(hs):
        slab.view(h)[:] = bytes([i]) * BLOCK
    keys = [os.urandom(16) for _ in range(6)]
    with KVClient(*node.address, slab=slab, transport="tcp", token=b"s3cret") as c:
        assert c.put(keys, hs[:6], BLOCK, [DIGEST] * 6) == [True] * 6
        missing = [os.urandom(16) for _ in range(3)]
        assert c.get(keys[:4] + missing, hs[6:13], [DIGEST] * 7) == [True] * 4 + [False] * 3
        assert c.exists(keys) == [True] * 6
        # a request over a protocol limit: refused, counted
        ch, _ = c._conn()
        with pytest.raises(RemoteError, match="LIMIT_EXCEEDED"):
            ch.call(Op.EXISTS, U32.pack(2**32 - 1), "EXISTS")
        stats = c.stats()
    with pytest.raises(AuthError):
        KVClient(*node.address, slab=None, transport="tcp", token=b"wrong").exists(keys)

    m = scrape(node.metrics_url)
    assert m[("rdmakv_node_ready", ())] == 1
    assert m[("rdmakv_node_keys", ())] == 6
    assert m[("rdmakv_node_puts_total", ())] == 6
    assert m[("rdmakv_node_lookups_total", ())] == 7
    assert m[("rdmakv_node_hits_total", ())] == 4
    assert m[("rdmakv_node_misses_total", ())] == 3
    assert m[("rdmakv_node_pool_capacity_bytes", ())] == 64 * BLOCK
    assert m[("rdmakv_node_pool_used_bytes", ())] >= 6 * BLOCK
    tcp_in = (("direction", "in"), ("transport", "tcp"))
    tcp_out = (("direction", "out"), ("transport", "tcp"))
    assert m[("rdmakv_node_bytes_total", tcp_in)] == 6 * BLOCK
    assert m[("rdmakv_node_bytes_total", tcp_out)] == 4 * BLOCK
    assert m[("rdmakv_node_refused_total", (("reason", "bad_token"),))] == 1
    assert m[("rdmakv_node_refused_total", (("reason", "over_limit"),))] == 1
    assert m[("rdmakv_node_sessions_accepted_total", ())] == 2
    for op in ("put", "commit", "get", "exists"):  # a tcp put and get (protocol v4)
        assert m[("rdmakv_node_request_seconds_count", (("op", op),))] >= 1, op
    # the metrics and the STATS op tell the same story
    assert stats["commits"] == 6 and stats["refused_over_limit"] == 1



def test_a_tcp_put_and_get_go_out_in_as_many_even_requests_as_the_pipeline(tmp_path) -> None:
    """Over tcp a PUT carries its values and a GET's answer carries them, so a
    1000-key put is PIPELINE_WINDOW PUTs and a get as many GETs, every value
    read back: not the ramped split (64, 128, ...) an ALLOC or LOOKUP round
    trip wants, whose extra requests cost both ends their fixed work."""
    n = 1000
    proc = LocalNodeProcess(
        {"pool-size": str((n + 8) * BLOCK), "block-size": str(BLOCK), "transport": "tcp",
         "metrics-port": "0"},
        extra_args=["--no-lock"],
    )
    try:
        assert proc.metrics_url is not None
        slab = Slab(2 * n * BLOCK, BLOCK, lock=False)
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        for i, h in enumerate(src):
            slab.view(h)[:] = i.to_bytes(4, "little") * (BLOCK // 4)
        keys = [os.urandom(16) for _ in range(n)]
        with KVClient(*proc.address, slab=slab, transport="tcp") as c:
            assert c.put(keys, src, BLOCK, [DIGEST] * n) == [True] * n
            assert c.get(keys, dst, [DIGEST] * n) == [True] * n
        assert all(slab.view(d) == slab.view(s) for s, d in zip(src, dst, strict=True))
        m = scrape(proc.metrics_url)
        for op in ("put", "commit", "get"):
            assert m[("rdmakv_node_request_seconds_count", (("op", op),))] == PIPELINE_WINDOW, op
        slab.close()
    finally:
        proc.terminate()

def test_readyz_false_until_serving_and_after_stop() -> None:
    node = KVNode(pool_size=8 * BLOCK, block_size=BLOCK, port=0, lock_pool=False, metrics_port=0)
    assert node.metrics_server is not None
    url = node.metrics_server.url
    try:
        assert status(url + "/healthz") == 200
        assert status(url + "/readyz") == 503  # pool registered, but not accepting yet
        node.start()
        t = threading.Thread(target=node.serve_forever, daemon=True)
        t.start()
        for _ in range(200):
            if status(url + "/readyz") == 200:
                break
            threading.Event().wait(0.01)
        assert status(url + "/readyz") == 200
        with socket.create_connection((node.host, node.port)) as s:  # accepting for real
            s.sendall(HEADER.pack(Op.HELLO, 0, 0, len(encode_hello(None)), 0, 1))
            s.sendall(encode_hello(None))
            assert len(s.recv(HEADER.size)) > 0
        assert status(url + "/nope") == 404
    finally:
        node.stop()
        t.join(10)
    # stopped: the metrics server is gone with the node
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/healthz", timeout=2)


def test_metrics_port_in_use_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(Exception, match=f"metrics port {port} .* already in use"):
            KVNode(pool_size=8 * BLOCK, block_size=BLOCK, port=0, lock_pool=False,
                   metrics_port=port)


def test_client_metrics_count_tiers_offload_and_fetches(tmp_path) -> None:
    n = LocalNodeProcess(
        {"pool-size": str(256 * BLOCK), "block-size": str(BLOCK), "transport": "tcp"},
        extra_args=["--no-lock"],
    )
    registry = CollectorRegistry()
    try:
        block_tokens = 4
        with KVCacheManager(
            namespace=KeyNamespace(model="m", dtype="float16", kv_layout="NHD"),
            l1_bytes=8 * BLOCK, block_bytes=BLOCK, block_tokens=block_tokens,
            node=n.endpoint, transport="tcp", offload="all", lock_slab=False,
            max_pending_offload_bytes=8 * BLOCK,
        ) as mgr:
            metrics = ClientMetrics([mgr], registry)
            server = start_http_server(0, "127.0.0.1", registry)
            try:
                # 64 blocks, more than L1 holds: put 8 at a time, as an engine's steps do;
                # then the first 6 (long evicted from L1) come back from the node
                tokens = np.arange(64 * block_tokens, dtype=np.int32)
                for first in range(0, 64, 8):
                    handles = mgr.allocate_for(8)
                    for i, h in enumerate(handles, first):
                        mgr.block_view(h)[:] = i
                    mgr.put(tokens, handles, first_block=first)
                    assert mgr.flush(30)
                got = mgr.acquire(tokens[: 6 * block_tokens])
                assert got.num_blocks == 6 and got.l2_blocks > 0
                for i, h in enumerate(got.handles):
                    assert (mgr.block_view(h) == i).all(), i
                mgr.release(got)
                m = scrape(server.url)
            finally:
                server.close()
                metrics.close()
    finally:
        n.terminate()
    l1 = m[("rdmakv_client_hits_total", (("tier", "l1"),))]
    node_hits = m[("rdmakv_client_hits_total", (("tier", "node"),))]
    assert l1 + node_hits == 6 and node_hits == got.l2_blocks
    assert m[("rdmakv_client_offload_total", (("outcome", "stored"),))] == 64
    assert m[("rdmakv_client_offload_total", (("outcome", "dropped"),))] == 0
    put = (("direction", "put"), ("transport", "tcp"))
    get = (("direction", "get"), ("transport", "tcp"))
    assert m[("rdmakv_client_bytes_total", put)] == 64 * BLOCK
    assert m[("rdmakv_client_bytes_total", get)] == node_hits * BLOCK
    assert m[("rdmakv_client_fetch_seconds_count", ())] >= 1
    assert m[("rdmakv_client_misses_total", ())] == 0
    assert m[("rdmakv_client_node_down_total", ())] == 0
