"""The concurrency section (TCP runs): several client processes against ONE server.

1, 2, 4 client processes (spawned) against one server of a system (rdmakv
node, Redis, Mooncake TE target), each putting and getting its own 256 KiB
blocks, every byte checked: aggregate GB/s and p50/p99 batch latency. An
*owner* driver starts the server (:func:`concurrency_one`); each client
process opens a driver of its own on it (``server=owner.server``), warms its
connections, and all start together at a barrier (:func:`_conc_run`).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdmakv.perf.driver import Driver, PeerUnavailable, Workload
from rdmakv.perf.drivers import make_driver
from rdmakv.perf.measure import (
    arena,
    close_quietly,
    error_entry,
    fill_random,
    percentiles,
    put_get_rounds,
    warm_up_rounds,
    wrong_bytes,
)
from rdmakv.perf.settings import (
    CONC_BATCH,
    CONC_BLOCK,
    CONC_ROUNDS,
    GB,
    QUICK_CONC_ROUNDS,
    BenchConfig,
)

CONC_TIMEOUT_S = 600.0


def _conc_worker(
    name: str,
    transport: str,
    server: str,
    idx: int,
    rounds: int,
    warm_rounds: int,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: its own driver on the shared server, its own blocks,
    its connections warmed (``warm_rounds`` untimed puts and gets, as in the
    throughput section) before the clients start together."""
    drv: Driver | None = None
    try:
        work = Workload(block_bytes=CONC_BLOCK, blocks=CONC_BATCH, batch=CONC_BATCH)
        src, dst = arena(CONC_BLOCK * CONC_BATCH), arena(CONC_BLOCK * CONC_BATCH)
        fill_random(src, seed=1000 + idx)
        drv = make_driver(name, transport, server=server)
        drv.open(work, src, dst)
        put_get_rounds(drv, work.keys(f"c{idx}w"), warm_rounds)
    except Exception as e:
        barrier.abort()
        results.put((idx, error_entry(e)))
        close_quietly(drv)
        return
    try:
        barrier.wait()
        lat: list[float] = []
        start = time.perf_counter()
        for r in range(rounds):
            keys = work.keys(f"c{idx}r{r}")
            t0 = time.perf_counter()
            drv.put(keys)
            t1 = time.perf_counter()
            dst[:] = 0
            t2 = time.perf_counter()
            drv.get(keys)
            t3 = time.perf_counter()
            lat += [(t1 - t0) * 1e3, (t3 - t2) * 1e3]
            bad = wrong_bytes(src, dst)
            if bad:
                raise RuntimeError(f"client {idx}: {bad} wrong bytes read back in round {r}")
        end = time.perf_counter()
        results.put(
            (
                idx,
                {
                    "start": start,
                    "end": end,
                    "lat": lat,
                    "bytes": 2 * rounds * src.size,
                    "verified": rounds * src.size,
                },
            )
        )
    except Exception as e:
        results.put((idx, error_entry(e)))
    finally:
        close_quietly(drv)


def conc_warm_up_rounds(cfg: BenchConfig) -> int:
    """Untimed rounds of each concurrency client's batch before they start together."""
    return warm_up_rounds(CONC_BLOCK * CONC_BATCH, cfg.quick, cfg.transport) if cfg.warm_up else 0


def concurrency_one(name: str, cfg: BenchConfig, procs: Sequence[int]) -> dict[str, Any]:
    """``name`` with each client count in ``procs`` on one server, keyed by the
    count; the first count that fails ends the series (its ``{"error": ...}``)."""
    rounds = QUICK_CONC_ROUNDS if cfg.quick else CONC_ROUNDS
    warm = conc_warm_up_rounds(cfg)
    total_blocks = max(procs) * rounds * CONC_BATCH
    work = Workload(block_bytes=CONC_BLOCK, blocks=total_blocks, batch=CONC_BATCH)
    owner: Driver | None = None
    try:
        owner = make_driver(name, cfg.transport)
        # The owner's arenas are never touched (zero pages): it only starts the server.
        z_src = np.zeros(CONC_BLOCK * total_blocks, dtype=np.uint8)
        z_dst = np.zeros(CONC_BLOCK * total_blocks, dtype=np.uint8)
        owner.open(work, z_src, z_dst)
        server = getattr(owner, "server", None)
        if not isinstance(server, str):
            raise PeerUnavailable(f"{name}: its driver cannot share a server (no .server)")
        out: dict[str, Any] = {}
        for n in procs:
            out[str(n)] = _conc_run(name, cfg.transport, server, n, rounds, warm)
            if "error" in out[str(n)]:
                break
        return out
    except Exception as e:
        return error_entry(e)
    finally:
        close_quietly(owner)


def _conc_run(
    name: str, transport: str, server: str, n: int, rounds: int, warm_rounds: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_conc_worker,
            args=(name, transport, server, i, rounds, warm_rounds, barrier, results),
            daemon=True,
        )
        for i in range(n)
    ]
    for w in workers:
        w.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + CONC_TIMEOUT_S
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": f"{n - len(got)} of {n} clients did not finish in time"}
            try:
                idx, res = results.get(timeout=min(left, 5.0))
            except Exception:
                if not any(w.is_alive() for w in workers) and results.empty():
                    return {"error": f"{n - len(got)} of {n} client processes died"}
                continue
            got[idx] = res
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
                w.join()
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors:
        real = [e for e in errors if "BrokenBarrierError" not in e]
        return {"error": (real or errors)[0]}
    start = min(r["start"] for r in got.values())
    end = max(r["end"] for r in got.values())
    lat = [x for r in got.values() for x in r["lat"]]
    return {
        "aggregate_gbps": round(sum(r["bytes"] for r in got.values()) / (end - start) / GB, 3),
        **{k.replace("_ms", "_batch_ms"): v for k, v in percentiles(lat).items()},
        "bytes_verified": sum(r["verified"] for r in got.values()),
    }
