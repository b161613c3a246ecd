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

import contextlib
import copy
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("vllm", reason="needs the engine venv: bash deploy/engines.sh")

import torch
from chaos.wire_proxy import Direction, WireProxy
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
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from rdmakv.connectors.vllm import RdmakvConnector
from rdmakv.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

IO_WAIT_S = 20.0

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
        kv_offset: float = 0.0,
    ) -> None:
        self.kv_offset = kv_offset
        """Added to every fake KV value: a stand-in for other weights under one name."""
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

    def kv_of(self, token: int, pos: int, layer: int) -> torch.Tensor:
        """The KV this engine's (fake) model computes."""
        return kv_value(token, pos, layer) + self.kv_offset

    @property
    def connector(self) -> RdmakvConnector:
        c = self.sched.connector
        assert isinstance(c, RdmakvConnector)
        return c

    def add(
        self,
        req_id: str,
        prompt: list[int],
        kv_transfer_params: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Request:
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(max_tokens=2, ignore_eos=True, extra_args=extra)
        req = Request(req_id, prompt, params, None, session_id=session_id)
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
                        self.kv[name][bid, :, pos % BLOCK, :] = self.kv_of(tokens[pos], pos, layer)

    def worker_step(self, out: Any) -> Any:
        """The model runner's part of a step: what GPUModelRunner does around its forward."""
        # vLLM has one worker connector per process: make it this engine's (a test
        # may step several engines in turn).
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.worker.handle_preemptions(out.kv_connector_metadata)
        self.fake_forward(out)
        with set_current_vllm_config(self.vc):
            mro = copy.copy(KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.vc))
        ids = list(out.num_scheduled_tokens)
        mro.req_ids = ids
        mro.req_id_to_index = {r: i for i, r in enumerate(ids)}
        mro.sampled_token_ids = [[5] for _ in ids]
        return mro

    def step(self) -> tuple[Any, Any]:
        out = self.sched.schedule()
        mro = self.worker_step(out)
        self.sched.update_from_output(out, mro)
        return out, mro

    def settle(self) -> None:
        """Wait until the scheduler side's lookups are answered (the test's pace, not
        vLLM's: vLLM simply asks again next step)."""
        lookups = self.connector.lookups
        assert lookups is not None
        deadline = time.monotonic() + IO_WAIT_S
        while lookups.pending():
            assert time.monotonic() < deadline, "the lookups never answered"
            time.sleep(0.002)

    def run(self, req: Request) -> list[tuple[Any, Any]]:
        """Step until ``req`` finished. Steps that schedule nothing (the request waits
        for a lookup or a load on the connector's threads) are not returned."""
        steps = []
        deadline = time.monotonic() + IO_WAIT_S
        while time.monotonic() < deadline:
            out, mro = self.step()
            if out.num_scheduled_tokens:
                steps.append((out, mro))
            if req.is_finished():
                return steps
            time.sleep(0.002)
        raise AssertionError(f"request {req.request_id} did not finish in {IO_WAIT_S} s")

    def step_until_scheduled(self, req_id: str) -> tuple[Any, Any]:
        """Step until a step computes tokens of ``req_id``; return that step."""
        deadline = time.monotonic() + IO_WAIT_S
        while time.monotonic() < deadline:
            out, mro = self.step()
            if req_id in out.num_scheduled_tokens:
                return out, mro
            time.sleep(0.002)
        raise AssertionError(f"request {req_id} was not scheduled in {IO_WAIT_S} s")

    @contextlib.contextmanager
    def transfers_held(self) -> Iterator[None]:
        """Hold the worker's transfer thread for the block, as a slow copy would."""
        gate = threading.Event()
        transfers = self.worker.transfers
        holder = threading.Thread(target=transfers.call, args=(gate.wait, IO_WAIT_S))
        holder.start()
        while transfers.idle():
            time.sleep(0.001)
        try:
            yield
        finally:
            gate.set()
            holder.join()

    def step_while(self, busy: Callable[[], bool], what: str) -> None:
        """Step while ``busy()``; fail naming ``what`` if it lasts past the wait."""
        deadline = time.monotonic() + IO_WAIT_S
        while busy():
            assert time.monotonic() < deadline, what
            self.step()
            time.sleep(0.002)

    def ask(self, req_id: str, prompt: list[int]) -> tuple[int | None, bool]:
        """The scheduler side's answer for ``prompt`` once its lookup is in."""
        book = self.connector.book
        deadline = time.monotonic() + IO_WAIT_S
        while (got := book.num_new_matched_tokens(req_id, prompt, 0, None))[0] is None:
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.002)
        return got

    def free_blocks(self) -> int:
        return int(self.sched.kv_cache_manager.block_pool.get_num_free_blocks())

    def leaks(self) -> list[str]:
        """What rdmakv still holds once every request ended and its last jobs ran:
        slab references handed out, jobs that never end, unanswered lookups."""
        found = []
        worker = self.worker
        assert isinstance(worker, RdmakvConnector) and worker.transfers is not None
        worker.transfers.flush(IO_WAIT_S)  # the last saves may still be running
        if not worker.transfers.idle():
            found.append("transfer jobs queued or running")
        for k, mgr in enumerate(worker.stores.managers):
            if mgr.l1.held_handles:
                found.append(f"group {k}: {mgr.l1.held_handles} slab references held")
        lookups = self.connector.lookups
        assert lookups is not None
        if lookups.pending():
            found.append(f"{lookups.pending()} lookups unanswered")
        return found

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
                        want = self.kv_of(prompt[pos], pos, layer)
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
        kv_offset: float = 0.0,
        model: Path | None = None,
    ) -> Engine:
        e = Engine(
            model or model_dir,
            node,
            hybrid=hybrid,
            layout_name=layout,
            options=options,
            kv_offset=kv_offset,
        )
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
    kv_transfer_state._KV_CONNECTOR_AGENT = None


def _fill_cache(
    engines: Callable[..., Engine], node: str, hybrid: bool, layout: str = "NHD"
) -> Engine:
    """Engine A computes PROMPT_A and saves its prompt blocks; wait until they reach the node."""
    a = engines(node, hybrid=hybrid, layout=layout)
    a.run(a.add("a", PROMPT_A))
    assert a.worker.transfers.flush(10.0)
    assert a.worker.stores.stats.saved_blocks == 4 * len(a.group_layers)
    return a


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
    ktc.kv_connector_extra_config = {"node": node.endpoint, "model": "m", "load_mode": "later"}
    with pytest.raises(ConfigError, match="load_mode"):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)


@pytest.mark.parametrize(("layout_a", "layout_b"), [("NHD", "NHD"), ("HND", "NHD")])
def test_single_group_prefix_saved_by_one_engine_is_loaded_by_another(
    layout_a: str, layout_b: str, node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    # Stored bytes are layout independent: an HND engine's blocks load into an NHD one.
    _fill_cache(engines, node.endpoint, hybrid=False, layout=layout_a)

    b = engines(node.endpoint, layout=layout_b)
    req = b.add("b", PROMPT_B)
    b.settle()
    out, _ = b.step()
    # The hit is loaded asynchronously: the request waits, nothing of it runs yet.
    assert out.num_scheduled_tokens == {}
    assert not out.has_sync_kv_loads
    out, _ = b.step_until_scheduled("b")
    # vLLM took the connector's 64-token hit: only the tail runs.
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - len(SHARED)}
    assert b.worker.stores.stats.loaded_blocks == 4
    assert b.blocks_hold("b", PROMPT_B, 4)  # bytes written by engine A, read by engine B
    b.run(req)
    assert req.is_finished()
    assert b.worker.transfers.flush(10.0)
    assert not b.leaks()


def test_sync_load_mode_loads_before_the_forward(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)
    b = engines(node.endpoint, options={"load_mode": "sync"})
    req = b.add("b", PROMPT_B)
    b.settle()
    out, mro = b.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - len(SHARED)}
    assert out.has_sync_kv_loads
    assert not mro.kv_connector_output or not mro.kv_connector_output.invalid_block_ids
    assert b.blocks_hold("b", PROMPT_B, 4)
    b.run(req)


def test_single_group_failed_load_is_reported_and_recomputed(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)

    b = engines(node.endpoint)
    req = b.add("b", PROMPT_B)
    b.settle()
    out = b.sched.schedule()
    assert out.num_scheduled_tokens == {}  # waiting for its 64-token load
    node.restart()  # the cached blocks vanish between the lookup and the load
    b.sched.update_from_output(out, b.worker_step(out))
    out, _ = b.step_until_scheduled("b")
    # vLLM took the block-level report: the whole prompt is recomputed.
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)}
    assert b.worker.stores.stats.failed_load_blocks == 4
    # The connector never offers that request a hit again (the failure would loop).
    assert b.connector.book.num_new_matched_tokens("b", PROMPT_B, 0, None) == (0, False)
    b.run(req)
    assert b.worker.stores.stats.loaded_blocks == 0
    assert b.blocks_hold("b", PROMPT_B, 4)  # computed by the (fake) forward this time
    assert b.worker.transfers.flush(10.0)
    assert b.worker.stores.stats.saved_blocks == 4  # and saved again for others
    assert not b.leaks()


def test_hybrid_groups_load_async_and_bytes_match(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=True)

    b = engines(node.endpoint, hybrid=True)
    assert len(b.kcc.kv_cache_groups) == 2
    req = b.add("b", PROMPT_B)
    b.settle()
    out, _ = b.step_until_scheduled("b")
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
    b.settle()
    out = b.sched.schedule()
    assert out.num_scheduled_tokens == {}  # waiting for the async load
    node.restart()
    b.sched.update_from_output(out, b.worker_step(out))
    out, _ = b.step_until_scheduled("b")
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)}  # recomputed in full
    b.run(req)
    assert b.worker.stores.stats.loaded_blocks == 0
    assert b.blocks_hold("b", PROMPT_B, 4)


def test_a_stalled_node_never_stalls_the_engine_and_its_loads_become_recomputes(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)
    b = engines(node.endpoint, options={"timeout": 2})
    hit = b.add("hit", PROMPT_B)
    other = b.add("other", [*range(700, 740)])  # no hit
    b.settle()
    node.pause()
    try:
        # The hit's load hangs on the stopped node; the other request runs to
        # completion meanwhile: the engine keeps stepping.
        steps = b.run(other)
        assert steps and all("hit" not in o.num_scheduled_tokens for o, _ in steps)
        assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        # The hanging load fails within the client timeout: the request is recomputed.
        out, _ = b.step_until_scheduled("hit")
        assert out.num_scheduled_tokens == {"hit": len(PROMPT_B)}
    finally:
        node.resume()
    b.run(hit)
    assert b.blocks_hold("hit", PROMPT_B, 4)


def test_a_node_answering_garbage_mid_load_costs_a_recompute_never_wrong_kv(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)
    with WireProxy(("127.0.0.1", node.port)) as proxy:
        b = engines(proxy.endpoint, options={"timeout": 2})
        req = b.add("b", PROMPT_B)
        b.settle()  # the lookup answered: a hit of 64 tokens
        proxy.flip_bits(Direction.DOWN, mean_gap=2048, seed=7)  # the load's reply is garbage
        b.run(req)
        proxy.clear()
    assert b.worker.stores.stats.loaded_blocks == 0
    assert b.worker.stores.stats.failed_load_blocks == 4
    assert b.blocks_hold("b", PROMPT_B, 4)  # recomputed, never the corrupted bytes


def test_a_save_corrupted_on_the_wire_never_reaches_another_engine(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    with WireProxy(("127.0.0.1", node.port)) as proxy:
        a = engines(proxy.endpoint, options={"timeout": 2})
        req = a.add("a", PROMPT_A)
        a.settle()
        proxy.flip_bits(Direction.UP, mean_gap=4096, seed=11)  # the save's bytes are garbage
        a.run(req)
        a.worker.transfers.flush(10.0)
        proxy.clear()
    b = engines(node.endpoint)
    rb = b.add("b", PROMPT_B)
    b.settle()
    b.run(rb)
    # Whatever the node kept, engine B computed or loaded the right KV.
    assert b.blocks_hold("b", PROMPT_B, 4)
    assert b.worker.transfers.flush(10.0)  # B's own saves ran
    assert not b.leaks()


def test_a_node_that_dies_mid_save_costs_the_saves_and_holds_nothing(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    a = engines(node.endpoint, options={"timeout": 2, "offload": "all"})
    free_before = a.free_blocks()
    req = a.add("a", PROMPT_A)
    a.settle()
    node.kill()  # the prompt's saves will find no node
    a.run(req)
    # Held until its saves ran (and failed).
    a.step_while(lambda: "a" in a.sched.requests, "the held request was never released")
    assert a.free_blocks() == free_before
    assert a.worker.transfers.flush(10.0)  # the offloads ended: they failed, not hung
    offloader = a.worker.stores.managers[0].offloader
    assert offloader is not None and offloader.failed_blocks == 4
    assert not a.leaks()


def test_a_request_aborted_while_its_load_is_in_flight_frees_its_blocks_once(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_cache(engines, node.endpoint, hybrid=False)
    b = engines(node.endpoint, options={"timeout": 2})
    free_before = b.free_blocks()
    b.add("b", PROMPT_B)
    b.settle()
    node.pause()  # the load hangs on the node
    try:
        b.step()
        assert b.free_blocks() < free_before  # blocks allocated for the load
        b.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        # vLLM keeps the blocks until the load reports back (it may still write them).
        assert b.free_blocks() < free_before
    finally:
        node.resume()
    b.step_while(
        lambda: b.free_blocks() != free_before, "the aborted request's blocks were never freed"
    )
    assert "b" not in b.sched.requests
    assert not b.leaks()


def test_a_finished_request_is_held_until_its_saves_ran(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    a = engines(node.endpoint)
    free_before = a.free_blocks()
    with a.transfers_held():
        req = a.add("a", PROMPT_A)
        a.run(req)
        for _ in range(5):
            a.step()
        # Finished, but its save has not run: vLLM must not free (and reuse) its blocks.
        assert "a" in a.sched.requests and a.free_blocks() < free_before
    a.step_while(lambda: "a" in a.sched.requests, "the held request was never released")
    assert a.free_blocks() == free_before
    assert a.worker.transfers.flush(10.0)
    assert a.worker.stores.stats.saved_blocks == 4
    assert not a.leaks()


def test_a_preempted_request_drops_its_pending_saves_and_saves_what_it_recomputes(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    a = engines(node.endpoint)
    with a.transfers_held():
        req = a.add("a", PROMPT_A)
        a.settle()
        a.step_until_scheduled("a")  # the prompt ran; its 4 block saves are queued
        assert a.sched.reset_prefix_cache(reset_running_requests=True)  # preempts "a"
        out = a.sched.schedule()
        assert "a" in (out.preempted_req_ids or ())
        # The worker drops the queued saves before the engine reuses the blocks.
        a.sched.update_from_output(out, a.worker_step(out))
    a.run(req)
    assert a.worker.transfers.flush(10.0)
    # Saved once, from the recomputed blocks (the dropped saves never ran).
    assert a.worker.stores.stats.saved_blocks == 4
    b = engines(node.endpoint)
    rb = b.add("b", PROMPT_B)
    b.settle()
    b.step_until_scheduled("b")
    assert b.blocks_hold("b", PROMPT_B, 4)
    b.run(rb)


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
    session = [*range(500, 564), 1, 2]
    half = [*range(700, 764), 1, 2]
    reqs = [
        a.add("kept", kept, {"rdmakv_keep": True}),
        a.add("dropped", dropped, {"rdmakv_keep": False}),
        a.add("odd", [*range(600, 664), 1, 2], {"rdmakv_keep": "yes"}),  # ignored, warned
        a.add("session", session, session_id="chat-42"),  # vLLM's own session_id field
        a.add("half", half, {"rdmakv_keep": 32}),  # only the first 32 tokens will be reused
    ]
    for r in reqs:
        a.run(r)
    assert a.worker.transfers.flush(10.0)
    assert a.worker.stores.stats.saved_blocks == 20  # every request saved into its L1
    b = engines(node.endpoint)
    # The kept prompts' blocks reached the node; the dropped one's did not.
    assert b.ask("x", kept) == (64, True)
    assert b.ask("y", dropped) == (0, False)
    assert b.ask("z", session) == (64, True)
    assert b.ask("w", half) == (32, True)


# -- audits and fingerprints (issue 59) ------------------------------------------------------
AUDIT_PREFIXES = [list(range(200 + 64 * i, 264 + 64 * i)) for i in range(5)]
"""Five 4-block prefixes, disjoint from each other and from SHARED."""


def _prompts(tail: list[int]) -> list[list[int]]:
    return [[*p, *tail] for p in AUDIT_PREFIXES]


def _fill_prompts(
    engines: Callable[..., Engine], node: str, prompts: list[list[int]], hybrid: bool = False
) -> Engine:
    """An engine computes ``prompts`` and saves their prompt blocks to the node."""
    a = engines(node, hybrid=hybrid)
    for i, p in enumerate(prompts):
        a.run(a.add(f"fill{i}", p))
    assert a.worker.transfers.flush(10.0)
    return a


def _finish(e: Engine, req_id: str) -> None:
    """Step until the engine released the finished request (its saves and audit ended)."""
    e.step_while(lambda: req_id in e.sched.requests, f"{req_id} was never released")
    assert e.worker.transfers.flush(10.0)


def _run_computed_in_full(e: Engine, req_id: str, prompt: list[int]) -> None:
    """Run a request and check the engine computed all of it (no hit taken) correctly."""
    req = e.add(req_id, prompt)
    e.settle()
    out, _ = e.step_until_scheduled(req_id)
    assert out.num_scheduled_tokens == {req_id: len(prompt)}
    e.run(req)
    assert e.blocks_hold(req_id, prompt, 4)
    _finish(e, req_id)


def _node_quarantines(endpoint: str) -> dict[str, str]:
    """What ``rdmakv stats`` shows as quarantined namespaces: label -> reason."""
    from rdmakv.client.remote import open_remote

    with contextlib.closing(open_remote(endpoint, None, transport="tcp", timeout=5)) as c:
        shown = c.stats()["quarantined_namespaces"]
    return {label: entry["reason"] for label, entry in shown.items()}


class HeadSwappingCopier:
    """Test-only fault: the real PagedGroupCopier, whose saves then swap the KV heads in
    the slab (a paged-copy layout bug). Everything else is the real copier's."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def save(self, slab: Any, handles: list[int], block_ids: list[int]) -> None:
        self.real.save(slab, handles, block_ids)
        for h in handles:
            view = self.real.block_layers(slab, h)  # [layers, tokens, heads, channels]
            view.copy_(view.flip(2))


@pytest.mark.parametrize("hybrid", [False, True])
def test_audit_at_rate_one_on_a_correct_stack_finds_no_mismatch_and_changes_no_kv(
    hybrid: bool, node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_prompts(engines, node.endpoint, _prompts([1, 2, 3]), hybrid=hybrid)
    audited = engines(node.endpoint, hybrid=hybrid, options={"audit_rate": 1.0})
    plain = engines(node.endpoint, hybrid=hybrid)
    groups = len(audited.group_layers)
    asks = _prompts([4, 5, 6, 7])
    for i, p in enumerate(asks):
        _run_computed_in_full(audited, f"r{i}", p)  # sampled: offered no hit
        req = plain.add(f"r{i}", p)
        plain.settle()
        out, _ = plain.step_until_scheduled(f"r{i}")
        assert out.num_scheduled_tokens == {f"r{i}": len(p) - 64}  # the hit is used
        plain.run(req)
        # The same KV in both engines' blocks, bit for bit.
        for name in LAYERS:
            for b in range(4):
                mine = audited.kv[name][audited.blocks[f"r{i}"][0][b]]
                theirs = plain.kv[name][plain.blocks[f"r{i}"][0][b]]
                assert torch.equal(mine, theirs)
    stats = audited.worker.stores.audits.stats
    # Every block the hit would have loaded was compared (the window group's too).
    assert stats.checks == len(asks) and stats.blocks_compared == 4 * groups * len(asks)
    assert stats.mismatches == 0 and stats.blocks_mismatched == 0
    assert audited.worker.stores.stats.loaded_blocks == 0
    assert plain.worker.stores.stats.loaded_blocks == (4 + 2 * (groups - 1)) * len(asks)
    assert not audited.connector.book.remote_off
    assert not audited.leaks()


def test_an_engine_with_other_kv_under_the_same_name_is_caught_and_quarantined(
    node_factory: Any, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    import urllib.request

    node = node_factory(block_size="64KiB")
    _fill_prompts(engines, node.endpoint, _prompts([1, 2, 3]))
    # Other "weights" under the same name: same fingerprint, different KV for the tokens.
    b = engines(
        node.endpoint, kv_offset=0.25, options={"audit_rate": 1.0, "metrics_port": 0}
    )
    asks = _prompts([4, 5, 6, 7])
    with caplog.at_level("ERROR", logger="rdmakv.connectors.audit"):
        _run_computed_in_full(b, "r0", asks[0])
    stats = b.worker.stores.audits.stats
    assert stats.checks == 1 and stats.mismatches == 1 and stats.blocks_mismatched >= 1
    guard = b.worker.stores.guard
    assert guard.quarantined is not None and "layer" in guard.quarantined
    lines = [r.getMessage() for r in caplog.records if "KV audit mismatch" in r.getMessage()]
    assert len(lines) == 1 and "key " in lines[0] and "quarantine" in lines[0]
    # The scheduler side learnt it through vLLM's worker metadata, the node from the worker.
    assert list(b.connector.book.remote_off) == [guard.label]
    assert _node_quarantines(node.endpoint) == {guard.label: guard.quarantined}
    for i, p in enumerate(asks[1:], start=1):
        _run_computed_in_full(b, f"r{i}", p)  # no hit offered any more
    assert stats.checks == 1  # nothing more to audit: no hits
    assert b.worker.stores.stats.loaded_blocks == 0  # wrong KV never used
    # Its stores stopped: what it computes now never reaches the node.
    new = [*range(900, 964), 1, 2]
    _run_computed_in_full(b, "new", new)
    c = engines(node.endpoint)
    assert c.ask("x", new) == (0, False)
    assert c.ask("y", asks[1]) == (64, True)  # the first engine's blocks are still there
    base = f"http://127.0.0.1:{b.worker.stores.metrics_server.port}"
    scrape = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert "rdmakv_client_audit_mismatches_total 1.0" in scrape
    assert "rdmakv_client_quarantined 1.0" in scrape
    # An operator clears it through the metrics endpoint; the scheduler side follows.
    clear = urllib.request.Request(f"{base}/rdmakv/quarantine/clear", data=b"", method="POST")
    assert json.loads(urllib.request.urlopen(clear, timeout=5).read())["cleared"] is True
    b.step()
    assert not b.connector.book.remote_off
    assert b.worker.transfers.flush(10.0)
    assert _node_quarantines(node.endpoint) == {}
    state = json.loads(urllib.request.urlopen(f"{base}/rdmakv/quarantine", timeout=5).read())
    assert state["quarantined"] is None and state["audits"]["mismatches"] == 1
    assert not b.leaks()


def test_a_paged_copy_layout_bug_is_caught_by_the_audit(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_prompts(engines, node.endpoint, _prompts([1, 2, 3]))
    b = engines(node.endpoint, options={"audit_rate": 1.0})
    transfers = b.worker.transfers
    transfers.copiers[0] = HeadSwappingCopier(transfers.copiers[0])
    _run_computed_in_full(b, "r0", _prompts([4, 5])[0])
    stats = b.worker.stores.audits.stats
    assert stats.mismatches == 1 and stats.blocks_mismatched == 4
    assert b.connector.book.remote_off
    assert not b.leaks()


def test_a_fingerprint_conflict_refuses_remote_hits_in_one_line(
    node_factory: Any,
    engines: Callable[..., Engine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rdmakv.connectors.fingerprint import CONFLICT

    node = node_factory(block_size="64KiB")
    other = tmp_path / "tiny-llama-finetune"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**TINY_LLAMA, "rms_norm_eps": 1e-6}))
    named = {"model": "tiny-llama"}  # both deployments use one model name
    a = engines(node.endpoint, options=named)
    a.run(a.add("a", PROMPT_A))
    assert a.worker.transfers.flush(10.0)
    with caplog.at_level("ERROR", logger="rdmakv.connectors"):
        b = engines(node.endpoint, options=named, model=other)
    lines = [r.getMessage() for r in caplog.records if CONFLICT in r.getMessage()]
    assert lines and all("\n" not in m and "weights" in m for m in lines)
    assert b.worker.stores.guard.refused is not None
    (reason,) = b.connector.book.remote_off.values()
    assert reason.startswith(CONFLICT)
    assert b.ask("b", PROMPT_B) == (0, False)
    _run_computed_in_full(b, "b", PROMPT_B)
    assert b.worker.stores.stats.loaded_blocks == 0 and b.worker.stores.stats.saved_blocks == 0
    same = engines(node.endpoint, options=named)  # the first deployment's twin: no conflict
    assert not same.connector.book.remote_off
    assert same.ask("c", PROMPT_B) == (64, True)


@pytest.mark.parametrize(
    ("key", "value"),
    [("audit_rate", 1.5), ("audit_rate", -0.1), ("audit_rate", "0.1"),
     ("audit_tolerance", -0.01), ("audit_quarantine", "yes")],
)
def test_bad_audit_options_are_refused_by_name(
    key: str, value: object, node_factory: Any
) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    node = node_factory()
    ktc = KVTransferConfig(
        kv_connector="RdmakvConnector",
        kv_connector_module_path="rdmakv.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"node": node.endpoint, "model": "m", key: value},
    )
    vc = VllmConfig(kv_transfer_config=ktc)
    fa = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    kcc = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, fa)]
    )
    with pytest.raises(ConfigError, match=key):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_a_stalled_node_costs_one_audit_fetch_and_never_holds_saves_longer(
    node_factory: Any, engines: Callable[..., Engine]
) -> None:
    node = node_factory(block_size="64KiB")
    _fill_prompts(engines, node.endpoint, _prompts([1, 2, 3]))
    b = engines(node.endpoint, options={"audit_rate": 1.0, "timeout": 2})
    asks = _prompts([4, 5, 6])[:2]
    reqs = [b.add(f"r{i}", p) for i, p in enumerate(asks)]
    b.settle()  # both lookups answered: both requests will be audited
    node.pause()
    try:
        started = time.monotonic()
        for r in reqs:
            b.run(r)
        for r in reqs:
            b.step_while(lambda r=r: r.request_id in b.sched.requests, "held past the stall")
        # The first audit fetch waited out the client timeout; the second was skipped
        # (audits back off after a node failure), so the saves waited about one timeout.
        assert time.monotonic() - started < IO_WAIT_S
    finally:
        node.resume()
    stats = b.worker.stores.audits.stats
    assert stats.checks == 0 and stats.mismatches == 0 and stats.fetches_skipped >= 1
    assert not b.connector.book.remote_off  # a failing node is not wrong KV
    for i, p in enumerate(asks):
        assert b.blocks_hold(f"r{i}", p, 4)
    assert b.worker.transfers.flush(10.0)
    assert not b.leaks()
