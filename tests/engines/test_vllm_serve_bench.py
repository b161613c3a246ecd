"""bench/serve.py end to end on a tiny slice: the real vLLM scheduler, the real
connector in both roles, real ``rdmakv serve`` nodes over TCP.

Checks the output's shape, that every block checked was right, that the rdmakv
configurations really loaded blocks from the node, and that a block corrupted
after a real load IS caught by the stand-in's check (the corruption wraps the
worker connector's real load; nothing else changes). No timing assertions: the
figures depend on the machine.

Named ``test_vllm_serve_*`` so that it runs after ``test_vllm_connector.py``: both
set up vLLM's distributed state in this process; bench/serve.py reuses it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("vllm", reason="needs the engine venv: bash deploy/engines.sh")

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH_DIR = ROOT / "bench"
SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"
RUN_TIMEOUT_S = 540
START = 246
"""Four short prompts of the committed slice; one continues an earlier conversation."""
TINY = ["--trace", str(SLICE), "--start", str(START), "--requests", "4", "--output-cap", "4"]
CONFIG_KEYS = {
    "ttft_p50_s", "ttft_p99_s", "ttft_hit_p50_s", "itl_p50_s", "itl_p99_s", "tokens_per_s",
    "hit_rate", "bytes_moved", "wrong_blocks",
}


def _serve_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rdmakv_bench_serve", BENCH_DIR / "serve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tiny_slice_end_to_end_shape_hits_and_no_wrong_block(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH_DIR / "serve.py"), *TINY, "--stall", "2", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, Any] = json.loads(r.stdout)
    assert result == json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert set(result) >= {"configs", "cost_model", "meta"}
    configs = result["configs"]
    assert list(configs) == ["prefix_only", "rdmakv_async", "rdmakv_sync", "rdmakv_async_stall"]
    for name, res in configs.items():
        assert set(res) >= CONFIG_KEYS, (name, CONFIG_KEYS - set(res))
        assert res["requests"] == res["finished"] == 4, name
        assert res["wrong_blocks"] == 0 and res["wrong_local_blocks"] == 0, name
        if name == "prefix_only":
            assert res["bytes_moved"] == 0 and res["hit_requests"] == 0
            continue
        assert "ttft_recompute_p50_s" in res
        # The earlier turn, saved by the earlier engine, came back from the node.
        assert res["hit_requests"] > 0, name
        assert res["bytes_moved"] > 0 and res["verified_remote_blocks"] > 0, name
        assert res["hit_rate"] > 0, name
    assert configs["rdmakv_async_stall"]["stall"]["seconds"] > 0
    cost = result["cost_model"]
    assert cost["model"] and cost["gpu"] and cost["gpu_figures"]["source"]
    assert cost["kv_bytes_per_token_held"] * cost["block_tokens"] == cost["block_bytes_held"]


def test_a_block_corrupted_after_a_real_load_is_caught() -> None:
    serve = _serve_module()
    trace = serve.load_trace(SLICE)
    plan = serve.Plan(
        trace, START, 4, 4, serve.TIME_SCALE, 0.0, serve._model_dir(), serve.CostModel()
    )
    flipped: list[int] = []

    def corrupt_first_load(eng: Any) -> None:
        stores = eng.worker.stores
        real_load = stores.load

        def load(transfer: Any, *args: Any, **kwargs: Any) -> set[int]:
            failed: set[int] = real_load(transfer, *args, **kwargs)
            ok = [b for b in transfer.engine_block_ids(0) if b not in failed]
            if ok and not flipped:  # one bit of one loaded block, in vLLM's paged tensor
                words = eng.words[eng.layers[0]]
                words[min(ok), 0, 0, 0] ^= 1
                flipped.append(min(ok))
            return failed

        stores.load = load

    res = serve.run_config("rdmakv_async", plan, on_engine=corrupt_first_load)
    assert flipped, "no block was loaded from the node"
    assert res["wrong_blocks"] == 1
    # The bad block entered vLLM's prefix cache with the load: a later request that
    # hits it there is caught again (as a local block); that is right, not double work.
    assert serve.exit_status({"rdmakv_async": res}) == 1
    res["wrong_blocks"] = res["wrong_local_blocks"] = 0
    assert serve.exit_status({"rdmakv_async": res}) == 0
