"""Trace replay: real request traces through L1, the offload policies and a node.

* :mod:`rdmakv.replay.trace` -- the trace format, its tokens, keys and future;
* :mod:`rdmakv.replay.fast` -- the fast replay (real L1 and policies, modelled node);
* :mod:`rdmakv.replay.stack` -- the real stack (``rdmakv serve`` + ``KVCacheManager``).

``bench/trace.py`` and ``docs/offload.md`` use them to judge offload policies.
"""

from rdmakv.replay.fast import NodeModel, replay_model
from rdmakv.replay.result import ReplayResult, ReplaySetup
from rdmakv.replay.trace import OracleOffload, Trace, TraceKeys, TraceRequest, load_trace

__all__ = [
    "NodeModel",
    "OracleOffload",
    "ReplayResult",
    "ReplaySetup",
    "Trace",
    "TraceKeys",
    "TraceRequest",
    "load_trace",
    "replay_model",
]
