"""vLLM tier benchmark: rdmakv as a secondary tier of vLLM's REAL TieringOffloadingManager.

Needs the engine venv (``bash deploy/engines.sh``): it builds vLLM 0.33's
``TieringOffloadingSpec`` with ``{"type": "rdmakv", "module_path":
"rdmakv.connectors.vllm_tier"}`` and drives its manager as vLLM's offloading
scheduler does, against a real ``rdmakv serve`` over TCP (``--transport rdma``:
over RDMA, in the soft-RoCE VM; chunks go one-sided into vLLM's CPU tier):

* **store**: engine A puts ``--chunks`` chunks into its CPU tier and
  ``complete_store`` cascades them to the tier (one job); timed from the
  cascade until vLLM's manager has no job in flight (stepping as vLLM does);
* **load**: engine B (its own CPU tier) looks the chunks up (answered by the
  node first, not timed), then the timed part: the lookups that find them in
  the tier and start promotions, the step that submits the loads, and the
  steps until every chunk is a HIT in B's CPU tier;
* the same bytes through rdmakv's own ``KVClient`` (one batched put, one get,
  over a slab of the same size) in the same run: the tier should cost little
  on top of it;
* **lookup latency** for 64 keys: from the step's lookups (``RETRY``) and
  ``on_schedule_end`` (which sends them as one batch) until all 64 answers
  are in, ``--lookup-rounds`` times (p50/p99);
* **scheduler-thread time in the tier per step**: every call vLLM's manager
  makes into the tier is timed (``lookup``, ``submit_*``,
  ``get_finished_jobs``, ``has_pending_work``, ``on_schedule_end``, ...) and
  summed per step (one ``on_schedule_end``); p50/p99/max over all steps of the
  run, and the step that submitted the store job.

Chunk size defaults to vLLM's for Llama-3-8B in bf16 with 16-token blocks and
TP 1: ``32 layers x 16 tokens x 8 KV heads x (128 + 128) x 2 bytes`` = 2 MiB.
GB/s are 1e9 bytes/s, best of ``--repeats``. Prints one JSON object
(``rdmakv.perf.provenance.publish``); ``--out DIR`` also writes
``vllm_tier.json`` and ``vllm_tier.png`` (``vllm_tier_rdma.*`` over RDMA).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # type: ignore[import-not-found]
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-not-found]
from vllm.v1.kv_offload.tiering.spec import (  # type: ignore[import-not-found]
    TieringOffloadingSpec,
)

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance, publish

LLAMA_8B_CHUNK = 32 * 16 * 8 * (128 + 128) * 2
"""vLLM's chunk for Llama-3-8B, bf16, 16-token blocks, TP 1 (bytes)."""
DEFAULT_CHUNKS = 1000
DEFAULT_REPEATS = 3
LOOKUP_KEYS = 64
DEFAULT_LOOKUP_ROUNDS = 200
CLIENT_TIMEOUT_S = 60.0
WAIT_S = 300.0
STEP_PAUSE_S = 0.001
"""Pause between steps while jobs run: an engine's step (its forward) takes time, and
vLLM's idle loop yields the GIL; stepping flat out would starve the tier's threads."""
POLL_S = 0.0001
"""Pause between checks while waiting for the lookup thread's answer."""
GB = 1e9
TIER_CALLS = (
    "lookup", "submit_store", "submit_load", "get_finished_jobs", "has_pending_work",
    "on_schedule_end", "on_new_request", "on_request_finished", "touch",
    "serve_external_requests",
)
"""The tier methods vLLM's manager calls on the scheduler thread (all timed)."""


class Engine:
    """One engine's real tiering spec and manager, with the tier's calls timed per step."""

    _ids = itertools.count()

    def __init__(
        self, node: str, chunk: int, chunks: int, steps: list[float], transport: str
    ) -> None:
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, tuple(f"l{i}" for i in range(32)), 0),),
            worker_kv_bytes_per_block=chunk,
            enable_kv_cache_events=False,
            extra_config={
                "cpu_bytes_to_use": chunks * chunk,
                "tier_poll_interval_s": 0,
                "secondary_tiers": [{
                    "type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier",
                    "node": node, "transport": transport, "timeout": CLIENT_TIMEOUT_S,
                    "offload": "all",
                }],
            },
            engine_id=f"rdmakv-bench-{os.getpid()}-{next(self._ids)}",
            model=OffloadingModelConfig(name="meta-llama/Llama-3.1-8B", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        )
        self.manager = TieringOffloadingSpec(cfg).get_manager()
        (self.tier,) = self.manager.secondary_tiers
        self.rows: Any = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.steps = steps
        self.in_tier = 0.0  # scheduler-thread seconds in the tier since the last step
        for name in TIER_CALLS:
            setattr(self.tier, name, self._timed(getattr(self.tier, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.in_tier += time.perf_counter() - t0
        return call

    def step(self) -> float:
        """End a scheduler step; returns (and records) the tier's time in it."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
        spent, self.in_tier = self.in_tier, 0.0
        self.steps.append(spent)
        return spent

    def pending(self) -> bool:
        with self.manager.lock:
            return bool(self.manager.has_pending_work())

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        with self.manager.lock:
            return [self.manager.lookup(k, ctx) for k in keys]

    def close(self) -> None:
        self.rows = None
        self.manager.shutdown()


def keys_for(tag: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


def until(cond: Callable[[], bool], what: str, tick: Callable[[], object]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"vllm_tier bench: {what} did not finish in {WAIT_S:.0f} s")
        tick()


def tier_round(
    node: str, chunk: int, chunks: int, tag: str, steps: list[float], transport: str
) -> dict[str, Any]:
    a = Engine(node, chunk, chunks, steps, transport)
    b = Engine(node, chunk, chunks, steps, transport)
    try:
        keys = keys_for(tag, chunks)
        data = np.random.default_rng(1).integers(0, 256, size=chunk, dtype=np.uint8)
        ctx = ReqContext(req_id="a")
        with a.manager.lock:
            a.manager.on_new_request(ctx)
            out = a.manager.prepare_store(keys, ctx)
            assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
            rows = out.store_spec.chunk_ids.tolist()
            a.rows[rows] = data  # the worker's GPU -> CPU DMA
            t0 = time.perf_counter()
            a.in_tier = 0.0
            a.manager.complete_store(keys, ctx)  # cascades: submit_store of all chunks
            a.manager.on_request_finished(ctx)
        submit_step = a.step()
        until(lambda: not a.pending(), "the store", lambda: (time.sleep(STEP_PAUSE_S), a.step()))
        store_s = time.perf_counter() - t0
        assert a.tier.core.stats.stored_chunks == chunks, a.tier.core.stats
        assert a.tier.core.transport_name == transport

        ctx = ReqContext(req_id="b")
        with b.manager.lock:
            b.manager.on_new_request(ctx)
        b.lookup(keys, ctx)
        b.step()
        lookups = b.tier.core.lookups
        until(lambda: lookups.pending() == 0, "the lookups", lambda: time.sleep(POLL_S))
        t0 = time.perf_counter()
        got = b.lookup(keys, ctx)  # tier HITs: promotions start
        assert set(got) == {LookupResult.HIT_PENDING}, set(got)
        b.step()  # submit_load
        until(lambda: not b.pending(), "the load", lambda: (time.sleep(STEP_PAUSE_S), b.step()))
        load_s = time.perf_counter() - t0
        assert set(b.lookup(keys, ctx)) == {LookupResult.HIT}
        assert b.tier.core.stats.loaded_chunks == chunks
        with b.manager.lock:
            spec = b.manager.prepare_load(keys, ctx)
            assert all(np.array_equal(b.rows[r], data) for r in spec.chunk_ids.tolist()[:8])
            b.manager.complete_load(keys, ctx)
        with KVClient(*node.split(":"), None, transport="tcp") as c:  # type: ignore[misc]
            # a control-only client (a node over RDMA answers TCP control too)
            c.delete(a.tier.core.keys.keys(keys))  # room for the next round
        return {"store_s": store_s, "load_s": load_s, "submit_step_s": submit_step}
    finally:
        a.close()
        b.close()


def client_round(
    host: str, port: int, slab: Slab, chunks: int, tag: str, transport: str
) -> dict[str, float]:
    keys = [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(chunks)]
    digests = [hashlib.blake2b(k, digest_size=16).digest() for k in keys]
    with KVClient(host, port, slab, transport=transport, timeout=CLIENT_TIMEOUT_S) as c:
        t0 = time.perf_counter()
        assert all(c.put(keys, list(range(chunks)), slab.block_size, digests))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert all(c.get(keys, list(range(chunks)), digests))
        get_s = time.perf_counter() - t0
        c.delete(keys)
    return {"put_s": put_s, "get_s": get_s}


def lookup_latency(
    node: str, chunk: int, rounds: int, steps: list[float], transport: str
) -> list[float]:
    e = Engine(node, chunk, LOOKUP_KEYS + 1, steps, transport)
    out: list[float] = []
    lookups = e.tier.core.lookups
    try:
        for r in range(rounds):
            ctx = ReqContext(req_id=f"l{r}")
            keys = keys_for(f"lookup-{r}", LOOKUP_KEYS)
            with e.manager.lock:
                e.manager.on_new_request(ctx)
            t0 = time.perf_counter()
            e.lookup(keys, ctx)
            e.step()  # the 64 questions go out as one batch
            until(lambda: lookups.pending() == 0, "a lookup", lambda: time.sleep(POLL_S))
            out.append(time.perf_counter() - t0)
            assert set(e.lookup(keys, ctx)) == {LookupResult.MISS}
            with e.manager.lock:
                e.manager.on_request_finished(ctx)
    finally:
        e.close()
    return out


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(
    chunk: int, chunks: int, repeats: int, lookup_rounds: int, transport: str
) -> dict[str, Any]:
    # Over RDMA a get leases what it reads, a client may lease up to half the pool,
    # and a get keeps up to four sub-batches leased: room for the whole batch twice.
    room = 2.5 if transport == "rdma" else 1.25
    node = LocalNodeProcess(
        {"pool-size": str(int(chunks * chunk * room)), "block-size": str(chunk),
         "transport": transport},
        extra_args=["--no-lock"],
    )
    steps: list[float] = []
    nbytes = chunks * chunk
    try:
        tier = [tier_round(node.endpoint, chunk, chunks, f"r{i}", steps, transport)
                for i in range(repeats)]
        # rdmakv's own client over a buffer of the same size (borrowed: every block live)
        with Slab.over_buffer(np.full(nbytes, 7, dtype=np.uint8), chunk) as slab:
            client = [client_round(node.host, node.port, slab, chunks, f"c{i}", transport)
                      for i in range(repeats)]
        lat = lookup_latency(node.endpoint, chunk, lookup_rounds, steps, transport)
    finally:
        node.kill()
    best = {
        "tier_store_gbps": max(nbytes / r["store_s"] for r in tier) / GB,
        "tier_load_gbps": max(nbytes / r["load_s"] for r in tier) / GB,
        "kvclient_put_gbps": max(nbytes / r["put_s"] for r in client) / GB,
        "kvclient_get_gbps": max(nbytes / r["get_s"] for r in client) / GB,
    }
    best["store_vs_kvclient"] = best["tier_store_gbps"] / best["kvclient_put_gbps"]
    best["load_vs_kvclient"] = best["tier_load_gbps"] / best["kvclient_get_gbps"]
    return {
        **best,
        "rounds": {"tier": tier, "kvclient": client},
        "lookup_64_keys_ms": {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3,
                              "rounds": len(lat)},
        "scheduler_ms_per_step": {
            "steps": len(steps), "p50": pct(steps, 0.5) * 1e3, "p99": pct(steps, 0.99) * 1e3,
            "mean": statistics.fmean(steps) * 1e3, "max": max(steps) * 1e3,
            "store_submit_step": min(r["submit_step_s"] for r in tier) * 1e3,
        },
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, m = result["result"], result["meta"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["store / put", "load / get"]
    x = np.arange(2)
    ax.bar(x - 0.2, [r["tier_store_gbps"], r["tier_load_gbps"]], 0.4, label="vLLM tier (rdmakv)")
    ax.bar(x + 0.2, [r["kvclient_put_gbps"], r["kvclient_get_gbps"]], 0.4, label="KVClient")
    ax.set_xticks(x, names)
    ax.set_ylabel(f"GB/s ({m['transport']})")
    ax.set_title(f"{m['chunks']} chunks of {m['chunk_bytes'] // 1024} KiB, "
                 f"{m['machine'][:60]}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS)
    ap.add_argument("--chunk-bytes", type=int, default=LLAMA_8B_CHUNK)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--lookup-rounds", type=int, default=DEFAULT_LOOKUP_ROUNDS)
    ap.add_argument("--transport", choices=["tcp", "rdma"], default="tcp",
                    help="node, tier and KVClient transport (rdma: in the soft-RoCE VM)")
    ap.add_argument("--out", type=Path, help="write vllm_tier.json (and .png) here")
    args = ap.parse_args(argv)
    print(f"vllm_tier: {args.chunks} chunks of {args.chunk_bytes} bytes...", file=sys.stderr)
    result = {
        "meta": {**provenance(), "chunks": args.chunks, "chunk_bytes": args.chunk_bytes,
                 "repeats": args.repeats, "transport": args.transport},
        "result": measure(args.chunk_bytes, args.chunks, args.repeats, args.lookup_rounds,
                          args.transport),
    }
    publish(result, args.out, "vllm_tier" if args.transport == "tcp" else "vllm_tier_rdma", _plot)


if __name__ == "__main__":
    main()
