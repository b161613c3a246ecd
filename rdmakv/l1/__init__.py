"""L1: the engine-side cache of KV blocks in the local slab.

``L1Cache`` maps block keys to slab blocks with byte capacity, pluggable
eviction (``policies``) and offload to the remote tier (``offload``).
"""

from rdmakv.l1.cache import L1Cache, L1Stats
from rdmakv.l1.offload import OffloadItem, OffloadMode, OffloadQueue
from rdmakv.l1.policies import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "FIFOPolicy",
    "L1Cache",
    "L1Stats",
    "LRUPolicy",
    "OffloadItem",
    "OffloadMode",
    "OffloadQueue",
    "S3FIFOPolicy",
    "make_policy",
]
