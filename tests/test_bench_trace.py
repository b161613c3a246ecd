"""bench/trace.py end to end on the committed slice: its JSON, its plots, its stack check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "trace.py"
SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"
MODES = {"all", "hot", "cold", "oracle", "reuse"}

pytestmark = pytest.mark.timeout(600)


def bench(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--trace", str(SLICE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )


def test_model_full_prints_the_headline_and_writes_results_and_plots(tmp_path: Path) -> None:
    r = bench("--model", "--full", "--out", tmp_path, "--jobs", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    head = json.loads(r.stdout)
    assert set(head) == {"0.05", "0.1"}
    for modes in head.values():
        assert set(modes) == MODES | {"reuse+hint", "reuse+prefix-hint", "best", "frontier"}
        assert modes["all"]["bytes_vs_all"] == 1.0
        assert modes["reuse"]["achieved_budget"] == modes["reuse"]["bytes_vs_all"]
        assert set(modes["frontier"]) == {"0.25", "0.5", "0.75"}
        # Offloading exactly what is used again loses nothing against all.
        assert modes["oracle"]["hit_rate"] == modes["all"]["hit_rate"]
        assert modes["oracle"]["bytes_vs_all"] < 0.5
        assert modes["hot"]["hit_rate"] <= modes["reuse"]["hit_rate"] <= modes["all"]["hit_rate"]
    full = json.loads((tmp_path / "trace_model_full.json").read_text())
    assert full["meta"]["requests"] == 300 and full["headline"] == head
    assert_best_is_within_a_point_of_all(full)
    # Every L1 size (4) at every node size (3) has a verdict; the fleet runs exist.
    assert len(full["verdicts"]) == 12
    assert {r["routing"] for r in full["runs"] if r["engines"] == 4} == {"prefix", "random"}
    assert all(r["dropped_offloads"] == 0 for r in full["runs"])
    for png in ("pareto", "timeline_l1_0.05", "timeline_l1_0.1"):
        assert (tmp_path / f"trace_model_full_{png}.png").stat().st_size > 10_000


def assert_best_is_within_a_point_of_all(results: dict[str, Any]) -> None:
    """``best`` is never more than 1 point below ``all`` on the replayed trace, and no
    cheaper online mode there is within that point."""
    for share, modes in results["headline"].items():
        rows = {
            r["label"]: r
            for r in results["runs"]
            if r["engines"] == 1 and r["node_share"] is None
            and abs(r["l1_share"] - float(share)) < 1e-3
        }
        best = rows[modes["best"]]
        assert best["hit_rate"] >= rows["all"]["hit_rate"] - 0.01
        cheaper = [
            r for r in rows.values()
            if not r["hints"] and r["offload"] != "oracle"
            and r["bytes_vs_all"] < best["bytes_vs_all"]
        ]
        assert all(r["hit_rate"] < rows["all"]["hit_rate"] - 0.01 for r in cheaper)


def test_best_comes_from_the_replayed_trace(tmp_path: Path) -> None:
    """On a generated agent-loop trace the conversation trace's advice would be wrong."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trace_shapes.py"), "--shape", "agent",
         "--requests", "300", "--out", tmp_path],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    trace = tmp_path / "agent_s0.jsonl"
    assert r.stdout.strip() == str(trace)
    r = subprocess.run(
        [sys.executable, str(BENCH), "--model", "--trace", str(trace), "--l1", "0.05",
         "--out", tmp_path, "--jobs", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "trace_model.json").read_text())
    assert results["meta"]["trace"] == str(trace)
    assert_best_is_within_a_point_of_all(results)
    head = results["headline"]["0.05"]
    # Nearly every block is reused here: nothing cheaper than all keeps the hits.
    assert head["best"] == "all" and head["oracle"]["bytes_vs_all"] > 0.6
    for budget, point in head["frontier"].items():
        assert abs(point["achieved_budget"] - float(budget)) <= 0.05 * float(budget)


def test_stack_mode_checks_the_real_node_against_the_model(tmp_path: Path) -> None:
    r = bench("--stack", "--requests", "80", "--modes", "all,reuse", "--out", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out) == {"all", "reuse@0.5", "reuse+hint"}
    for v in out.values():
        assert v["agree"] and v["stack"]["wrong_blocks"] == 0
        assert v["stack"]["transport"] == "tcp"
    assert (tmp_path / "trace_stack.json").exists()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    r = bench("--model", "--l1", "1.5", "--out", tmp_path)
    assert r.returncode == 2 and "a share must be in (0, 1]" in r.stderr
    r = subprocess.run(
        [sys.executable, str(BENCH), "--trace", str(tmp_path / "none.jsonl"), "--out", tmp_path],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "error: cannot read trace" in r.stderr
