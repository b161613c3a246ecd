"""``rdmakv demo``: a generated KV workload through L1 and a local KV node.

Starts a real ``rdmakv serve`` child on 127.0.0.1 (default transport; with
``--local-nodes N``, N of them as a cluster; with ``--nodes``, uses running
nodes instead), then plays an inference-shaped workload against a
:class:`KVCacheManager`:

* *prefill*: requests share a few long "system prompt" prefixes and each adds
  a unique suffix; each request acquires its cached prefix and "computes" the
  missing blocks (fills them with KV derived from the block key), then puts them.
  The L1 is deliberately smaller than the working set, so it evicts, and the
  offload mode decides which blocks reach the node.
* *replay*: the same requests again; every hit block is checked byte for byte
  against the KV it must hold, whichever tier it came from.

It prints hits per tier, evictions, offload decisions, bytes and throughput, and
exits non-zero if any block came back wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.synthetic_kv import fill_kv, kv_matches
from rdmakv.config import CONFIG_ENV, env_var
from rdmakv.defaults import DEFAULT_OFFLOAD, DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import ConfigError
from rdmakv.node.process import LocalNodeProcess

Say = Callable[[str], None]
_NODE_ENV_PREFIX = env_var("node", "")


def _print(line: str) -> None:
    print(line, flush=True)


def _silent(line: str) -> None:
    pass


DEMO_NAMESPACE = KeyNamespace(model="rdmakv-demo", dtype="bfloat16", kv_layout="demo")
VOCAB = 32000


@dataclass
class DemoConfig:
    block_tokens: int = 16
    block_bytes: int = 256 * 1024
    l1_bytes: int = 32 * 1024 * 1024
    pool_bytes: int = 512 * 1024 * 1024
    prefixes: int = 8
    prefix_blocks: int = 32
    requests: int = 64
    suffix_blocks: int = 8
    policy: str = "s3fifo"
    offload: str = DEFAULT_OFFLOAD
    offload_budget: float | None = None
    transport: str = "auto"
    seed: int = 0
    local_nodes: int = 1
    nodes: str | None = None
    """Running nodes to use (``rdmakv.client.remote`` address) instead of local ones."""
    token: bytes | None = None
    replication: int = DEFAULT_REPLICATION
    streams: int | None = None
    """Connections to one node, a large batch split across them (None: 2 over
    RDMA; over TCP 2 on a host of 2 usable CPUs or more, else 1)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds any remote wait may take."""


def make_requests(cfg: DemoConfig) -> list[np.ndarray]:
    """Token sequences: a Zipf-popular shared prefix plus a unique suffix each."""
    rng = np.random.default_rng(cfg.seed)
    bt = cfg.block_tokens
    prefixes = [
        rng.integers(0, VOCAB, cfg.prefix_blocks * bt, dtype=np.int32) for _ in range(cfg.prefixes)
    ]
    popularity = 1.0 / np.arange(1, cfg.prefixes + 1)
    popularity /= popularity.sum()
    out = []
    for _ in range(cfg.requests):
        p = prefixes[rng.choice(cfg.prefixes, p=popularity)]
        suffix = rng.integers(0, VOCAB, cfg.suffix_blocks * bt, dtype=np.int32)
        out.append(np.concatenate([p, suffix]))
    return out


def run(cfg: DemoConfig, *, quiet: bool = False) -> dict[str, object]:
    say: Say = _silent if quiet else _print
    requests = make_requests(cfg)
    total_blocks = sum(len(r) // cfg.block_tokens for r in requests)
    say(
        f"[demo] workload: {len(requests)} requests, {cfg.prefixes} shared prefixes of "
        f"{cfg.prefix_blocks} blocks + {cfg.suffix_blocks} unique blocks each; "
        f"block = {cfg.block_tokens} tokens / {cfg.block_bytes // 1024} KiB; "
        f"L1 = {cfg.l1_bytes >> 20} MiB ({cfg.policy}, offload {cfg.offload})"
    )
    with contextlib.ExitStack() as stack:
        remote = cfg.nodes or _start_local_nodes(cfg, stack, say)
        with KVCacheManager(
            namespace=DEMO_NAMESPACE,
            block_tokens=cfg.block_tokens,
            block_bytes=cfg.block_bytes,
            l1_bytes=cfg.l1_bytes,
            node=remote,
            transport=cfg.transport,
            token=cfg.token,
            replication=cfg.replication,
            streams=cfg.streams,
            timeout=cfg.timeout,
            policy=cfg.policy,
            offload=cfg.offload,
            offload_budget=cfg.offload_budget,
            # The demo "computes" KV far faster than a GPU would; let a whole L1's
            # worth be in flight so back-pressure does not drop most offloads.
            max_pending_offload_bytes=cfg.l1_bytes,
            lock_slab=False,
        ) as mgr:
            say(f"[demo] client transport: {mgr.transport_name}")
            prefill = _prefill(mgr, requests, say)
            mgr.flush()
            off = mgr.offloader
            say(
                f"[demo] offload ({cfg.offload}): {mgr.l1.stats.offloads} blocks queued "
                "for the node, "
                f"{mgr.l1.stats.offloads_dropped} dropped by back-pressure, "
                f"{off.sent_blocks if off else 0} stored on the node "
                f"({(off.sent_bytes if off else 0) / 2**20:.1f} MiB), "
                f"{mgr.l1.stats.evictions} L1 evictions"
            )
            replay = _replay(mgr, requests, say)
            summary: dict[str, object] = {
                "transport": mgr.transport_name,
                "blocks_in_workload": total_blocks,
                "prefill": prefill,
                "replay": replay,
                "l1": asdict(mgr.l1.stats),
                "manager": asdict(mgr.stats),
                "offload_sent_blocks": off.sent_blocks if off else 0,
                "offload_failed_blocks": off.failed_blocks if off else 0,
            }
    return summary


def _start_local_nodes(cfg: DemoConfig, stack: contextlib.ExitStack, say: Say) -> str:
    """Start ``cfg.local_nodes`` nodes sharing ``cfg.pool_bytes``; their address list."""
    if cfg.local_nodes < 1:
        raise ConfigError(f"local nodes must be >= 1, got {cfg.local_nodes}")
    pool = max(cfg.block_bytes, cfg.pool_bytes // cfg.local_nodes)
    endpoints = []
    for _ in range(cfg.local_nodes):
        with _without_node_settings():
            node = stack.enter_context(
                LocalNodeProcess(
                    {"pool-size": str(pool), "block-size": str(cfg.block_bytes),
                     "transport": cfg.transport},
                    extra_args=["--no-lock"],
                )
            )
        say(f"[demo] {node.ready_line}")
        endpoints.append(node.endpoint)
    return ",".join(endpoints)


@contextlib.contextmanager
def _without_node_settings() -> Iterator[None]:
    """Hide RDMAKV_CONFIG and RDMAKV_NODE_* from the demo's own nodes while they start.

    Those configure a production node: its token file (the demo's client would
    not send the token) or one fixed metrics port (the second local node could
    not bind it). The nodes inherit our environment, so it is scrubbed around
    the start (single-threaded here) and restored after.
    """
    hidden = {
        k: v for k, v in os.environ.items() if k == CONFIG_ENV or k.startswith(_NODE_ENV_PREFIX)
    }
    for k in hidden:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(hidden)


def _prefill(mgr: KVCacheManager, requests: list[np.ndarray], say: Say) -> dict[str, float]:
    t0 = time.perf_counter()
    computed = reused = 0
    for tokens in requests:
        got = mgr.acquire(tokens)
        keys = mgr.keyer.keys(tokens)
        missing = len(keys) - got.num_blocks
        reused += got.num_blocks
        mgr.release(got)
        handles = mgr.allocate_for(missing)
        for h, key in zip(handles, keys[got.num_blocks :], strict=True):
            fill_kv(mgr.block_view(h), key)
        mgr.put(tokens, handles, first_block=got.num_blocks)
        computed += missing
    dt = time.perf_counter() - t0
    say(f"[demo] prefill: {computed} blocks computed, {reused} reused from cache, {dt:.2f}s")
    return {"computed_blocks": computed, "reused_blocks": reused, "seconds": dt}


def _replay(mgr: KVCacheManager, requests: list[np.ndarray], say: Say) -> dict[str, float]:
    t0 = time.perf_counter()
    l1 = l2 = missed = wrong = 0
    l2_seconds = 0.0
    for tokens in requests:
        keys = mgr.keyer.keys(tokens)
        s = time.perf_counter()
        got = mgr.acquire(tokens)
        if got.l2_blocks:
            l2_seconds += time.perf_counter() - s
        l1 += got.l1_blocks
        l2 += got.l2_blocks
        missed += len(keys) - got.num_blocks
        for h, key in zip(got.handles, keys, strict=False):
            wrong += not kv_matches(mgr.block_view(h), key)
        mgr.release(got)
    dt = time.perf_counter() - t0
    l2_bytes = l2 * mgr.block_bytes
    return {
        "l1_hit_blocks": l1,
        "l2_hit_blocks": l2,
        "missed_blocks": missed,
        "wrong_blocks": wrong,
        "seconds": dt,
        "l2_bytes": l2_bytes,
        "l2_gbps": (l2_bytes / l2_seconds / 1e9) if l2_seconds else 0.0,
    }


def main(cfg: DemoConfig, *, as_json: bool = False) -> int:
    """Run the demo, print its summary (and the JSON with ``as_json``); 1 if any block was wrong."""
    summary = run(cfg)
    r = summary["replay"]
    assert isinstance(r, dict)
    total = r["l1_hit_blocks"] + r["l2_hit_blocks"] + r["missed_blocks"]
    print(
        f"[demo] replay: {r['l1_hit_blocks']} L1 hits, {r['l2_hit_blocks']} node hits, "
        f"{r['missed_blocks']} misses of {total} blocks; "
        f"{r['l2_bytes'] / 2**20:.1f} MiB from the node at {r['l2_gbps']:.2f} GB/s; "
        f"{r['wrong_blocks']} wrong blocks",
        flush=True,
    )
    if as_json:
        print(json.dumps(summary, indent=2))
    return 1 if r["wrong_blocks"] else 0
