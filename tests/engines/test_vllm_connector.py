"""RdmakvConnector against the real vLLM 0.33 classes, on CPU, with a real ``rdmakv serve``.

What is real here: vLLM's connector factory (``kv_connector_module_path``),
``VllmConfig``'s HMA check, the real ``Scheduler`` (it calls the scheduler-side
connector itself), KV cache tensors from vLLM's own planner and allocator
(``get_kv_cache_configs`` + ``allocate_kv_cache``: the ``[B, H, N, C]`` views of
one shared buffer), the worker connector built by
``ensure_kv_transfer_initialized``, and the worker lifecycle of
``KVConnectorModelRunnerMixin.kv_connector_no_forward`` (bind metadata,
start_load_kv, wait_for_save, transfer results, load errors).

What is simulated: the model forward. ``fake_forward`` writes, for every token
the scheduler computes this step, a KV value that depends only on the token,
its position and the layer, just as real KV depends only on the prefix; it runs
before the worker lifecycle (loads and saves never touch the blocks it writes
in the same step). A block loaded from rdmakv is never written by it, so equal
values prove the bytes came through rdmakv.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("vllm", reason="needs the engine venv: bash deploy/engines.sh")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    supports_hma,
)
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from rdmakv.connectors.vllm import RdmakvConnector
from rdmakv.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
HEADS = 2
HEAD = 8
WINDOW = 32
NUM_BLOCKS_BUDGET = 64
MAX_LEN = 256  # the KV budget must fit one request of this length
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": len(LAYERS),
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHARED = list(range(100, 164))  # 4 full blocks shared by both requests
PROMPT_A = [*SHARED, 7, 8, 9, 10, 11, 12]
PROMPT_B = [*SHARED, 20, 21, 22, 23, 24, 25]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model directory with only a config.json: enough for ModelConfig offline."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_dist_ready: list[bool] = []


def kv_value(token: int, pos: int, layer: int) -> torch.Tensor:
    """The fake KV of one token in one layer: [heads, K+V channels]."""
    base = torch.arange(HEADS * 2 * HEAD, dtype=torch.float32).view(HEADS, 2 * HEAD)
    return base * 0.001 + token + pos * 0.01 + layer * 0.5


class Engine:
    """One vLLM instance's scheduler + worker connector over real vLLM objects (CPU)."""

    def __init__(
        self,
        model_dir: Path,
        node: str,
        *,
        hybrid: bool,
        layout_name: str = "NHD",
        options: dict[str, Any] | None = None,
    ) -> None:
        ktc = KVTransferConfig(
            kv_connector="RdmakvConnector",
            kv_connector_module_path="rdmakv.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "node": node,
                "transport": "tcp",
                "l1_bytes": "4MiB",
                "lock_slab": False,
                "timeout": 5,
                **(options or {}),
            },
        )
        mc = ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32"
        )
        vc = VllmConfig(
            model_config=mc,
            # vLLM's own prefix cache off: every hit must come from rdmakv.
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=256,
                max_model_len=MAX_LEN,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=ktc,
        )
        self.vc = vc
        fa = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
        )
        specs: dict[str, Any] = {LAYERS[0]: fa, LAYERS[1]: fa}
        if hybrid:
            specs[LAYERS[1]] = SlidingWindowSpec(
                block_size=BLOCK,
                num_kv_heads=HEADS,
                head_size=HEAD,
                dtype=torch.float32,
                sliding_window=WINDOW,
            )
        # "NHD" gives strided [B, H, N, C] views, "HND" contiguous ones (the CPU backend's).
        layout = resolve_kv_cache_layout(vc, [[layout_name]], specs.values())
        vc.cache_config.kv_cache_layout = layout.name
        groups = get_global_kv_cache_groups(vc, [specs])
        budget = fa.page_size_bytes * len(LAYERS) * NUM_BLOCKS_BUDGET
        (kcc,) = get_kv_cache_configs(vc, [specs], [budget], groups)
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.kcc = kcc
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), layout)
        self.layer_of = {name: i for i, name in enumerate(LAYERS)}
        self.group_layers = [list(g.layer_names) for g in kcc.kv_cache_groups]
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
        )
        with set_current_vllm_config(vc):
            if not _dist_ready:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    local_rank=0,
                    backend="gloo",
                )
                initialize_model_parallel(1, 1)
                _dist_ready.append(True)
            # One worker connector per process in vLLM: forget the previous test's.
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            kv_transfer_state.ensure_kv_transfer_initialized(vc, kcc)
        self.worker = kv_transfer_state.get_kv_transfer_group()
        self.worker.register_kv_caches(self.kv)  # what GPUModelRunner.initialize_kv_cache does
        self.requests: dict[str, Request] = {}
        self.blocks: dict[str, list[list[int]]] = {}

    @property
    def connector(self) -> RdmakvConnector:
        c = self.sched.connector
        assert isinstance(c, RdmakvConnector)
        return c

    def add(
        self, req_id: str, prompt: list[int], kv_transfer_params: dict[str, Any] | None = None
    ) -> Request:
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(max_tokens=2, ignore_eos=True, extra_args=extra)
        req = Request(req_id, prompt, params, None)
        self.requests[req_id] = req
        self.sched.add_request(req)
        return req

    def fake_forward(self, out: Any) -> None:
        """Write KV for the tokens computed this step (see the module docstring)."""
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(b) for b in new.block_ids]
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                if req_id in cached.resumed_req_ids:
                    self.blocks[req_id] = [list(b) for b in ids]
                else:
                    for have, more in zip(self.blocks[req_id], ids, strict=True):
                        have.extend(more)
            starts[req_id] = cached.num_computed_tokens[i]
        for req_id, n in out.num_scheduled_tokens.items():
            tokens = self.requests[req_id].all_token_ids
            for pos in range(starts[req_id], starts[req_id] + n):
                for g, names in enumerate(self.group_layers):
                    bid = self.blocks[req_id][g][pos // BLOCK]
                    for name in names:
                        layer = self.layer_of[name]
                        self.kv[name][bid, :, pos % BLOCK, :] = kv_value(tokens[pos], pos, layer)

    def step(self) -> tuple[Any, Any]:
        out = self.sched.schedule()
        self.fake_forward(out)
        with set_current_vllm_config(self.vc):
            mro = copy.copy(KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.vc))
        ids = list(out.num_scheduled_tokens)
        mro.req_ids = ids
        mro.req_id_to_index = {r: i for i, r in enumerate(ids)}
        mro.sampled_token_ids = [[5] for _ in ids]
        self.sched.update_from_output(out, mro)
        return out, mro

    def run(self, req: Request, max_steps: int = 12) -> list[tuple[Any, Any]]:
        steps = []
        for _ in range(max_steps):
            steps.append(self.step())
            if req.is_finished():
                return steps
        raise AssertionError(f"request {req.request_id} did not finish in {max_steps} steps")

    def blocks_hold(self, req_id: str, prompt: list[int], n_blocks: int) -> bool:
        """Whether the request's first ``n_blocks`` blocks hold the fake KV of ``prompt``."""
        for g, names in enumerate(self.group_layers):
            for b in range(n_blocks):
                bid = self.blocks[req_id][g][b]
                if bid == 0:
                    continue  # null block: the window moved past it
                for name in names:
                    layer = self.layer_of[name]
                    for slot in range(BLOCK):
                        pos = b * BLOCK + slot
                        want = kv_value(prompt[pos], pos, layer)
                        if not torch.equal(self.kv[name][bid, :, slot, :], want):
                            return False
        return True

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


@pytest.fixture
def engines(model_dir: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(
        node: str,
        *,
        hybrid: bool = False,
        layout: str = "NHD",
        options: dict[str, Any] | None = None,
    ) -> Engine:
        e = Engine(model_dir, node, hybrid=hybrid, layout_name=layout, options=options)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
    kv_transfer_state._KV_CONNECTOR_AGENT = None


def _fill_cache(
    engines: Callable[..., Engine], node: str, hybrid: bool, layout: str = "NHD"
) -> None:
    """Engine A computes PROMPT_A and saves its prompt blocks; wait until they reach the node."""
    a = engines(node, hybrid=hybrid, layout=layout)
    a.run(a.add("a", PROMPT_A))
    assert a.worker.stores.stats.saved_blocks == 4 * len(a.group_layers)
    assert a.worker.stores.flush(10.0)


# ------------------------------------------------------------------------------------------
def test_factory_loads_connector_by_module_path_and_keeps_hma(node_factory: Any) -> None:
    node = node_factory()
    ktc = KVTransferConfig(
        kv_connector="RdmakvConnector",
        kv_connector_module_path="rdmakv.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"node": node.endpoint, "transport": "tcp", "model": "m"},
    )
    vc = VllmConfig(kv_transfer_config=ktc)
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls is RdmakvConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert supports_hma(cls)
    # A SupportsHMA connector leaves vLLM's hybrid KV cache manager on.
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    fa = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    kcc = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, fa)]
    )
    conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        assert isinstance(conn, RdmakvConnector)
        assert conn.requires_kv_delivery is False
    finally:
        conn.shutdown()


def test_unknown_option_is_refused_by_name(node_factory: Any) -> None:
    node = node_factory()
    ktc = KVTransferConfig(
        kv_connector="RdmakvConnector",
        kv_connector_module_path="rdmakv.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"node": node.endpoint, "l1_size": "1GiB", "model": "m"},
    )
    vc = VllmConfig(kv_transfer_config=ktc)
    fa = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    kcc = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, fa)]
    )
    with pytest.raises(ConfigError, match="l1_size"):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)


@pytest.mark.parametrize(("layout_a", "layout_b"), [("NHD", "NHD"), ("HND", "NHD")])
def test_single_group_prefix_saved_by_one_engine_is_loaded_by_another(
    layout_a: str, layout_b: str, node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    # Stored bytes are layout independent: an HND engine's blocks load into an NHD one.
    _fill_cache(engines, node.endpoint, hybrid=False, layout=layout_a)

    b = engines(node.endpoint, layout=layout_b)
    req = b.add("b", PROMPT_B)
    out, mro = b.step()
    # The scheduler asked the connector and took its 64-token hit: only the tail runs.
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - len(SHARED)}
    assert out.has_sync_kv_loads
    assert not mro.kv_connector_output or not mro.kv_connector_output.invalid_block_ids
    assert b.worker.stores.stats.loaded_blocks == 4
    assert b.blocks_hold("b", PROMPT_B, 4)  # bytes written by engine A, read by engine B
    b.run(req)
    assert req.is_finished()


def test_single_group_failed_load_is_reported_and_recomputed(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)

    b = engines(node.endpoint)
    req = b.add("b", PROMPT_B)
    out = b.sched.schedule()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - len(SHARED)}
    node.restart()  # the cached blocks vanish between the lookup and the load
    b.fake_forward(out)
    with set_current_vllm_config(b.vc):
        mro = copy.copy(KVConnectorModelRunnerMixin.kv_connector_no_forward(out, b.vc))
    bad = mro.kv_connector_output.invalid_block_ids
    assert bad == set(b.blocks["b"][0][:4])
    mro.req_ids = ["b"]
    mro.req_id_to_index = {"b": 0}
    mro.sampled_token_ids = [[5]]
    b.sched.update_from_output(out, mro)
    assert req.num_computed_tokens == 0  # vLLM rescheduled the whole prompt
    # The connector never offers that request a hit again (the failure would loop).
    assert b.connector.book.num_new_matched_tokens("b", PROMPT_B, 0, None) == (0, False)
    steps = b.run(req)
    # Recomputed, not fetched again: the whole prompt ran, no further loads.
    assert steps[0][0].num_scheduled_tokens == {"b": len(PROMPT_B)}
    assert b.worker.stores.stats.loaded_blocks == 0
    assert b.blocks_hold("b", PROMPT_B, 4)  # computed by the (fake) forward this time
    assert b.worker.stores.stats.saved_blocks == 4  # and saved again for others


def test_hybrid_groups_load_async_and_bytes_match(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=True)

    b = engines(node.endpoint, hybrid=True)
    assert len(b.kcc.kv_cache_groups) == 2
    req = b.add("b", PROMPT_B)
    out, mro = b.step()
    # Async: nothing computed this step, the load finished within it.
    assert out.num_scheduled_tokens == {}
    assert mro.kv_connector_output.finished_recving == {"b"}
    assert not mro.kv_connector_output.failed_recving
    out, _ = b.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - len(SHARED)}
    # Full attention needs all 4 blocks; the 32-token window only the last 2 before the
    # hit end: vLLM gave the null block for the others, and the connector skipped it.
    assert b.blocks["b"][1][:2] == [0, 0]
    assert b.worker.stores.stats.loaded_blocks == 4 + 2
    assert b.blocks_hold("b", PROMPT_B, 4)
    b.run(req)
    assert req.is_finished()


def test_hybrid_failed_load_is_reported_per_request_and_not_retried(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=True)

    b = engines(node.endpoint, hybrid=True)
    req = b.add("b", PROMPT_B)
    out = b.sched.schedule()
    assert out.num_scheduled_tokens == {}  # waiting for the async load
    node.restart()
    with set_current_vllm_config(b.vc):
        mro = copy.copy(KVConnectorModelRunnerMixin.kv_connector_no_forward(out, b.vc))
    kco = mro.kv_connector_output
    assert kco.failed_recving == {"b"} and "b" in kco.finished_recving
    assert not kco.invalid_block_ids  # block-level reports are refused for hybrid models
    b.sched.update_from_output(out, mro)
    steps = b.run(req)
    assert steps[0][0].num_scheduled_tokens == {"b": len(PROMPT_B)}  # recomputed in full
    assert b.worker.stores.stats.loaded_blocks == 0
    assert b.blocks_hold("b", PROMPT_B, 4)


def test_mamba_groups_are_refused_at_start_up(node_factory: Any) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    node = node_factory()
    ktc = KVTransferConfig(
        kv_connector="RdmakvConnector",
        kv_connector_module_path="rdmakv.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"node": node.endpoint, "model": "m"},
    )
    vc = VllmConfig(kv_transfer_config=ktc)
    fa = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    kcc = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS[:1], fa), KVCacheGroupSpec(LAYERS[1:], mamba)],
    )
    with pytest.raises(ConfigError, match="group 1 has a MambaSpec"):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_keep_hint_in_kv_transfer_params_drives_the_reuse_offload(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    # A tiny budget: without a hint (or proven reuse) nothing is worth the bytes.
    a = engines(node.endpoint, options={"offload": "reuse", "offload_budget": 0.01})
    kept = [*range(300, 364), 1, 2]
    dropped = [*range(400, 464), 1, 2]
    ra = a.add("kept", kept, {"rdmakv_keep": True})
    rb = a.add("dropped", dropped, {"rdmakv_keep": False})
    rc = a.add("odd", [*range(600, 664), 1, 2], {"rdmakv_keep": "yes"})  # ignored, warned
    for r in (ra, rb, rc):
        a.run(r)
    assert a.worker.stores.flush(10.0)
    assert a.worker.stores.stats.saved_blocks == 12  # every request saved into its L1
    b = engines(node.endpoint)
    book = b.connector.book
    # The kept prompt's 4 blocks reached the node; the dropped one's did not.
    assert book.num_new_matched_tokens("x", kept, 0, None) == (64, False)
    assert book.num_new_matched_tokens("y", dropped, 0, None) == (0, False)
