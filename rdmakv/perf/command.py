"""``rdmakv bench``: the same blocks through rdmakv, its peers and the plain-loop ceiling.

One run (:func:`run`) measures three sections, then builds one JSON object
(:mod:`~rdmakv.perf.report`, which documents its format) and, with an output
directory, writes it and PNG plots (:mod:`~rdmakv.perf.plot`):

* **throughput** (:mod:`~rdmakv.perf.measure`): at each block size, one
  batched put and get of every block per system, every byte checked, systems
  interleaved repeat by repeat, each repeat on fresh, warmed connections
  (``warm_up_rounds``: over TCP 16 rounds at 16 and 64 KiB, 4 at 256 KiB and
  1 MiB; over RDMA and in quick runs one; ``--no-warm-up`` times the first
  transfer on each connection instead); best and median of the repeats;
* **latency** (:mod:`~rdmakv.perf.latency`): p50/p99 of ``exists`` on 1, 16
  and 64 keys and of a 1-block get (64 KiB) per system, next to a one-byte
  ping-pong round trip;
* **concurrency** (:mod:`~rdmakv.perf.concurrency`, TCP runs only): 1, 2, 4
  client processes (spawned) against ONE server of a system (rdmakv node,
  Redis, Mooncake TE target), each putting and getting its own 256 KiB
  blocks: aggregate GB/s and p50/p99 batch latency.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any

from rdmakv.perf import report
from rdmakv.perf.concurrency import conc_warm_up_rounds, concurrency_one
from rdmakv.perf.drivers import OURS_VARIANTS
from rdmakv.perf.latency import latency_one, round_trip
from rdmakv.perf.measure import bench_size
from rdmakv.perf.placement import placements
from rdmakv.perf.plot import write_plots
from rdmakv.perf.settings import (
    CONC_BATCH,
    CONC_BLOCK,
    CONC_PROCS,
    CONC_ROUNDS,
    CONC_SYSTEMS,
    LATENCY_BLOCK,
    LATENCY_SAMPLES,
    QUICK_CONC_PROCS,
    QUICK_CONC_ROUNDS,
    QUICK_LATENCY_SAMPLES,
    BenchConfig,
)


class Progress:
    """tqdm on stderr when available and wanted; a no-op otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                tqdm = importlib.import_module("tqdm").tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, file=sys.stderr, unit="step", leave=False)

    def step(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_description(what)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run(cfg: BenchConfig) -> tuple[dict[str, Any], int]:
    """Run the whole comparison; returns (the JSON object, exit status 0 or 1)."""
    systems = cfg.resolved_systems()
    sizes = cfg.resolved_sizes()
    samples = QUICK_LATENCY_SAMPLES if cfg.quick else LATENCY_SAMPLES
    procs = list(cfg.conc_procs or (QUICK_CONC_PROCS if cfg.quick else CONC_PROCS))
    # Concurrency is a TCP figure (issue 11 item 5): an RDMA run's clients would
    # measure the emulated device, and the soft-RoCE VM has no /dev/shm for them.
    run_conc = cfg.concurrency and cfg.transport == "tcp"
    conc_systems = [s for s in systems if s in CONC_SYSTEMS] if run_conc else []
    # a latency batch is never split: a variant of rdmakv would measure rdmakv again
    lat_systems = [s for s in systems if s not in OURS_VARIANTS] if cfg.latency else []
    where = placements()
    progress = Progress(
        len(sizes) * len(systems) + (len(lat_systems) + 1) * len(where) * bool(lat_systems)
        + len(conc_systems),
        cfg.progress,
    )
    latency: dict[str, Any] = {}
    concurrency: dict[str, Any] = {}
    try:
        section: dict[str, dict[str, dict[str, Any]]] = {}
        for size in sizes:
            section[str(size)] = bench_size(size, cfg, progress.step)
        if lat_systems:
            latency = {"block_bytes": LATENCY_BLOCK, "samples": samples}
            for i, place in enumerate(where):
                # The first placement's figures are the section's own; others nest.
                part = latency if i == 0 else latency.setdefault(place.name, {})
                if i == 0:
                    part["placement"] = place.name
                part["cpus"] = place.describe()
                part["round_trip"] = round_trip(cfg, samples, place)
                progress.step(f"round trip ({place.name})")
                part["systems"] = {}
                for name in lat_systems:
                    part["systems"][name] = latency_one(name, cfg, samples, place)
                    progress.step(f"latency {name} ({place.name})")
        if conc_systems:
            concurrency = {
                "block_bytes": CONC_BLOCK,
                "blocks_per_batch": CONC_BATCH,
                "rounds_per_client": QUICK_CONC_ROUNDS if cfg.quick else CONC_ROUNDS,
                "warm_up_rounds_per_client": conc_warm_up_rounds(cfg),
                "transport": cfg.transport,
                "systems": {},
            }
            for name in conc_systems:
                concurrency["systems"][name] = concurrency_one(name, cfg, procs)
                progress.step(f"concurrency {name}")
    finally:
        progress.close()
    return report.build(cfg, section, latency, concurrency)


def main(cfg: BenchConfig, *, as_json: bool = False) -> int:
    """``rdmakv bench``: run, write the files, print the JSON (``as_json``) or a
    table and the ratios; returns the exit status."""
    try:
        result, rc = run(cfg)
    except Exception:
        traceback.print_exc()
        return 1
    out_dir = cfg.output_dir()
    if out_dir is not None:
        name = cfg.output_name()
        written = [report.write_json(result, out_dir, name)]
        written += write_plots(result, out_dir, name)
        for p in written:
            print(f"rdmakv bench: wrote {p}", file=sys.stderr)
    if as_json:
        print(json.dumps(result))
    else:
        for line in report.summary_lines(result, cfg.transport):
            print(line)
        print(json.dumps(result["ratios"]))
    for f in result["meta"].get("failures", []):
        print(f"rdmakv bench: FAILED: {f}", file=sys.stderr)
    return rc
