"""The connectors' stores over RDMA, against a real ``rdmakv serve --transport rdma``:
with ``streams`` unset, a worker-side manager holds two queue pairs to the node
(the RDMA default, :mod:`rdmakv.streams`) and a scheduler-side one, which only
looks keys up, holds one connection; blocks a worker saves are found by the
scheduler side and read back exactly by another worker."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from rdmakv.client import KVClient
from rdmakv.connectors.store import GroupStores, StoreOptions
from rdmakv.hybrid import FullAttentionSpec, KVCacheGroup
from rdmakv.keys import KeyNamespace
from rdmakv.node.process import LocalNodeProcess
from rdmakv.streams import STREAMS_RDMA, MultiStreamClient

pytestmark = pytest.mark.timeout(300)

BLOCK = 16384
BLOCK_TOKENS = 16
BLOCKS = 8
GROUPS = [KVCacheGroup(0, FullAttentionSpec(BLOCK_TOKENS))]
NS = KeyNamespace(model="m", dtype="float16", kv_layout="NHD")
CLIENT_TIMEOUT = 20.0  # emulated soft-RoCE is slow; never a timing assertion


@pytest.fixture
def node() -> Iterator[LocalNodeProcess]:
    n = LocalNodeProcess(
        {"pool-size": str(8 * BLOCKS * BLOCK), "block-size": str(BLOCK), "transport": "rdma"},
        extra_args=["--no-lock"],
    )
    yield n
    n.kill()


def stores(endpoint: str, *, scheduler: bool) -> GroupStores:
    options = StoreOptions.from_mapping({
        "node": endpoint, "transport": "rdma", "l1_bytes": str(4 * BLOCKS * BLOCK),
        "lock_slab": False, "timeout": CLIENT_TIMEOUT, "offload": "all",
    })
    assert options.streams is None  # unset: by transport
    return GroupStores(NS, GROUPS, [BLOCK], options, scheduler=scheduler)


def test_workers_hold_two_queue_pairs_and_the_scheduler_one(node: LocalNodeProcess) -> None:
    tokens = np.arange(BLOCKS * BLOCK_TOKENS, dtype=np.int32)
    writer = stores(node.endpoint, scheduler=False)
    sched = stores(node.endpoint, scheduler=True)
    reader = stores(node.endpoint, scheduler=False)
    try:
        for worker in (writer, reader):
            client = worker.managers[0].client
            assert isinstance(client, MultiStreamClient) and client.streams == STREAMS_RDMA
            assert [c.transport_name for c in client.clients] == ["rdma"] * STREAMS_RDMA
        looker = sched.managers[0].client
        assert isinstance(looker, KVClient) and looker.transport_name == "rdma"

        kv = writer.managers[0]
        handles = kv.allocate_for(BLOCKS)
        for i, h in enumerate(handles):
            kv.block_view(h)[:] = (i * 37 + 11) % 251
        kv.put(tokens, handles)
        assert kv.flush(60)
        assert sched.managers[0].exists(tokens) == len(tokens)  # the scheduler finds them
        got = reader.managers[0].acquire(tokens)
        assert got.num_blocks == BLOCKS
        for i, h in enumerate(got.handles):
            assert (reader.managers[0].block_view(h) == (i * 37 + 11) % 251).all()
        reader.managers[0].release(got)
    finally:
        for s in (writer, sched, reader):
            s.close()
