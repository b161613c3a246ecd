"""rdmakv: RDMA-first KV-cache transport for LLM inference."""

from rdmakv.errors import RdmakvError
from rdmakv.slab import Slab

__all__ = ["RdmakvError", "Slab"]
__version__ = "0.1.0"
