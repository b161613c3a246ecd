"""The KV node: pool + index + leases (:mod:`store`), served over the wire (:mod:`server`)."""

from rdmakv.node.server import DEFAULT_HOST, DEFAULT_PORT, KVNode
from rdmakv.node.store import KVStore

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "KVNode", "KVStore"]
