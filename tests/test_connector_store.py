"""GroupStores + RequestBook + PagedGroupCopier against a real ``rdmakv serve``.

Two "engines" (each its own stores, L1 slabs and KV tensors) share one node:
engine A saves blocks of a hybrid model (full attention + sliding window),
engine B finds them through the scheduler-side lookup service and loads them
into different block ids on its transfer thread. No engine library is
imported: this is the connector logic that the vLLM adapter only forwards to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.connectors.group_stores import GroupStores, StoreOptions
from rdmakv.connectors.lookups import Bitmaps, LookupService
from rdmakv.connectors.paged import PagedGroupCopier, PageSpec
from rdmakv.connectors.plan import GroupBlocks, RequestBook, Transfer
from rdmakv.connectors.transfers import TransferWorker
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from rdmakv.errors import ConfigError

# Engine KV caches are torch tensors (rdmakv[torch]; the dev extras install it).
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

IO_TIMEOUT_S = 10.0

B = 16
SPEC = PageSpec(block_tokens=B, num_heads=2, head_size=8, head_size_v=8, dtype=torch.float32)
GROUPS = [KVCacheGroup(0, FullAttentionSpec(B)), KVCacheGroup(1, SlidingWindowSpec(B, 2 * B))]
NUM_BLOCKS = 16
NULL = 0
NS = KeyNamespace(model="test-model", dtype="float32", kv_layout="test")
PROMPT = list(range(500, 570))  # 4 full blocks + 6 tokens


class Clock:
    """A clock the test moves by hand: deadlines pass when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """An engine's paged KV (2 layers per group, block-first views) plus the connector parts:
    a scheduler side's :class:`LookupService`, or a worker's :class:`TransferWorker`."""

    def __init__(
        self,
        node: str,
        *,
        scheduler: bool = False,
        ns: KeyNamespace = NS,
        clock: Clock | None = None,
        **opts: Any,
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
        kw: dict[str, Any] = {} if clock is None else {"clock": clock}
        self.lookups: LookupService | None = None
        self.transfers: TransferWorker | None = None
        if scheduler:
            self.lookups = LookupService(self.stores, options.timeout, **kw)
            self.book = RequestBook(GROUPS, self.lookup, null_block=NULL)
        else:
            self.transfers = TransferWorker(
                self.stores, self.copiers, null_block=NULL, timeout=options.timeout, **kw
            )

    def lookup(self, req_id: str, tokens: Sequence[int], extra: bytes | None) -> Bitmaps | None:
        assert self.lookups is not None
        self.lookups.submit(req_id, tokens, extra)
        return self.lookups.answer(req_id)

    def ask(self, req_id: str, tokens: Sequence[int], extra: bytes | None = None) -> Any:
        """What the scheduler hears once the lookup answered (it asks again each step)."""
        deadline = time.monotonic() + IO_TIMEOUT_S
        while (got := self.book.num_new_matched_tokens(req_id, tokens, 0, extra))[0] is None:
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.005)
        return got

    def run(self, *, loads: Sequence[Transfer] = (), saves: Sequence[Transfer] = ()) -> Any:
        """Queue a step's jobs, wait for them to end, return what they report."""
        t = self.transfers
        assert t is not None
        t.save(saves, after=t.mark())
        t.wait(t.load(loads, report_async=True))
        assert t.call(lambda: None, IO_TIMEOUT_S) is None  # the saves queued before ran
        return t.results()

    @contextlib.contextmanager
    def transfers_held(self) -> Iterator[TransferWorker]:
        """Hold the transfer thread for the block, as a load stuck on a stalled node would."""
        t = self.transfers
        assert t is not None
        gate = threading.Event()
        holder = threading.Thread(target=t.call, args=(gate.wait, IO_TIMEOUT_S))
        holder.start()
        while t.idle():
            time.sleep(0.001)
        try:
            yield t
        finally:
            gate.set()
            holder.join()

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        elif self.transfers is not None:
            self.transfers.close()


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


def _prompt_save() -> Transfer:
    return Transfer(
        "a", tuple(PROMPT[:64]), None, (GroupBlocks(0, (1, 2, 3, 4)), GroupBlocks(0, (5, 6, 7, 8)))
    )


def _save_prompt(a: FakeEngine) -> list[list[int]]:
    """Engine A computed the prompt into blocks 1-4 (group 0) and 5-8 (group 1); save them."""
    save = _prompt_save()
    ids = [list(g.block_ids) for g in save.groups]
    for g, layers in enumerate(a.kv):
        for t in layers:
            t[ids[g]] = torch.randn(4, 2, B, 16)
    a.run(saves=[save])
    assert a.stores.stats.saved_blocks == 8
    assert a.transfers is not None and a.transfers.flush(10.0)
    return ids


def _load_b() -> Transfer:
    return Transfer(
        "b",
        tuple(PROMPT[:64]),
        None,
        (GroupBlocks(0, (9, 10, 11, 12)), GroupBlocks(0, (0, 0, 13, 14))),
    )


def test_blocks_saved_by_one_engine_are_found_and_loaded_by_another(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    ids_a = _save_prompt(a)

    sched = engines(node.endpoint, scheduler=True)
    assert sched.ask("b", PROMPT) == (64, True)

    b = engines(node.endpoint)
    ids_b = [[9, 10, 11, 12], [0, 0, 13, 14]]  # the window group got null blocks 0-1
    sched.book.after_alloc("b", PROMPT, len(PROMPT), None, ids_b, 64)
    (load,) = sched.book.build({}).loads
    got = b.run(loads=[load])
    assert got.finished_recving == {"b"} and not got.failed_recving and not got.bad_blocks
    for g in range(2):
        for layer in range(2):
            for ia, ib in zip(ids_a[g], ids_b[g], strict=True):
                if ib != NULL:
                    assert torch.equal(b.kv[g][layer][ib], a.kv[g][layer][ia])
    assert torch.count_nonzero(b.kv[1][0][0]) == 0  # the null block was never written
    assert b.stores.stats.loaded_blocks == 6
    assert b.stores.stats.loaded_bytes == 6 * 2 * SPEC.page_bytes
    assert b.stores.stats.fetch_s > 0 and b.stores.stats.load_copy_s > 0  # both were timed


def test_lookups_of_many_requests_share_one_batch(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    sched = engines(node.endpoint, scheduler=True)
    assert sched.lookups is not None
    node.pause()  # the questions queue up behind the first one
    for i in range(8):
        sched.lookups.submit(f"r{i}", PROMPT if i % 2 else PROMPT[:40], None)
    node.resume()
    answers = [sched.ask(f"r{i}", PROMPT if i % 2 else PROMPT[:40]) for i in range(8)]
    assert answers == [(32, True) if i % 2 == 0 else (64, True) for i in range(8)]
    assert sched.lookups.stats.answered == 8
    assert sched.lookups.stats.batches <= 2  # the first question, then all the others


def test_other_extra_or_namespace_misses(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    sched = engines(node.endpoint, scheduler=True)
    assert sched.ask("b", PROMPT, b"lora:x") == (0, False)
    other_ns = KeyNamespace(model="another-model", dtype="float32", kv_layout="test")
    other = engines(node.endpoint, scheduler=True, ns=other_ns)
    assert other.ask("b", PROMPT) == (0, False)


def test_a_stalled_node_costs_the_scheduler_no_wait_and_no_hit_after_the_timeout(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    clock = Clock()
    sched = engines(node.endpoint, scheduler=True, clock=clock, timeout=30)
    assert sched.lookups is not None
    node.pause()
    try:
        # Asked while the node is stopped: "ask again", as often as the scheduler likes.
        for _ in range(3):
            assert sched.book.num_new_matched_tokens("b", PROMPT, 0, None) == (None, False)
        assert sched.lookups.pending() == 1
        clock.now = 30.0  # the lookup's deadline: the request is computed, not held back
        assert sched.book.num_new_matched_tokens("b", PROMPT, 0, None) == (0, False)
        assert sched.lookups.stats.expired == 1
    finally:
        node.resume()


def test_a_dead_node_turns_loads_into_reported_failures(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    b = engines(node.endpoint, timeout=2)
    sched = engines(node.endpoint, scheduler=True, timeout=2)
    node.kill()
    got = b.run(loads=[_load_b()])
    # Two groups: vLLM takes the failure per request, never per block.
    assert got.finished_recving == {"b"} and got.failed_recving == {"b"}
    assert not got.bad_blocks
    assert all(torch.count_nonzero(t) == 0 for layers in b.kv for t in layers)
    assert sched.ask("b", PROMPT) == (0, False)


def test_a_load_queued_past_its_deadline_fails_without_a_node_call(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    _save_prompt(a)
    clock = Clock()
    b = engines(node.endpoint, clock=clock, timeout=30)
    with b.transfers_held() as t:
        jobs = t.load([_load_b()], report_async=True)
        clock.now = 30.0
    t.wait(jobs)
    got = t.results()
    assert got.failed_recving == {"b"}
    assert b.stores.stats.loaded_blocks == 0 and b.stores.managers[0].stats.l2_hit_blocks == 0


def test_loads_queued_behind_one_stuck_on_a_stalled_node_fail_with_it(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    _save_prompt(engines(node.endpoint))
    b = engines(node.endpoint, timeout=2)
    t = b.transfers
    assert t is not None
    node.pause()
    try:
        first = t.load([_load_b()], report_async=True)
        while t.idle():  # the first load is on the node, stuck
            time.sleep(0.001)
        behind = t.load([dataclasses.replace(_load_b(), req_id="c")], report_async=True)
        t.wait(first + behind)
    finally:
        node.resume()
    assert t.results().failed_recving == {"b", "c"}
    # One node call per group timed out; the load queued behind it made none.
    assert [m.stats.l2_errors for m in b.stores.managers] == [1, 1]


def test_a_held_request_is_reported_once_its_saves_ran_and_preempted_saves_are_dropped(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    preempted = Transfer("p", tuple(PROMPT[:64]), None, (GroupBlocks(0, (9,)), GroupBlocks(0, ())))
    with a.transfers_held() as t:
        t.save([_prompt_save(), preempted], after=t.mark())
        # Finished while its save is queued: not reported yet (vLLM keeps the blocks).
        assert t.results({"a", "p"}).finished_sending == set()
        t.drop_saves({"p"})  # the engine reuses p's blocks next: its save must never run
    assert t.call(lambda: None, IO_TIMEOUT_S) is None
    assert t.results().finished_sending == {"a", "p"}
    assert a.stores.stats.saved_blocks == 8  # a's 8 blocks; p's block was dropped
    assert t.results({"a"}).finished_sending == set()  # reported once


def test_save_skips_null_blocks_and_bad_ids_are_not_fatal(
    node_factory: Any, engines: Callable[..., FakeEngine]
) -> None:
    node = node_factory()
    a = engines(node.endpoint)
    save = Transfer(
        "a", tuple(PROMPT[:64]), None, (GroupBlocks(0, (1, 2, 3, 4)), GroupBlocks(0, (0, 0, 7, 8)))
    )
    a.run(saves=[save])
    assert a.stores.stats.saved_blocks == 6
    bad = Transfer(
        "a", tuple(PROMPT[:64]), None, (GroupBlocks(0, (1, 2, 3, NUM_BLOCKS)), GroupBlocks(0, ()))
    )
    a.run(saves=[bad])  # refused before any copy
    assert a.stores.stats.saved_blocks == 6
    assert a.stores.stats.failed_save_blocks == 4


def test_options_are_validated_by_name() -> None:
    with pytest.raises(ConfigError, match="node"):
        StoreOptions.from_mapping({})
    with pytest.raises(ConfigError, match="l1_sizee"):
        StoreOptions.from_mapping({"node": "h:1", "l1_sizee": 1})
    with pytest.raises(ConfigError, match="timeout"):
        StoreOptions.from_mapping({"node": "h:1", "timeout": 0})
    with pytest.raises(ConfigError, match="load_mode must be one of"):
        StoreOptions.from_mapping({"node": "h:1", "load_mode": "eager"})
    assert StoreOptions.from_mapping({"node": "h:1"}).load_mode == "async"
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
