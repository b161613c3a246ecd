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
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_TORCHVISION_STUB = '''
"""Test-only stand-in for torchvision (see tests/engines/conftest.py).

Module-level names resolve (sglang's multimodal modules bind them at import),
but calling anything raises: a code path that needs torchvision fails loudly.
"""
__version__ = "0.0.0+rdmakv-test-stub"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not installed (rdmakv test stand-in)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder
'''
_STUB_MODULES = ("torchvision", "torchvision/transforms")
_STUB_SUBMODULES = ("torchvision/transforms/functional.py", "torchvision/transforms/v2.py")


def install_torchvision_stand_in(tmp_root: Path) -> None:
    """Make sglang's unconditional ``import torchvision.transforms`` succeed (see module doc)."""
    if importlib.util.find_spec("torchvision") is not None and "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401  # a working torchvision needs no stand-in

            return
        except Exception:
            sys.modules.pop("torchvision", None)
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cache "absent" before the stand-in appears
    if import_utils.is_torchvision_available():
        return
    for pkg in _STUB_MODULES:
        (tmp_root / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_root / pkg / "__init__.py").write_text(_TORCHVISION_STUB)
    for mod in _STUB_SUBMODULES:
        (tmp_root / mod).write_text(_TORCHVISION_STUB)
    sys.path.insert(0, str(tmp_root))


@pytest.fixture(scope="session")
def torchvision_stand_in(tmp_path_factory: pytest.TempPathFactory) -> None:
    install_torchvision_stand_in(tmp_path_factory.mktemp("stubs"))
