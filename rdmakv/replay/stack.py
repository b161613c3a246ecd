"""The real-stack replay: a trace through a real ``rdmakv serve`` and the real manager.

One engine's :class:`~rdmakv.engine.manager.KVCacheManager` talks to a real node
process over the chosen transport, with real bytes (``block_bytes`` per block,
scaled down from a model's KV so a trace fits this machine). Each request does
what an engine does: ``exists`` (the scheduler's hit count), ``acquire`` capped
at it, a byte-for-byte check of every block it got, ``release``, then
``allocate_for`` / fill / ``put`` of the blocks it had to compute. Requests
arrive at their trace timestamps divided by ``speedup`` (None: back to back).

``sync=True`` (the default) waits for each request's offloads to reach the
node before the next request, so no offload is dropped by back-pressure and
the counts equal :func:`rdmakv.replay.fast.replay_model`'s (a test holds them
to it). ``sync=False`` lets offloads overlap the next requests as in
production; drops then show in the result.
"""

from __future__ import annotations

import time
from typing import Any

from rdmakv.blocks.synthetic_kv import fill_kv, kv_matches
from rdmakv.engine.l1 import OffloadPolicy
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import ConfigError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.replay.fast import PROGRESS_EVERY, Progress, check_setup, pending_room, replay_hint
from rdmakv.replay.result import ReplayResult, ReplaySetup
from rdmakv.replay.trace import OracleOffload, TraceKeys

DEFAULT_STACK_BLOCK_BYTES = 16 * 1024
FLUSH_TIMEOUT_S = 30.0


def replay_stack(
    keys: TraceKeys,
    setup: ReplaySetup,
    *,
    block_bytes: int = DEFAULT_STACK_BLOCK_BYTES,
    transport: str = "tcp",
    speedup: float | None = None,
    sync: bool = True,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``keys.trace`` through a fresh local node; see the module docstring."""
    check_setup(setup)
    if setup.engines != 1:
        raise ConfigError(
            f"the stack replay runs one engine, got engines={setup.engines} "
            "(replay fleets with the model)"
        )
    if block_bytes < 64 or block_bytes % 8:
        raise ConfigError(f"block_bytes must be a multiple of 8 and >= 64, got {block_bytes}")
    if speedup is not None and speedup <= 0:
        raise ConfigError(f"speedup must be positive, got {speedup}")
    room = pending_room(keys)
    node_blocks = setup.node_blocks if setup.node_blocks is not None else keys.unique_blocks
    # The pool also holds the extents of one put being written (uncommitted).
    pool_blocks = node_blocks + (room if setup.node_blocks is None else 0)
    offload: str | OffloadPolicy = setup.offload
    oracle: OracleOffload | None = None
    if setup.offload == "oracle":
        offload = oracle = OracleOffload(keys)
    result = ReplayResult(setup)
    trace = keys.trace
    with LocalNodeProcess(
        {
            "pool-size": str(pool_blocks * block_bytes),
            "block-size": str(block_bytes),
            "transport": transport,
        },
        extra_args=["--no-lock"],
    ) as node, KVCacheManager(
        namespace=keys.keyer.namespace,
        block_tokens=trace.block_tokens,
        block_bytes=block_bytes,
        l1_bytes=setup.l1_blocks * block_bytes,
        node=node.endpoint,
        transport=transport,
        policy=setup.policy,
        offload=offload,
        offload_budget=setup.offload_budget,
        max_pending_offload_bytes=room * block_bytes,
        lock_slab=False,
    ) as mgr:
        assert mgr.client is not None
        commits_before = int(mgr.client.stats()["commits"])
        t0 = time.monotonic()
        ts0 = trace[0].timestamp_ms if len(trace) else 0
        lag = 0.0
        unsettled = 0
        for r, req in enumerate(trace):
            if speedup is not None:
                due = t0 + (req.timestamp_ms - ts0) / 1000.0 / speedup
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    lag = max(lag, -wait)
            if oracle is not None:
                oracle.now = r
            block_keys = keys.keys[r]
            keep = replay_hint(keys, setup, r)
            tokens = trace.prompt_tokens(req)
            got = mgr.acquire(tokens, max_tokens=mgr.exists(tokens))
            try:
                for h, k in zip(got.handles, block_keys, strict=False):
                    result.wrong_blocks += not kv_matches(mgr.block_view(h), k)
            finally:
                mgr.release(got)
            done = got.num_blocks
            handles = mgr.allocate_for(len(block_keys) - done)
            for h, k in zip(handles, block_keys[done:], strict=True):
                fill_kv(mgr.block_view(h), k)
            mgr.put(tokens, handles, first_block=done, keep=keep)
            if sync and not mgr.flush(FLUSH_TIMEOUT_S):
                unsettled += 1
            result.count_request(req.timestamp_ms, len(block_keys), got.l1_blocks, got.l2_blocks)
            if progress is not None and (r + 1) % PROGRESS_EVERY == 0:
                progress(PROGRESS_EVERY)
        if progress is not None:
            progress(len(trace) % PROGRESS_EVERY)
        mgr.flush(FLUSH_TIMEOUT_S)
        stats = mgr.client.stats()
        result.sent_blocks = int(stats["commits"]) - commits_before
        result.dropped_offloads = mgr.l1.stats.offloads_dropped
        result.extra.update(_stack_extra(mgr, stats, time.monotonic() - t0, lag, unsettled))
        result.extra["block_bytes"] = block_bytes
    return result


def _stack_extra(
    mgr: KVCacheManager, node_stats: dict[str, Any], seconds: float, lag: float, unsettled: int
) -> dict[str, Any]:
    off = mgr.offloader
    return {
        "transport": mgr.transport_name,
        "seconds": seconds,
        "max_lag_s": lag,
        "flushes_timed_out": unsettled,
        "offload_failed_blocks": off.failed_blocks if off else 0,
        "node_evictions": int(node_stats["evictions"]),
        "l1_evictions": mgr.l1.stats.evictions,
        "bytes_fetched": mgr.stats.bytes_fetched,
        "l2_errors": mgr.stats.l2_errors,
    }
