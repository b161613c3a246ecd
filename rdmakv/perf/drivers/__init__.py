"""The systems ``rdmakv bench`` knows, by the name they carry in the JSON.

:func:`make_driver` builds one; a peer's module (and the package it wraps) is
imported only then, so a peer that is missing here becomes
:class:`~rdmakv.perf.driver.PeerUnavailable` with the reason -- never an
ImportError when ``rdmakv bench`` starts.

Factories are called as ``factory(transport, server=None)``:

* ``transport`` is the run's transport (``"tcp"`` or ``"rdma"``); a driver that
  cannot use it raises PeerUnavailable from ``open()`` (or from the factory).
* ``server`` (concurrency runs): the address of a server another driver of the
  same system already started. A driver given one connects to it instead of
  starting its own. A driver that can share its server sets the attribute
  ``server`` (a string) once ``open()`` has started it; the concurrency
  runner opens one such *owner* driver, then one driver per client process
  with ``server=owner.server``. A driver without the attribute is reported as
  ``{"error": ...}`` in the concurrency section.

Optional driver attributes the runner uses when present:

* ``discard(keys)``: drop stored keys; called (untimed) after each repeat so
  stores that never evict stay within memory.
* ``reconnect()``: drop the driver's connections and open new ones to the
  same server (what it stores may go: every repeat puts before it gets).
  Called (untimed) before each repeat after the first, so that repeats are
  independent draws of a connection (``fresh_connections`` in the JSON);
  rdmakv, the socket loop and Redis have it.
* ``min_repeats``: a size is measured at least this many times, for every
  system in the run alike (the ceiling's "best of several runs", with no
  system given fewer draws than the one it is compared with).
* ``has_exists`` = False: the system has no lookup (latency skips ``exists``).
* ``self_timed`` = True: after ``put``/``get``, ``last_seconds`` is the time the
  system measured itself for those bytes (perftest), used instead of wall time.
* ``moves_keys`` = False: the system stores nothing (perftest): nothing is read
  back or verified (``bytes_verified`` 0) and latency skips it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from rdmakv.client.streams import default_streams
from rdmakv.perf.driver import Driver, PeerUnavailable

Factory = Callable[..., Driver]
"""``factory(transport, server=None) -> Driver``."""

# name -> (module, class, extra keyword arguments the class takes).
_LAZY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "rdmakv": ("rdmakv.perf.drivers.rdmakv_node", "RdmakvDriver", {}),
    "rdmakv_streams1": ("rdmakv.perf.drivers.rdmakv_node", "RdmakvDriver", {"streams": 1}),
    "rdmakv_streams2": ("rdmakv.perf.drivers.rdmakv_node", "RdmakvDriver", {"streams": 2}),
    "socket_loop": ("rdmakv.perf.drivers.socket_loop", "SocketLoopDriver", {}),
    "redis": ("rdmakv.perf.drivers.redis", "RedisDriver", {}),
    "mooncake_te": ("rdmakv.perf.drivers.mooncake", "MooncakeTEDriver", {}),
    "infinistore": ("rdmakv.perf.drivers.infinistore", "InfiniStoreDriver", {}),
    "perftest": ("rdmakv.perf.drivers.perftest", "PerftestDriver", {}),
    "perftest_q2": ("rdmakv.perf.drivers.perftest", "PerftestDriver", {"qps": 2}),
}

_EXTRA: dict[str, Factory] = {}
"""Factories added with :func:`register` (they win over the built-in names)."""

CEILING = "socket_loop"
OURS = "rdmakv"
OURS_VARIANTS = ("rdmakv_streams1", "rdmakv_streams2")
"""rdmakv in a configuration other than its default (:func:`rdmakv.client.streams.default_streams`:
``rdmakv`` is 2 connections over RDMA; over TCP 2 on a host of 2 usable CPUs or
more, else 1): ``streams=1``, one connection (one queue pair, perftest's
like), and ``streams=2``, two with a big batch split across them.
Throughput only: latency batches are never split, so there it is ``rdmakv``
itself."""
FATAL = frozenset({OURS, *OURS_VARIANTS, CEILING})
"""Systems whose failure fails the whole run (they never skip)."""

_DEFAULT_SYSTEMS = {
    "tcp": ("rdmakv", *OURS_VARIANTS, "socket_loop", "redis", "mooncake_te"),
    "rdma": ("rdmakv", *OURS_VARIANTS, "perftest", "perftest_q2", "infinistore", "mooncake_te"),
}


def default_systems(transport: str) -> tuple[str, ...]:
    """The systems a run measures unless told: every peer, the ceilings, and
    ``rdmakv`` beside the variant that is NOT its default on this host (that
    one would only measure ``rdmakv`` twice)."""
    same = f"{OURS}_streams{default_streams(transport)}"
    return tuple(s for s in _DEFAULT_SYSTEMS.get(transport, _DEFAULT_SYSTEMS["tcp"]) if s != same)


def register(name: str, factory: Factory) -> None:
    """Add (or replace) a system; tests use this to inject a failing peer."""
    _EXTRA[name] = factory


def unregister(name: str) -> None:
    _EXTRA.pop(name, None)


def known_systems() -> list[str]:
    return sorted({*_LAZY, *_EXTRA})


def _lazy_factory(name: str) -> Factory:
    module_name, cls_name, extra = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PeerUnavailable(f"{name}: cannot import its driver ({module_name}): {e}") from e
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise PeerUnavailable(f"{name}: {module_name} has no {cls_name}")

    params = inspect.signature(cls).parameters
    any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def factory(transport: str, server: str | None = None) -> Driver:
        kwargs = dict(extra)
        # Mooncake's driver names its transport "protocol", as Mooncake does.
        for arg in ("protocol", "transport"):
            if arg in params:
                kwargs[arg] = transport
                break
        else:
            if any_kw:
                kwargs["transport"] = transport
        if server is not None:
            if "server" not in params and not any_kw:
                raise PeerUnavailable(f"{name}: its driver cannot join a running server")
            kwargs["server"] = server
        driver: Driver = cls(**kwargs)
        return driver

    return factory


def make_driver(name: str, transport: str, server: str | None = None) -> Driver:
    """A new, unopened driver for ``name``; PeerUnavailable if it cannot be built here."""
    if name in _EXTRA:
        return _EXTRA[name](transport, server=server)
    if name not in _LAZY:
        raise PeerUnavailable(
            f"unknown system {name!r} (known: {', '.join(known_systems())})"
        )
    try:
        return _lazy_factory(name)(transport, server=server)
    except PeerUnavailable:
        raise
    except Exception as e:  # a peer package that breaks while being set up
        raise PeerUnavailable(f"{name}: {type(e).__name__}: {e}") from e
