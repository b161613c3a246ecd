"""Engine connectors: how vLLM and SGLang use rdmakv.

* :mod:`rdmakv.connectors.vllm` -- ``RdmakvConnector``, a vLLM v1 KV connector
  (imports vllm; load it with ``kv_connector_module_path``).
* :mod:`rdmakv.connectors.sglang` -- ``RdmakvHiCacheStorage``, an SGLang HiCache
  storage backend (imports sglang; load it with ``--hicache-storage-backend dynamic``).

Engine-independent parts, importable without any engine installed:

* :mod:`rdmakv.connectors.paged` -- block copies between paged KV tensors and slab blocks;
* :mod:`rdmakv.connectors.plan` -- scheduler-side request bookkeeping (what to load/save);
* :mod:`rdmakv.connectors.group_stores` -- options, and load/save execution over the
  per-KV-cache-group managers of a :class:`~rdmakv.engine.groups.HybridKVCacheManager`.

This package deliberately imports neither engine: ``import rdmakv.connectors``
works in any environment.
"""
