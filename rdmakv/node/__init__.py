"""The KV node: pool + index + leases (:mod:`store`), served over the wire (:mod:`server`).

``KVNode`` and ``KVStore`` are loaded on first use: a module that needs only a
name from here must not pull in the server, its metrics and the transports with
them. The node's defaults are :mod:`rdmakv.defaults`'s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rdmakv.defaults import DEFAULT_HOST, DEFAULT_PORT

if TYPE_CHECKING:
    from rdmakv.node.server import KVNode
    from rdmakv.node.store import KVStore

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "KVNode", "KVStore"]

_HOME = {
    "KVNode": "rdmakv.node.server",
    "KVStore": "rdmakv.node.store",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'rdmakv.node' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
