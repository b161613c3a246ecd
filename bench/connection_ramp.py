"""How a new TCP connection's transfers speed up: put and get GB/s by their
position on the connection.

A new connection starts with small socket buffers and a small congestion
window that the kernel grows as data flows, so its first transfers are
slower than later ones. ``rdmakv bench`` warms each repeat's new connections
(``warm_up_rounds``) so that it times warm ones, as an engine's are; this
measures how many transfers that takes. For each system and block size it
opens ``--connections`` fresh sets of connections (the driver's
``reconnect``), moves ``--transfers`` put + get rounds of the whole batch on
each, and reports the median GB/s of each round position across the
connections. Every get is compared with the source byte for byte.

Systems are ``rdmakv bench``'s drivers (``rdmakv`` through a real
``rdmakv serve``, ``socket_loop``, and peers such as ``redis`` where they
run here); one that cannot run is recorded as ``{"error": ...}``, except
``rdmakv`` and ``socket_loop``, which must.

Prints ONE JSON object and, with ``--out DIR``, writes
``DIR/connection_ramp.json`` and ``DIR/connection_ramp.png`` (with
matplotlib). GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.perf.driver import Driver, Workload
from rdmakv.perf.drivers import make_driver
from rdmakv.perf.measure import arena, fill_random, wrong_bytes
from rdmakv.perf.provenance import provenance, publish

DEFAULT_SYSTEMS = ("rdmakv", "socket_loop")
NEVER_SKIP = frozenset(DEFAULT_SYSTEMS)
DEFAULT_SIZES = (16 * 1024, 64 * 1024)
MAX_BLOCKS = 1000
MAX_BYTES = 256 * 1024 * 1024
DEFAULT_CONNECTIONS = 5
DEFAULT_TRANSFERS = 20
GB = 1e9


def _one_system(name: str, block: int, blocks: int, connections: int,
                transfers: int) -> dict[str, Any]:
    """``connections`` x ``transfers`` timed put + get rounds of one system."""
    work = Workload(block_bytes=block, blocks=blocks, batch=blocks)
    src, dst = arena(block * blocks), arena(block * blocks)
    fill_random(src, seed=block)
    puts = np.zeros((connections, transfers))
    gets = np.zeros((connections, transfers))
    drv: Driver | None = None
    try:
        drv = make_driver(name, "tcp")
        drv.open(work, src, dst)
        reconnect = getattr(drv, "reconnect", None)
        if reconnect is None:
            raise RuntimeError(f"{name}: its driver keeps its connections (no reconnect)")
        discard = getattr(drv, "discard", None)
        for c in range(connections):
            reconnect()
            for t in range(transfers):
                keys = work.keys(f"c{c}t{t}")
                t0 = time.perf_counter()
                drv.put(keys)
                puts[c, t] = time.perf_counter() - t0
                dst[:] = 0
                t0 = time.perf_counter()
                drv.get(keys)
                gets[c, t] = time.perf_counter() - t0
                bad = wrong_bytes(src, dst)
                if bad:
                    raise RuntimeError(f"{name}: {bad} wrong bytes read back "
                                       f"(connection {c}, transfer {t + 1})")
                if discard is not None:
                    discard(keys)
    except Exception as e:
        if name in NEVER_SKIP:
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if drv is not None:
            with contextlib.suppress(Exception):
                drv.close()
    nbytes = block * blocks
    return {
        "put_gbps_median": [round(nbytes / float(np.median(puts[:, t])) / GB, 3)
                            for t in range(transfers)],
        "get_gbps_median": [round(nbytes / float(np.median(gets[:, t])) / GB, 3)
                            for t in range(transfers)],
        "bytes_verified": nbytes * connections * transfers,
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sizes = list(result["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for name, fig_ in result["sizes"][size].items():
            if "error" in fig_:
                continue
            x = np.arange(1, len(fig_["put_gbps_median"]) + 1)
            ax.plot(x, fig_["put_gbps_median"], marker="o", ms=3, label=f"{name} put")
            ax.plot(x, fig_["get_gbps_median"], marker="x", ms=3, ls="--", label=f"{name} get")
        ax.set_title(f"{int(size) // 1024} KiB blocks", fontsize=9)
        ax.set_xlabel("transfer on a new connection")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("GB/s (median over connections)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"A new TCP connection's ramp\n{result['meta']['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help="comma-separated rdmakv bench systems")
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                    help="comma-separated block sizes in bytes")
    ap.add_argument("--blocks", type=int, default=0,
                    help="blocks per batch (default min(1000, 256 MiB / size))")
    ap.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS,
                    help="fresh connections per system and size (the median is over these)")
    ap.add_argument("--transfers", type=int, default=DEFAULT_TRANSFERS,
                    help="put + get rounds on each connection")
    ap.add_argument("--out", type=Path, help="write connection_ramp.json (and .png) here")
    args = ap.parse_args(argv)
    for flag in ("connections", "transfers"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.blocks < 0:
        ap.error(f"--blocks must be at least 1 (0: the default), got {args.blocks}")
    systems = [s for s in args.systems.split(",") if s]
    result: dict[str, Any] = {
        "meta": {**provenance(), "connections": args.connections, "transfers": args.transfers},
        "sizes": {},
    }
    for size in (int(s) for s in args.sizes.split(",")):
        blocks = args.blocks or min(MAX_BLOCKS, MAX_BYTES // size)
        per: dict[str, Any] = {}
        for name in systems:
            print(f"connection_ramp: {size // 1024} KiB {name} ({args.connections} x "
                  f"{args.transfers} transfers of {blocks} blocks)...", file=sys.stderr,
                  flush=True)
            per[name] = _one_system(name, size, blocks, args.connections, args.transfers)
        result["sizes"][str(size)] = per
        result["meta"].setdefault("blocks", {})[str(size)] = blocks
    publish(result, args.out, "connection_ramp", _plot)


if __name__ == "__main__":
    main()
