"""Offload policies on a real trace: hit rate against bytes sent to the node.

Replays a Mooncake-format trace (default: ``../shared/traces/``'s conversation
trace) through the real L1 cache and offload policies (``rdmakv.replay``):

``--model`` (the default)
    The fast model for the whole trace: L1 = 5% and 10% of the trace's unique
    blocks (``--l1``), an unbounded node (``--node``), every mode: ``all``,
    ``hot``, ``cold``, the ``oracle`` (offloads exactly the blocks used again;
    not online), ``reuse`` at budgets 0.25 / 0.5 / 0.75, and ``reuse`` with the
    request hint (perfect, and wrong for 10% / 25% of requests). Prints ONE
    JSON object::

        {"0.05": {"all": {"hit_rate": .., "bytes_vs_all": ..}, "hot": .., "cold": ..,
                  "oracle": .., "reuse": {.., "budget": 0.5, "achieved_budget": ..},
                  "reuse+hint": .., "reuse+prefix-hint": ..,
                  "best": "reuse@0.75",
                  "frontier": {"0.25": {"hit_rate": .., "achieved_budget": ..},
                               "0.5": {..}, "0.75": {..}}},
         "0.1": {..}}

    ``bytes_vs_all`` is the steady-state cost: blocks sent during the replay
    plus those a policy still owes when L1 empties at the end (``cold`` sends at
    eviction), over what ``all`` sends; for a budgeted mode it is also its
    ``achieved_budget``. The ``reuse`` row is budget 0.5 (its default, 1,
    sends what ``all`` sends unless hints say otherwise; those are the
    ``reuse+hint`` rows: one bool per request, and ``prefix-hint``, the number
    of first tokens reused). ``best`` is the cheapest online mode and budget
    whose hit rate is within :data:`BEST_MAX_LOSS` of ``all`` on *this* trace at
    this L1 size (``all`` when none is; hints and the oracle are not
    candidates: they need knowledge the replay takes from the trace's
    future). ``frontier`` is ``reuse``'s hit rate at 0.25x / 0.5x / 0.75x
    of all's bytes. Every budget, hint and the undrained figures are in the
    results file.

``--full``
    Also L1 = 2% and 20%, the node at 25% and 50% of the unique blocks, a finer
    ``reuse`` frontier, and a fleet of 4 engines behind a prefix-affine or a
    random router; writes the plots (``--plots`` is implied).

``--stack``
    The real stack on a slice (``--start``, ``--requests``): a real
    ``rdmakv serve`` and ``KVCacheManager`` over ``--transport``, real bytes
    (``--block-bytes``), timestamps compressed by ``--speedup``, every hit
    checked byte for byte; the model on the same slice beside it. Prints
    ``{"<mode>": {"model": {..}, "stack": {..}, "agree": bool}}``; exits 1 if a
    block came back wrong or (with ``--sync``, the default) the two disagree.

Results go to ``bench/results/trace_<kind>.json`` (and ``.png`` plots).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rdmakv.errors import RdmakvError
from rdmakv.perf.provenance import provenance
from rdmakv.replay import ReplayResult, ReplaySetup, TraceKeys, load_trace, replay_model
from rdmakv.replay.stack import DEFAULT_STACK_BLOCK_BYTES, replay_stack

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
RESULTS = ROOT / "bench" / "results"
BASE_MODES = ("all", "hot", "cold", "oracle")
BUDGETS = (0.25, 0.5, 0.75)
HEADLINE_BUDGET = 0.5
"""The ``reuse`` budget of the printed object's ``reuse`` row."""
HINT_NOISE = (0.0, 0.1, 0.25)
FRONTIER_BUDGETS = (0.15, 0.35, 0.6, 0.9)
FULL_L1 = (0.02, 0.05, 0.1, 0.2)
FULL_NODE: tuple[float | None, ...] = (None, 0.5, 0.25)
FLEET_ENGINES = 4
FLEET_L1 = 0.1
"""The fleet's L1, as a share of unique blocks, split across its engines."""
BEST_MAX_LOSS = 0.01
"""``best``: at most this much hit rate (absolute) below ``all`` on the replayed trace."""
BEST_CANDIDATES = ("all", "hot", "cold", "reuse")
"""Modes ``best`` may name: the online ones, without hints."""
BYTES_TARGET = 0.5
"""The issue's bar for a selective mode: at most this share of all's bytes..."""
HIT_LOSS_TARGET = 0.01
"""...losing at most this much hit rate (absolute)."""

_KEYS: TraceKeys | None = None  # set before the pool forks: workers inherit it


def _run(setup: ReplaySetup) -> ReplayResult:
    assert _KEYS is not None
    return replay_model(_KEYS, setup)


def run_grid(keys: TraceKeys, setups: list[ReplaySetup], jobs: int) -> list[ReplayResult]:
    """Every setup through the model, ``jobs`` at a time, with a progress bar."""
    global _KEYS
    _KEYS = keys
    bar = tqdm(total=len(setups), desc="replays", unit="run", file=sys.stderr)
    out: list[ReplayResult] = []
    try:
        if jobs <= 1:
            for s in setups:
                out.append(_run(s))
                bar.update()
        else:
            with mp.get_context("fork").Pool(jobs) as pool:
                for res in pool.imap(_run, setups):
                    out.append(res)
                    bar.update()
    finally:
        bar.close()
    return out


def model_setups(
    keys: TraceKeys, l1_shares: Iterable[float], node_shares: Iterable[float | None], full: bool
) -> list[ReplaySetup]:
    u = keys.unique_blocks
    setups = []
    for share in l1_shares:
        l1 = max(1, round(share * u))
        for ns in node_shares:
            nb = None if ns is None else max(1, round(ns * u))
            for mode in BASE_MODES:
                setups.append(ReplaySetup(l1, nb, mode))
            budgets = BUDGETS + (FRONTIER_BUDGETS if full and ns is None else ())
            for b in sorted(budgets):
                setups.append(ReplaySetup(l1, nb, "reuse", b))
            for noise in HINT_NOISE if ns is None else (0.0,):
                setups.append(ReplaySetup(l1, nb, "reuse", hints=True, hint_noise=noise))
            setups.append(ReplaySetup(l1, nb, "reuse", hints=True, hint_form="prefix"))
    if full:
        per_engine = max(1, round(FLEET_L1 * u / FLEET_ENGINES))
        for routing in ("prefix", "random"):
            for mode, budget, hints in (
                ("all", None, False),
                ("cold", None, False),
                ("hot", None, False),
                ("reuse", HEADLINE_BUDGET, False),
                ("reuse", None, True),
            ):
                setups.append(
                    ReplaySetup(
                        per_engine, None, mode, budget, hints, engines=FLEET_ENGINES,
                        routing=routing,
                    )
                )
    return setups


def _share(n: int | None, unique: int) -> float | None:
    return None if n is None else round(n / unique, 4)


def _share_of(node_share: float | None, keys: TraceKeys) -> float | None:
    """A --node share as the rows spell it (rounded through the block count)."""
    u = keys.unique_blocks
    return None if node_share is None else _share(max(1, round(node_share * u)), u)


def summarize(keys: TraceKeys, results: list[ReplayResult]) -> list[dict[str, Any]]:
    """One flat row per replay, with ratios to ``all`` of the same L1, node and fleet."""
    u = keys.unique_blocks
    base: dict[tuple[Any, ...], ReplayResult] = {}
    for r in results:
        s = r.setup
        if s.offload == "all":
            base[(s.l1_blocks, s.node_blocks, s.engines, s.routing)] = r
    rows = []
    for r in results:
        s = r.setup
        ref = base[(s.l1_blocks, s.node_blocks, s.engines, s.routing)]
        rows.append(
            {
                "label": s.label,
                "offload": s.offload,
                "budget": s.offload_budget,
                "hints": s.hints,
                "hint_noise": s.hint_noise,
                "hint_form": s.hint_form,
                "l1_share": round(s.l1_blocks * s.engines / u, 4),
                "node_share": _share(s.node_blocks, u),
                "engines": s.engines,
                "routing": s.routing,
                "hit_rate": r.hit_rate,
                "hit_rate_minus_all": r.hit_rate - ref.hit_rate,
                "bytes_vs_all": r.steady_sent_blocks / ref.steady_sent_blocks,
                "bytes_vs_all_undrained": r.sent_blocks / ref.sent_blocks,
                "l1_hits": r.l1_hits,
                "node_hits": r.node_hits,
                "sent_blocks": r.sent_blocks,
                "drained_blocks": r.drained_blocks,
                "dropped_offloads": r.dropped_offloads,
                "timeline": r.timeline,
                **r.extra,
            }
        )
    return rows


def headline(
    rows: list[dict[str, Any]], l1_shares: Iterable[float], node_share: float | None = None
) -> dict[str, Any]:
    """The printed object: per L1 share, each mode's hit rate and bytes, at one node size."""
    out: dict[str, Any] = {}
    for share in l1_shares:
        mine = [
            r
            for r in rows
            if r["engines"] == 1
            and r["node_share"] == node_share
            and abs(r["l1_share"] - share) < 1e-3
        ]
        entry: dict[str, Any] = {}
        frontier: dict[str, Any] = {}
        for r in mine:
            name = r["label"]
            figures = {
                "hit_rate": round(r["hit_rate"], 5),
                "bytes_vs_all": round(r["bytes_vs_all"], 4),
            }
            if r["offload"] == "reuse" and not r["hints"] and r["budget"] in BUDGETS:
                frontier[f"{r['budget']:g}"] = {
                    "hit_rate": figures["hit_rate"],
                    "achieved_budget": figures["bytes_vs_all"],
                }
            if name == f"reuse@{HEADLINE_BUDGET:g}":
                name = "reuse"
                figures.update(budget=HEADLINE_BUDGET, achieved_budget=figures["bytes_vs_all"])
            elif name not in (*BASE_MODES, "reuse+hint", "reuse+prefix-hint"):
                continue
            entry[name] = figures
        entry["best"] = best_mode(mine)
        entry["frontier"] = dict(sorted(frontier.items(), key=lambda kv: float(kv[0])))
        out[f"{share:g}"] = entry
    return out


def best_mode(rows: list[dict[str, Any]]) -> str:
    """The cheapest online mode and budget within :data:`BEST_MAX_LOSS` of ``all``.

    ``rows`` are the replays of one trace at one L1 and node size: the
    recommendation comes from them alone, never from another trace's figures.
    """
    ref = next(r for r in rows if r["offload"] == "all")
    fit = [
        r
        for r in rows
        if r["offload"] in BEST_CANDIDATES
        and not r["hints"]
        and r["hit_rate"] >= ref["hit_rate"] - BEST_MAX_LOSS
    ]
    # Ties (cold and all both send everything): the plainer mode, all, wins.
    best = min(fit, key=lambda r: (r["bytes_vs_all"], r["offload"] != "all"))
    return str(best["label"])


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every L1 / node setting: the best online hit rate within the bytes target."""
    out = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if r["engines"] == 1:
            groups.setdefault((r["l1_share"], r["node_share"]), []).append(r)
    for (l1, node), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 9)):
        ref = next(r for r in rs if r["offload"] == "all")
        online = [
            r
            for r in rs
            if r["offload"] != "oracle" and not r["hints"] and r["bytes_vs_all"] <= BYTES_TARGET
        ]
        best = max(online, key=lambda r: r["hit_rate"])
        out.append(
            {
                "l1_share": l1,
                "node_share": node,
                "all_hit_rate": ref["hit_rate"],
                "best_online_within_target": best["label"],
                "its_hit_rate": best["hit_rate"],
                "its_bytes_vs_all": best["bytes_vs_all"],
                "meets_target": ref["hit_rate"] - best["hit_rate"] <= HIT_LOSS_TARGET,
            }
        )
    return out


def meta(path: Path, keys: TraceKeys, seconds: float, **more: Any) -> dict[str, Any]:
    return {
        "trace": str(path),
        "requests": len(keys.trace),
        "unique_blocks": keys.unique_blocks,
        "total_blocks": keys.total_blocks,
        "block_tokens": keys.trace.block_tokens,
        "trace_seconds": keys.trace.duration_s,
        **provenance(),
        "seconds": round(seconds, 1),
        **more,
    }


def write_json(out: Path, name: str, obj: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


# -- plots ---------------------------------------------------------------------------------

MODE_STYLE = {
    "all": ("tab:blue", "s"),
    "cold": ("tab:cyan", "v"),
    "hot": ("tab:red", "^"),
    "oracle": ("black", "*"),
    "reuse": ("tab:green", "o"),
    "hint": ("tab:purple", "P"),
    "prefix-hint": ("tab:pink", "X"),
}


def style_name(row: dict[str, Any]) -> str:
    """The :data:`MODE_STYLE` entry of a result row."""
    if not row["hints"]:
        return str(row["offload"])
    return "prefix-hint" if row["hint_form"] == "prefix" else "hint"



def plot_pareto(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = sorted({r["l1_share"] for r in rows if r["engines"] == 1})
    nodes = sorted({r["node_share"] or 9 for r in rows if r["engines"] == 1}, reverse=True)
    fig, axes = plt.subplots(
        len(nodes), len(shares), figsize=(4.2 * len(shares), 3.6 * len(nodes)), squeeze=False
    )
    for i, node in enumerate(nodes):
        for j, share in enumerate(shares):
            ax = axes[i][j]
            rs = [
                r
                for r in rows
                if r["engines"] == 1 and r["l1_share"] == share and (r["node_share"] or 9) == node
            ]
            frontier = sorted(
                (r for r in rs if r["offload"] == "reuse" and not r["hints"]),
                key=lambda r: r["bytes_vs_all"],
            )
            hinted = sorted(
                (r for r in rs if style_name(r) == "hint"), key=lambda r: r["hint_noise"]
            )
            if len(hinted) > 1:
                ax.plot(
                    [r["bytes_vs_all"] for r in hinted],
                    [100 * r["hit_rate"] for r in hinted],
                    ":", color=MODE_STYLE["hint"][0], label="hint wrong for 0/10/25%",
                )
            ax.plot(
                [r["bytes_vs_all"] for r in frontier],
                [100 * r["hit_rate"] for r in frontier],
                "-o", color=MODE_STYLE["reuse"][0], label="reuse (budget 0.15-0.9)", ms=4,
            )
            labels = {"hint": "reuse + perfect hint", "prefix-hint": "reuse + prefix hint"}
            for r in rs:
                name = style_name(r)
                if name == "reuse" or r["hint_noise"]:
                    continue
                color, marker = MODE_STYLE[name]
                ax.plot(
                    r["bytes_vs_all"], 100 * r["hit_rate"], marker, color=color,
                    ms=12 if name == "oracle" else 8, label=labels.get(name, name),
                )
            node_txt = "unbounded node" if node == 9 else f"node {node:.0%} of unique"
            ax.set_title(f"L1 {share:.0%} of unique, {node_txt}", fontsize=9)
            ax.set_xlabel("bytes sent / bytes sent by all (steady state)")
            ax.set_ylabel("hit rate, % of blocks")
            ax.set_xlim(0, 1.1)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Offload policies on {title} (model replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(rows: list[dict[str, Any]], path: Path, share: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in rows:
        if r["engines"] != 1 or r["node_share"] is not None or abs(r["l1_share"] - share) > 1e-3:
            continue
        if r["hint_noise"] or (
            r["offload"] == "reuse" and not r["hints"] and r["budget"] != HEADLINE_BUDGET
        ):
            continue
        name = style_name(r)
        t = [p[0] / 60 for p in r["timeline"]]
        rate = [100 * p[2] / p[1] if p[1] else 0.0 for p in r["timeline"]]
        ax.plot(t, rate, color=MODE_STYLE[name][0], lw=1.2, label=r["label"])
    ax.set_xlabel("trace time, minutes")
    ax.set_ylabel("hit rate in that minute, %")
    ax.set_title(f"Hit rate over the trace, L1 = {share:.0%} of unique blocks, unbounded node")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- commands ------------------------------------------------------------------------------


def cmd_model(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    trace = load_trace(args.trace, start=args.start, limit=args.requests)
    print(f"[trace] {len(trace)} requests; computing keys", file=sys.stderr)
    keys = TraceKeys(trace)
    l1 = FULL_L1 if args.full else args.l1
    node = FULL_NODE if args.full else args.node
    results = run_grid(keys, model_setups(keys, l1, node, args.full), args.jobs)
    rows = summarize(keys, results)
    # The first node size asked (--full: the unbounded node, as docs/offload.md's tables).
    head = headline(rows, args.l1, None if args.full else _share_of(args.node[0], keys))
    out = {
        "meta": meta(args.trace, keys, time.monotonic() - t0, kind="model"),
        "headline": head,
        "verdicts": verdicts(rows),
        "runs": rows,
    }
    name = "trace_model_full" if args.full else "trace_model"
    path = write_json(args.out, name, out)
    print(f"[trace] wrote {path}", file=sys.stderr)
    if args.full or args.plots:
        plot_pareto(rows, args.out / f"{name}_pareto.png", args.trace.name)
        for share in (0.05, 0.1):
            if any(abs(r["l1_share"] - share) < 1e-3 for r in rows):
                plot_timeline(rows, args.out / f"{name}_timeline_l1_{share:g}.png", share)
        print(f"[trace] plots in {args.out}/{name}_*.png", file=sys.stderr)
    print(json.dumps(head, indent=1))
    return 0


STACK_MODES: tuple[tuple[str, float | None, bool], ...] = (
    ("all", None, False),
    ("hot", None, False),
    ("cold", None, False),
    ("oracle", None, False),
    ("reuse", HEADLINE_BUDGET, False),
    ("reuse", None, True),
)


def cmd_stack(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    trace = load_trace(args.trace, start=args.start, limit=args.requests)
    keys = TraceKeys(trace)
    l1 = max(1, round(args.l1[0] * keys.unique_blocks))
    nshare = args.node[0]
    nb = None if nshare is None else max(1, round(nshare * keys.unique_blocks))
    out: dict[str, Any] = {}
    bad = False
    modes = [m for m in STACK_MODES if args.modes is None or m[0] in args.modes]
    for mode, budget, hints in tqdm(modes, desc="stack replays", unit="run", file=sys.stderr):
        setup = ReplaySetup(l1, nb, mode, budget, hints)
        model = replay_model(keys, setup)
        stack = replay_stack(
            keys,
            setup,
            block_bytes=args.block_bytes,
            transport=args.transport,
            speedup=args.speedup,
            sync=args.sync,
        )
        agree = (model.l1_hits, model.node_hits, model.sent_blocks) == (
            stack.l1_hits,
            stack.node_hits,
            stack.sent_blocks,
        )
        bad |= stack.wrong_blocks > 0 or (args.sync and not agree)
        out[setup.label] = {
            "model": _counts(model),
            "stack": {**_counts(stack), **stack.extra},
            "agree": agree,
        }
    path = write_json(
        args.out,
        "trace_stack",
        {
            "meta": meta(
                args.trace, keys, time.monotonic() - t0, kind="stack", start=args.start,
                l1_share=args.l1[0], node_share=nshare, transport=args.transport,
                speedup=args.speedup, sync=args.sync,
            ),
            "results": out,
        },
    )
    print(f"[trace] wrote {path}", file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 1 if bad else 0


def _counts(r: ReplayResult) -> dict[str, Any]:
    return {
        "requests": r.requests,
        "blocks": r.blocks,
        "l1_hits": r.l1_hits,
        "node_hits": r.node_hits,
        "hit_rate": round(r.hit_rate, 5),
        "sent_blocks": r.sent_blocks,
        "dropped_offloads": r.dropped_offloads,
        "wrong_blocks": r.wrong_blocks,
    }


def _shares(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("inf", "none", "unbounded"):
            out.append(None)
            continue
        v = float(part)
        if not 0.0 < v <= 1.0:
            raise argparse.ArgumentTypeError(f"a share must be in (0, 1] or 'inf', got {part}")
        out.append(v)
    return out


def _l1_shares(text: str) -> list[float]:
    out = [s for s in _shares(text) if s is not None]
    if len(out) != len(text.split(",")):
        raise argparse.ArgumentTypeError("L1 shares must be numbers in (0, 1]")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--model", action="store_true", help="the fast model (default)")
    kind.add_argument("--stack", action="store_true", help="the real stack on a slice")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a Mooncake-format trace")
    p.add_argument("--start", type=int, default=0, help="first request replayed")
    p.add_argument("--requests", type=int, help="requests replayed (default: all; stack: 1000)")
    p.add_argument("--l1", type=_l1_shares, default=[0.05, 0.1],
                   help="L1 sizes, as shares of the trace's unique blocks (default 0.05,0.1)")
    p.add_argument("--node", type=_shares, default=[None],
                   help="node sizes, shares of the unique blocks or inf (default inf)")
    p.add_argument("--full", action="store_true", help="every figure of docs/offload.md")
    p.add_argument("--plots", action="store_true", help="write the PNG plots")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="model replays at once")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and plots go")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_STACK_BLOCK_BYTES)
    p.add_argument("--transport", choices=["tcp", "rdma", "auto"], default="tcp")
    p.add_argument("--speedup", type=float, default=None,
                   help="stack: trace time / replay time (default: back to back)")
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="stack: let offloads overlap later requests (drops possible)")
    p.add_argument("--modes", type=lambda t: t.split(","), default=None,
                   help="stack: only these modes (comma-separated)")
    args = p.parse_args(argv)
    try:
        if args.stack:
            if args.requests is None:
                args.requests = 1000
            return cmd_stack(args)
        return cmd_model(args)
    except RdmakvError as e:  # a bad trace or setting: say what, no traceback
        print(f"bench/trace.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
