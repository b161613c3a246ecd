"""Chaos over RDMA, through the KVCacheManager an engine uses: the client's QP is
forced into the error state in the middle of a batched fetch. The manager must
return no wrong block and raise nothing (failed ops are misses or are retried
on a reconnected QP), and the next fetch must hit again."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.client.streams import MultiStreamClient
from rdmakv.engine.manager import KVCacheManager
from rdmakv.node.process import LocalNodeProcess
from rdmakv.transport.rdma.client_side import RdmaTransport

pytestmark = pytest.mark.timeout(300)

BLOCK = 16384
BLOCK_TOKENS = 16
BLOCKS = 64
CLIENT_TIMEOUT = 20.0  # emulated soft-RoCE is slow; never a timing assertion


@pytest.fixture
def node() -> Iterator[LocalNodeProcess]:
    n = LocalNodeProcess(
        {"pool-size": str(4 * BLOCKS * BLOCK), "block-size": str(BLOCK), "transport": "rdma"},
        extra_args=["--no-lock"],
    )
    yield n
    n.kill()


def manager(endpoint: str) -> KVCacheManager:
    return KVCacheManager(
        namespace=KeyNamespace(model="m", dtype="float16", kv_layout="NHD"),
        block_tokens=BLOCK_TOKENS,
        block_bytes=BLOCK,
        l1_bytes=2 * BLOCKS * BLOCK,
        node=endpoint,
        transport="rdma",
        offload="all",
        max_pending_offload_bytes=BLOCKS * BLOCK,
        timeout=CLIENT_TIMEOUT,
        lock_slab=False,
    )


def kv_of(i: int) -> int:
    return (i * 37 + 11) % 251


def test_qp_error_mid_fetch_gives_misses_or_hits_never_wrong_kv(
    node: LocalNodeProcess,
) -> None:
    tokens = np.arange(BLOCKS * BLOCK_TOKENS, dtype=np.int32)
    with manager(node.endpoint) as writer:
        handles = writer.allocate_for(BLOCKS)
        for i, h in enumerate(handles):
            writer.block_view(h)[:] = kv_of(i)
        writer.put(tokens, handles)
        assert writer.flush(60)
    with manager(node.endpoint) as reader:  # an empty L1: every block comes from the node
        # two queue pairs by default over RDMA; a 1 MiB fetch is not split, it
        # runs on the first
        assert isinstance(reader.client, MultiStreamClient) and reader.client.streams == 2
        client = reader.client.clients[0]
        tp = client._tp  # fault injection needs the live transport
        assert isinstance(tp, RdmaTransport)
        breaker = threading.Timer(0.001, tp.qp.force_error)
        breaker.start()
        got = reader.acquire(tokens)  # must not raise
        breaker.join()
        for i, h in enumerate(got.handles):  # a leading prefix: each one exact
            assert (reader.block_view(h) == kv_of(i)).all(), f"block {i} is wrong KV"
        reader.release(got)
        again = reader.acquire(tokens)  # service restored: everything hits
        assert again.num_blocks == BLOCKS
        for i, h in enumerate(again.handles):
            assert (reader.block_view(h) == kv_of(i)).all(), f"block {i} is wrong KV"
        reader.release(again)
