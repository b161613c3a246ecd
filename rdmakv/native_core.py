"""The optional native core: the cffi modules ``native/build.py`` builds.

Each one is optional. A host without a C compiler (or, for the verbs core,
without libibverbs-dev) still installs rdmakv, and the module that uses a
missing one falls back to Python or says why it cannot run. So every one is
loaded the same way, and where a user of one can be told to run without it
(for comparison, and to test the fallback), the switch is an environment
variable set to ``0``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, NamedTuple


class NativeModule(NamedTuple):
    """One native module's cffi ``ffi`` and ``lib``, or (both None) why it is missing."""

    ffi: Any
    lib: Any
    error: str | None


def load(name: str, what: str, hint: str = "") -> NativeModule:
    """``rdmakv.<name>``, described as ``what`` (and ``hint`` appended) when it is not built."""
    try:
        module = importlib.import_module(f"rdmakv.{name}")
    except ImportError as exc:
        return NativeModule(None, None, f"the {what} rdmakv.{name} is not built ({exc}){hint}")
    return NativeModule(module.ffi, module.lib, None)


def load_extension(name: str, what: str) -> tuple[ModuleType | None, str | None]:
    """``rdmakv.<name>``, a CPython extension (no cffi ``ffi`` / ``lib``), or
    (None, why) when it is not built."""
    try:
        return importlib.import_module(f"rdmakv.{name}"), None
    except ImportError as exc:
        return None, f"the {what} rdmakv.{name} is not built ({exc})"


def state(error: str | None, env: str) -> str:
    """One piece of the native core as ``rdmakv doctor`` reports it for a new
    process: "on", "off (ENV=0)", or "not built (why)"."""
    if error is not None:
        return f"not built ({error})"
    return f"off ({env}=0)" if switched_off(env) else "on"


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` asks to run without a native module."""
    return os.environ.get(env, "1") == "0"
