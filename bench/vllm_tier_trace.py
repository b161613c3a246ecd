"""Selective offload in vLLM's tier: the conversation trace through vLLM's REAL
TieringOffloadingManager with rdmakv as its secondary tier.

What and why. rdmakv's vLLM tier (:mod:`rdmakv.connectors.vllm_tier`) applies
rdmakv's offload policies (``all``, ``hot``, ``reuse`` with a byte budget and
the request's ``rdmakv_keep`` hint) to the chunks vLLM's CPU tier cascades to
it: the policy runs per chunk on the tier's I/O thread and decides which
chunks go to the node. docs/offload.md measures what each policy costs in
hits and saves in bytes for rdmakv's own connector (the L1 model,
``bench/trace.py``); this script measures the same for the tier, where vLLM's
CPU tier plays the L1 and vLLM, not rdmakv, decides what it evicts, what it
looks up and what it tells the tier.

What is real: vLLM 0.33's ``TieringOffloadingSpec`` and manager (its CPU tier
in ``/dev/shm``, LRU eviction, lookups with ``RETRY`` / ``HIT_PENDING``,
promotions, cascades, ``serve_external_requests``), the tier loaded from
``{"type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier"}``, and a
real ``rdmakv serve`` over TCP (one per configuration, sized to hold every
distinct chunk: only the offload policy decides what the node holds). Each
request is driven as vLLM's offloading scheduler drives the manager:

1. ``on_new_request``, with each chunk's end-token position recorded in the
   request context (as the scheduler's ``update_offload_keys`` does: the
   tier's policy reads the chunk's depth from it);
2. the prefix lookup of vLLM's ``_maximal_prefix_lookup``: chunks in order,
   ``HIT`` / ``HIT_PENDING`` count, ``RETRY`` defers (the scan goes on, so
   the tier is asked about every chunk up to the first miss), ``MISS`` stops;
   while deferred, the step ends (``on_schedule_end``: promotions are
   submitted, the tier's questions go out) and the lookup is repeated, with a
   deadline (a request that never settles is counted, and gets the HITs it
   has, never a hang);
3. ``prepare_load`` / ``complete_load`` of the hit prefix, every hit chunk's
   bytes checked;
4. the rest is "computed": ``prepare_store`` in steps of
   :data:`STORE_STEP_CHUNKS` chunks (a chunked-prefill step of 8,192
   tokens), the worker's DMA simulated by writing bytes derived from the key
   into the rows vLLM handed out, ``complete_store`` (the cascade: the tier's
   policy decides which chunks the node gets), and the steps until no job is
   in flight; then ``on_request_finished``. When the tier asked for vLLM's
   request-level offload policy (``hot``, ``reuse``), the stores start at
   chunk 0, hits included, as vLLM's scheduler then does: the manager
   cascades the hits already in its CPU tier to the tier, which is how the
   tier sees a chunk used again.

Simplifications, said here so the figures are read right: arrival times are
ignored (requests run one after another, each settled before the next, which
is also how ``bench/trace.py`` replays the connector); there is no GPU prefix
cache in front of the CPU tier (the CPU tier is the only local cache, as the
L1 is in the connector's replay); only *full* 512-token blocks are chunks (one
chunk per trace hash id, as vLLM stores only full blocks), and a chunk's
``OffloadKey`` is ``make_offload_key(sha256 chain of the hash ids up to and
including it, 0)``, so equal prefixes give equal keys. Chunks are small
(``--chunk-bytes``, 4 KiB): counts matter here, not speed.

Configurations (``--modes``): ``MODE[@BUDGET][+hint]``; ``MODE`` is
the tier's ``offload`` option (``all``, ``hot``, ``reuse``), ``@B`` its
``offload_budget``. ``+hint`` passes each request's perfect ``rdmakv_keep``
hint in ``kv_transfer_params`` (whether a later request continues it, what an
application that knows its conversation goes on can say).

Reported per configuration: ``hit_rate`` (hit chunks / looked-up chunks),
``remote_hit_rate`` (hit chunks promoted from the rdmakv tier, by vLLM's own
load-source bookkeeping, ``get_load_source``), the bytes the tier sent to the
node (its ``put_bytes``, ``stored_chunks``) and both relative to ``all``; and
the connector's figures on the same slice at the same L1 size
(``rdmakv.replay.replay_model``) beside them. ``wrong_chunks`` counts hit
chunks whose bytes differ from their key's: the script exits 1 if any.

Run in the engine venv::

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python bench/vllm_tier_trace.py \\
        --out bench/results

Prints one JSON object (``rdmakv.perf.provenance.publish``); ``--out DIR``
also writes ``vllm_tier_trace.json`` and ``vllm_tier_trace.png``
(``vllm_tier_trace_full.*`` with ``--full``); progress goes to stderr. The
default slice (the trace's first 2,000 requests, every configuration) takes a
few minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    OffloadKey,
    OffloadPolicy,
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

from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance, publish
from rdmakv.replay import ReplaySetup, TraceKeys, replay_model
from rdmakv.replay.trace import TRACE_BLOCK_TOKENS, Trace, load_trace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_MODES = (
    "all,hot,reuse@0.25,reuse@0.5,reuse@0.75,reuse+hint"
)
DEFAULT_REQUESTS = 2000
DEFAULT_CPU_SHARE = 0.05
DEFAULT_CHUNK_BYTES = 4096
CHUNK_TOKENS = TRACE_BLOCK_TOKENS
"""Tokens per chunk: one trace hash id (vLLM block = chunk = 512 tokens here)."""
STORE_STEP_CHUNKS = 16
"""Chunks a request stores per scheduler step: 8,192 tokens, a chunked-prefill step."""
CLIENT_TIMEOUT_S = 10.0
LOOKUP_DEADLINE_S = 10.0
"""How long one request's lookups may stay deferred before it takes the HITs it has."""
SETTLE_DEADLINE_S = 60.0
"""How long the jobs in flight may take to end before the run is declared stuck."""
STEP_PAUSE_S = 0.0005
"""Pause between steps while waiting: vLLM's step takes time; spinning would starve
the tier's threads of the GIL."""
PROGRESS_EVERY = 250
NODE_SLACK = 1.5
"""Node pool: this many times the distinct chunks' bytes (plus 16 MiB): never full."""


@dataclass(frozen=True)
class TierConfig:
    """One configuration: the tier's offload mode and budget, and what the replay adds."""

    offload: str
    budget: float | None = None
    hint: bool = False

    @property
    def label(self) -> str:
        name = self.offload + (f"@{self.budget:g}" if self.budget is not None else "")
        return name + ("+hint" if self.hint else "")


_MODE_RE = re.compile(r"^(all|hot|reuse)(?:@([0-9.]+))?(\+hint)?$")


def parse_modes(text: str) -> list[TierConfig]:
    """``all,hot,reuse@0.5+hint,...`` -> configurations (a bad one is a one-line error)."""
    out: list[TierConfig] = []
    for item in (s.strip() for s in text.split(",")):
        m = _MODE_RE.match(item)
        if not m:
            raise SystemExit(f"vllm_tier_trace: bad mode {item!r} "
                             "(MODE[@BUDGET][+hint], MODE in all, hot, reuse)")
        budget = float(m.group(2)) if m.group(2) else None
        if budget is not None and (m.group(1) != "reuse" or not 0.0 < budget <= 1.0):
            raise SystemExit(f"vllm_tier_trace: bad mode {item!r} (a budget in (0, 1], "
                             "for reuse only)")
        out.append(TierConfig(m.group(1), budget, m.group(3) is not None))
    if not any(c.label == "all" for c in out):
        out.insert(0, TierConfig("all"))  # the reference every ratio is taken against
    return out


@dataclass
class Chunks:
    """Every request's chunk keys (full blocks only), and what the future holds."""

    keys: list[list[OffloadKey]]
    continued: list[bool]
    """Whether a later request asks for the request's last chunk: the perfect hint."""
    distinct: int
    asked: int
    largest: int


def trace_chunks(trace: Trace) -> Chunks:
    """One vLLM ``OffloadKey`` per full trace block: sha256 chained along ``hash_ids``."""
    keys: list[list[OffloadKey]] = []
    last_use: dict[OffloadKey, int] = {}
    for r, req in enumerate(trace):
        digest = b""
        ks: list[OffloadKey] = []
        for h in req.hash_ids[: req.full_blocks(trace.block_tokens)]:
            digest = hashlib.sha256(digest + h.to_bytes(8, "little")).digest()
            key = make_offload_key(digest, 0)
            ks.append(key)
            last_use[key] = r
        keys.append(ks)
    continued = [bool(ks) and last_use[ks[-1]] > r for r, ks in enumerate(keys)]
    return Chunks(keys, continued, len(last_use), sum(len(k) for k in keys),
                  max((len(k) for k in keys), default=0))


def chunk_bytes(key: bytes, n: int) -> bytes:
    """What the worker's DMA would write into ``key``'s row: a function of the key only."""
    seed = hashlib.sha256(key).digest()
    return (seed * (n // len(seed) + 1))[:n]


@dataclass
class Counts:
    """What one configuration's replay measured (chunks unless named otherwise)."""

    requests: int = 0
    looked_up: int = 0
    hits: int = 0
    cpu_hits: int = 0
    remote_hits: int = 0
    computed: int = 0
    store_refused: int = 0
    """Computed chunks vLLM's CPU tier had no room for (``prepare_store`` None)."""
    wrong_chunks: int = 0
    wrong_remote_chunks: int = 0
    lookup_deadlines: int = 0
    lookup_rounds: int = 0
    steps: int = 0
    seconds: float = 0.0
    tier: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hits / self.looked_up if self.looked_up else 0.0
        out["remote_hit_rate"] = self.remote_hits / self.looked_up if self.looked_up else 0.0
        out["put_bytes"] = self.tier.get("put_bytes", 0)
        out["stored_chunks"] = self.tier.get("stored_chunks", 0)
        return out


class Engine:
    """One engine's scheduler-side offloading: vLLM's real spec and manager, rdmakv's tier."""

    _ids = itertools.count()

    def __init__(self, node: str, cfg: TierConfig, cpu_chunks: int, chunk: int) -> None:
        tier: dict[str, Any] = {
            "type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier",
            "node": node, "transport": "tcp", "timeout": CLIENT_TIMEOUT_S,
            "offload": cfg.offload,
        }
        if cfg.budget is not None:
            tier["offload_budget"] = cfg.budget
        spec_cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(CHUNK_TOKENS, ("l0", "l1"), 0),),
            worker_kv_bytes_per_block=chunk,
            enable_kv_cache_events=False,
            extra_config={
                "cpu_bytes_to_use": cpu_chunks * chunk,
                "tier_poll_interval_s": 0,  # serviced per step, as the scheduler does
                "secondary_tiers": [tier],
            },
            engine_id=f"rdmakv-trace-{os.getpid()}-{next(self._ids)}",
            model=OffloadingModelConfig(name="rdmakv-trace-replay", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=CHUNK_TOKENS, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        )
        self.manager = TieringOffloadingSpec(spec_cfg).get_manager()
        (self.tier,) = self.manager.secondary_tiers
        self.cpu_chunks = int(self.manager.primary_tier._num_chunks)
        self.rows: Any = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.row_bytes = int(self.rows.shape[1])
        self.steps = 0

    def step(self) -> None:
        """The end of a scheduler step (jobs polled, promotions submitted, lookups sent)."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
        self.steps += 1

    def settle(self) -> None:
        """Step until vLLM's manager and the tier have no job in flight."""
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm_tier_trace: jobs still in flight after {SETTLE_DEADLINE_S:.0f} s "
                    f"(tier stats {self.tier.core.stats})"
                )
            time.sleep(STEP_PAUSE_S)

    def prefix_lookup(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> tuple[list[LookupResult], bool]:
        """vLLM's ``_maximal_prefix_lookup`` (caller holds the lock): the answers up to
        the first MISS, and whether the lookup is deferred (a RETRY or HIT_PENDING)."""
        out: list[LookupResult] = []
        deferred = False
        for key in keys:
            res = self.manager.lookup(key, ctx)
            out.append(res)
            if res is LookupResult.MISS:
                break
            deferred |= res is not LookupResult.HIT
        return out, deferred

    def close(self) -> None:
        self.rows = None  # vLLM unmaps its buffer in shutdown
        self.manager.shutdown()


def _leading_hits(results: Sequence[LookupResult]) -> int:
    n = 0
    for res in results:
        if res is not LookupResult.HIT:
            break
        n += 1
    return n


def run_config(
    cfg: TierConfig,
    chunks: Chunks,
    cpu_chunks: int,
    chunk: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay every request through one engine with ``cfg`` against a fresh node."""
    pool = int(chunks.distinct * chunk * NODE_SLACK) + (16 << 20)
    node = LocalNodeProcess(
        {"pool-size": str(pool), "block-size": str(chunk), "transport": "tcp"},
        extra_args=["--no-lock"],
    )
    counts = Counts()
    t0 = time.perf_counter()
    try:
        e = Engine(node.endpoint, cfg, cpu_chunks, chunk)
        try:
            source = e.tier.cache_hit_source
            for r, keys in enumerate(chunks.keys):
                _request(e, cfg, r, keys, chunks.continued[r], counts, source)
                if progress is not None and (r + 1) % PROGRESS_EVERY == 0:
                    progress(f"{cfg.label}: {r + 1}/{len(chunks.keys)} requests, "
                             f"hit {counts.hits / max(1, counts.looked_up):.1%}, "
                             f"{time.perf_counter() - t0:.0f} s")
            e.settle()
            counts.steps = e.steps
            counts.tier = asdict(e.tier.core.stats)
        finally:
            e.close()
    finally:
        node.kill()
    counts.seconds = time.perf_counter() - t0
    return counts.as_dict()


def _request(
    e: Engine,
    cfg: TierConfig,
    r: int,
    keys: list[OffloadKey],
    continued: bool,
    counts: Counts,
    remote_source: Any,
) -> None:
    counts.requests += 1
    if not keys:
        return
    counts.looked_up += len(keys)
    m = e.manager
    ctx = ReqContext(
        req_id=f"req-{r}",
        kv_transfer_params={"rdmakv_keep": continued} if cfg.hint else None,
    )
    for i, key in enumerate(keys):  # the scheduler's update_offload_keys
        ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
    with m.lock:
        every_use = m.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
    deadline = time.monotonic() + LOOKUP_DEADLINE_S
    while True:
        with m.lock:
            results, deferred = e.prefix_lookup(keys, ctx)
            counts.lookup_rounds += 1
            late = deferred and time.monotonic() > deadline
            if not deferred or late:
                counts.lookup_deadlines += late
                hits = _leading_hits(results)  # settled: every answer before the MISS
                if hits:
                    _load(e, keys[:hits], ctx, counts, remote_source)
                break
        e.step()
        time.sleep(STEP_PAUSE_S)
    counts.hits += hits
    computed = keys[hits:]
    counts.computed += len(computed)
    offered = keys if every_use else computed  # request level: the hits too, from chunk 0
    for start in range(0, len(offered), STORE_STEP_CHUNKS):
        piece = offered[start : start + STORE_STEP_CHUNKS]
        with m.lock:
            out = m.prepare_store(piece, ctx)
            if out is None:
                counts.store_refused += len(piece)
            elif out.keys_to_store:
                assert isinstance(out.store_spec, CPULoadStoreSpec)
                rows = out.store_spec.chunk_ids.tolist()
                for key, row in zip(out.keys_to_store, rows, strict=True):  # the worker's DMA
                    e.rows[row] = np.frombuffer(chunk_bytes(key, e.row_bytes), dtype=np.uint8)
                m.complete_store(out.keys_to_store, ctx)  # the cascade: the policy decides
        e.settle()
    with m.lock:
        m.on_request_finished(ctx)
    e.settle()


def _load(
    e: Engine, keys: Sequence[OffloadKey], ctx: ReqContext, counts: Counts, remote_source: Any
) -> None:
    """The hit prefix, CPU tier -> GPU (caller holds the lock): every chunk's bytes checked."""
    m = e.manager
    spec = m.prepare_load(keys, ctx)
    assert isinstance(spec, CPULoadStoreSpec)
    for key, row in zip(keys, spec.chunk_ids.tolist(), strict=True):
        remote = m.get_load_source(key, ctx) == remote_source
        counts.remote_hits += remote
        counts.cpu_hits += not remote
        if e.rows[row].tobytes() != chunk_bytes(key, e.row_bytes):
            counts.wrong_chunks += 1
            counts.wrong_remote_chunks += remote
    m.complete_load(keys, ctx)


def connector_model(keys: TraceKeys, cfg: TierConfig, l1_blocks: int) -> dict[str, Any]:
    """rdmakv's own connector on the same slice (``bench/trace.py``'s model)."""
    setup = ReplaySetup(l1_blocks=l1_blocks, offload=cfg.offload,
                        offload_budget=cfg.budget, hints=cfg.hint)
    res = replay_model(keys, setup)
    return {"hits": res.hits, "node_hits": res.node_hits, "hit_rate": res.hit_rate,
            "node_hit_rate": res.node_hits / max(1, res.blocks),
            "sent_blocks": res.steady_sent_blocks}


def replay(
    trace: Trace,
    configs: Sequence[TierConfig],
    *,
    cpu_share: float = DEFAULT_CPU_SHARE,
    chunk: int = DEFAULT_CHUNK_BYTES,
    with_model: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every configuration over ``trace``; ratios against the ``all`` configuration."""
    chunks = trace_chunks(trace)
    cpu_chunks = max(1, round(cpu_share * chunks.distinct))
    if cpu_chunks < chunks.largest and progress is not None:
        progress(f"warning: the CPU tier ({cpu_chunks} chunks) is smaller than the largest "
                 f"request ({chunks.largest} chunks): its lookups may thrash")
    out: dict[str, Any] = {}
    models: dict[str, dict[str, Any]] = {}
    trace_keys: TraceKeys | None = None
    for cfg in configs:
        res = run_config(cfg, chunks, cpu_chunks, chunk, progress)
        if with_model:
            if cfg.label not in models:
                if trace_keys is None:
                    trace_keys = TraceKeys(trace)
                models[cfg.label] = connector_model(trace_keys, cfg, cpu_chunks)
            res["connector"] = dict(models[cfg.label])
        out[cfg.label] = res
        if progress is not None:
            progress(f"{cfg.label}: hit {res['hit_rate']:.1%} (remote "
                     f"{res['remote_hit_rate']:.1%}), {res['stored_chunks']} chunks sent, "
                     f"{res['wrong_chunks']} wrong, {res['seconds']:.0f} s")
    ref = out["all"]
    for res in out.values():
        res["bytes_vs_all"] = res["put_bytes"] / ref["put_bytes"] if ref["put_bytes"] else 0.0
        res["hit_points_vs_all"] = 100.0 * (res["hit_rate"] - ref["hit_rate"])
        if "connector" in res:
            c, c_all = res["connector"], ref["connector"]
            base = c_all["sent_blocks"]
            c["bytes_vs_all"] = c["sent_blocks"] / base if base else 0.0
            c["hit_points_vs_all"] = 100.0 * (c["hit_rate"] - c_all["hit_rate"])
    return {
        "requests": len(trace),
        "distinct_chunks": chunks.distinct,
        "looked_up_chunks": chunks.asked,
        "largest_request_chunks": chunks.largest,
        "cpu_chunks": cpu_chunks,
        "configs": out,
        "wrong_chunks": sum(r["wrong_chunks"] for r in out.values()),
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, m = result["result"], result["meta"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    configs = r["configs"]
    for label, c in configs.items():
        x, y = c["bytes_vs_all"], 100 * c["hit_rate"]
        ax.scatter([x], [y], s=18, color="tab:blue", zorder=3)
        ax.annotate(label, (x, y), fontsize=7, textcoords="offset points", xytext=(6, 4))
        if "connector" in c:
            ax.scatter([c["connector"]["bytes_vs_all"]], [100 * c["connector"]["hit_rate"]],
                       s=90, facecolors="none", edgecolors="tab:green", zorder=2)
    ax.scatter([], [], s=18, color="tab:blue", label="vLLM tier (as vLLM 0.33 drives it)")
    ax.scatter([], [], s=90, facecolors="none", edgecolors="tab:green",
               label="rdmakv connector (model), same slice and L1")
    ax.set_xlabel("bytes sent to the node, vs all")
    ax.set_ylabel("hit rate, % of looked-up chunks")
    ax.set_title(f"conversation trace, {r['requests']} requests, CPU tier {r['cpu_chunks']} "
                 f"chunks ({m['cpu_share']:.0%} of distinct)\n{m['machine'][:70]}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--start", type=int, default=0, help="first request of the slice")
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    ap.add_argument("--full", action="store_true", help="every request of the trace")
    ap.add_argument("--cpu", type=float, default=DEFAULT_CPU_SHARE,
                    help="vLLM's CPU tier, as a share of the slice's distinct chunks")
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="MODE[@BUDGET][+hint],... (MODE: all, hot, reuse)")
    ap.add_argument("--no-model", action="store_true",
                    help="skip the connector model replay on the same slice")
    ap.add_argument("--out", type=Path, help="write vllm_tier_trace.json (and .png) here")
    args = ap.parse_args(argv)
    if not 0.0 < args.cpu <= 1.0:
        raise SystemExit(f"vllm_tier_trace: --cpu must be in (0, 1], got {args.cpu}")
    configs = parse_modes(args.modes)
    trace = load_trace(args.trace, start=args.start, limit=None if args.full else args.requests)

    def say(line: str) -> None:
        print(f"vllm_tier_trace: {line}", file=sys.stderr, flush=True)

    say(f"{len(trace)} requests of {args.trace.name}, {len(configs)} configurations")
    result = {
        "meta": {**provenance(), "trace": args.trace.name, "start": args.start,
                 "cpu_share": args.cpu, "chunk_bytes": args.chunk_bytes,
                 "store_step_chunks": STORE_STEP_CHUNKS, "modes": [c.label for c in configs]},
        "result": replay(trace, configs, cpu_share=args.cpu, chunk=args.chunk_bytes,
                         with_model=not args.no_model, progress=say),
    }
    publish(result, args.out, "vllm_tier_trace_full" if args.full else "vllm_tier_trace", _plot)
    if result["result"]["wrong_chunks"]:
        say(f"{result['result']['wrong_chunks']} chunks came back wrong")
        sys.exit(1)


if __name__ == "__main__":
    main()
