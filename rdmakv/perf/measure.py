"""The throughput section's timing loop, and the pieces every section measures with.

For each block size (:func:`bench_size`) it fills a source arena with random
bytes (every block different), and for each system: opens its driver, times
one batched ``put`` of every block, zeroes the destination arena, times one
batched ``get`` of every block into it, and compares every byte with the
source. Systems are interleaved repeat by repeat (load on a shared machine
drifts over seconds), every system as many times as any driver asks
(``min_repeats``), each repeat on fresh connections where the driver can
reconnect (``fresh_connections``), and each repeat's timed put and get
preceded by untimed ones of the same batch under other keys (``warm_up``,
:func:`warm_up_rounds`). Each figure is the best of the repeats, and its
median beside it.

Also here, shared with the latency and concurrency sections: page-aligned
arenas, the byte check, a failure as its ``{"error": ...}`` entry,
percentiles, and untimed put + get rounds.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdmakv.perf.driver import Arena, Driver, PeerUnavailable, Workload
from rdmakv.perf.drivers import make_driver
from rdmakv.perf.settings import GB, BenchConfig, KiB

WARM_UP_BYTES = 1 << 30
WARM_UP_MAX_ROUNDS = 16
"""Untimed put + get rounds before each timed TCP repeat (:func:`warm_up_rounds`):
enough to move WARM_UP_BYTES each way, at least one, at most WARM_UP_MAX_ROUNDS."""
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def arena(nbytes: int) -> Arena:
    """Page-aligned, pre-faulted anonymous memory as a uint8 array."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=_MAP_FLAGS)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


def fill_random(a: Arena, seed: int) -> None:
    a[:] = np.random.default_rng(seed).integers(0, 256, a.size, dtype=np.uint8)


def wrong_bytes(src: Arena, dst: Arena) -> int:
    if np.array_equal(src, dst):
        return 0
    return int(np.count_nonzero(src != dst))


def error_entry(e: BaseException) -> dict[str, Any]:
    """``e`` as a system's entry in the JSON: ``{"error": why}`` (a peer's own
    reason as it gave it, any other exception with its type)."""
    if isinstance(e, PeerUnavailable):
        return {"error": str(e)}
    return {"error": f"{type(e).__name__}: {e}".strip()}


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """``p50_ms`` and ``p99_ms`` of ``samples`` (milliseconds)."""
    a = np.asarray(samples, dtype=np.float64)
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 4),
        "p99_ms": round(float(np.percentile(a, 99)), 4),
    }


def close_quietly(drv: Driver | None) -> None:
    """Close ``drv`` if there is one; a failure to close never hides the figure."""
    if drv is not None:
        with contextlib.suppress(Exception):
            drv.close()


@dataclass
class _Run:
    name: str
    drv: Driver | None = None
    puts: list[float] = field(default_factory=list)
    gets: list[float] = field(default_factory=list)
    result: dict[str, Any] | None = None
    """Set once the system is finished (numbers or an error)."""
    verifies: bool = True
    """False for a ceiling that stores nothing (perftest): nothing to read back."""
    fresh: bool = False
    """True when each repeat ran on connections of its own (the driver reconnects)."""
    warm: bool = False
    """True when each timed transfer followed untimed ones on the same connections."""
    warm_rounds: int = 0
    """How many untimed put + get rounds came before each timed one."""


def bench_size(
    size: int, cfg: BenchConfig, step: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """All systems at one block size, interleaved repeat by repeat; ``step`` is
    told each system's name once it is finished (a progress bar)."""
    blocks = cfg.blocks_for(size)
    work = Workload(block_bytes=size, blocks=blocks, batch=blocks)
    nbytes = size * blocks
    src, dst = arena(nbytes), arena(nbytes)
    fill_random(src, seed=size)
    repeats = cfg.resolved_repeats()
    runs = [_Run(name) for name in cfg.resolved_systems()]
    for run in runs:
        try:
            run.drv = make_driver(run.name, cfg.transport)
            run.drv.open(work, src, dst)
            repeats = max(repeats, int(getattr(run.drv, "min_repeats", 1)))
        except Exception as e:
            run.result = error_entry(e)
            close_quietly(run.drv)
            run.drv = None
    # Every system gets as many tries as the most-repeated one (a ceiling's
    # minimum): the figures are best-of, and a best of 5 against a best of 3
    # would favour whichever had more draws from the same noise.
    try:
        for rep in range(repeats):
            for run in runs:
                if run.result is not None or run.drv is None:
                    continue
                try:
                    if rep:
                        _fresh_connections(run)
                    if cfg.warm_up:
                        _warm_up(run, run.drv, work, rep,
                                 warm_up_rounds(nbytes, cfg.quick, cfg.transport))
                    _one_repeat(run, run.drv, work, src, dst, rep)
                except Exception as e:
                    run.result = error_entry(e)
    finally:
        for run in runs:
            close_quietly(run.drv)
            run.drv = None
            step(f"{size // KiB} KiB {run.name}")
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.result is None:
            run.result = {
                "put_gbps": round(nbytes / min(run.puts) / GB, 3),
                "get_gbps": round(nbytes / min(run.gets) / GB, 3),
                "put_gbps_median": round(nbytes / float(np.median(run.puts)) / GB, 3),
                "get_gbps_median": round(nbytes / float(np.median(run.gets)) / GB, 3),
                "repeats": len(run.puts),
                "fresh_connections": run.fresh,
                "warm_up": run.warm,
                "warm_up_rounds": run.warm_rounds,
                "bytes_verified": nbytes if run.verifies else 0,
            }
        out[run.name] = run.result
    return out


def _fresh_connections(run: _Run) -> None:
    """New connections for the next repeat, where the driver can make them
    (untimed). Over loopback a connection can run slow for its whole life
    (reordered segments set off spurious fast retransmits, bench/README), so
    repeats that shared one would share that draw: the best of them would
    not be a best of independent tries."""
    reconnect = getattr(run.drv, "reconnect", None)
    if reconnect is not None:
        reconnect()
        run.fresh = True


def warm_up_rounds(nbytes: int, quick: bool, transport: str = "tcp") -> int:
    """Untimed put + get rounds of an ``nbytes`` batch before each timed one:
    one in a quick run (it checks the drivers, not speed) and over RDMA
    (a queue pair has no window to grow: one round warms its first-use
    costs); else enough to move WARM_UP_BYTES each way, between 1 and
    WARM_UP_MAX_ROUNDS (16 at 16 and 64 KiB, 4 at 256 KiB and 1 MiB)."""
    if quick or transport != "tcp":
        return 1
    return max(1, min(WARM_UP_MAX_ROUNDS, -(-WARM_UP_BYTES // max(1, nbytes))))


def _warm_up(run: _Run, drv: Driver, work: Workload, rep: int, rounds: int) -> None:
    """``rounds`` untimed puts and gets of the whole batch, under keys of their
    own, deleted after each. A new TCP connection starts with small socket
    buffers and a small congestion window that the kernel grows as data flows,
    so its first transfers are slower than later ones, while an engine's
    connections move KV all day. ``bench/connection_ramp.py`` measures that
    ramp (medians by a transfer's position on a new connection; its figures in
    bench/README.md): one round timed a point on it, where the systems stand
    in another order than warm.
    The warm-up goes through the driver's own put and get (into the
    destination arena, which the timed get overwrites after zeroing it). A
    driver that stores nothing (perftest, a process per measurement) has
    nothing to warm."""
    if not bool(getattr(drv, "moves_keys", True)):
        return
    put_get_rounds(drv, work.keys(f"w{run.name[:6]}{rep}"), rounds)
    run.warm = True
    run.warm_rounds = rounds


def put_get_rounds(drv: Driver, keys: Sequence[bytes], rounds: int) -> None:
    """``rounds`` untimed puts and gets of ``keys``, deleted after each (a warm-up)."""
    for _ in range(rounds):
        drv.put(keys)
        drv.get(keys)
        _discard(drv, keys)


def _one_repeat(run: _Run, drv: Driver, work: Workload, src: Arena, dst: Arena, rep: int) -> None:
    """One timed put and get of every block, then every byte of ``dst`` checked.

    A driver with ``self_timed = True`` reports the seconds of its own data path
    in ``last_seconds`` (perftest: its own measurement, not process start-up);
    one with ``moves_keys = False`` stores nothing, so nothing is read back or
    verified (its ``bytes_verified`` is 0)."""
    keys = work.keys(f"{run.name[:6]}{rep}")
    self_timed = bool(getattr(drv, "self_timed", False))
    moves = bool(getattr(drv, "moves_keys", True))
    t0 = time.perf_counter()
    drv.put(keys)
    run.puts.append(_seconds(drv, self_timed, t0))
    if moves:
        dst[:] = 0
    t0 = time.perf_counter()
    drv.get(keys)
    run.gets.append(_seconds(drv, self_timed, t0))
    if not moves:
        run.verifies = False
        return
    bad = wrong_bytes(src, dst)
    if bad:
        run.result = {
            "error": f"{bad} wrong bytes of {src.size} read back (repeat {rep + 1})",
        }
        return
    _discard(drv, keys)


def _discard(drv: Driver, keys: Sequence[bytes]) -> None:
    """Delete ``keys`` where the driver can (its optional ``discard``), so the
    next transfer finds room."""
    discard = getattr(drv, "discard", None)
    if discard is not None:
        discard(keys)


def _seconds(drv: Driver, self_timed: bool, t0: float) -> float:
    wall = time.perf_counter() - t0
    if self_timed:
        own = float(getattr(drv, "last_seconds", 0.0))
        if own > 0:
            return own
    return wall
