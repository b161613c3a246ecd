"""The engine side: the in-process cache an inference engine talks to.

* :mod:`rdmakv.engine.manager` -- :class:`~rdmakv.engine.manager.KVCacheManager`,
  the engine-facing API (lookups, acquire and release, saves, prefetch, TP);
* :mod:`rdmakv.engine.l1` -- the L1 cache of blocks in the local slab, its
  eviction policies, offload policies and offload queue;
* :mod:`rdmakv.engine.hybrid` -- KV cache group specs of hybrid models and their
  common prefix hit;
* :mod:`rdmakv.engine.groups` -- :class:`~rdmakv.engine.groups.HybridKVCacheManager`,
  the one class that keeps a manager per KV cache group.

The connectors (:mod:`rdmakv.connectors`) sit on top of this package.
"""
