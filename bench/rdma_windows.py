"""What RDMA confinement with memory windows costs: put/get GB/s of a real
node with ``rdma_confinement="windows"`` (the default) against the same node
with ``"none"`` (one pool-wide rkey), same device, same run, same bytes.

Run it on an RDMA device (on hosts without one, inside the soft-RoCE VM:
``deploy/softroce/run-in-vm.sh -- .venv/bin/python bench/rdma_windows.py``).

Each node is its own process (``KVNode`` started by a small inline script, as
``rdmakv serve`` does with ``node.rdma_confinement``). A put is ALLOC (the
node binds a window per contiguous run of extents on the client's QP) + RDMA
WRITEs + COMMIT (the node deallocates it); a get is LOOKUP with a lease (a
window per run, READ only) + RDMA READs + RELEASE. Client slab blocks are
shuffled, so each op is one SGE and the node's extents are what decides
whether ops gather into one WR. Every byte is verified after each get.

Prints ONE JSON object: ``{"windows": {...}, "none": {...}, "put_ratio",
"get_ratio"}`` where ratio = windows / none (1.0 = free). Figures are the
best of ``--repeats`` (GB/s = 1e9 bytes/s). On soft-RoCE under emulation the
absolute numbers are small and noisy; the ratio is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient

NODE_SCRIPT = """
import sys, threading
from rdmakv.node.server import KVNode
n = KVNode(pool_size=int(sys.argv[1]), block_size=int(sys.argv[2]), host="127.0.0.1",
           port=0, transports=("rdma",), lock_pool=True, rdma_confinement=sys.argv[3])
_, port = n.start()
print("PORT", port, flush=True)
n.serve_forever()
"""


def run_mode(mode: str, blocks: int, block: int, repeats: int, timeout: float) -> dict[str, Any]:
    pool = blocks * block * (repeats + 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, str(pool), str(block), mode],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("PORT"):
            raise SystemExit(f"node ({mode}) did not start: {line!r}")
        port = int(line.split()[1])
        slab = Slab(2 * blocks * block, block)
        try:
            return _measure(slab, port, blocks, block, repeats, timeout)
        finally:
            slab.close()
    finally:
        proc.kill()
        proc.wait(30)


def _measure(
    slab: Slab, port: int, blocks: int, block: int, repeats: int, timeout: float
) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    handles = slab.alloc_many(2 * blocks)
    order = rng.permutation(len(handles))
    src = [handles[i] for i in order[:blocks]]
    dst = [handles[i] for i in order[blocks:]]
    for h in src:
        slab.numpy(h)[:] = rng.integers(0, 256, block, dtype=np.uint8)
    digests = [i.to_bytes(16, "little") for i in range(blocks)]
    put_s: list[float] = []
    get_s: list[float] = []
    with KVClient("127.0.0.1", port, slab, transport="rdma", timeout=timeout) as c:
        assert c.transport_name == "rdma"
        for r in range(repeats):
            keys = [b"r%d-%d" % (r, i) for i in range(blocks)]
            t0 = time.perf_counter()
            ok = c.put(keys, src, block, digests)
            put_s.append(time.perf_counter() - t0)
            if ok != [True] * blocks:
                raise SystemExit(f"put failed for {ok.count(False)} blocks")
            t0 = time.perf_counter()
            ok = c.get(keys, dst, digests)
            get_s.append(time.perf_counter() - t0)
            if ok != [True] * blocks:
                raise SystemExit(f"get missed {ok.count(False)} blocks")
            for s, d in zip(src, dst, strict=True):
                if bytes(slab.view(s)) != bytes(slab.view(d)):
                    raise SystemExit("wrong bytes after get")
            c.delete(keys)
        tp: Any = c._tp
        stats = tp.last_stats
    nbytes = blocks * block
    return {
        "put_gbps": round(nbytes / min(put_s) / 1e9, 4),
        "get_gbps": round(nbytes / min(get_s) / 1e9, 4),
        "put_s": [round(x, 4) for x in put_s],
        "get_s": [round(x, 4) for x in get_s],
        "last_read_wrs": stats.wrs if stats else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64 * 1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    out: dict[str, Any] = {
        "blocks": args.blocks, "block_size": args.block_size, "repeats": args.repeats,
        "device": os.environ.get("RDMAKV_TEST_DEVICE", "auto"),
    }
    for mode in ("windows", "none"):
        out[mode] = run_mode(mode, args.blocks, args.block_size, args.repeats, args.timeout)
    for what in ("put", "get"):
        base = out["none"][f"{what}_gbps"]
        out[f"{what}_ratio"] = round(out["windows"][f"{what}_gbps"] / base, 3) if base else None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
