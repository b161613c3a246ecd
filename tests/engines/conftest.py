"""Set-up for tests against the REAL vLLM / SGLang classes (CPU only).

These tests need the engine venv (``bash deploy/engines.sh``). In any other
environment each module skips itself, unless ``RDMAKV_REQUIRE_ENGINES=1`` (set
by deploy/engines.sh), which turns a missing engine into an import failure.

Engine quirks handled here, in test set-up code (never by editing site-packages):

* vLLM resolves its platform at import: ``VLLM_TARGET_DEVICE=cpu`` must be set
  first, else ``VllmConfig()`` fails with "Failed to infer device type".
* sglang's host memory pool imports ``torchvision.transforms`` unconditionally
  (multimodal preprocessing), and no PyPI torchvision loads against the local
  torch 2.13.0 CPU build. We first let transformers cache "torchvision is not
  available" (otherwise it imports many torchvision symbols from whatever it
  finds), then put a minimal stand-in package on ``sys.path`` for the
  unconditional import. The stand-in raises on any attribute use, so a code
  path that really needs torchvision fails loudly instead of silently.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_TORCHVISION_STUB = '''
"""Test-only stand-in for torchvision (see tests/engines/conftest.py)."""
__version__ = "0.0.0+rdmakv-test-stub"


def __getattr__(name):
    raise AttributeError(f"torchvision stand-in has no {name!r}: this code path needs torchvision")
'''


def install_torchvision_stand_in(tmp_root: Path) -> None:
    """Make sglang's unconditional ``import torchvision.transforms`` succeed (see module doc)."""
    if importlib.util.find_spec("torchvision") is not None and "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401  # a working torchvision needs no stand-in

            return
        except Exception:  # noqa: BLE001 -- a broken wheel: fall through to the stand-in
            sys.modules.pop("torchvision", None)
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cache "absent" before the stand-in appears
    if import_utils.is_torchvision_available():
        return
    pkg = tmp_root / "torchvision"
    (pkg / "transforms").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_TORCHVISION_STUB))
    (pkg / "transforms" / "__init__.py").write_text(textwrap.dedent(_TORCHVISION_STUB))
    sys.path.insert(0, str(tmp_root))


@pytest.fixture(scope="session")
def torchvision_stand_in(tmp_path_factory: pytest.TempPathFactory) -> None:
    install_torchvision_stand_in(tmp_path_factory.mktemp("stubs"))
