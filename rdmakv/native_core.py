"""The native core (native/build.py), loaded once for every module that uses it.

``rdmakv._native`` is required: the tcp transport's per-block loop
(native/rk_tcp.c), the node's index and request loop (rk_index.c,
rk_serve.c), and the client's calls (rk_call.c), each compiled once into one
shared object, so the receive-spin setting and counts are the process's. It
holds two modules: cffi's (:data:`ffi`, :data:`lib`) and rk_call.c's CPython
one (:data:`CALL`), made here from the same file. Installing rdmakv builds
it, or fails saying what is missing (setup.py).

``rdmakv._native_verbs``, the RDMA hot loop, is optional: it is built only
where libibverbs-dev is, and :func:`load_optional` says why it is missing.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

from rdmakv.errors import RdmakvError

CORE = "rdmakv._native"
CALL_MODULE = "rdmakv._native_call"
"""rk_call.c's module, in :data:`CORE`'s shared object (native/rk_call.c's init)."""
ENV_RECV_SPIN = "RDMAKV_TCP_RECV_SPIN_US"
"""Microseconds a native TCP receive polls for more bytes before it sleeps
(rk_tcp.h; 0 never spins), applied when the core loads."""


class NativeCoreMissing(RdmakvError, ImportError):
    """``rdmakv._native`` cannot be imported: rdmakv was not installed (built)."""


def _import_core() -> ModuleType:
    try:
        return importlib.import_module(CORE)
    except ImportError as exc:
        raise NativeCoreMissing(
            f"rdmakv's native core {CORE} is not built ({exc}): install rdmakv with pip, "
            "or run `python setup.py build_ext --inplace` in a source checkout"
        ) from exc


def _load_call(core: ModuleType) -> ModuleType:
    """rk_call.c's module, created from the core's shared object by its own
    init function (PEP 489, "multiple modules in one library")."""
    path = core.__file__
    assert path is not None
    loader = importlib.machinery.ExtensionFileLoader(CALL_MODULE, path)
    spec = importlib.util.spec_from_file_location(CALL_MODULE, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_core = _import_core()
FILE: str = _core.__file__ or CORE
"""Where the core was loaded from (``rdmakv doctor`` names it)."""
ffi: Any = _core.ffi
"""The core's cffi ``ffi``."""
lib: Any = _core.lib
"""The core's cffi ``lib``: rk_tcp.h, rk_index.h and rk_serve.h (native/build.py)."""
CALL: Any = _load_call(_core)
"""rk_call.c's functions (``flags_call``, ``get_call``, ``join_uniform``,
``live_handles``, ``configure``): :mod:`rdmakv.wire.batches` configures it."""


class NativeModule(NamedTuple):
    """An optional native module's cffi ``ffi`` and ``lib``, or (both None) why it is missing."""

    ffi: Any
    lib: Any
    error: str | None


def load_optional(name: str, what: str, hint: str = "") -> NativeModule:
    """``rdmakv.<name>``, described as ``what`` (and ``hint`` appended) when it is not built."""
    try:
        module = importlib.import_module(f"rdmakv.{name}")
    except ImportError as exc:
        return NativeModule(None, None, f"the {what} rdmakv.{name} is not built ({exc}){hint}")
    return NativeModule(module.ffi, module.lib, None)


def recv_spin_env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with :data:`ENV_RECV_SPIN` in ``env`` (default:
    ``os.environ``), or None (unset or valid). :func:`rdmakv.config.load_config`
    raises it, so every command and connector refuses to start on it."""
    return _recv_spin_problem(_recv_spin_raw(env), int(lib.RK_TCP_RECV_SPIN_MAX_US))


def _recv_spin_raw(env: Mapping[str, str] | None = None) -> str:
    """:data:`ENV_RECV_SPIN` as set in ``env`` (default ``os.environ``); "" when unset."""
    return (os.environ if env is None else env).get(ENV_RECV_SPIN, "").strip()


def _recv_spin_problem(raw: str, most: int) -> str | None:
    """Why ``raw`` is not a receive spin in microseconds of 0 to ``most``;
    None when it is one, or empty (unset)."""
    if not raw:
        return None
    try:
        if 0 <= int(raw) <= most:
            return None
    except ValueError:
        pass
    return f"{raw!r} is not an integer of 0 to {most} microseconds"


def _apply_recv_spin_env() -> None:
    """:data:`ENV_RECV_SPIN`, when set and valid, into the core's state, as
    the core loads (once per process). A bad value is not applied (the
    default stays) and is logged here, where importing must not fail; the
    configuration's loading refuses it (:func:`recv_spin_env_problem`)."""
    raw = _recv_spin_raw()
    problem = _recv_spin_problem(raw, int(lib.RK_TCP_RECV_SPIN_MAX_US))
    if problem:
        logging.getLogger("rdmakv.native_core").warning(
            "%s: %s: ignored, receives spin up to %d us", ENV_RECV_SPIN, problem,
            lib.rk_tcp_recv_spin_us())
    elif raw:
        lib.rk_tcp_set_recv_spin_us(int(raw))


_apply_recv_spin_env()
