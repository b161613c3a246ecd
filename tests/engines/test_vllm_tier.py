"""rdmakv as a vLLM 0.33 secondary tier, against vLLM's REAL tiering classes (scheduler side, CPU).

What is real here: ``TieringOffloadingSpec`` (vLLM's CPU spec, its shared
``/dev/shm`` region and primary tier), ``SecondaryTierFactory`` loading the
tier from ``{"type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier"}``,
``TieringOffloadingManager`` driving it exactly as vLLM's offloading
scheduler does (``on_new_request``, ``lookup`` with ``RETRY`` /
``HIT_PENDING``, ``prepare_store`` / ``complete_store`` cascading to the tier,
promotions submitted at ``on_schedule_end``, ``get_finished_jobs`` polled by
the manager, ``shutdown``), and ``rdmakv serve`` nodes over TCP
(``deploy/engines.sh``) or, with ``RDMAKV_TIER_TEST_TRANSPORT=rdma``, over
RDMA on soft-RoCE in the VM (``.ci/run``; the tests that need a TCP proxy
between tier and node are marked ``tcp_proxy`` and deselected there).

What is simulated: the GPU -> CPU DMA of vLLM's worker, i.e. the bytes of a
chunk: :meth:`Engine.store` writes them into the CPU-tier rows vLLM handed
out, as the worker would. Every chunk's bytes depend only on its key, so a
chunk read back equal proves the bytes came through rdmakv.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("vllm", reason="needs the engine venv: bash deploy/engines.sh")

from chaos.wire_proxy import Direction, WireProxy
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from rdmakv.client.node_client import KVClient
from rdmakv.connectors.vllm_tier import RdmakvTier
from rdmakv.errors import ConfigError

TRANSPORT = os.environ.get("RDMAKV_TIER_TEST_TRANSPORT", "tcp")
"""The nodes' and the tier's transport (rdma: in the soft-RoCE VM, under emulation)."""
EMULATED = TRANSPORT == "rdma"

pytestmark = pytest.mark.timeout(600 if EMULATED else 120)

CHUNK_BYTES = 16 * 1024  # one 16-token block of a tiny model per chunk (page aligned)
NUM_CHUNKS = 64
# the client timeout: lookups expire after it, stalled jobs fail (emulated verbs are slow)
TIMEOUT_S = 10.0 if EMULATED else 1.0
# the longest a test waits for vLLM's manager to settle (no timing assertion)
WAIT_S = 120.0 if EMULATED else 20.0
TIER = {"type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier"}
_engine_ids = itertools.count()


def chunk_keys(tag: str, n: int) -> list[OffloadKey]:
    """``n`` vLLM offload keys (block hash + group 0), distinct per ``tag``."""
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


def chunk_bytes(key: bytes) -> bytes:
    """What the worker's DMA would put in ``key``'s row: depends only on the key."""
    seed = hashlib.sha256(key).digest()
    return (seed * (CHUNK_BYTES // len(seed) + 1))[:CHUNK_BYTES]


def offloading_config(tier: dict[str, Any], engine_id: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": NUM_CHUNKS * CHUNK_BYTES,
            "secondary_tiers": [tier],
            "tier_poll_interval_s": 0,  # serviced per step, as a real scheduler does
        },
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny-llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class Engine:
    """One vLLM engine's scheduler-side offloading: the real spec and manager, our tier."""

    def __init__(self, **tier_options: Any) -> None:
        opts = {"transport": TRANSPORT, "timeout": TIMEOUT_S, **tier_options}
        self.spec = TieringOffloadingSpec(
            offloading_config({**TIER, **opts}, f"rdmakv-test-{os.getpid()}-{next(_engine_ids)}")
        )
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, RdmakvTier)
        self.tier = tier
        # the CPU tier's rows, as the worker's DMA sees them (dropped before vLLM unmaps)
        self.rows: Any = np.asarray(manager.primary_tier.get_kv_memoryview())
        self._req = itertools.count()
        self.closed = False

    def request(self, **params: Any) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(self._req)}", kv_transfer_params=params or None)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        """The end of a scheduler step: vLLM polls jobs, submits promotions, flushes lookups."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self) -> None:
        """Step until vLLM's manager has no job in flight (each step as vLLM would)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "jobs never finished"
            time.sleep(0.005)

    def store(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Offload ``keys`` as vLLM does: into the CPU tier (the worker's DMA simulated),
        then ``complete_store`` cascades them to the tier. Waits until they ran."""
        ctx = ctx or self.request()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None and list(out.keys_to_store) == list(keys)
            assert isinstance(out.store_spec, CPULoadStoreSpec)
            for key, row in zip(keys, out.store_spec.chunk_ids.tolist(), strict=True):
                self.rows[row] = np.frombuffer(chunk_bytes(key), dtype=np.uint8)
            self.manager.complete_store(keys, ctx)
            self.manager.on_request_finished(ctx)
        self.settle()

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        with self.manager.lock:
            return [self.manager.lookup(k, ctx) for k in keys]

    def resolve(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """Look ``keys`` up each step, as vLLM's scheduler does, until every answer is
        final (HIT or MISS): tier hits are promoted into the CPU tier meanwhile."""
        deadline = time.monotonic() + WAIT_S
        while True:
            got = self.lookup(keys, ctx)
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in got):
                return got
            assert time.monotonic() < deadline, f"lookups never settled: {got}"
            self.step()
            time.sleep(0.005)

    def ask(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Look ``keys`` up and end the step (the questions go out); wait until the
        node answered them all (the next lookups then start promotions)."""
        self.lookup(keys, ctx)
        self.step()
        lookups = self.tier.core.lookups
        assert lookups is not None
        deadline = time.monotonic() + WAIT_S
        while lookups.pending():
            assert time.monotonic() < deadline, "the node never answered"
            time.sleep(0.005)

    def read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bytes]:
        """The CPU-tier bytes of ``keys`` (HITs), as vLLM's worker would load them."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
            assert isinstance(spec, CPULoadStoreSpec)
            rows = spec.chunk_ids.tolist()
            data = [self.rows[r].tobytes() for r in rows]
            self.manager.complete_load(keys, ctx)
        return data

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.rows = None  # vLLM releases its view of the rows
            self.manager.shutdown()


@pytest.fixture
def node_factory(node_factory: Callable[..., Any]) -> Callable[..., Any]:
    """Nodes serving ``TRANSPORT`` (they answer control calls over TCP as well)."""
    return lambda **options: node_factory(**{"transport": TRANSPORT, **options})


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**tier_options: Any) -> Engine:
        e = Engine(**tier_options)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
        assert not e.tier.core._thread.is_alive()


def node_has(node: Any, engine: Engine, keys: Sequence[OffloadKey]) -> list[bool]:
    """Ask the node directly (own client) whether it holds ``keys`` under the tier's keys."""
    with KVClient(*node.address, None, transport="tcp") as c:
        return c.exists(engine.tier.core.keys.keys(keys))


def test_store_then_load_in_another_engine_bytes_verified(node_factory: Any, engines: Any) -> None:
    node = node_factory()
    a, b = engines(node=node.endpoint), engines(node=node.endpoint)
    keys = chunk_keys("shared", 8)
    a.store(keys)
    assert a.tier.core.transport_name == b.tier.core.transport_name == TRANSPORT
    assert a.tier.core.stats.stored_chunks == 8
    assert a.tier.core.stats.put_bytes == 8 * CHUNK_BYTES
    assert node_has(node, a, keys) == [True] * 8
    # b never computed them: the first answer is RETRY (asked, not answered yet)
    ctx = b.request()
    assert b.lookup(keys[:1], ctx) == [LookupResult.RETRY]
    assert b.resolve(keys, ctx) == [LookupResult.HIT] * 8
    assert b.read(keys, ctx) == [chunk_bytes(k) for k in keys]
    assert b.tier.core.stats.loaded_chunks == 8 and b.tier.core.stats.failed_load_chunks == 0
    # zero copy: the KV client's slab is vLLM's CPU tier itself
    assert b.tier.core.slab.external and b.tier.core.slab.nbytes == NUM_CHUNKS * CHUNK_BYTES
    b.finish(ctx)
    b.settle()
    assert b.tier.core.lookups is not None and b.tier.core.lookups.size() == 0


def test_miss_is_retry_then_miss(node_factory: Any, engines: Any) -> None:
    e = engines(node=node_factory().endpoint)
    ctx = e.request()
    keys = chunk_keys("never-stored", 3)
    assert e.lookup(keys, ctx) == [LookupResult.RETRY] * 3
    assert e.resolve(keys, ctx) == [LookupResult.MISS] * 3
    assert e.tier.core.stats.lookup_keys == 3 and e.tier.core.stats.lookup_found == 0
    assert e.tier.core.lookups is not None and e.tier.core.lookups.stats.batches == 1


def test_load_with_chunks_gone_reports_successful_keys(node_factory: Any, engines: Any) -> None:
    node = node_factory()
    a, b = engines(node=node.endpoint), engines(node=node.endpoint)
    keys = chunk_keys("partial", 6)
    a.store(keys)
    ctx = b.request()
    b.ask(keys, ctx)
    # between lookup and load, the node loses two of them (evicted, another engine's DELETE)
    with KVClient(*node.address, None, transport="tcp") as c:
        assert c.delete(b.tier.core.keys.keys([keys[1], keys[4]])) == [True, True]
    results: list[Any] = []
    real = b.tier.get_finished_jobs
    b.tier.get_finished_jobs = lambda: results.extend(r := list(real())) or r  # type: ignore[method-assign]
    got = b.resolve(keys, ctx)
    assert got == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.HIT,
                   LookupResult.MISS, LookupResult.HIT]
    loads = [r for r in results if r.job_id is not None and not r.success]
    assert len(loads) == 1 and set(loads[0].successful_keys) == {keys[0], keys[2], keys[3], keys[5]}
    hits = [k for k, r in zip(keys, got, strict=True) if r is LookupResult.HIT]
    assert b.read(hits, ctx) == [chunk_bytes(k) for k in hits]


def test_node_killed_between_lookup_and_load_fails_the_keys(
    node_factory: Any, engines: Any
) -> None:
    node = node_factory()
    a, b = engines(node=node.endpoint), engines(node=node.endpoint)
    keys = chunk_keys("dead-before-load", 6)
    a.store(keys)
    ctx = b.request()
    b.ask(keys, ctx)  # the node said it holds them all...
    node.kill()  # ...and dies before the promotions' load runs
    assert b.resolve(keys, ctx) == [LookupResult.MISS] * 6
    assert b.tier.core.stats.failed_load_chunks == 6 and b.tier.core.stats.loaded_chunks == 0
    b.settle()  # nothing in flight, nothing pinned
    assert not b.tier.core.busy()


@pytest.mark.tcp_proxy
def test_node_killed_mid_load_fails_the_keys_and_nothing_hangs(
    node_factory: Any, engines: Any
) -> None:
    node = node_factory(pool_size="64MiB")
    a = engines(node=node.endpoint)
    keys = chunk_keys("killed", 48)
    a.store(keys)
    with WireProxy(("127.0.0.1", node.port)) as proxy:
        b = engines(node=proxy.endpoint)
        ctx = b.request()
        b.ask(keys, ctx)
        # the node dies once a third of the load's bytes came back, and the rest
        # (already in socket buffers) never arrives
        proxy.call_at(Direction.DOWN, 16 * CHUNK_BYTES, node.kill)
        proxy.cut_after(Direction.DOWN, 16 * CHUNK_BYTES)
        got = b.resolve(keys, ctx)
    assert node.proc is None or node.proc.poll() is not None
    assert got.count(LookupResult.HIT) == b.tier.core.stats.loaded_chunks
    assert b.tier.core.stats.failed_load_chunks >= 1
    hits = [k for k, r in zip(keys, got, strict=True) if r is LookupResult.HIT]
    assert b.read(hits, ctx) == [chunk_bytes(k) for k in hits]  # nothing reported loaded is wrong
    b.settle()  # nothing in flight, nothing pinned
    assert not b.tier.core.busy()
    # the failed keys read MISS from now on (vLLM would otherwise promote them in a loop)
    assert set(b.lookup(keys, ctx)) <= {LookupResult.HIT, LookupResult.MISS}


def test_stalled_node_lookups_retry_then_miss_and_jobs_fail(
    node_factory: Any, engines: Any
) -> None:
    node = node_factory()
    a = engines(node=node.endpoint)
    stored = chunk_keys("before-stall", 4)
    a.store(stored)
    node.pause()  # SIGSTOP
    try:
        ctx = a.request()
        fresh = chunk_keys("during-stall", 4)
        assert a.lookup(fresh, ctx) == [LookupResult.RETRY] * 4
        # the node never answers: the questions expire after the client timeout as MISS
        assert a.resolve(fresh, ctx) == [LookupResult.MISS] * 4
        assert a.tier.core.stats.lookup_found == 0
        # a store to the stalled node fails (reported, the rows unpinned), never hangs
        a.store(chunk_keys("store-during-stall", 2))
        assert a.tier.core.stats.failed_store_chunks == 2
    finally:
        node.resume()


def test_two_engines_share_a_node(node_factory: Any, engines: Any) -> None:
    node = node_factory()
    a, b = engines(node=node.endpoint), engines(node=node.endpoint)
    ka, kb = chunk_keys("from-a", 5), chunk_keys("from-b", 5)
    a.store(ka)
    b.store(kb)
    ca, cb = a.request(), b.request()
    assert a.resolve(kb, ca) == [LookupResult.HIT] * 5
    assert b.resolve(ka, cb) == [LookupResult.HIT] * 5
    assert a.read(kb, ca) == [chunk_bytes(k) for k in kb]
    assert b.read(ka, cb) == [chunk_bytes(k) for k in ka]
    # a different model never sees them (the namespace differs)
    c = engines(node=node.endpoint, model="another-model")
    assert c.resolve(ka, c.request()) == [LookupResult.MISS] * 5


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"nod": "127.0.0.1:1"}, "nod"),
        ({"node": "127.0.0.1:1", "l1_bytes": "1GiB"}, "l1_bytes"),
        ({"node": "127.0.0.1:1", "offload": "cold"}, "offload"),
        ({"node": "127.0.0.1:1", "audit_rate": 0.1}, "audit_rate"),
        ({"node": "127.0.0.1:1", "replication": 0}, "replication"),
        ({"node": "127.0.0.1:1", "locality": "MARS"}, "locality"),
        ({"node": "not an address"}, "not an address"),
        ({}, "node"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(options: dict[str, Any], named: str) -> None:
    spec = TieringOffloadingSpec(offloading_config({**TIER, **options}, "rdmakv-bad-config"))
    with pytest.raises(ConfigError) as err:
        spec.get_manager()
    msg = str(err.value)
    assert named in msg and "\n" not in msg


@pytest.mark.tcp_proxy
def test_corrupt_chunk_on_the_wire_is_never_reported_loaded(
    node_factory: Any, engines: Any
) -> None:
    node = node_factory()
    a = engines(node=node.endpoint)
    keys = chunk_keys("corrupt", 16)
    a.store(keys)
    with WireProxy(("127.0.0.1", node.port)) as proxy:
        b = engines(node=proxy.endpoint)
        ctx = b.request()
        b.ask(keys, ctx)
        proxy.flip_bits(Direction.DOWN, mean_gap=4096, seed=7)  # the load's reply is garbage
        got = b.resolve(keys, ctx)
        proxy.clear()
    assert b.tier.core.stats.failed_load_chunks >= 1
    hits = [k for k, r in zip(keys, got, strict=True) if r is LookupResult.HIT]
    assert b.read(hits, ctx) == [chunk_bytes(k) for k in hits]


def test_shutdown_with_jobs_in_flight_returns_and_stops_the_threads(
    node_factory: Any, engines: Any
) -> None:
    node = node_factory()
    a, b = engines(node=node.endpoint), engines(node=node.endpoint)
    keys = chunk_keys("shutdown", 8)
    a.store(keys)
    ctx = b.request()
    assert b.resolve(keys[:1], ctx) == [LookupResult.HIT]  # the tier answered; a load is queued
    b.lookup(keys, ctx)
    b.step()
    node.pause()
    try:
        # loads and a store in flight against a stalled node, then vLLM shuts down
        with b.manager.lock:
            out = b.manager.prepare_store(chunk_keys("late", 4), ctx)
            assert out is not None
            b.manager.complete_store(out.keys_to_store, ctx)
        b.step()
        done = threading.Event()
        closer = threading.Thread(target=lambda: (b.close(), done.set()))
        closer.start()
        assert done.wait(WAIT_S), "shutdown hung on jobs in flight"
        closer.join()
    finally:
        node.resume()
    assert not b.tier.core._thread.is_alive()
    assert b.tier.core.client is None and b.tier.core.slab.closed


def use_again(e: Engine, keys: Sequence[OffloadKey]) -> None:
    """A new request uses ``keys`` while vLLM's CPU tier holds them, as vLLM's scheduler
    does: they are HITs, loaded from the CPU tier, and (request-level offload policy)
    offered for storing from chunk 0, which cascades the hits to the tier."""
    ctx = e.request()
    assert e.lookup(keys, ctx) == [LookupResult.HIT] * len(keys)
    e.read(keys, ctx)
    with e.manager.lock:
        out = e.manager.prepare_store(keys, ctx)
        assert out is not None and not out.keys_to_store  # nothing new for the CPU tier
        e.manager.on_request_finished(ctx)
    e.settle()


def test_selective_offload_hint_and_hot(node_factory: Any, engines: Any) -> None:
    node = node_factory()
    a = engines(node=node.endpoint)  # offload: reuse (default)
    assert a.tier.on_new_request(a.request()).policy is OffloadPolicy.REQUEST_LEVEL
    once = chunk_keys("one-shot", 3)
    a.store(once, a.request(rdmakv_keep=False))
    assert a.tier.core.stats.declined_chunks == 3 and a.tier.core.stats.stored_chunks == 0
    assert node_has(node, a, once) == [False] * 3
    # the one-shot prefix is used again while vLLM's CPU tier holds it: stored then
    use_again(a, once)
    assert a.tier.core.stats.hot_chunks == 3 and a.tier.core.stats.stored_chunks == 3
    assert node_has(node, a, once) == [True] * 3
    # used once more: already on the node, nothing sent
    use_again(a, once)
    assert a.tier.core.stats.known_chunks == 3 and a.tier.core.stats.stored_chunks == 3
    h = engines(node=node.endpoint, offload="hot")
    cold = chunk_keys("hot-mode", 2)
    h.store(cold)
    assert node_has(node, h, cold) == [False, False]
    use_again(h, cold[:1])
    assert node_has(node, h, cold) == [True, False]
    # offload "all" stores every chunk once: vLLM need not offer the hits again
    e = engines(node=node.endpoint, offload="all")
    assert e.tier.on_new_request(e.request()).policy is OffloadPolicy.CHUNK_LEVEL


def test_a_job_whose_rows_do_not_match_its_keys_fails_alone(
    node_factory: Any, engines: Any
) -> None:
    """Rows and keys of unequal length (a caller's bug) fail that job, logged; the
    I/O thread goes on and the next job is served."""
    node = node_factory()
    e = engines(node=node.endpoint, offload="all")
    core = e.tier.core
    keys = chunk_keys("mismatch", 2)
    core.store(10_001, keys, [0])  # two keys, one row
    core.store(10_002, keys[:1], [1])
    got: dict[int, Any] = {}
    deadline = time.monotonic() + WAIT_S
    while len(got) < 2:
        assert time.monotonic() < deadline, "the jobs never ended"
        got.update((out.job_id, out) for out in core.finished())
        time.sleep(0.005)
    assert got[10_001].ok == [False, False] and got[10_001].nbytes == 0
    assert got[10_002].success and core.stats.stored_chunks == 1
    assert node_has(node, e, keys) == [True, False]
