"""bench/connection_ramp.py end to end, tiny: a real node and socket-loop peer, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_published

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "connection_ramp.py"

pytestmark = pytest.mark.timeout(180)


def test_connection_ramp_reports_each_transfer_position_and_verifies_bytes(
    tmp_path: Path,
) -> None:
    out, stderr = run_published(SCRIPT.name, "--sizes", "16384", "--blocks", "16", "--connections",
                                  "2", "--transfers", "3", out=tmp_path, name="connection_ramp")
    assert {"date", "machine", "commit", "python"} <= set(out["meta"])
    assert out["meta"]["blocks"] == {"16384": 16}
    per = out["sizes"]["16384"]
    assert set(per) == {"rdmakv", "socket_loop"}
    for name, fig in per.items():
        # one median per position on a connection, every get read back whole
        assert len(fig["put_gbps_median"]) == len(fig["get_gbps_median"]) == 3, name
        assert all(g > 0 for g in fig["put_gbps_median"] + fig["get_gbps_median"]), name
        assert fig["bytes_verified"] == 16 * 16384 * 2 * 3, name
    assert "16 KiB rdmakv" in stderr  # progress lines


def test_a_peer_that_cannot_run_is_recorded_not_fatal(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--systems", "socket_loop,no_such_system",
         "--sizes", "16384", "--blocks", "4", "--connections", "1", "--transfers", "1"],
        capture_output=True, text=True, timeout=170, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    per = json.loads(r.stdout)["sizes"]["16384"]
    assert "no_such_system" in per["no_such_system"]["error"]
    assert per["socket_loop"]["bytes_verified"] == 4 * 16384


def test_bad_counts_are_refused_by_name() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--transfers", "0"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert "--transfers must be at least 1, got 0" in r.stderr
