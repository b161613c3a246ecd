"""PNG plots of one ``rdmakv bench`` result: throughput, latency, concurrency.

matplotlib is imported here only, and only when plots are written
(:func:`write_plots`): the measuring code and ``rdmakv`` itself never load it,
and a machine without it still gets the JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.perf.report import latency_parts
from rdmakv.perf.settings import LATENCY_KEYS, KiB


def write_plots(result: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """``out_dir/<name>_<section>.png`` for each section with figures; none (and a
    line on stderr) where matplotlib is not installed."""
    written: list[Path] = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # matplotlib missing: the JSON is the result
        print(f"rdmakv bench: no plots ({e})", file=sys.stderr)
        return written
    for what, draw in (
        ("throughput", _plot_throughput),
        ("latency", _plot_latency),
        ("concurrency", _plot_concurrency),
    ):
        fig = draw(plt, result)
        if fig is None:
            continue
        png = out_dir / f"{name}_{what}.png"
        fig.tight_layout()
        fig.savefig(png, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(png)
    return written


def _transport_of(result: dict[str, Any]) -> str:
    return "rdma" if "rdma" in result else "tcp"


def _plot_throughput(plt: Any, result: dict[str, Any]) -> Any:
    tp = _transport_of(result)
    section = result[tp]
    sizes = list(section)
    systems = sorted({n for per in section.values() for n in per})
    if not sizes or not systems:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / len(systems)
    x = np.arange(len(sizes))
    for ax, op in zip(axes, ("put", "get"), strict=True):
        for i, n in enumerate(systems):
            vals = [float(section[s].get(n, {}).get(f"{op}_gbps", 0.0)) for s in sizes]
            bars = ax.bar(x + i * width, vals, width, label=n)
            for b, s in zip(bars, sizes, strict=True):
                if "error" in section[s].get(n, {}):
                    ax.annotate("n/a", (b.get_x() + b.get_width() / 2, 0), ha="center",
                                va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(x + width * (len(systems) - 1) / 2)
        ax.set_xticklabels([f"{int(s) // KiB} KiB" for s in sizes])
        ax.set_title(f"{op} ({tp}), GB/s, best of repeats, every byte verified")
        ax.set_xlabel("block size")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    # one legend above both panels: inside one it covered that panel's tallest bars
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(systems),
               frameon=False, bbox_to_anchor=(0.5, 1.06))
    return fig


def _plot_latency(plt: Any, result: dict[str, Any]) -> Any:
    lat = result.get("latency") or {}
    parts = [
        (place, {n: v for n, v in part.get("systems", {}).items()
                 if "error" not in v and "skipped" not in v}, part)
        for place, part in latency_parts(lat)
    ]
    parts = [p for p in parts if p[1]]
    if not parts:
        return None
    ops = [f"exists_{k}" for k in LATENCY_KEYS] + ["get_1"]
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4.5 * len(parts)), squeeze=False)
    x = np.arange(len(ops))
    for row, (place, systems, part) in zip(axes, parts, strict=True):
        width = 0.8 / len(systems)
        for ax, q in zip(row, ("p50_ms", "p99_ms"), strict=True):
            for i, (n, v) in enumerate(sorted(systems.items())):
                vals = [float(v.get(op, {}).get(q, 0.0)) for op in ops]
                ax.bar(x + i * width, vals, width, label=n)
            rt = part.get("round_trip", {}).get(q)
            if rt is not None:
                ax.axhline(rt, color="k", ls="--", lw=1, label="ping-pong round trip")
            ax.set_xticks(x + width * (len(systems) - 1) / 2)
            ax.set_xticklabels([op.replace("_", " ") for op in ops])
            ax.set_title(
                f"{q[:3]} latency (ms), {lat.get('block_bytes', 0) // KiB} KiB blocks\n"
                f"{place}: {part.get('cpus', '')}", fontsize=10,
            )
            ax.grid(axis="y", alpha=0.3)
        row[1].legend()
    return fig


def _plot_concurrency(plt: Any, result: dict[str, Any]) -> Any:
    conc = result.get("concurrency") or {}
    systems = {n: v for n, v in conc.get("systems", {}).items() if "error" not in v}
    if not systems:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, per in sorted(systems.items()):
        ok = {int(p): v for p, v in per.items() if isinstance(v, dict) and "error" not in v}
        procs = sorted(ok)
        axes[0].plot(procs, [ok[p]["aggregate_gbps"] for p in procs], marker="o", label=n)
        axes[1].plot(procs, [ok[p]["p99_batch_ms"] for p in procs], marker="o", label=n)
    axes[0].set_title("aggregate GB/s (put + get), one server")
    axes[1].set_title(f"p99 batch latency (ms), {conc.get('blocks_per_batch')} blocks per batch")
    for ax in axes:
        ax.set_xlabel("client processes")
        ax.grid(alpha=0.3)
    axes[0].legend()
    return fig
