"""Where and when a benchmark result was measured: every bench's ``meta`` block.

Absolute figures on shared machines are noise; a result is only comparable
with one from the same machine and commit, so every results file says both.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """Short commit of the checkout, ``-dirty`` with uncommitted changes; ``unknown``
    outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def machine() -> str:
    """Host name, CPU count and model, memory and OS, in one line."""
    mem = ""
    with contextlib.suppress(OSError, ValueError):
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{platform.node()}: {os.cpu_count()} x {cpu}{mem}, {platform.platform()}"


def provenance() -> dict[str, Any]:
    """``date`` (UTC, ISO 8601), ``machine``, ``commit`` and ``python``."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "commit": commit(),
        "python": platform.python_version(),
    }


def publish(
    result: dict[str, Any], out: Path | None, name: str,
    plot: Callable[[dict[str, Any], Path], None],
) -> None:
    """A bench script's output: ``result`` as one JSON object on stdout and,
    with ``out``, ``out/<name>.json`` and the plot ``out/<name>.png`` (none
    where matplotlib is not installed)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(text + "\n")
        with contextlib.suppress(ImportError):
            plot(result, out / f"{name}.png")
