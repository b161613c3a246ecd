"""The connectors' stores over RDMA, against a real ``rdmakv serve --transport rdma``:
with ``streams`` unset, a worker-side manager holds two queue pairs to the node
(the RDMA default, :mod:`rdmakv.client.streams`) and a scheduler-side one, which only
looks keys up, holds one connection; blocks a worker saves are found by the
scheduler side and read back exactly by another worker."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.client.node_client import KVClient
from rdmakv.client.streams import STREAMS_RDMA, MultiStreamClient
from rdmakv.connectors.group_stores import GroupStores, StoreOptions
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup
from rdmakv.node.process import LocalNodeProcess

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


def test_the_connector_threads_save_find_and_load_over_rdma(node: LocalNodeProcess) -> None:
    """The vLLM connector's transfer and lookup threads (what its hooks only queue to)
    move a prompt's blocks between two workers' paged tensors over RDMA."""
    torch = pytest.importorskip("torch")

    from rdmakv.connectors.lookups import LookupService
    from rdmakv.connectors.paged import PagedGroupCopier, PageSpec
    from rdmakv.connectors.plan import RequestBook
    from rdmakv.connectors.transfers import TransferWorker

    spec = PageSpec(BLOCK_TOKENS, num_heads=2, head_size=32, head_size_v=32, dtype=torch.float32)
    assert 2 * spec.page_bytes == BLOCK  # two layers make one node block
    prompt = list(range(3000, 3000 + BLOCKS * BLOCK_TOKENS + 5))
    hit_tokens = BLOCKS * BLOCK_TOKENS

    def worker() -> tuple[TransferWorker, list[torch.Tensor]]:
        kv = [torch.zeros(2 * BLOCKS + 2, 2, BLOCK_TOKENS, 64) for _ in range(2)]
        copier = PagedGroupCopier([(f"l{i}", t) for i, t in enumerate(kv)], spec, null_block=0)
        s = stores(node.endpoint, scheduler=False)
        return TransferWorker(s, [copier], null_block=0, timeout=CLIENT_TIMEOUT), kv

    writer, kv_a = worker()
    reader, kv_b = worker()
    lookups = LookupService(stores(node.endpoint, scheduler=True), CLIENT_TIMEOUT)
    try:
        def lookup(
            req_id: str, tokens: Sequence[int], extra: bytes | None
        ) -> list[list[bool]] | None:
            lookups.submit(req_id, tokens, extra)
            return lookups.answer(req_id)

        book = RequestBook(GROUPS, lookup)
        ids_a = list(range(1, BLOCKS + 2))
        for t in kv_a:
            t[ids_a] = torch.randn(len(ids_a), 2, BLOCK_TOKENS, 64)
        book.after_alloc("a", prompt, len(prompt), None, [ids_a], 0, num_computed=0)
        book.scheduled("a", 0, block_ids=[ids_a])
        writer.save(book.build({"a": len(prompt)}).saves, after=writer.mark())
        assert writer.flush(120)
        while (hit := book.num_new_matched_tokens("b", prompt, 0, None))[0] is None:
            time.sleep(0.01)  # vLLM would ask again next step
        assert hit == (hit_tokens, True)
        ids_b = list(range(BLOCKS + 2, 2 * BLOCKS + 2))
        book.after_alloc("b", prompt, len(prompt), None, [ids_b], hit_tokens)
        reader.wait(reader.load(book.build({}).loads, report_async=True))
        got = reader.results()
        assert got.finished_recving == {"b"} and not got.bad_blocks
        for ta, tb in zip(kv_a, kv_b, strict=True):
            assert torch.equal(ta[ids_a[:BLOCKS]], tb[ids_b])
        assert reader.stores.managers[0].transport_name == "rdma"
    finally:
        lookups.close()
        writer.close()
        reader.close()
