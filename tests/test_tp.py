"""Tensor parallelism: ranks agree on the number of blocks fetched (issue 5 item 2).

Spawns 2 and then 4 real ranks (``python tests/test_tp.py --rank ...``) in a
gloo ``torch.distributed`` group initialised through a FileStore, all talking
to one real ``rdmakv serve``. Each rank keys its own slice of the KV heads
(:func:`rdmakv.engine.manager.tp_namespace`). Scenarios, run one after another in the
same processes (torch import is the slow part, so processes are few):

* ``healthy``: every rank fetches all blocks -> all agree on all of them;
* ``fetch_fails``: one rank's real client is wrapped to raise TransportError on
  fetch (it keeps only its L1 hits) -> every rank keeps that smaller count and
  releases the blocks it fetched beyond it;
* ``node_gap``: one rank's slice misses a block on the node -> all stop there.

Each rank writes a JSON report; the test checks them all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rdmakv.blocks.keys import BlockKey, KeyNamespace
from rdmakv.engine.manager import KVCacheManager, tp_namespace
from rdmakv.errors import TransportError

BLOCK_TOKENS = 4
BLOCK_BYTES = 8 * 1024
NUM_BLOCKS = 8
L1_LOCAL_BLOCKS = 3  # blocks every rank already holds in L1 before acquiring
GAP_BLOCK = 6  # node_gap: the block missing from one rank's slice
CLIENT_TIMEOUT = 5.0
COLLECTIVE_TIMEOUT_S = 30
RANK_WAIT_S = 90.0
BASE_NS = KeyNamespace(model="tp-test", dtype="bfloat16", kv_layout="NHD")
SCENARIOS = ("healthy", "fetch_fails", "node_gap")


def kv_bytes(key: BlockKey) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, BLOCK_BYTES, dtype=np.uint8
    )


class FailingFetchClient:
    """The rank's real client, except that every fetch raises TransportError (a fault)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def get_sizes(self, *args: Any, **kwargs: Any) -> Any:
        raise TransportError("injected: this rank's fetch fails")


def _manager(ns: KeyNamespace, node: str, offload: str) -> KVCacheManager:
    return KVCacheManager(
        namespace=ns,
        block_tokens=BLOCK_TOKENS,
        block_bytes=BLOCK_BYTES,
        l1_bytes=4 * NUM_BLOCKS * BLOCK_BYTES,
        max_pending_offload_bytes=4 * NUM_BLOCKS * BLOCK_BYTES,
        node=node,
        transport="tcp",
        offload=offload,
        timeout=CLIENT_TIMEOUT,
        lock_slab=False,
    )


def _put(m: KVCacheManager, tokens: np.ndarray, count: int) -> list[BlockKey]:
    keys = m.keyer.keys(tokens)[:count]
    handles = m.allocate_for(count)
    for h, k in zip(handles, keys, strict=True):
        m.block_view(h)[:] = kv_bytes(k)
    m.put(tokens, handles)
    return keys


def run_rank(rank: int, world: int, store: str, node: str, odd_rank: int) -> dict[str, Any]:
    """One TP rank: write its slice, then acquire each scenario's request as a collective."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    ns = tp_namespace(BASE_NS, tp_rank=rank, tp_size=world, num_kv_heads=world)
    report: dict[str, Any] = {"rank": rank, "layout": ns.kv_layout}
    writer = _manager(ns, node, "all")
    requests = {
        s: np.random.default_rng([world, i]).integers(0, 32000, NUM_BLOCKS * BLOCK_TOKENS)
        for i, s in enumerate(SCENARIOS)
    }
    for s, tokens in requests.items():
        keys = _put(writer, tokens, NUM_BLOCKS)
        report[f"{s}_keys"] = [k.hex() for k in keys]
    assert writer.flush(CLIENT_TIMEOUT * 2)
    if rank == odd_rank:
        assert writer.client is not None
        writer.client.delete([writer.keyer.keys(requests["node_gap"])[GAP_BLOCK]])
    writer.close()
    dist.barrier()

    for s, tokens in requests.items():
        reader = _manager(ns, node, "none")
        _put(reader, tokens, L1_LOCAL_BLOCKS)
        if s == "fetch_fails" and rank == odd_rank:
            reader.client = FailingFetchClient(reader.client)  # type: ignore[assignment]
        got = reader.acquire(tokens, tp_group=dist.group.WORLD)
        keys = reader.keyer.keys(tokens)
        report[s] = {
            "num_blocks": got.num_blocks,
            "l1_blocks": got.l1_blocks,
            "fetched": reader.stats.l2_hit_blocks,
            "held": reader.l1.held_handles,
            "bytes_ok": all(
                np.array_equal(reader.block_view(h), kv_bytes(keys[i]))
                for i, h in enumerate(got.handles)
            ),
            "l2_errors": reader.stats.l2_errors,
        }
        reader.release(got)
        report[s]["held_after_release"] = reader.l1.held_handles
        reader.close()
    dist.destroy_process_group()
    return report


def _spawn_ranks(world: int, tmp: Path, node: str, odd_rank: int) -> list[dict[str, Any]]:
    store = tmp / f"store-{world}"
    procs = []
    for rank in range(world):
        out = tmp / f"rank-{world}-{rank}.json"
        argv = [sys.executable, __file__, "--rank", str(rank), "--world", str(world)]
        argv += ["--store", str(store), "--node", node, "--odd-rank", str(odd_rank)]
        argv += ["--out", str(out)]
        err = (tmp / f"rank-{world}-{rank}.stderr").open("wb")
        procs.append((subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err), out, err))
    reports = []
    try:
        for p, out, err in procs:
            rc = p.wait(RANK_WAIT_S)
            err.close()
            stderr = Path(err.name).read_text(errors="replace")[-3000:]
            assert rc == 0, f"rank exited with {rc}: {stderr}"
            reports.append(json.loads(out.read_text()))
    finally:
        for p, _, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    return reports


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_tp_ranks_agree_on_the_minimum_blocks_fetched(
    world: int, tmp_path: Path, node: Any
) -> None:
    pytest.importorskip("torch")  # the ranks' group is torch.distributed's (rdmakv[torch])
    odd_rank = world - 1
    reports = _spawn_ranks(world, tmp_path, node.endpoint, odd_rank)
    assert [r["rank"] for r in reports] == list(range(world))
    # Each rank stores its own head slice: no two ranks share keys here.
    assert len({r["layout"] for r in reports}) == world
    assert len({r["healthy_keys"][0] for r in reports}) == world

    for r in reports:
        h = r["healthy"]
        assert (h["num_blocks"], h["l1_blocks"], h["fetched"]) == (NUM_BLOCKS, 3, NUM_BLOCKS - 3)
        assert h["bytes_ok"] and h["held"] == NUM_BLOCKS and h["held_after_release"] == 0

        f = r["fetch_fails"]
        assert f["num_blocks"] == L1_LOCAL_BLOCKS, "every rank keeps the failing rank's count"
        assert f["held"] == L1_LOCAL_BLOCKS, "blocks beyond the agreed count were released"
        assert f["bytes_ok"] and f["held_after_release"] == 0
        if r["rank"] == odd_rank:
            assert (f["fetched"], f["l2_errors"]) == (0, 1)
        else:
            assert f["fetched"] == NUM_BLOCKS - L1_LOCAL_BLOCKS, "it did fetch, then agreed"

        g = r["node_gap"]
        assert g["num_blocks"] == GAP_BLOCK
        assert g["held"] == GAP_BLOCK and g["bytes_ok"] and g["held_after_release"] == 0


def main() -> None:
    ap = argparse.ArgumentParser(description="one TP rank of test_tp")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--odd-rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    report = run_rank(a.rank, a.world, a.store, a.node, a.odd_rank)
    Path(a.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
