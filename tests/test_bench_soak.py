"""bench/soak.py end to end, tiny: real node, client processes, its JSON and files."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_published

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "bench" / "soak.py"

pytestmark = pytest.mark.timeout(180)


def test_short_soak_verifies_values_and_finds_no_leaks(tmp_path: Path) -> None:
    out, stderr = run_published(
        SOAK.name, "--minutes", "0.1", "--clients", "2", "--manager-clients", "1", "--keys",
        "256", "--block-size", "4KiB", "--interval", "1", "--name", "soak_test",
        out=tmp_path, name="soak_test",
    )
    assert out["wrong_values"] == 0 and out["crashed"] == []
    assert out["values_verified"] > 0 and out["batches"] > 0
    assert out["leaked"] == {"leases_active": 0, "pending": 0}
    assert out["after_close"]["settled"] and out["after_close"]["sessions_active"] == 1
    assert out["rss_mib"]["max"] > 0 and len(out["samples"]) >= 3
    assert {"date", "machine", "commit", "python"} <= set(out["meta"])
    assert "soak" in stderr  # progress lines
