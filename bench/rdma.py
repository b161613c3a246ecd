"""RDMA benchmark: rdmakv put/get over the ``rdma`` transport against perftest.

Run it on an RDMA device (in CI / on hosts without one: inside the soft-RoCE
VM, ``deploy/softroce/run-in-vm.sh -- .venv/bin/python bench/rdma.py``).

For each block size (16 KiB, 64 KiB, 256 KiB) and in the same run, on the same
device:

* ceilings: ``ib_write_bw`` and ``ib_read_bw`` (server and client on this
  device, client to the device's own IPv4 GID address), moving the same number
  of bytes as our path;
* rdmakv: a real ``rdmakv serve --transport rdma`` node and a KVClient whose
  slab blocks are shuffled (as an L1 cache's blocks are), so SGL gathering
  does real work. ``put`` = ALLOC + RDMA WRITEs + COMMIT of N blocks, ``get``
  = LOOKUP(lease) + RDMA READs + RELEASE, every byte verified after the get.

Prints ONE JSON object: ``{"16384": {put_gbps, get_gbps, ceiling_write_gbps,
ceiling_read_gbps, wrs_per_batch, sges_per_wr, ...}, ...}``. A put or get of
N blocks is split by the client into a few pipelined sub-batches (each one a
transport batch): ``wrs_per_batch`` is WRs per such batch, ``*_datapath_*``
the rate of the native loop alone (no control round trips). GB/s are 1e9
bytes per second (perftest is run with ``--report_gbits`` and converted).
Each figure is the best of ``--repeats`` runs, the same rule for both sides.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.perf.drivers.perftest import run_perftest
from rdmakv.transport.rdma import verbs
from rdmakv.transport.rdma.client_side import RdmaTransport
from rdmakv.transport.rdma.device import DataPathTotals

BLOCK_SIZES = (16 * 1024, 64 * 1024, 256 * 1024)
DEFAULT_BYTES = 32 * 1024 * 1024
DEFAULT_REPEATS = 3
GB = 1e9
CLIENT_TIMEOUT_S = 120.0
PERFTEST_TIMEOUT_S = 300.0


def perftest_gbps(tool: str, sel: verbs.Selection, size: int, iters: int) -> float:
    """Average bandwidth of one perftest run (server + client on this device)."""
    ip = ipaddress.IPv6Address(sel.gid).ipv4_mapped
    if ip is None:
        raise RuntimeError(f"perftest needs an IPv4 GID; {sel.describe()} has none")
    return run_perftest(tool, size, iters, device=sel.device, ib_port=sel.port,
                        gid_index=sel.gid_index, host=str(ip), timeout=PERFTEST_TIMEOUT_S)


def _shape(before: DataPathTotals, after: DataPathTotals) -> dict[str, float]:
    """WRs per transport batch and SGEs per WR over one put or get."""
    batches = after.batches - before.batches
    wrs = after.wrs - before.wrs
    return {
        "batches": batches,
        "wrs_per_batch": round(wrs / max(1, batches), 2),
        "sges_per_wr": round((after.sges - before.sges) / max(1, wrs), 2),
    }


def start_node(block: int, blocks: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdmakv.cli", "serve", "--port", "0", "--transport", "rdma",
         "--pool-size", str(block * blocks), "--block-size", str(block)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready on" not in line:
        proc.kill()
        raise RuntimeError(f"node did not start: {line!r}")
    return proc, int(line.split("ready on ", 1)[1].split()[0].rsplit(":", 1)[1])


def bench_size(sel: verbs.Selection, block: int, total: int, repeats: int) -> dict[str, Any]:
    count = max(1, total // block)
    slab = Slab(2 * count * block, block)
    rng = np.random.default_rng(block)
    handles = [int(h) for h in rng.permutation(slab.alloc_many(2 * count))]
    src, dst = handles[:count], handles[count:]
    for h in src:
        slab.numpy(h)[:] = rng.integers(0, 256, block, dtype=np.uint8)
    digests = [i.to_bytes(16, "little") for i in range(count)]
    # Fresh keys each repeat and no deletes, so the node hands out pool
    # extents in address order (as a long-running node mostly does).
    node, port = start_node(block, count * repeats + 1)
    puts, gets, wr_ceil, rd_ceil = [], [], [], []
    put_dp, get_dp = [], []  # the data path alone (native loop), without control RPCs
    put_shape: dict[str, float] = {}
    get_shape: dict[str, float] = {}
    try:
        with KVClient("127.0.0.1", port, slab, transport="rdma", timeout=CLIENT_TIMEOUT_S) as c:
            tp = c._tp
            assert isinstance(tp, RdmaTransport)
            for rep in range(repeats):
                wr_ceil.append(perftest_gbps("ib_write_bw", sel, block, count))
                keys = [b"b%d-%d" % (rep, i) for i in range(count)]
                before = tp.totals.snapshot()
                t0 = time.perf_counter()
                ok = c.put(keys, src, block, digests)
                puts.append(count * block / (time.perf_counter() - t0) / GB)
                put_dp.append(count * block / (tp.totals.busy_s - before.busy_s) / GB)
                put_shape = _shape(before, tp.totals)
                if not all(ok):
                    raise RuntimeError(f"put stored {sum(ok)} of {count}")
                for h in dst:
                    slab.numpy(h)[:] = 0
                rd_ceil.append(perftest_gbps("ib_read_bw", sel, block, count))
                before = tp.totals.snapshot()
                t0 = time.perf_counter()
                hits = c.get(keys, dst, digests)
                gets.append(count * block / (time.perf_counter() - t0) / GB)
                get_dp.append(count * block / (tp.totals.busy_s - before.busy_s) / GB)
                get_shape = _shape(before, tp.totals)
                if not all(hits):
                    raise RuntimeError(f"get hit {sum(hits)} of {count}")
                for s, d in zip(src, dst, strict=True):
                    if not np.array_equal(slab.numpy(s), slab.numpy(d)):
                        raise RuntimeError(f"block {s} came back different")
    finally:
        node.kill()
        node.wait()
        slab.close()
    best = {"put_gbps": max(puts), "get_gbps": max(gets),
            "ceiling_write_gbps": max(wr_ceil), "ceiling_read_gbps": max(rd_ceil),
            "put_datapath_gbps": max(put_dp), "get_datapath_gbps": max(get_dp)}
    return {
        **{k: round(v, 4) for k, v in best.items()},
        "put_ratio": round(best["put_gbps"] / best["ceiling_write_gbps"], 3),
        "get_ratio": round(best["get_gbps"] / best["ceiling_read_gbps"], 3),
        "put_datapath_ratio": round(best["put_datapath_gbps"] / best["ceiling_write_gbps"], 3),
        "get_datapath_ratio": round(best["get_datapath_gbps"] / best["ceiling_read_gbps"], 3),
        "wrs_per_batch": put_shape["wrs_per_batch"],
        "sges_per_wr": put_shape["sges_per_wr"],
        "batches_per_put": put_shape["batches"],
        "get_wrs_per_batch": get_shape["wrs_per_batch"],
        "get_sges_per_wr": get_shape["sges_per_wr"],
        "batches_per_get": get_shape["batches"],
        "blocks_per_batch": count,
        "bytes_per_batch": count * block,
        "repeats": repeats,
        "device": sel.describe(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="bytes moved per batch")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--sizes", default=",".join(map(str, BLOCK_SIZES)))
    args = ap.parse_args(argv)
    sel = verbs.select(os.environ.get("RDMAKV_TEST_DEVICE"))
    out = {
        str(size): bench_size(sel, size, args.bytes, args.repeats)
        for size in (int(s) for s in args.sizes.split(","))
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
