"""torch is an extra (``rdmakv[torch]``): a plain install runs the node, the client and
the demo, and the extras that need torch pull it in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_torch_is_an_extra_that_the_test_and_infinistore_extras_pull_in() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch" not in _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert _names(extras["torch"]) == {"torch"}
    # dev: the suite tests the tensor paths; infinistore: its wheel imports torch.
    for extra in ("dev", "infinistore"):
        pulled = [r for r in extras[extra] if r.startswith("rdmakv[")]
        assert any("torch" in r for r in pulled), (extra, extras[extra])


def test_the_demo_and_its_node_run_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    # Every interpreter started with this PYTHONPATH runs sitecustomize, the demo's node
    # too; None in sys.modules is Python's own "this module cannot be imported".
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RDMAKV_NODE_", "RDMAKV_CLIENT_", "RDMAKV_LOG_", "RDMAKV_CONFIG"))
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    blocked = subprocess.run(
        [sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
        timeout=60,
    )
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr
    out = subprocess.run(
        [sys.executable, "-m", "rdmakv.cli", "demo", "--requests", "8", "--transport", "tcp"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "rdmakv node ready" in out.stdout and " 0 wrong blocks" in out.stdout
