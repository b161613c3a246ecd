"""L1: the engine-side cache of KV blocks in the local slab.

``L1Cache`` maps block keys to slab blocks with byte capacity, pluggable
eviction (``policies``) and offload to the remote tier: which blocks go is an
offload policy (``offload_policies``), how they go a bounded queue (``offload``).
"""

from rdmakv.l1.cache import L1Cache, L1Stats
from rdmakv.l1.offload import OffloadItem, OffloadQueue
from rdmakv.l1.offload_policies import (
    OFFLOAD_MODES,
    AllOffload,
    ColdOffload,
    HotOffload,
    NoOffload,
    OffloadMode,
    OffloadPolicy,
    ReuseOffload,
    make_offload_policy,
)
from rdmakv.l1.policies import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)

__all__ = [
    "OFFLOAD_MODES",
    "POLICIES",
    "AllOffload",
    "ColdOffload",
    "EvictionPolicy",
    "FIFOPolicy",
    "HotOffload",
    "L1Cache",
    "L1Stats",
    "LRUPolicy",
    "NoOffload",
    "OffloadItem",
    "OffloadMode",
    "OffloadPolicy",
    "OffloadQueue",
    "ReuseOffload",
    "S3FIFOPolicy",
    "make_offload_policy",
    "make_policy",
]
