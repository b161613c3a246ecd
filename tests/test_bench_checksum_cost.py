"""bench/checksum_cost.py end to end, tiny: a real node and socket-loop peer, its JSON and plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_published

from rdmakv.transport.tcp import loop as tcp

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "checksum_cost.py"
ROUNDS = 4

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not tcp.native_checksums(),
                       reason="needs the native TCP loop with checksums (the XXH3 C API)"),
]


def test_checksum_cost_measures_all_three_and_verifies_bytes(tmp_path: Path) -> None:
    out, stderr = run_published(SCRIPT.name, "--sizes", "16384", "--rounds", str(ROUNDS),
                                  out=tmp_path, name="checksum_cost")
    assert {"date", "machine", "commit", "python"} <= set(out["meta"])
    size = out["sizes"]["16384"]
    arena_bytes = size["blocks"] * 16384
    for name in ("socket_loop", "rdmakv", "rdmakv_unchecked"):
        assert size[name]["put_gbps"] > 0 and size[name]["put_gbps_median"] > 0
        assert size[name]["put_cpu_ms"] > 0
    # checked puts were read back byte for byte; an unchecked one cannot be
    assert size["socket_loop"]["bytes_verified"] == arena_bytes
    assert size["rdmakv"]["bytes_verified"] == arena_bytes
    assert size["rdmakv_unchecked"]["bytes_verified"] == 0
    # every counted unchecked put really skipped the hash pass (warm-up rounds too)
    assert size["unchecked_sends"] >= ROUNDS
    assert size["rdmakv"]["put_vs_socket_loop"] > 0
    assert "16 KiB" in stderr  # progress line


def test_checksum_cost_refuses_too_few_rounds() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert "--rounds must be more than the 2 warm-up rounds" in r.stderr
