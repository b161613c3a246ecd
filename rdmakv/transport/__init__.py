"""Transports by name: ``"tcp"`` (built in), ``"rdma"`` (registered by its module), ``"auto"``.

A transport module registers itself with :func:`register_transport` when
imported; :data:`_BUILTIN_MODULES` lists the modules imported on demand, so a
caller only ever names a transport. ``"auto"`` resolves to ``"rdma"`` when that
module imports, says it is usable, and the node offers it; else ``"tcp"``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from rdmakv.errors import ConfigError, UnsupportedTransport
from rdmakv.transport.base import (
    IoFuture,
    IoOp,
    NodeDataPath,
    NodeDataPathFactory,
    NodeHandler,
    NodeSession,
    Transport,
    TransportFactory,
)

__all__ = [
    "IoFuture",
    "IoOp",
    "NodeDataPath",
    "NodeHandler",
    "NodeSession",
    "Transport",
    "TransportSpec",
    "available_transports",
    "get_transport",
    "register_transport",
    "resolve_transport",
]

log = logging.getLogger(__name__)

AUTO = "auto"
_BUILTIN_MODULES = {"tcp": "rdmakv.transport.tcp", "rdma": "rdmakv.transport.rdma"}


@dataclass(frozen=True)
class TransportSpec:
    """A named transport: its client factory, node data path, and a usability probe."""

    name: str
    client: TransportFactory
    node: NodeDataPathFactory
    usable: Callable[[], bool] = lambda: True


_REGISTRY: dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec) -> None:
    """Make ``spec.name`` selectable (called by a transport module at import)."""
    if spec.name == AUTO:
        raise ConfigError(f"{AUTO!r} is reserved for automatic selection")
    _REGISTRY[spec.name] = spec


def get_transport(name: str) -> TransportSpec:
    """The spec for a concrete transport name (imports its module on first use)."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        try:
            importlib.import_module(_BUILTIN_MODULES[name])
        except ImportError as e:
            raise UnsupportedTransport(f"transport {name!r} is not available here: {e}") from e
    if name not in _REGISTRY:
        known = sorted({*_REGISTRY, *_BUILTIN_MODULES, AUTO})
        raise UnsupportedTransport(f"unknown transport {name!r}; choose one of {known}")
    return _REGISTRY[name]


def available_transports() -> list[str]:
    """Concrete transports that import and report themselves usable on this host."""
    out = []
    for name in _BUILTIN_MODULES:
        try:
            spec = get_transport(name)
        except ConfigError:
            continue
        if spec.usable():
            out.append(name)
    return out


def resolve_transport(name: str, offered: tuple[str, ...] | None = None) -> str:
    """Map ``name`` (possibly ``"auto"``) to a concrete transport, logging the choice.

    ``offered`` is what the peer node supports; ``None`` means "don't care"
    (node side).
    """
    if name != AUTO:
        get_transport(name)
        if offered is not None and name not in offered:
            raise UnsupportedTransport(
                f"transport {name!r} requested but the node offers only {list(offered)}"
            )
        return name
    for cand in ("rdma", "tcp"):
        if offered is not None and cand not in offered:
            continue
        try:
            spec = get_transport(cand)
        except ConfigError:
            continue
        if spec.usable():
            log.info("transport auto -> %s", cand)
            return cand
    raise UnsupportedTransport(f"no usable transport (node offers {list(offered or ())})")


def _register_tcp() -> None:
    from rdmakv.transport.tcp.client_side import TcpTransport
    from rdmakv.transport.tcp.node_side import TcpNodeDataPath

    register_transport(TransportSpec("tcp", TcpTransport, TcpNodeDataPath))


_register_tcp()
