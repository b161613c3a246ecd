"""What the value checksum costs a TCP put: rdmakv with and without its hash pass.

Every value rdmakv puts is hashed (XXH3-64) on its way out, and the COMMIT
carries the checksums, so a get can tell a corrupted value from a good one.
The socket loop (``rdmakv bench``'s ceiling) checks nothing. This measures how
much of the gap between the two is that hash pass:

* ``socket_loop``: the ceiling's put (``rdmakv.perf.drivers.socket_loop``);
* ``rdmakv``: a put through a real ``rdmakv serve``, as shipped;
* ``rdmakv_unchecked``: the same client, node and connection, with the native
  send told to hash nothing (the COMMIT then carries zeros). This is NOT a mode
  of rdmakv -- no setting gives it -- and it exists only in this script, which
  swaps ``rdmakv.transport.tcp.client_side.send_iov`` (the client's name for the
  loop's send) for the duration of those puts and
  fails unless every one of them went through the swapped call.

Rounds alternate the three (the order rotating each round), so all meet the
same machine weather; each figure is the best and the median of the rounds.
``put_cpu_ms`` is this process's CPU time per put (median; all its threads:
the hash pass shows there whatever the core count), ``checksum_cpu_ms`` the
checked put's minus the unchecked put's, and ``unchecked_sends`` how many
native sends ran without hashing. Before timing, one checked put of
each system is read back and compared byte for byte (an unchecked put's
values would fail their checksums on a get: those keys are only deleted).

Prints ONE JSON object and, with ``--out DIR``, writes ``DIR/checksum_cost.json``
and ``DIR/checksum_cost.png`` (with matplotlib). GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.perf.driver import Driver, Workload
from rdmakv.perf.drivers.rdmakv_node import RdmakvDriver
from rdmakv.perf.drivers.socket_loop import SocketLoopDriver
from rdmakv.perf.measure import arena, fill_random, wrong_bytes
from rdmakv.perf.provenance import provenance, publish
from rdmakv.transport.tcp import client_side
from rdmakv.transport.tcp import loop as tcp_loop

BLOCK_SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)
MAX_BLOCKS = 1000
MAX_BYTES = 256 * 1024 * 1024
DEFAULT_ROUNDS = 12
WARM_UP_ROUNDS = 2
"""Rounds timed but not counted (a new connection's first transfers cost more)."""
GB = 1e9
SYSTEMS = ("socket_loop", "rdmakv", "rdmakv_unchecked")


class _UncheckedSends:
    """While entered, ``client_side.send_iov`` hashes nothing: each checksum it was asked
    for is sent as 0. ``calls`` counts the sends that asked for checksums, so a
    put that no longer goes through ``send_iov`` fails here instead of silently
    measuring the checked path twice."""

    def __init__(self) -> None:
        self.calls = 0
        self._real: Callable[..., None] | None = None

    def __enter__(self) -> _UncheckedSends:
        real = self._real = client_side.send_iov

        def send_unhashed(sock: Any, iov: np.ndarray, checksums: np.ndarray | None = None) -> None:
            if checksums is not None:
                self.calls += 1
                checksums[:] = 0  # a COMMIT's checksum row points here
            real(sock, iov, None)

        client_side.send_iov = send_unhashed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._real is not None
        client_side.send_iov = self._real  # type: ignore[assignment]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextlib.contextmanager
def _drivers(
    work: Workload, src: np.ndarray, dst: np.ndarray
) -> Iterator[tuple[SocketLoopDriver, RdmakvDriver]]:
    loop, ours = SocketLoopDriver(), RdmakvDriver("tcp")
    try:
        loop.open(work, src, dst)
        ours.open(work, src, dst)
        yield loop, ours
    finally:
        for d in (ours, loop):
            with contextlib.suppress(Exception):
                d.close()


def _verify(name: str, drv: Driver, work: Workload, src: np.ndarray, dst: np.ndarray) -> int:
    """One checked put and get of every block, compared byte for byte."""
    keys = work.keys(f"v{name[:4]}")  # Workload keys are 16 bytes: short tags
    dst[:] = 0
    drv.put(keys)
    drv.get(keys)
    bad = wrong_bytes(src, dst)
    if bad:
        raise SystemExit(f"{name}: {bad} wrong bytes read back at {work.block_bytes} B blocks")
    discard = getattr(drv, "discard", None)
    if discard is not None:
        discard(keys)
    return int(src.size)


def measure(block: int, rounds: int) -> dict[str, Any]:
    blocks = min(MAX_BLOCKS, MAX_BYTES // block)
    work = Workload(block_bytes=block, blocks=blocks, batch=blocks)
    src, dst = arena(block * blocks), arena(block * blocks)
    fill_random(src, seed=block)
    unchecked = _UncheckedSends()
    secs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    cpu: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    with _drivers(work, src, dst) as (loop, ours):
        verified = {"socket_loop": _verify("socket_loop", loop, work, src, dst),
                    "rdmakv": _verify("rdmakv", ours, work, src, dst)}
        for r in range(rounds):
            order = SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]
            for name in order:
                keys = work.keys(f"s{SYSTEMS.index(name)}r{r}")
                drv = loop if name == "socket_loop" else ours
                swap = unchecked if name == "rdmakv_unchecked" else contextlib.nullcontext()
                with swap:
                    before = unchecked.calls
                    c0, t0 = _cpu_s(), time.perf_counter()
                    drv.put(keys)
                    t1, c1 = time.perf_counter(), _cpu_s()
                    if name == "rdmakv_unchecked" and unchecked.calls == before:
                        raise SystemExit("rdmakv_unchecked: the put never called send_iov "
                                         "with checksums; this script no longer measures it")
                if drv is ours:
                    ours.discard(keys)
                if r >= WARM_UP_ROUNDS:
                    secs[name].append(t1 - t0)
                    cpu[name].append(c1 - c0)
    nbytes = block * blocks
    out: dict[str, Any] = {"blocks": blocks}
    for name in SYSTEMS:
        s = np.array(secs[name])
        out[name] = {
            "put_gbps": round(nbytes / s.min() / GB, 3),
            "put_gbps_median": round(nbytes / float(np.median(s)) / GB, 3),
            "put_cpu_ms": round(float(np.median(cpu[name])) * 1e3, 3),
            "bytes_verified": verified.get(name, 0),
        }
    loop_fig = out["socket_loop"]
    for name in ("rdmakv", "rdmakv_unchecked"):
        for key in ("put_gbps", "put_gbps_median"):
            out[name][f"{key.replace('put_gbps', 'put')}_vs_socket_loop"] = round(
                out[name][key] / loop_fig[key], 3
            )
    out["unchecked_sends"] = unchecked.calls
    out["checksum_cpu_ms"] = round(
        out["rdmakv"]["put_cpu_ms"] - out["rdmakv_unchecked"]["put_cpu_ms"], 3
    )
    return out


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    x = np.arange(len(sizes))
    width = 0.8 / len(SYSTEMS)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(SYSTEMS):
        ax.bar(x + i * width, [result["sizes"][s][name]["put_gbps"] for s in sizes], width,
               label=name)
    ax.set_xticks(x + width * (len(SYSTEMS) - 1) / 2)
    ax.set_xticklabels([f"{int(s) // 1024} KiB" for s in sizes])
    ax.set_ylabel("put GB/s (best of rounds)")
    ax.set_title(f"TCP put with and without the value checksum\n{result['meta']['machine']}",
                 fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in BLOCK_SIZES),
                    help="comma-separated block sizes in bytes")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"timed rounds per size, the first {WARM_UP_ROUNDS} not counted")
    ap.add_argument("--out", type=Path, help="write checksum_cost.json (and .png) here")
    args = ap.parse_args(argv)
    if args.rounds <= WARM_UP_ROUNDS:
        ap.error(f"--rounds must be more than the {WARM_UP_ROUNDS} warm-up rounds")
    if not tcp_loop.native_checksums():
        raise SystemExit("the native TCP loop has no checksums here (the xxhash module "
                         "exports no XXH3 C API): nothing to measure")
    result: dict[str, Any] = {"meta": {**provenance(), "rounds": args.rounds,
                                       "warm_up_rounds": WARM_UP_ROUNDS}, "sizes": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"checksum_cost: {size // 1024} KiB blocks...", file=sys.stderr, flush=True)
        result["sizes"][str(size)] = measure(size, args.rounds)
    publish(result, args.out, "checksum_cost", _plot)


if __name__ == "__main__":
    main()
