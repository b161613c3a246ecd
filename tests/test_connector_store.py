"""GroupStores + RequestBook + PagedGroupCopier against a real ``rdmakv serve``.

Two "engines" (each its own stores, L1 slabs and KV tensors) share one node:
engine A saves blocks of a hybrid model (full attention + sliding window),
engine B finds them through the scheduler-side lookup and loads them into
different block ids. No engine library is imported: this is the connector
logic that the vLLM adapter only forwards to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from rdmakv.connectors.paged import PagedGroupCopier, PageSpec
from rdmakv.connectors.plan import GroupBlocks, RequestBook, Transfer
from rdmakv.connectors.store import GroupStores, StoreOptions
from rdmakv.errors import ConfigError
from rdmakv.hybrid import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from rdmakv.keys import KeyNamespace

pytestmark = pytest.mark.timeout(120)

B = 16
SPEC = PageSpec(block_tokens=B, num_heads=2, head_size=8, head_size_v=8, dtype=torch.float32)
GROUPS = [KVCacheGroup(0, FullAttentionSpec(B)), KVCacheGroup(1, SlidingWindowSpec(B, 2 * B))]
NUM_BLOCKS = 16
NULL = 0
NS = KeyNamespace(model="test-model", dtype="float32", kv_layout="test")
PROMPT = list(range(500, 570))  # 4 full blocks + 6 tokens


class FakeEngine:
    """An engine's paged KV (2 layers per group, block-first views) plus the connector parts."""

    def __init__(
        self, node: str, *, scheduler: bool = False, ns: KeyNamespace = NS, **opts: Any
    ) -> None:
        self.kv = [
            [torch.zeros(NUM_BLOCKS, 2, B, 16) for _ in range(2)] for _ in GROUPS
        ]  # [group][layer]
        options = StoreOptions.from_mapping(
            {"node": node, "transport": "tcp", "l1_bytes": "2MiB", "lock_slab": False, **opts}
        )
        self.stores = GroupStores(
            ns, GROUPS, [2 * SPEC.page_bytes] * 2, options, scheduler=scheduler
        )
        self.copiers = [
            PagedGroupCopier(
                [(f"g{g}l{i}", t) for i, t in enumerate(layers)], SPEC, null_block=NULL
            )
            for g, layers in enumerate(self.kv)
        ]

    def close(self) -> None:
        self.stores.close()


@pytest.fixture
def engines() -> Iterator[Callable[..., FakeEngine]]:
    made: list[FakeEngine] = []

    def make(node: str, **kw: Any) -> FakeEngine:
        e = FakeEngine(node, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _save_prompt(a: FakeEngine) -> list[list[int]]:
    """Engine A computed the prompt into blocks 1-4 (group 0) and 5-8 (group 1); save them."""
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    for g, layers in enumerate(a.kv):
        for t in layers:
            t[ids[g]] = torch.randn(4, 2, B, 16)
    save = Transfer(
        "a",
        tuple(PROMPT[:64]),
        None,
        (GroupBlocks(0, tuple(ids[0])), GroupBlocks(0, tuple(ids[1]))),
    )
    assert a.stores.save(save, a.copiers, NULL) == 8
    assert a.stores.flush(10.0)
    return ids


def test_blocks_saved_by_one_engine_are_found_and_loaded_by_another(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    ids_a = _save_prompt(a)

    sched = engines(node.endpoint, scheduler=True)
    book = RequestBook(GROUPS, sched.stores.hit_bitmaps, null_block=NULL)
    assert book.num_new_matched_tokens("b", PROMPT, 0, None) == (64, True)

    b = engines(node.endpoint)
    ids_b = [[9, 10, 11, 12], [0, 0, 13, 14]]  # the window group got null blocks 0-1
    book.after_alloc("b", PROMPT, len(PROMPT), None, ids_b, 64)
    (load,) = book.build({}).loads
    assert b.stores.load(load, b.copiers, NULL) == set()
    for g in range(2):
        for layer in range(2):
            for ia, ib in zip(ids_a[g], ids_b[g], strict=True):
                if ib != NULL:
                    assert torch.equal(b.kv[g][layer][ib], a.kv[g][layer][ia])
    assert torch.count_nonzero(b.kv[1][0][0]) == 0  # the null block was never written
    assert b.stores.stats.loaded_blocks == 6


def test_other_extra_or_namespace_misses(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    sched = engines(node.endpoint, scheduler=True)
    book = RequestBook(GROUPS, sched.stores.hit_bitmaps)
    assert book.num_new_matched_tokens("b", PROMPT, 0, b"lora:x") == (0, False)
    other_ns = KeyNamespace(model="another-model", dtype="float32", kv_layout="test")
    other = engines(node.endpoint, scheduler=True, ns=other_ns)
    book2 = RequestBook(GROUPS, other.stores.hit_bitmaps)
    assert book2.num_new_matched_tokens("b", PROMPT, 0, None) == (0, False)


def test_a_dead_node_turns_loads_into_reported_failures(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    b = engines(node.endpoint, timeout=2)
    node.kill()
    load = Transfer(
        "b",
        tuple(PROMPT[:64]),
        None,
        (GroupBlocks(0, (9, 10, 11, 12)), GroupBlocks(0, (0, 0, 13, 14))),
    )
    assert b.stores.load(load, b.copiers, NULL) == {9, 10, 11, 12, 13, 14}
    assert all(torch.count_nonzero(t) == 0 for layers in b.kv for t in layers)
    sched_book = RequestBook(GROUPS, b.stores.hit_bitmaps)
    assert sched_book.num_new_matched_tokens("b", PROMPT, 0, None) == (0, False)


def test_save_skips_null_blocks_and_bad_ids_are_not_fatal(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    save = Transfer(
        "a", tuple(PROMPT[:64]), None, (GroupBlocks(0, (1, 2, 3, 4)), GroupBlocks(0, (0, 0, 7, 8)))
    )
    assert a.stores.save(save, a.copiers, NULL) == 6
    bad = Transfer(
        "a", tuple(PROMPT[:64]), None, (GroupBlocks(0, (1, 2, 3, NUM_BLOCKS)), GroupBlocks(0, ()))
    )
    assert a.stores.save(bad, a.copiers, NULL) == 0  # refused before any copy
    assert a.stores.stats.failed_save_blocks == 4


def test_options_are_validated_by_name() -> None:
    with pytest.raises(ConfigError, match="node"):
        StoreOptions.from_mapping({})
    with pytest.raises(ConfigError, match="l1_sizee"):
        StoreOptions.from_mapping({"node": "h:1", "l1_sizee": 1})
    with pytest.raises(ConfigError, match="timeout"):
        StoreOptions.from_mapping({"node": "h:1", "timeout": 0})
    assert StoreOptions.from_mapping({"node": "h:1", "l1_bytes": "2MiB"}).l1_bytes == 2 << 20
    assert StoreOptions.from_mapping({"node": "[::1]:7070"}).node == "[::1]:7070"
    cluster = StoreOptions.from_mapping({"node": "a:1,b:2", "replication": 2})
    assert cluster.replication == 2
    assert StoreOptions.from_mapping({"node": "dns://kv.default.svc:7480"}).replication == 1
    with pytest.raises(ConfigError, match="no port"):
        StoreOptions.from_mapping({"node": "nohost"})
    with pytest.raises(ConfigError, match="replication must be an int >= 1"):
        StoreOptions.from_mapping({"node": "a:1,b:2", "replication": 0})
    assert StoreOptions.from_mapping({"node": "h:1", "streams": 4}).streams == 4
    # unset: by transport, for one node or a cluster alike
    assert StoreOptions.from_mapping({"node": "h:1"}).streams is None
    assert StoreOptions.from_mapping({"node": "a:1,b:2"}).streams is None
    assert StoreOptions.from_mapping({"node": "a:1,b:2", "streams": 1}).streams == 1
    with pytest.raises(ConfigError, match="streams > 1 applies to one rdmakv node"):
        StoreOptions.from_mapping({"node": "a:1,b:2", "streams": 2})
    for bad in (0, 17, "2", True):
        with pytest.raises(ConfigError, match=r"streams must be an integer in \[1, 16\]"):
            StoreOptions.from_mapping({"node": "h:1", "streams": bad})


def test_metrics_port_serves_the_engines_hits_and_saves(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    node = node_factory()
    a = engines(node.endpoint, metrics_port=0)
    assert a.stores.metrics_server is not None
    _save_prompt(a)
    with urllib.request.urlopen(a.stores.metrics_server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("rdmakv_client_offload_total", (("outcome", "stored"),))] == 8
    a.close()  # unregisters: a second engine in this process can export again
    b = engines(node.endpoint, metrics_port=0)
    assert b.stores.metrics is not None
