"""A cluster wherever one node was taken: KVCacheManager, the connectors' options,
``rdmakv stats`` and ``rdmakv demo`` (issue 10 item 1), against real nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from conftest import NodeProcess
from test_manager import (
    BLOCK_BYTES,
    FLUSH_TIMEOUT,
    compute_and_put,
    kv_bytes,
    make_manager,
    tokens_of,
)

from rdmakv import demo
from rdmakv.client.cluster import ClusterClient
from rdmakv.client.node_client import KVClient
from rdmakv.client.remote import open_remote
from rdmakv.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
NODES = 3


@pytest.fixture
def cluster(node_factory: Callable[..., NodeProcess]) -> list[NodeProcess]:
    return [node_factory() for _ in range(NODES)]


def spec(nodes: list[NodeProcess]) -> str:
    return ",".join(n.endpoint for n in nodes)


def test_manager_over_a_cluster_spreads_blocks_and_serves_them_back(
    cluster: list[NodeProcess],
) -> None:
    writer = make_manager(spec(cluster), offload="all", max_pending_offload_bytes=256 * BLOCK_BYTES)
    assert isinstance(writer.client, ClusterClient)
    prompts = [tokens_of(100 + i, 6) for i in range(20)]
    keys = [compute_and_put(writer, t) for t in prompts]
    assert writer.flush(FLUSH_TIMEOUT)
    writer.close()
    per_node = [KVClient(n.host, n.port, None).stats()["entries"] for n in cluster]
    assert sum(per_node) == 120 and min(per_node) > 0  # every block once, on every node
    # A fresh manager (empty L1) finds every prefix on the cluster, bytes intact.
    reader = make_manager(spec(cluster))
    try:
        for t, ks in zip(prompts, keys, strict=True):
            assert reader.exists(t) == len(t)
            got = reader.acquire(t)
            assert got.l2_blocks == 6
            for h, k in zip(got.handles, ks, strict=True):
                assert (reader.block_view(h) == kv_bytes(k, BLOCK_BYTES)).all()
            reader.release(got)
    finally:
        reader.close()


def test_a_dead_member_costs_only_its_share_as_misses(cluster: list[NodeProcess]) -> None:
    writer = make_manager(spec(cluster), offload="all", max_pending_offload_bytes=256 * BLOCK_BYTES)
    prompts = [tokens_of(200 + i, 1) for i in range(60)]  # one block each: no chain effects
    keys = [compute_and_put(writer, t)[0] for t in prompts]
    assert writer.flush(FLUSH_TIMEOUT)
    owners = writer.client.owners(keys)  # type: ignore[union-attr]
    writer.close()
    cluster[1].kill()
    dead = cluster[1].endpoint
    reader = make_manager(spec(cluster))
    try:
        for t, k, o in zip(prompts, keys, owners, strict=True):
            got = reader.acquire(t)  # never raises: the dead node's blocks are misses
            assert got.l2_blocks == (0 if o[0] == dead else 1)
            if got.l2_blocks:
                assert (reader.block_view(got.handles[0]) == kv_bytes(k, BLOCK_BYTES)).all()
            reader.release(got)
        assert any(o[0] == dead for o in owners) and any(o[0] != dead for o in owners)
    finally:
        reader.close()


def test_replication_needs_a_cluster(node: NodeProcess) -> None:
    with pytest.raises(ConfigError, match="replication 2 needs a cluster"):
        open_remote(node.endpoint, None, replication=2)
    with pytest.raises(ConfigError, match="no port"):
        make_manager("a:1,b")


def test_stats_cli_reports_every_node_and_the_total(cluster: list[NodeProcess]) -> None:
    with ClusterClient(spec(cluster), None) as c:
        want = [c.stats()["nodes"][n.endpoint]["entries"] for n in cluster]
    cluster[2].kill()
    out = subprocess.run(
        [sys.executable, "-m", "rdmakv.cli", "stats", spec(cluster), "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    stats: dict[str, Any] = json.loads(out.stdout)
    assert set(stats["nodes"]) == {n.endpoint for n in cluster}
    assert "error" in stats["nodes"][cluster[2].endpoint]
    assert stats["total"]["entries"] == sum(want[:2])
    assert stats["cluster"]["up"] == 2


def test_demo_over_local_nodes_and_running_nodes(cluster: list[NodeProcess]) -> None:
    small = {"requests": 16, "prefixes": 4, "prefix_blocks": 8, "suffix_blocks": 2,
             "block_bytes": 64 * 1024, "l1_bytes": 2 << 20, "pool_bytes": 64 << 20,
             "transport": "tcp"}
    for cfg in (
        demo.DemoConfig(local_nodes=2, **small),  # type: ignore[arg-type]
        demo.DemoConfig(nodes=spec(cluster), replication=2, **small),  # type: ignore[arg-type]
    ):
        r = demo.run(cfg, quiet=True)["replay"]
        assert isinstance(r, dict)
        assert r["wrong_blocks"] == 0 and r["l2_hit_blocks"] > 0
    per_node = [KVClient(n.host, n.port, None).stats()["entries"] for n in cluster]
    assert min(per_node) > 0
