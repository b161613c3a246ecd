"""bench/vllm_tier_trace.py's replay on the committed 300-request slice of the
conversation trace: vLLM's REAL TieringOffloadingManager with rdmakv's tier,
real ``rdmakv serve`` nodes over TCP.

The whole slice, not a 30-60 request window: the trace's conversations
continue minutes later, so inside any 60 consecutive requests the only reuse
is the shared first block, which never leaves vLLM's CPU tier; over the 300
requests later turns find their earlier turns' chunks evicted from the CPU
tier (5% of the distinct chunks) and promoted from the node.

Checks what could go wrong: every hit chunk's bytes are its key's (promoted
ones included); ``all`` really hits in the rdmakv tier and keeps exactly the
hits of rdmakv's connector model on the same slice (with an unbounded node,
every chunk computed before is a hit, whoever evicts); ``reuse`` with a
budget of 0.5 sends fewer bytes and keeps fewer remote hits; no lookup ran
into its deadline. No timing assertions.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("vllm", reason="needs the engine venv: bash deploy/engines.sh")

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent.parent
SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"


def _bench() -> ModuleType:
    path = ROOT / "bench" / "vllm_tier_trace.py"
    spec = importlib.util.spec_from_file_location("rdmakv_bench_vllm_tier_trace", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_slice_all_and_reuse_bytes_hits_and_no_wrong_chunk() -> None:
    bench = _bench()
    trace = bench.load_trace(SLICE)
    out = bench.replay(trace, bench.parse_modes("all,reuse@0.5"), cpu_share=0.05)
    assert out["requests"] == 300 and out["cpu_chunks"] >= out["largest_request_chunks"]
    every, reuse = out["configs"]["all"], out["configs"]["reuse@0.5"]
    for res in (every, reuse):
        assert res["wrong_chunks"] == 0
        assert res["lookup_deadlines"] == 0
        assert res["tier"]["failed_store_chunks"] == 0 and res["tier"]["failed_load_chunks"] == 0
        assert res["hits"] == res["cpu_hits"] + res["remote_hits"]
        assert res["looked_up"] == out["looked_up_chunks"]
    # all: every distinct chunk goes to the node, and later turns load from it
    assert every["stored_chunks"] == out["distinct_chunks"]
    assert every["remote_hits"] > 0 and every["tier"]["loaded_chunks"] >= every["remote_hits"]
    assert every["hits"] == every["connector"]["hits"]
    # reuse@0.5: about half the bytes, and hits given up for them
    assert 0 < reuse["put_bytes"] < every["put_bytes"]
    assert reuse["bytes_vs_all"] < 0.75
    assert reuse["tier"]["declined_chunks"] > 0
    assert reuse["remote_hits"] < every["remote_hits"]
    assert out["wrong_chunks"] == 0
