"""rdmakv: RDMA-first KV-cache transport for LLM inference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdmakv.errors import RdmakvError

if TYPE_CHECKING:
    from rdmakv.blocks.slab import Slab

__all__ = ["RdmakvError", "Slab"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Slab brings numpy and the native core; every ``import rdmakv.<module>`` runs this
    # file first, so importing it eagerly would make even rdmakv.config pay for them.
    if name == "Slab":
        from rdmakv.blocks.slab import Slab

        return Slab
    raise AttributeError(f"module 'rdmakv' has no attribute {name!r}")
