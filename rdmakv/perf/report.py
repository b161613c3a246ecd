"""The JSON result of one ``rdmakv bench`` run: ratios, meta, failures, a summary.

Output (also written to ``<out>/<name>.json``, with PNG plots)::

    {"tcp": {"<block bytes>": {"<system>": {"put_gbps", "get_gbps", "bytes_verified",
                                            "put_gbps_median", "get_gbps_median", "repeats",
                                            "fresh_connections", "warm_up",
                                            "warm_up_rounds"}
                                          | {"error": "why"}}},
     "latency": {...}, "concurrency": {...}, "ratios": {...}, "meta": {...}}

``bytes_verified`` is the size of the destination arena (blocks x block
bytes) when every byte of it matched the source after EVERY repeat; a
mismatch is recorded as ``{"error": "N wrong bytes ..."}`` and fails the run,
as does any failure of ``rdmakv``, or of ``socket_loop`` in a TCP run (they
never skip). A peer that cannot run here
(:class:`~rdmakv.perf.driver.PeerUnavailable`, or any exception) is recorded
as ``{"error": ...}`` and the run goes on.

``ratios`` holds rdmakv's figures over the best peer's and over each ceiling's
at each size, and its 64-key lookup p99 over the round trip's.

GB/s are 1e9 bytes per second; latencies are in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from rdmakv.perf.drivers import CEILING, FATAL, OURS, OURS_VARIANTS
from rdmakv.perf.provenance import provenance
from rdmakv.perf.settings import LATENCY_KEYS, BenchConfig, KiB
from rdmakv.transport.tcp.loop import hashed_send_plan, recv_spin_us

CEILINGS = (CEILING, "perftest", "perftest_q2")


def _figure(per: dict[str, dict[str, Any]], key: str, name: str) -> float:
    return float(per[name][key])


def ratios(
    section: dict[str, dict[str, dict[str, Any]]], latency: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, systems in section.items():
        if "put_gbps" not in systems.get(OURS, {}):
            out[size] = {"error": "rdmakv has no figure at this size"}
            continue
        out[size] = _size_ratios(systems, OURS)
        for variant in OURS_VARIANTS:  # nested: rdmakv's own figures stay where they were
            if "put_gbps" in systems.get(variant, {}):
                out[size][variant] = _size_ratios(systems, variant)
    lat: dict[str, Any] = {}
    for i, (place, part) in enumerate(latency_parts(latency)):
        own = _latency_ratios(part)
        if i == 0:
            lat.update(own)
        elif own:
            lat[place] = own
    if lat:
        out["latency"] = lat
    return out


def _size_ratios(systems: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """``name``'s put/get over the best peer and over each ceiling, at one size."""
    ours = systems[name]
    r: dict[str, Any] = {}
    peers = {
        n: v for n, v in systems.items()
        if n != OURS and n not in OURS_VARIANTS and n not in CEILINGS and "put_gbps" in v
    }
    for op in ("put", "get"):
        key = f"{op}_gbps"
        if peers:
            best = max(peers, key=partial(_figure, peers, key))
            r[f"{op}_vs_best_peer"] = round(ours[key] / peers[best][key], 3)
            r[f"best_{op}_peer"] = best
        else:
            r[f"{op}_vs_best_peer"] = None
        for c in CEILINGS:
            ceil = systems.get(c, {})
            if key in ceil:
                r[f"{op}_vs_{c}"] = round(ours[key] / ceil[key], 3)
                mid = f"{key}_median"
                if mid in ours and mid in ceil:  # the typical run beside the best one
                    r[f"{op}_vs_{c}_median"] = round(ours[mid] / ceil[mid], 3)
            elif c == CEILING and c in systems:
                r[f"{op}_vs_{c}"] = None
    return r


def latency_parts(latency: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(placement, figures) for the section's own placement, then each nested one."""
    if "systems" not in latency:
        return []
    parts = [(str(latency.get("placement", "unpinned")), latency)]
    parts += [(k, v) for k, v in latency.items() if isinstance(v, dict) and "systems" in v]
    return parts


def _latency_ratios(part: dict[str, Any]) -> dict[str, Any]:
    """rdmakv's 64-key lookup p99 over the round trip's p99 under one placement:
    over the round trips taken between its lookups, and over the section's."""
    rt = part.get("round_trip", {})
    ours_lat = part.get("systems", {}).get(OURS, {})
    big = f"exists_{max(LATENCY_KEYS)}"
    out: dict[str, Any] = {}
    paired = ours_lat.get(big, {}).get("paired_round_trip", {})
    if "p99_ms" in paired:  # the target's ratio: both sides under the same load
        out[f"{big}_p99_vs_paired_round_trip_p99"] = round(
            ours_lat[big]["p99_ms"] / paired["p99_ms"], 3
        )
    if "p99_ms" in rt and "p99_ms" in ours_lat.get(big, {}):
        out[f"{big}_p99_vs_round_trip_p99"] = round(ours_lat[big]["p99_ms"] / rt["p99_ms"], 3)
        tcp = rt.get("tcp", {})
        if "p99_ms" in tcp:  # rdma runs: lookups ride the TCP control channel
            out[f"{big}_p99_vs_tcp_round_trip_p99"] = round(
                ours_lat[big]["p99_ms"] / tcp["p99_ms"], 3
            )
    return out

def build(
    cfg: BenchConfig,
    section: dict[str, dict[str, dict[str, Any]]],
    latency: dict[str, Any],
    concurrency: dict[str, Any],
) -> tuple[dict[str, Any], int]:
    """The run's JSON object from its three sections, and its exit status: 1 when
    a system that never skips failed or any bytes came back wrong (``meta.failures``)."""
    result: dict[str, Any] = {
        cfg.transport: section,
        "latency": latency,
        "concurrency": concurrency,
        "ratios": ratios(section, latency),
        "meta": {
            **provenance(),
            "quick": cfg.quick,
            "transport": cfg.transport,
            "blocks": {str(s): cfg.blocks_for(s) for s in cfg.resolved_sizes()},
            "repeats": cfg.resolved_repeats(),
            "warm_up": cfg.warm_up,
            **cfg.extra_meta,
        },
    }
    if cfg.transport == "tcp":  # the plan this process's puts followed (tcp.send_plan)
        plan = hashed_send_plan()
        result["meta"]["tcp_hashed_send_window"] = plan.window if plan else None
        result["meta"]["tcp_hashed_send_ahead"] = plan.ahead if plan else None
        # the nodes the bench starts inherit the environment that set it
        result["meta"]["tcp_recv_spin_us"] = recv_spin_us()
    fatal = failures(cfg.transport, section, latency, concurrency)
    if fatal:
        result["meta"]["failures"] = fatal
    return result, 1 if fatal else 0


def failures(
    transport: str,
    section: dict[str, dict[str, dict[str, Any]]],
    latency: dict[str, Any],
    concurrency: dict[str, Any],
) -> list[str]:
    """What fails the run: any error of a system that never skips, and any wrong bytes."""
    fatal: list[str] = []
    # rdmakv never skips; nor does the socket loop where it applies (TCP runs).
    never_skip = FATAL if transport == "tcp" else FATAL - {CEILING}
    for size_key, per in section.items():
        for name, res in per.items():
            if "error" in res and (name in never_skip or "wrong bytes" in res["error"]):
                fatal.append(f"{name} at {size_key} B: {res['error']}")
    for where_name, part in latency_parts(latency):
        for name, res in part.get("systems", {}).items():
            if "error" in res and (name in never_skip or "wrong bytes" in res["error"]):
                fatal.append(f"{name} latency ({where_name}): {res['error']}")
    for name, res in concurrency.get("systems", {}).items():
        errs = [res] + [v for v in res.values() if isinstance(v, dict)]
        for r in errs:
            if "error" in r and (name in never_skip or "wrong bytes" in r["error"]):
                fatal.append(f"{name} concurrency: {r['error']}")
    return fatal


def write_json(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    """``out_dir/<name>.json`` (``out_dir`` made if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def summary_lines(result: dict[str, Any], transport: str) -> Iterator[str]:
    """A short human-readable table of the throughput section."""
    yield f"{'size':>9} {'system':<15} {'put GB/s':>9} {'get GB/s':>9}  note"
    for size, per in result[transport].items():
        for name, res in per.items():
            if "error" in res:
                yield f"{int(size) // KiB:>6}KiB {name:<15} {'-':>9} {'-':>9}  {res['error'][:90]}"
            else:
                yield (
                    f"{int(size) // KiB:>6}KiB {name:<15} {res['put_gbps']:>9.3f} "
                    f"{res['get_gbps']:>9.3f}  verified {res['bytes_verified']} B"
                )
