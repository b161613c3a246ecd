"""L1: the engine-side cache of KV blocks in the local slab.

``L1Cache`` maps block keys to slab blocks with byte capacity, pluggable
eviction (``policies``) and offload to the remote tier: which blocks go is an
offload policy (``offload_policies``), how they go a bounded queue (``offload``).
"""

from rdmakv.engine.l1.cache import L1Cache, L1Stats
from rdmakv.engine.l1.offload import OffloadItem, OffloadQueue
from rdmakv.engine.l1.offload_policies import (
    OFFLOAD_MODES,
    AllOffload,
    ColdOffload,
    HotOffload,
    KeepHint,
    NoOffload,
    OffloadMode,
    OffloadPolicy,
    ReuseOffload,
    block_keep,
    check_keep_hint,
    make_offload_policy,
)
from rdmakv.engine.l1.policies import (
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
    "KeepHint",
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
    "block_keep",
    "check_keep_hint",
    "make_offload_policy",
    "make_policy",
]
