"""bench/cluster.py --quick end to end: real nodes, its JSON object, its results file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "cluster.py"
FIGURES = {"put_gbps", "get_gbps", "put_p50_ms", "put_p99_ms", "get_p50_ms", "get_p99_ms"}

pytestmark = pytest.mark.timeout(120)


def test_quick_run_measures_verifies_and_writes_the_results(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    for name in ("nodes_1", "nodes_2", "nodes_4", "kvclient_1"):
        assert set(out[name]) >= FIGURES, name
        assert all(out[name][f] > 0 for f in FIGURES), out[name]
        assert out[name]["transport"] == "tcp" and out[name]["bytes_verified"] > 0
    for name in ("ratio_4_vs_1", "split_cost_vs_kvclient"):
        assert set(out[name]) == {"put", "get"} and all(v > 0 for v in out[name].values())
    assert out["bytes_verified"] > 0
    assert 0.15 <= out["moved_fraction_4_to_5"] <= 0.25
    moves = out["moves"]
    assert 0.15 <= moves["moved_fraction_5_to_4"] <= 0.25
    assert 0.3 <= moves["moved_fraction_4_to_5_r2"] <= 0.5
    assert moves["only_newcomer_keys_moved"] and moves["only_newcomer_keys_moved_r2"]
    live = out["live_4_to_5"]
    assert live["only_newcomer_keys_missed"] and live["missed"] == live["placed_on_newcomer"]
    assert {"date", "machine", "commit"} <= set(out["meta"]) and out["meta"]["quick"]
    assert json.loads((tmp_path / "cluster.json").read_text()) == out


def test_bad_option_is_refused() -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--blocks", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode == 2 and "--blocks must be >= 1" in r.stderr
