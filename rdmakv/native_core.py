"""The optional native core: the cffi modules ``native/build.py`` builds.

Each one is optional. A host without a C compiler (or, for the verbs core,
without libibverbs-dev) still installs rdmakv, and the module that uses a
missing one falls back to Python or says why it cannot run. So every one is
loaded the same way, and where a user of one can be told to run without it
(for comparison, and to test the fallback), the switch is an environment
variable set to ``0``.

native/rk_tcp.c is compiled into several of them (the TCP loop, the node's
index and request loop, the client's call), each with statics of its own; its
receive-spin setting and counts are the process's because every module is
pointed at :data:`TCP_CORE`'s as it loads here.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

TCP_CORE = "_native_tcp"
"""The module whose copy of native/rk_tcp.c holds the process's receive-spin
state; the other modules compiled with rk_tcp.c are pointed at it as they load."""
ENV_RECV_SPIN = "RDMAKV_TCP_RECV_SPIN_US"
"""Microseconds a native TCP receive polls for more bytes before it sleeps
(rk_tcp.h; 0 never spins), applied when :data:`TCP_CORE` first loads."""


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
    if name == TCP_CORE:
        _apply_recv_spin_env(module.lib)
    elif hasattr(module.lib, "rk_tcp_share_recv_spin"):
        _share_recv_spin(module.lib.rk_tcp_share_recv_spin)
    return NativeModule(module.ffi, module.lib, None)


def load_extension(name: str, what: str) -> tuple[ModuleType | None, str | None]:
    """``rdmakv.<name>``, a CPython extension (no cffi ``ffi`` / ``lib``), or
    (None, why) when it is not built."""
    try:
        module = importlib.import_module(f"rdmakv.{name}")
    except ImportError as exc:
        return None, f"the {what} rdmakv.{name} is not built ({exc})"
    if hasattr(module, "share_recv_spin"):
        _share_recv_spin(module.share_recv_spin)
    return module, None


_recv_spin_env_applied = False


def recv_spin_env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with :data:`ENV_RECV_SPIN` in ``env`` (default:
    ``os.environ``), or None (unset, valid, or no native TCP core to apply it
    to). :func:`rdmakv.config.load_config` raises it, so every command and
    connector refuses to start on it."""
    tcp = load(TCP_CORE, "native TCP core")
    if tcp.lib is None:
        return None
    return _recv_spin_problem(_recv_spin_raw(env), int(tcp.lib.RK_TCP_RECV_SPIN_MAX_US))


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


def _apply_recv_spin_env(tcp_lib: Any) -> None:
    """:data:`ENV_RECV_SPIN`, when set and valid, into :data:`TCP_CORE`'s
    state, once per process. A bad value is not applied (the default stays)
    and is logged here, where importing must not fail; the configuration's
    loading refuses it (:func:`recv_spin_env_problem`)."""
    global _recv_spin_env_applied
    if _recv_spin_env_applied:
        return
    _recv_spin_env_applied = True
    raw = _recv_spin_raw()
    problem = _recv_spin_problem(raw, int(tcp_lib.RK_TCP_RECV_SPIN_MAX_US))
    if problem:
        logging.getLogger("rdmakv.native_core").warning(
            "%s: %s: ignored, receives spin up to %d us", ENV_RECV_SPIN, problem,
            tcp_lib.rk_tcp_recv_spin_us())
    elif raw:
        tcp_lib.rk_tcp_set_recv_spin_us(int(raw))


def _share_recv_spin(share: Callable[[int], None]) -> None:
    """Point a module's copy of rk_tcp.c at :data:`TCP_CORE`'s receive-spin
    state (where that is not built, the copy keeps its own, at the default)."""
    tcp = load(TCP_CORE, "native TCP core")
    if tcp.lib is not None:
        share(int(tcp.lib.rk_tcp_recv_spin_state()))


def state(error: str | None, env: str) -> str:
    """One piece of the native core as ``rdmakv doctor`` reports it for a new
    process: "on", "off (ENV=0)", or "not built (why)"."""
    if error is not None:
        return f"not built ({error})"
    return f"off ({env}=0)" if switched_off(env) else "on"


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` asks to run without a native module."""
    return os.environ.get(env, "1") == "0"
