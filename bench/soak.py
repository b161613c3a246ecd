"""Soak test: N client processes hammer one node for M minutes; every value is verified.

Each client process runs mixed batches of random sizes -- put, get, exists,
delete -- over one shared key space (``--keys`` keys) through its own
:class:`~rdmakv.client.node_client.KVClient`; ``--manager-clients`` of them instead go
through a :class:`~rdmakv.engine.manager.KVCacheManager` (small L1, every block
offloaded), putting and acquiring token sequences. A key's value is a pure
function of the key (its length and bytes; the first 8 bytes carry the key
number), so EVERY value read back is checked byte for byte: a hit with the
wrong length or bytes is a *wrong value* (0 required). KVClient's own value
checksum turns corrupted bytes into misses; those are counted too
(``checksum_mismatches``, 0 required). Misses are fine (the
pool is smaller than the key space, so the node evicts, and clients delete
each other's keys); puts refused for space or a concurrent writer are fine.

Every ``--interval`` seconds the main process samples the node: its RSS
(``/proc/PID/status`` VmRSS; only for a node this script started, or with
``--node-pid``) and ``stats()`` (entries, pending, leases_active,
sessions_active, evictions, the refusal counters), and prints one progress
line on stderr. When the clients are done and closed, the node must settle
to no leases and no uncommitted extents (anything left is leaked) and only
this script's own session.

Output: one JSON object on stdout (config, totals, rates, RSS figures, the
samples, the final node stats, ``meta`` with provenance) and
``<--out>/<--name>.json`` plus ``<--name>.png`` (RSS and ops/s over time).
Exit status 1 on any wrong value or checksum mismatch, leaked lease or
extent, or a client process that crashed; 2 on a bad option.

Usage: ``python bench/soak.py [--clients 4] [--manager-clients 1] [--minutes 10]
[--block-size 64KiB] [--keys 4096] [--max-batch 32] [--pool-size SIZE]
[--node HOST:PORT [--node-pid PID] [--token-file F]] [--interval 5]
[--name soak] [--out bench/results] [--seed 0]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.config import parse_size
from rdmakv.errors import RdmakvError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
KIB = 1024
MIB = 1024 * 1024
DEFAULTS = {"clients": 4, "manager_clients": 1, "minutes": 10.0, "block_size": "64KiB",
            "keys": 4096, "max_batch": 32, "interval": 5.0}
OP_WEIGHTS = {"put": 35, "get": 40, "exists": 15, "delete": 10}
CLIENT_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 30.0
"""How long the node may take, after the clients closed, to end their sessions."""
JOIN_GRACE_S = 120.0
"""How long a client may run past the deadline (its last batch, closing) before it is killed."""
MANAGER_BLOCK_TOKENS = 16
MANAGER_SEQ_BLOCKS = (1, 8)  # blocks per token sequence, min and max
MAX_WRONG_DETAILS = 5
REPORT_S = 0.5
"""Clients report their counts this often, so each sample's rate covers its interval."""
REFUSAL_KEYS = ("protocol_errors", "refused_over_limit", "refused_timeout",
                "refused_bad_token", "lease_refusals")


class SoakFailure(Exception):
    """Wrong values, leaked leases or extents, or a crashed client: exit 1."""


# -- deterministic values ---------------------------------------------------------------------


def _mix(i: int) -> int:
    """A 64-bit hash of ``i`` (splitmix64): sizes and offsets per key."""
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class Values:
    """Key ``i``'s value: a slice of a seeded random pattern at an offset and length
    given by ``i``, its first 8 bytes the key number. Same in every process."""

    def __init__(self, block: int, seed: int) -> None:
        self.block = block
        self.pattern = np.random.default_rng(seed).integers(0, 256, 2 * block, dtype=np.uint8)
        self._digests: dict[int, bytes] = {}

    def size(self, i: int) -> int:
        h = _mix(i)
        if h % 16 == 0:  # some tiny values
            return 1 + (h >> 8) % 64
        return self.block - (h >> 8) % (self.block // 2)

    def value(self, i: int) -> np.ndarray:
        n = self.size(i)
        start = (_mix(i) >> 20) % self.block
        out = self.pattern[start : start + n].copy()
        stamp = np.frombuffer(struct.pack("<Q", i), dtype=np.uint8)[: min(8, n)]
        out[: len(stamp)] = stamp
        return out

    def digest(self, i: int) -> bytes:
        d = self._digests.get(i)
        if d is None:
            d = hashlib.blake2b(self.value(i).tobytes(), digest_size=16).digest()
            self._digests[i] = d
        return d


def key_of(i: int) -> bytes:
    return b"soak/%08d" % i


# -- client processes --------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    index: int
    host: str
    port: int
    token: bytes | None
    block: int
    keys: int
    max_batch: int
    seed: int
    deadline: float  # time.time() at which to stop
    interval: float  # seconds between progress reports
    manager: bool


def _new_counts() -> Counter[str]:
    return Counter()


def kv_worker(spec: WorkerSpec, out: Any) -> None:
    """Mixed batches through a KVClient until the deadline; counts go to ``out``
    every interval (cumulative) and once more at the end (``final``)."""
    rng = random.Random(spec.seed * 1000 + spec.index)
    vals = Values(spec.block, spec.seed)
    slab = Slab(spec.max_batch * spec.block, spec.block, lock=False)
    handles = slab.alloc_many(spec.max_batch)
    counts = _new_counts()
    wrong: list[str] = []
    ops, weights = zip(*OP_WEIGHTS.items(), strict=True)
    client = KVClient(spec.host, spec.port, slab, token=spec.token, transport="tcp",
                      timeout=CLIENT_TIMEOUT_S)
    next_report = time.time() + spec.interval
    try:
        while time.time() < spec.deadline:
            op = rng.choices(ops, weights)[0]
            n = rng.randint(1, spec.max_batch)
            ids = rng.sample(range(spec.keys), n)
            keys = [key_of(i) for i in ids]
            hs = handles[:n]
            try:
                if op == "put":
                    sizes = [vals.size(i) for i in ids]
                    for i, h, size in zip(ids, hs, sizes, strict=True):
                        slab.numpy(h)[:size] = vals.value(i)
                    stored = client.put(keys, hs, sizes, [vals.digest(i) for i in ids])
                    counts["put_stored"] += sum(stored)
                    counts["put_bytes"] += sum(s for s, ok in zip(sizes, stored, strict=True)
                                               if ok)
                elif op == "get":
                    got = client.get_sizes(keys, hs, [vals.digest(i) for i in ids])
                    for i, h, n_read in zip(ids, hs, got, strict=True):
                        if n_read is None:
                            counts["get_misses"] += 1
                            continue
                        counts["get_hits"] += 1
                        counts["get_bytes"] += n_read
                        want = vals.value(i)
                        if n_read != len(want) or not np.array_equal(slab.numpy(h)[:n_read],
                                                                      want):
                            counts["wrong_values"] += 1
                            if len(wrong) < MAX_WRONG_DETAILS:
                                wrong.append(f"client {spec.index}: key {i}: {n_read} bytes "
                                             f"read, {len(want)} expected, bytes differ")
                elif op == "exists":
                    counts["exists_present"] += sum(client.exists(keys))
                else:
                    counts["deleted"] += sum(client.delete(keys))
                counts[f"{op}_batches"] += 1
                counts[f"{op}_keys"] += n
            except RdmakvError as e:
                counts["errors"] += 1
                counts[f"error_{type(e).__name__}"] += 1
            counts["checksum_mismatches"] = getattr(client, "checksum_mismatches", 0)
            if time.time() >= next_report:
                out.put(("progress", spec.index, dict(counts), wrong))
                next_report += spec.interval
    finally:
        counts["checksum_mismatches"] = getattr(client, "checksum_mismatches", 0)
        client.close()
        slab.close()
    out.put(("final", spec.index, dict(counts), wrong))


def manager_worker(spec: WorkerSpec, out: Any) -> None:
    """Token sequences through a KVCacheManager: put (offloaded to the node), then
    acquire (L1 is 8 blocks: most blocks come back from the node), every block
    checked against the bytes its key stands for."""
    from rdmakv.blocks.keys import KeyNamespace
    from rdmakv.engine.manager import KVCacheManager

    rng = random.Random(spec.seed * 1000 + spec.index)
    pattern = np.random.default_rng(spec.seed + 1).integers(0, 256, 2 * spec.block,
                                                            dtype=np.uint8)

    def content(key: bytes) -> np.ndarray:
        start = int.from_bytes(key[:8], "little") % spec.block
        return pattern[start : start + spec.block]

    counts = _new_counts()
    wrong: list[str] = []
    mgr = KVCacheManager(
        namespace=KeyNamespace(model="soak", dtype="uint8", kv_layout=f"seed{spec.seed}"),
        block_tokens=MANAGER_BLOCK_TOKENS, block_bytes=spec.block, l1_bytes=8 * spec.block,
        node=f"{spec.host}:{spec.port}", transport="tcp", offload="all", token=spec.token,
        timeout=CLIENT_TIMEOUT_S, lock_slab=False,
    )
    sequences = max(8, spec.keys // 16)  # few enough that acquires find what was put
    next_report = time.time() + spec.interval
    try:
        while time.time() < spec.deadline:
            seq = rng.randrange(sequences)
            nblocks = MANAGER_SEQ_BLOCKS[0] + _mix(seq) % MANAGER_SEQ_BLOCKS[1]
            tokens = np.random.default_rng(seq).integers(
                0, 32000, nblocks * MANAGER_BLOCK_TOKENS, dtype=np.int32)
            chain = mgr.keyer.chain(tokens)
            if rng.random() < 0.4:
                try:
                    hs = mgr.allocate_for(len(chain))
                except RdmakvError:
                    counts["errors"] += 1
                    continue
                for (_, key, _), h in zip(chain, hs, strict=True):
                    mgr.block_view(h)[:] = content(key)
                counts["mgr_put_blocks"] += mgr.put(tokens, hs, keep=True)
                counts["mgr_put_batches"] += 1
            else:
                got = mgr.acquire(tokens)
                try:
                    for (_, key, _), h in zip(chain, got.handles, strict=False):
                        if not np.array_equal(mgr.block_view(h), content(key)):
                            counts["wrong_values"] += 1
                            if len(wrong) < MAX_WRONG_DETAILS:
                                wrong.append(f"manager client {spec.index}: sequence {seq}: "
                                             "an acquired block holds other bytes")
                    counts["mgr_acquire_batches"] += 1
                    counts["mgr_acquired_blocks"] += got.num_blocks
                    counts["mgr_node_blocks"] += got.l2_blocks
                    counts["get_bytes"] += got.l2_blocks * spec.block
                finally:
                    mgr.release(got)
            if time.time() >= next_report:
                counts["mgr_l2_errors"] = mgr.stats.l2_errors
                counts["checksum_mismatches"] = getattr(mgr.client, "checksum_mismatches", 0)
                out.put(("progress", spec.index, dict(counts), wrong))
                next_report += spec.interval
    finally:
        mgr.flush(CLIENT_TIMEOUT_S)
        counts["mgr_l2_errors"] = mgr.stats.l2_errors
        counts["checksum_mismatches"] = getattr(mgr.client, "checksum_mismatches", 0)
        mgr.close()
    out.put(("final", spec.index, dict(counts), wrong))


def run_worker(spec: WorkerSpec, out: Any) -> None:
    try:
        (manager_worker if spec.manager else kv_worker)(spec, out)
    except BaseException as e:  # reported, then the exit status says it crashed
        out.put(("crash", spec.index, {}, [f"client {spec.index} crashed: {e!r}"]))
        raise


# -- the main process --------------------------------------------------------------------------


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


BATCH_OPS = ("put", "get", "exists", "delete", "mgr_put", "mgr_acquire")


def total_batches(c: Counter[str] | dict[str, int]) -> int:
    return sum(c.get(f"{op}_batches", 0) for op in BATCH_OPS)


def total_keys(c: Counter[str] | dict[str, int]) -> int:
    return (sum(c.get(f"{op}_keys", 0) for op in OP_WEIGHTS) + c.get("mgr_put_blocks", 0)
            + c.get("mgr_acquired_blocks", 0))


def node_sample(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: stats.get(k) for k in ("entries", "pending", "leases_active", "sessions_active",
                                      "evictions", "blocks_used", "blocks_total")}
    out["refused"] = {k: stats[k] for k in REFUSAL_KEYS if k in stats}
    return out


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.samples: list[dict[str, Any]] = []
        self.latest: dict[int, dict[str, int]] = {}
        self.final: dict[int, dict[str, int]] = {}
        self.wrong: list[str] = []
        self.crashed: list[str] = []

    def drain(self, q: Any, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                kind, idx, counts, wrong = q.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return
            self.latest[idx] = counts
            for w in wrong:
                if w not in self.wrong:
                    self.wrong.append(w)
            if kind == "final":
                self.final[idx] = counts
            elif kind == "crash":
                self.crashed.extend(wrong)
            if time.monotonic() >= end:
                return

    def totals(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for counts in self.latest.values():
            c.update(counts)
        return c

    def run(self, host: str, port: int, token: bytes | None, pid: int | None) -> dict[str, Any]:
        a = self.args
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        t0 = time.time()
        deadline = t0 + a.minutes * 60
        specs = [
            WorkerSpec(i, host, port, token, a.block_bytes, a.keys, a.max_batch, a.seed,
                       deadline, min(REPORT_S, a.interval / 2), manager=i < a.manager_clients)
            for i in range(a.clients)
        ]
        procs = [ctx.Process(target=run_worker, args=(s, q), name=f"soak-client-{s.index}")
                 for s in specs]
        control = KVClient(host, port, None, token=token, transport="tcp",
                           timeout=CLIENT_TIMEOUT_S)
        try:
            self.sample(control, pid, t0, 0, 0)
            for p in procs:
                p.start()
            prev_batches = prev_keys = 0
            while any(p.is_alive() for p in procs) and time.time() < deadline + JOIN_GRACE_S:
                self.drain(q, a.interval)
                tot = self.totals()
                self.sample(control, pid, t0, total_batches(tot) - prev_batches,
                            total_keys(tot) - prev_keys)
                prev_batches, prev_keys = total_batches(tot), total_keys(tot)
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    self.crashed.append(f"{p.name} did not stop; killed")
                elif p.exitcode != 0:
                    self.crashed.append(f"{p.name} exited with {p.exitcode}")
            self.drain(q, 1.0)
            settled = self.settle(control)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            control.close()
        return self.report(t0, settled, pid)

    def sample(self, control: KVClient, pid: int | None, t0: float, batches: int,
               keys: int) -> None:
        now = time.time()
        dt = now - (t0 + self.samples[-1]["t_s"]) if self.samples else 0.0
        try:
            node = node_sample(control.stats())
        except RdmakvError as e:
            node = {"error": str(e)}
        rss = rss_kib(pid)
        tot = self.totals()
        s = {
            "t_s": round(now - t0, 2),
            "rss_mib": None if rss is None else round(rss / 1024, 2),
            "batches_per_s": round(batches / dt, 1) if dt > 0 else 0.0,
            "keys_per_s": round(keys / dt, 1) if dt > 0 else 0.0,
            "wrong_values": tot["wrong_values"],
            "errors": tot["errors"],
            "node": node,
        }
        self.samples.append(s)
        if len(self.samples) > 1:
            print(
                f"soak {s['t_s']:7.1f}s: {s['batches_per_s']:8.1f} batches/s "
                f"{s['keys_per_s']:9.1f} keys/s  RSS {s['rss_mib']} MiB  "
                f"entries {node.get('entries')} leases {node.get('leases_active')} "
                f"sessions {node.get('sessions_active')} wrong {s['wrong_values']} "
                f"errors {s['errors']}",
                file=sys.stderr, flush=True,
            )

    def settle(self, control: KVClient) -> dict[str, Any]:
        """Wait until only our control session is left; its stats then."""
        end = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            stats = control.stats()
            done = stats.get("sessions_active") == 1
            if done or time.monotonic() > end:
                return {"settled": done, **node_sample(stats), "stats": stats}
            time.sleep(0.1)

    def report(self, t0: float, settled: dict[str, Any], pid: int | None) -> dict[str, Any]:
        a = self.args
        tot = self.totals()
        seconds = time.time() - t0
        rss = [s["rss_mib"] for s in self.samples if s["rss_mib"] is not None]
        half = rss[len(rss) // 2 :]
        span = (self.samples[-1]["t_s"] - self.samples[len(self.samples) - len(half)]["t_s"]
                if half and len(half) > 1 else 0.0)
        stats = settled.pop("stats")
        leaks = {"leases_active": settled["leases_active"], "pending": settled["pending"]}
        return {
            "config": {
                "clients": a.clients, "manager_clients": a.manager_clients,
                "minutes": a.minutes, "block_bytes": a.block_bytes, "keys": a.keys,
                "max_batch": a.max_batch, "pool_bytes": stats.get("pool_bytes"),
                "interval_s": a.interval, "seed": a.seed, "node": a.node or "started here",
                "op_weights": OP_WEIGHTS,
            },
            "seconds": round(seconds, 1),
            "totals": dict(sorted(tot.items())),
            "batches": total_batches(tot),
            "keys_touched": total_keys(tot),
            "batches_per_s": round(total_batches(tot) / seconds, 1),
            "keys_per_s": round(total_keys(tot) / seconds, 1),
            "values_verified": tot["get_hits"] + tot["mgr_acquired_blocks"],
            "wrong_values": tot["wrong_values"],
            "wrong_details": self.wrong,
            # bytes that failed the client's own value checksum: returned as misses,
            # so never wrong KV, but corruption on the node or the wire all the same
            "checksum_mismatches": tot["checksum_mismatches"],
            "errors": tot["errors"],
            "crashed": self.crashed,
            "rss_mib": {
                "first": rss[0] if rss else None,
                "last": rss[-1] if rss else None,
                "max": max(rss) if rss else None,
                "growth_second_half_mib_per_min": (
                    round((half[-1] - half[0]) / span * 60, 3) if span > 0 else None
                ),
            },
            "after_close": settled,
            "leaked": leaks,
            "samples": self.samples,
            "meta": {**provenance(), "node_pid_sampled": pid is not None},
        }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"][1:]
    t = [s["t_s"] / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    rss = [s["rss_mib"] for s in samples]
    if any(r is not None for r in rss):
        ax1.plot(t, [r if r is not None else float("nan") for r in rss], color="tab:red")
    ax1.set_ylabel("node RSS (MiB)")
    c = result["config"]
    ax1.set_title(
        f"soak: {c['clients']} clients ({c['manager_clients']} via KVCacheManager), "
        f"{c['block_bytes'] // KIB} KiB blocks, {c['keys']} keys; "
        f"wrong values {result['wrong_values']}, leaked leases {result['leaked']['leases_active']}"
    )
    ax1.grid(alpha=0.3)
    ax2.plot(t, [s["batches_per_s"] for s in samples], color="tab:blue")
    ax2.set_ylabel("batches/s (all clients)", color="tab:blue")
    ax3 = ax2.twinx()
    ax3.plot(t, [s["keys_per_s"] for s in samples], color="tab:green")
    ax3.set_ylabel("keys/s (all clients)", color="tab:green")
    ax2.set_xlabel("minutes")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=DEFAULTS["clients"],
                   help=f"client processes (default {DEFAULTS['clients']})")
    p.add_argument("--manager-clients", type=int, default=DEFAULTS["manager_clients"],
                   help="of those, how many go through KVCacheManager "
                   f"(default {DEFAULTS['manager_clients']})")
    p.add_argument("--minutes", type=float, default=DEFAULTS["minutes"],
                   help=f"duration (default {DEFAULTS['minutes']})")
    p.add_argument("--block-size", default=DEFAULTS["block_size"],
                   help=f"value / block size (default {DEFAULTS['block_size']})")
    p.add_argument("--keys", type=int, default=DEFAULTS["keys"],
                   help=f"shared key space (default {DEFAULTS['keys']})")
    p.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"],
                   help=f"largest batch (default {DEFAULTS['max_batch']})")
    p.add_argument("--pool-size", default=None,
                   help="pool of the node started here (default: half the key space's bytes)")
    p.add_argument("--node", default=None, metavar="HOST:PORT",
                   help="soak a running node instead of starting one")
    p.add_argument("--node-pid", type=int, default=None,
                   help="with --node: the node's pid, for RSS samples")
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument("--interval", type=float, default=DEFAULTS["interval"],
                   help=f"seconds between samples (default {DEFAULTS['interval']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="soak", help="results name (default soak)")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="where <name>.json and <name>.png go (default bench/results)")
    args = p.parse_args(argv)
    try:
        args.block_bytes = parse_size(args.block_size)
        args.pool_bytes = parse_size(args.pool_size) if args.pool_size else None
    except RdmakvError as e:
        p.error(str(e))
    if args.clients < 1 or not 0 <= args.manager_clients <= args.clients:
        p.error("--clients must be >= 1 and --manager-clients within [0, clients]")
    if args.minutes <= 0 or args.interval <= 0:
        p.error("--minutes and --interval must be > 0")
    if args.keys < args.max_batch or args.max_batch < 1:
        p.error("--max-batch must be >= 1 and --keys >= --max-batch")
    if args.block_bytes < 128:
        p.error("--block-size must be at least 128 bytes")
    if args.node_pid is not None and args.node is None:
        p.error("--node-pid goes with --node")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = args.token_file.read_bytes().strip() if args.token_file else None
    node: LocalNodeProcess | None = None
    with tempfile.TemporaryDirectory(prefix="rdmakv-soak-") as tmp:
        try:
            if args.node is None:
                pool = args.pool_bytes or max(64 * args.block_bytes,
                                              args.keys * args.block_bytes // 2)
                opts = {"pool-size": str(pool), "block-size": str(args.block_bytes),
                        "transport": "tcp"}
                if token is not None:
                    (Path(tmp) / "token").write_bytes(token)
                    opts["token-file"] = str(Path(tmp) / "token")
                node = LocalNodeProcess(opts, stderr_path=Path(tmp) / "node.stderr",
                                        extra_args=["--no-lock"])
                host, port = node.address
                pid = node.proc.pid if node.proc else None
            else:
                host, _, port_s = args.node.rpartition(":")
                port, pid = int(port_s), args.node_pid
            result = Soak(args).run(host, port, token, pid)
        except RdmakvError as e:
            print(f"bench/soak.py: error: {e}", file=sys.stderr)
            return 1
        finally:
            if node is not None:
                node.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{args.name}.png")
    print(json.dumps(result))
    problems = []
    if result["wrong_values"]:
        problems.append(f"{result['wrong_values']} wrong values: {result['wrong_details']}")
    if result["checksum_mismatches"]:
        problems.append(f"{result['checksum_mismatches']} values read back failed their "
                        "checksum (corrupted on the node or the wire)")
    if result["leaked"]["leases_active"] or result["leaked"]["pending"]:
        problems.append(f"leaked after every client closed: {result['leaked']}")
    if not result["after_close"]["settled"]:
        problems.append("the clients' sessions did not end on the node")
    if result["crashed"]:
        problems.append(f"client processes failed: {result['crashed']}")
    for problem in problems:
        print(f"bench/soak.py: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
