"""The latency section: lookups and a 1-block get beside the transport's round trip.

p50/p99 of ``exists`` on 1, 16 and 64 keys and of a 1-block get (64 KiB) per
system (:func:`latency_one`), next to a one-byte ping-pong round trip
(:func:`round_trip`; over RDMA an 8-byte RDMA read, the ping-pong beside it).
Client and servers run where a :class:`~rdmakv.perf.placement.Placement`
puts them, the same for every system measured under it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from rdmakv.perf.driver import Arena, Driver, PeerUnavailable, Workload
from rdmakv.perf.drivers import make_driver
from rdmakv.perf.measure import (
    arena,
    close_quietly,
    error_entry,
    fill_random,
    percentiles,
    wrong_bytes,
)
from rdmakv.perf.placement import Placement
from rdmakv.perf.settings import LATENCY_BLOCK, LATENCY_KEYS, BenchConfig

UNPINNED = Placement("unpinned")


def _time_ms(
    fn: Callable[[], Any], samples: int, pair: Callable[[], float] | None = None
) -> dict[str, Any]:
    """p50/p99 of ``samples`` timed calls of ``fn``. With ``pair`` (a round trip
    in ms), one round trip follows each call, and its p50/p99 sit beside the
    call's as ``paired_round_trip``: both met the same machine weather."""
    fn()  # warm up (and surface errors before sampling)
    out: list[float] = []
    trips: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        if pair is not None:
            trips.append(pair())
    res: dict[str, Any] = percentiles(out)
    if trips:
        res["paired_round_trip"] = percentiles(trips)
    return res


def latency_one(
    name: str, cfg: BenchConfig, samples: int, placement: Placement = UNPINNED
) -> dict[str, Any]:
    """``name``'s lookup and 1-block-get latency, each sample followed by a TCP
    round trip to an echo child placed like the servers (``paired_round_trip``):
    the round trip measured once for the section drifts with the machine's load
    between it and these samples (by how much: bench/README.md, "Measurements
    moved from code comments (issue 58)")."""
    from rdmakv.perf.drivers.socket_loop import EchoPeer

    blocks = max(LATENCY_KEYS)
    work = Workload(block_bytes=LATENCY_BLOCK, blocks=blocks, batch=blocks)
    src, dst = arena(LATENCY_BLOCK * blocks), arena(LATENCY_BLOCK * blocks)
    fill_random(src, seed=7)
    drv: Driver | None = None
    try:
        drv = make_driver(name, cfg.transport)
        if not getattr(drv, "moves_keys", True):
            return {"skipped": f"{name} moves no keys: nothing to look up or get"}
        drv.open(work, src, dst)
        with EchoPeer() as echo:
            placement.pin_servers()  # the echo child too
            with placement.client():
                return _latency_samples(name, drv, work, src, dst, samples, echo.ping_ms)
    except Exception as e:
        return error_entry(e)
    finally:
        close_quietly(drv)


def _latency_samples(
    name: str,
    drv: Driver,
    work: Workload,
    src: Arena,
    dst: Arena,
    samples: int,
    pair: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Store the workload's keys, then time lookups and a 1-block get (bytes checked)."""
    keys = work.keys(f"lat{name[:8]}")
    drv.put(keys)
    res: dict[str, Any] = {}
    if getattr(drv, "has_exists", True):
        for k in LATENCY_KEYS:
            sub = keys[:k]
            try:
                got = drv.exists(sub)
            except PeerUnavailable as e:
                res[f"exists_{k}"] = {"error": str(e)}
                continue
            if list(got) != [True] * k:
                raise RuntimeError(f"exists on {k} stored keys answered {list(got)[:8]}...")
            res[f"exists_{k}"] = _time_ms(partial(drv.exists, sub), samples, pair)
    res["get_1"] = _time_ms(partial(drv.get, keys[:1]), samples, pair)
    bad = wrong_bytes(src[:LATENCY_BLOCK], dst[:LATENCY_BLOCK])
    if bad:
        return {"error": f"{bad} wrong bytes of {LATENCY_BLOCK} in the 1-block get"}
    return res


def round_trip(cfg: BenchConfig, samples: int, placement: Placement = UNPINNED) -> dict[str, Any]:
    """The transport's own round trip: a 1-byte TCP ping-pong for tcp; for rdma
    an 8-byte RDMA read (``ib_read_lat``: one read is one full round trip), with
    the TCP ping-pong beside it, or instead of it (saying why) when perftest
    cannot run. The far end runs where ``placement`` puts servers."""
    from rdmakv.perf.drivers.socket_loop import tcp_ping_pong_ms

    with placement.client():
        try:
            tcp: dict[str, Any] = {"kind": "tcp 1-byte ping-pong to a child process"}
            tcp.update(percentiles(tcp_ping_pong_ms(samples, on_spawned=placement.pin_servers)))
        except Exception as e:
            tcp = error_entry(e)
        if cfg.transport == "tcp":
            return tcp
        try:
            res: dict[str, Any] = {"kind": "rdma 8-byte read (ib_read_lat), t_typical and 99%"}
            res.update(rdma_read_lat_ms(samples, on_spawned=placement.pin_servers))
            res["tcp"] = tcp
            return res
        except Exception as e:
            tcp["kind"] += f" (no rdma round trip: {error_entry(e)['error'][:300]})"
            return tcp


def rdma_read_lat_ms(
    samples: int, size: int = 8, on_spawned: Callable[[], object] | None = None
) -> dict[str, float]:
    """p50 (perftest's t_typical, the median) and p99 of ``ib_read_lat`` in ms,
    server and client on this machine's device (``RDMAKV_TEST_DEVICE``, rxe0).
    ``on_spawned`` runs once the server process exists (the client comes later)."""
    import shutil
    import socket

    exe = shutil.which("ib_read_lat")
    if exe is None:
        raise PeerUnavailable("ib_read_lat not found (apt-get install perftest)")
    device = os.environ.get("RDMAKV_TEST_DEVICE", "rxe0")
    if not os.path.exists(f"/sys/class/infiniband/{device}"):
        raise PeerUnavailable(f"no RDMA device {device} here")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    common = [exe, "-d", device, "-i", "1", "-x", "1", "-s", str(size),
              "-n", str(max(samples, 100)), "-F", "-p", str(port)]
    server = subprocess.Popen(common, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if on_spawned is not None:
            on_spawned()
        deadline = time.monotonic() + 120.0
        while True:
            client = subprocess.run([*common, "127.0.0.1"], capture_output=True, text=True,
                                    timeout=300, check=False)
            if client.returncode == 0:
                break
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"ib_read_lat failed: {(client.stdout + client.stderr)[-600:]}")
            time.sleep(0.5)
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%   (usec)
    for line in client.stdout.splitlines():
        f = line.split()
        if len(f) >= 8 and f[0] == str(size):
            return {"p50_ms": round(float(f[4]) / 1e3, 4), "p99_ms": round(float(f[7]) / 1e3, 4)}
    raise RuntimeError(f"no result line in ib_read_lat output: {client.stdout[-600:]}")
