"""Cluster benchmark: what splitting batches over 1, 2 and 4 real KV nodes costs.

Starts 5 real ``rdmakv serve`` processes on 127.0.0.1 (TCP, ``--no-lock``) and,
for 1, 2 and 4 of them, puts then gets ``--blocks`` blocks of ``--block-bytes``
through a :class:`~rdmakv.client.cluster.ClusterClient`, in batches of ``--batch``,
``--repeats`` times, verifying every byte read back. The reference, measured in
the same run and interleaved with the 1-node cluster repeat by repeat, is the
plain :class:`~rdmakv.client.node_client.KVClient` against that same node: the cluster of
one over it is the cost of the split machinery alone. On a machine with few
cores the aggregate cannot scale with nodes (client and nodes share the cores);
the figure that matters is how little the split costs (``ratio_4_vs_1``).

Membership change 4 -> 5 nodes (rendezvous placement):

* ``moved_fraction_4_to_5``: share of ``--keys`` random 16-byte keys whose
  owner changes when a 5th node joins (ideal 1/5). ``moves`` holds the rest:
  5 -> 4, the same for replication 2 (ideal 2/5), whether only the newcomer's
  keys moved, each node's share (spread) and the placement cost per key.
  Placement is a pure function of (member ids, key), so this is exactly what a
  ClusterClient does; the ids are those of a 5-pod StatefulSet.
* ``live_4_to_5``: the same on the real nodes: the last 4-node repeat's keys are
  read through a 5-member ClusterClient; exactly the keys placed on the
  (empty) newcomer must miss and every other key must hit, bytes verified.

GB/s are 1e9 bytes per second of batch time (sum over the batches of a repeat),
the best of the repeats; p50/p99 are over every batch of every repeat.

Prints ONE JSON object: ``nodes_1``, ``nodes_2``, ``nodes_4``, ``kvclient_1``
(each ``put_gbps``, ``get_gbps``, ``put_p50_ms``, ``put_p99_ms``,
``get_p50_ms``, ``get_p99_ms``, ...), ``ratio_4_vs_1`` and
``split_cost_vs_kvclient`` (``put``/``get`` GB/s ratios), ``moved_fraction_4_to_5``,
``moves``, ``live_4_to_5``, ``bytes_verified`` and ``meta``.

Written to ``<--out>/cluster.json`` when ``--out`` is given; without it, to
``bench/results/cluster.json`` unless ``--quick`` (a tiny run for CI and tests,
which writes nothing unless ``--out`` is given). Exit 1 when a byte read back
differs, a put is refused or a key misses that should hit; 2 on a bad option.
Node processes are always stopped at the end.

Usage: ``python bench/cluster.py [--quick] [--blocks N] [--block-bytes B]
[--batch K] [--repeats R] [--keys N] [--out DIR]``
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster import ClusterClient
from rdmakv.client.cluster.rendezvous import Rendezvous, fold_key, mix64, node_seed
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmakvError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GB = 1e9
KIB = 1024
NODE_COUNTS = (1, 2, 4)
SPARE_NODES = 1  # the newcomer of the live 4 -> 5 check
DEFAULT_BLOCKS = 1000
DEFAULT_BLOCK_BYTES = 256 * KIB
DEFAULT_BATCH = 64
DEFAULT_REPEATS = 5
DEFAULT_KEYS = 100_000
QUICK = {"blocks": 64, "block_bytes": 64 * KIB, "batch": 16, "repeats": 1, "keys": 20_000}
CLIENT_TIMEOUT_S = 60.0
POOL_SLACK = 1.5  # a node's pool holds this many times its even share of one repeat's blocks
POOL_SPARE_BLOCKS = 16

NODES_5 = [f"10.244.{i}.17:7480" for i in range(5)]  # pod ids of a 5-replica StatefulSet
NEWCOMER = NODES_5[-1]
RANK_BATCH = 4000  # keys per batch for the placement cost figures
RANK_REPEATS = 5


class BenchFailure(Exception):
    """Wrong or missing bytes: the run is not a measurement (exit 1)."""


# -- moved keys (placement only) ----------------------------------------------------------


def moved(before: list[tuple[str, ...]], after: list[tuple[str, ...]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]


def spread(ring: Rendezvous, keys: list[bytes]) -> dict[str, Any]:
    counts = np.bincount(ring.rank(keys)[:, 0], minlength=len(ring))
    shares = counts / len(keys)
    even = 1 / len(ring)
    return {
        "shares": {n: round(float(s), 5) for n, s in zip(ring.nodes, shares, strict=True)},
        "max_rel_deviation": round(float(np.max(np.abs(shares - even)) / even), 5),
    }


def best_us_per_key(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(RANK_REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best / n * 1e6, 4)


def scalar_owners(nodes: list[str], keys: list[bytes]) -> list[int]:
    seeds = [node_seed(n) for n in nodes]
    out = []
    for k in keys:
        f = fold_key(k)
        w = [mix64(f ^ s) for s in seeds]
        out.append(w.index(max(w)))
    return out


def placement_moves(n_keys: int, seed: int) -> dict[str, Any]:
    """Keys moved by 4 -> 5 and 5 -> 4 nodes (R = 1 and 2), spread, placement cost."""
    rng = np.random.default_rng(seed)
    keys = [bytes(row) for row in rng.integers(0, 256, size=(n_keys, 16), dtype=np.uint8)]
    four, five = Rendezvous(NODES_5[:4]), Rendezvous(NODES_5)
    out: dict[str, Any] = {"keys": n_keys, "nodes_5": NODES_5}
    for r in (1, 2):
        o4, o5 = four.owners(keys, r), five.owners(keys, r)
        up, down = moved(o4, o5), moved(o5, o4)
        suffix = "" if r == 1 else "_r2"
        out[f"moved_fraction_4_to_5{suffix}"] = round(len(up) / n_keys, 5)
        out[f"moved_fraction_5_to_4{suffix}"] = round(len(down) / n_keys, 5)
        out[f"ideal{suffix}"] = r / 5
        out[f"only_newcomer_keys_moved{suffix}"] = all(NEWCOMER in o5[i] for i in up) and all(
            NEWCOMER in o5[i] for i in down
        )
    out["spread_4"] = spread(four, keys)
    out["spread_5"] = spread(five, keys)
    batch = keys[:RANK_BATCH]
    vec = {
        f"r{r}_{n}_nodes": best_us_per_key(functools.partial(g.rank, batch, r), len(batch))
        for r in (1, 2)
        for n, g in ((4, four), (5, five))
    }
    many = [f"10.0.{i}.1:7480" for i in range(64)]
    vec["r1_64_nodes"] = best_us_per_key(lambda: Rendezvous(many).rank(batch), len(batch))
    out["rank_us_per_key"] = {
        "numpy": vec,
        "python_scalar_r1_4_nodes": best_us_per_key(
            lambda: scalar_owners(NODES_5[:4], batch), len(batch)
        ),
        "batch": len(batch),
    }
    return out


# -- data path ----------------------------------------------------------------------------


def make_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def digest_of(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16, person=b"bench.digest").digest()


class Workload:
    """``blocks`` random source blocks in one client slab, and ``batch`` blocks to read into.

    :meth:`run` puts every source block under fresh keys in batches, gets them
    back batch by batch, and compares every byte with its source (outside the
    timed calls).
    """

    def __init__(self, blocks: int, block_bytes: int, batch: int, seed: int = 0) -> None:
        self.blocks, self.block, self.batch = blocks, block_bytes, batch
        self.slab = Slab((blocks + batch) * block_bytes, block_bytes, lock=False)
        self.src = self.slab.alloc_many(blocks)
        self.dst = self.slab.alloc_many(batch)
        rng = np.random.default_rng(seed)
        for h in self.src:
            self.slab.numpy(h)[:] = np.frombuffer(rng.bytes(block_bytes), dtype=np.uint8)

    def batches(self) -> list[range]:
        return [range(i, min(i + self.batch, self.blocks)) for i in range(0, self.blocks,
                                                                          self.batch)]

    def put(self, client: KVClient | ClusterClient, keys: Sequence[bytes]) -> list[float]:
        times = []
        for b in self.batches():
            ks = [keys[i] for i in b]
            hs = [self.src[i] for i in b]
            ds = [digest_of(k) for k in ks]
            t0 = time.perf_counter()
            ok = client.put(ks, hs, self.block, ds)
            times.append(time.perf_counter() - t0)
            if not all(ok):
                raise BenchFailure(f"put stored {sum(ok)} of {len(ks)} blocks")
        return times

    def get(
        self, client: KVClient | ClusterClient, keys: Sequence[bytes],
        expect_hit: Callable[[int], bool] = lambda i: True,
    ) -> tuple[list[float], int, int]:
        """Batch times, bytes verified, misses (each miss must be expected)."""
        times, verified, misses = [], 0, 0
        for b in self.batches():
            ks = [keys[i] for i in b]
            hs = self.dst[: len(ks)]
            for h in hs:
                self.slab.numpy(h)[:] = 0
            t0 = time.perf_counter()
            sizes = client.get_sizes(ks, hs, [digest_of(k) for k in ks])
            times.append(time.perf_counter() - t0)
            for i, h, size in zip(b, hs, sizes, strict=True):
                if size is None:
                    if expect_hit(i):
                        raise BenchFailure(f"block {i} missed")
                    misses += 1
                    continue
                if not expect_hit(i):
                    raise BenchFailure(f"block {i} hit where a miss was expected")
                if size != self.block or not np.array_equal(
                    self.slab.numpy(h), self.slab.numpy(self.src[i])
                ):
                    raise BenchFailure(f"block {i}: bytes read back differ from those put")
                verified += size
        return times, verified, misses

    def warm_up(self, client: KVClient | ClusterClient, tag: str) -> None:
        """One untimed batch through ``client`` (connections, threads, node pages)."""
        n = min(self.batch, self.blocks)
        keys = make_keys(f"warm-{tag}", n)
        ds = [digest_of(k) for k in keys]
        client.put(keys, self.src[:n], self.block, ds)
        client.get(keys, self.dst[:n], ds)
        client.delete(keys)

    def delete(self, client: KVClient | ClusterClient, keys: Sequence[bytes]) -> None:
        for b in self.batches():
            client.delete([keys[i] for i in b])

    def close(self) -> None:
        self.slab.close()


class Series:
    """Batch times of one configuration over all its repeats."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.put: list[list[float]] = []
        self.get: list[list[float]] = []
        self.verified = 0

    def add(self, put: list[float], get: list[float], verified: int) -> None:
        self.put.append(put)
        self.get.append(get)
        self.verified += verified

    def summary(self, blocks: int, **more: Any) -> dict[str, Any]:
        def gbps(reps: list[list[float]]) -> list[float]:
            return [blocks * self.block / sum(r) / GB for r in reps]

        def pct(reps: list[list[float]], q: float) -> float:
            return round(float(np.percentile([t for r in reps for t in r], q)) * 1e3, 3)

        puts, gets = gbps(self.put), gbps(self.get)
        return {
            "put_gbps": round(max(puts), 3),
            "get_gbps": round(max(gets), 3),
            "put_p50_ms": pct(self.put, 50),
            "put_p99_ms": pct(self.put, 99),
            "get_p50_ms": pct(self.get, 50),
            "get_p99_ms": pct(self.get, 99),
            "median_put_gbps": round(float(np.median(puts)), 3),
            "median_get_gbps": round(float(np.median(gets)), 3),
            "batches": sum(map(len, self.put)),
            "bytes_verified": self.verified,
            **more,
        }


def start_nodes(args: argparse.Namespace, logdir: Path) -> list[LocalNodeProcess]:
    """Node i serves every config of at least i+1 nodes; its pool fits its share of
    the smallest one with slack. Started concurrently; all stopped if one fails."""
    def pool_blocks(i: int) -> int:
        n = next((c for c in NODE_COUNTS if c > i), None)
        share = 0 if n is None else math.ceil(args.blocks * POOL_SLACK / n)
        return int(min(share, args.blocks) + args.batch + POOL_SPARE_BLOCKS)

    def start(i: int) -> LocalNodeProcess:
        opts = {"pool-size": str(pool_blocks(i) * args.block_bytes),
                "block-size": str(args.block_bytes), "transport": "tcp"}
        return LocalNodeProcess(opts, stderr_path=logdir / f"node-{i}.stderr",
                                extra_args=["--no-lock"])

    count = max(NODE_COUNTS) + SPARE_NODES
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(start, i) for i in range(count)]
    nodes, errors = [], []
    for f in futures:
        try:
            nodes.append(f.result())
        except Exception as e:  # stop the others, then report
            errors.append(e)
    if errors:
        stop_nodes(nodes)
        raise errors[0]
    return nodes


def stop_nodes(nodes: Sequence[LocalNodeProcess]) -> None:
    for n in nodes:
        try:
            n.close()
        finally:
            n.kill()


def cluster_client(nodes: Sequence[LocalNodeProcess], slab: Slab) -> ClusterClient:
    return ClusterClient([n.endpoint for n in nodes], slab, transport="tcp",
                         timeout=CLIENT_TIMEOUT_S)


def check_counters(c: ClusterClient, name: str) -> None:
    bad = {k: v for k, v in c.counters.items() if v and k != "membership_changes"}
    if bad:
        raise BenchFailure(f"{name}: the cluster client saw node trouble: {bad}")


def run_data(args: argparse.Namespace, nodes: list[LocalNodeProcess]) -> dict[str, Any]:
    wl = Workload(args.blocks, args.block_bytes, args.batch)
    out: dict[str, Any] = {}
    steps = sum(args.repeats * (2 if n == 1 else 1) for n in NODE_COUNTS) + 1
    bar = tqdm(total=steps, desc="cluster bench", unit="run", file=sys.stderr)
    live_keys: list[bytes] = []  # the last 4-node repeat's keys, kept for live_4_to_5
    try:
        ref = Series(args.block_bytes)
        with KVClient(*nodes[0].address, wl.slab, transport="tcp",
                      timeout=CLIENT_TIMEOUT_S) as kv:
            wl.warm_up(kv, "kv")
            for n in NODE_COUNTS:
                series = Series(args.block_bytes)
                with cluster_client(nodes[:n], wl.slab) as cc:
                    wl.warm_up(cc, f"n{n}")
                    for rep in range(args.repeats):
                        runs: list[tuple[KVClient | ClusterClient, Series, str]] = [
                            (cc, series, f"n{n}-r{rep}")
                        ]
                        if n == 1:  # interleave the reference, alternating who goes first
                            runs.insert(rep % 2, (kv, ref, f"kv-r{rep}"))
                        for client, s, tag in runs:
                            keys = make_keys(tag, args.blocks)
                            put = wl.put(client, keys)
                            get, verified, _ = wl.get(client, keys)
                            s.add(put, get, verified)
                            last = n == max(NODE_COUNTS) and rep == args.repeats - 1
                            if last:
                                live_keys = keys
                            else:
                                wl.delete(client, keys)
                            bar.update()
                    check_counters(cc, f"nodes_{n}")
                    out[f"nodes_{n}"] = series.summary(args.blocks, nodes=n,
                                                       transport=cc.transport_name)
            out["kvclient_1"] = ref.summary(args.blocks, nodes=1, transport=kv.transport_name)
        out["live_4_to_5"] = live_move(wl, nodes, live_keys)
        bar.update()
    finally:
        bar.close()
        wl.close()
    return out


def live_move(wl: Workload, nodes: list[LocalNodeProcess], keys: list[bytes]) -> dict[str, Any]:
    """Read the 4-node keys through a 5-member client: exactly the newcomer's keys miss."""
    four, five = nodes[:4], nodes[:5]
    newcomer = five[-1].endpoint
    with cluster_client(five, wl.slab) as cc:
        owners = cc.owners(keys)
        on_new = {i for i, o in enumerate(owners) if o[0] == newcomer}
        _, verified, misses = wl.get(cc, keys, lambda i: i not in on_new)
        check_counters(cc, "live_4_to_5")
    with cluster_client(four, wl.slab) as cc:
        wl.delete(cc, keys)
    return {
        "keys": len(keys),
        "missed": misses,
        "placed_on_newcomer": len(on_new),
        "missed_fraction": round(misses / len(keys), 5),
        "only_newcomer_keys_missed": misses == len(on_new),
        "bytes_verified": verified,
    }


def ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    return {op: round(a[f"{op}_gbps"] / b[f"{op}_gbps"], 3) for op in ("put", "get")}


def meta(args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    return {
        "blocks": args.blocks,
        "block_bytes": args.block_bytes,
        "batch": args.batch,
        "repeats": args.repeats,
        "moves_keys": args.keys,
        "quick": args.quick,
        "transport": "tcp",
        "host": "127.0.0.1",
        **provenance(),
        "seconds": round(seconds, 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny run for CI/tests: "
                   + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--blocks", type=int, help=f"blocks per repeat (default {DEFAULT_BLOCKS})")
    p.add_argument("--block-bytes", type=int,
                   help=f"bytes per block (default {DEFAULT_BLOCK_BYTES})")
    p.add_argument("--batch", type=int, help=f"blocks per put/get call (default {DEFAULT_BATCH})")
    p.add_argument("--repeats", type=int,
                   help=f"repeats per node count (default {DEFAULT_REPEATS})")
    p.add_argument("--keys", type=int, help=f"keys for the moved fraction (default {DEFAULT_KEYS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the moved-fraction keys")
    p.add_argument("--out", type=Path, default=None,
                   help="write <out>/cluster.json (default: bench/results unless --quick)")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {
        "blocks": DEFAULT_BLOCKS, "block_bytes": DEFAULT_BLOCK_BYTES, "batch": DEFAULT_BATCH,
        "repeats": DEFAULT_REPEATS, "keys": DEFAULT_KEYS,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.out is None and not args.quick:
        args.out = RESULTS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rdmakv-bench-cluster-") as tmp:
        try:
            nodes = start_nodes(args, Path(tmp))
            try:
                data = run_data(args, nodes)
            finally:
                stop_nodes(nodes)
        except BenchFailure as e:
            print(f"bench/cluster.py: FAILED: {e}", file=sys.stderr)
            return 1
        except RdmakvError as e:
            print(f"bench/cluster.py: error: {e}", file=sys.stderr)
            return 1
    moves = placement_moves(args.keys, args.seed)
    if not (moves["only_newcomer_keys_moved"] and moves["only_newcomer_keys_moved_r2"]):
        print("bench/cluster.py: FAILED: keys moved between old nodes", file=sys.stderr)
        return 1
    out: dict[str, Any] = {f"nodes_{n}": data[f"nodes_{n}"] for n in NODE_COUNTS}
    out["kvclient_1"] = data["kvclient_1"]
    out["ratio_4_vs_1"] = ratio(data["nodes_4"], data["nodes_1"])
    out["split_cost_vs_kvclient"] = ratio(data["nodes_1"], data["kvclient_1"])
    out["moved_fraction_4_to_5"] = moves["moved_fraction_4_to_5"]
    out["moves"] = moves
    out["live_4_to_5"] = data["live_4_to_5"]
    out["bytes_verified"] = sum(
        v["bytes_verified"] for k, v in data.items() if isinstance(v, dict)
    )
    out["meta"] = meta(args, time.monotonic() - t0)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
