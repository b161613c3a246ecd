"""Serving benchmark: TTFT and step time of the real vLLM scheduler with and without rdmakv.

A serving loop built from real parts, replaying the Mooncake conversation trace:

* **The real vLLM v1** ``Scheduler`` (prefix caching on in every configuration),
  with rdmakv's connector in both roles, loaded through vLLM's connector factory
  (``kv_connector_module_path``, ``kv_load_failure_policy: recompute``).
* **A model-runner stand-in on CPU** that drives the worker connector as vLLM's
  GPU model runner does: ``handle_preemptions`` before the forward, then
  ``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output`` around the
  forward under ``set_forward_context``, a ``ModelRunnerOutput`` carrying the
  connector output, ``Scheduler.update_from_output``. Its forward writes, into
  vLLM's own CPU paged KV tensors (``allocate_kv_cache``), KV bytes that are a
  function of (token, position, layer) only (:func:`kv_rows`), for every token it
  computes; every block a request starts with (vLLM's prefix cache or rdmakv) is
  checked against that function before the request runs (``wrong_blocks``;
  exit status 1 if any). Each step then sleeps up to the time a GPU cost model
  gives it (:class:`CostModel`: a named model on a named GPU from published
  figures, printed with its sources in ``cost_model``).
* **Real nodes**: ``rdmakv serve`` processes over TCP (:class:`LocalNodeProcess`).

Configurations, each with a fresh scheduler, engine and node:

``prefix_only``        vLLM's prefix cache alone (no connector): the baseline.
``rdmakv_async``       rdmakv's connector, ``load_mode: async`` (the default).
``rdmakv_sync``        the same with ``load_mode: sync``.
``rdmakv_async_stall`` async, the node SIGSTOPped for ``--stall`` seconds in the
                       middle of the replay, then SIGCONT.
``rdmakv_audit_R``     (only when named in ``--configs``) async with recompute
                       audits at rate R (0.01 or 0.1).

Where remote hits come from: before a measured rdmakv run, an earlier engine
(same stand-in, no sleeps, one output token each) serves the *earlier turns* of
the slice's conversations: for each request of the slice, the latest request
before the slice that shares the longest prefix with it (at least
:data:`MIN_SHARED_BLOCKS` trace blocks). Its connector saves their prompt blocks
to the node. The measured engine then starts with an empty prefix cache, as a
new or restarted instance of a fleet would: a returning conversation finds its
earlier turns on the node, not in the engine. The trace's universal first block
(hash id 0) and any reuse inside the slice are served by vLLM's prefix cache
in every configuration alike.

Usage (engines venv)::

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python bench/serve.py \\
        [--requests N | --full] [--start I] [--trace PATH] [--out DIR] [--quick]

Prints one JSON object ``{"configs": {...}, "cost_model": {...}, "meta": {...}}``
and writes ``serve.json`` and ``serve.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported

import numpy as np
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
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import (
    KVConnectorModelRunnerMixin,
)
from vllm.v1.worker.utils import allocate_kv_cache

from rdmakv.errors import RdmakvError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance, publish
from rdmakv.replay.trace import Trace, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
FALLBACK_TRACE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"
RESULTS = ROOT / "bench" / "results"
CONFIGS = ("prefix_only", "rdmakv_async", "rdmakv_sync", "rdmakv_async_stall")
AUDIT_CONFIGS = {"rdmakv_audit_0.01": 0.01, "rdmakv_audit_0.1": 0.1}
"""Optional configs (``--configs``): async with recompute audits at that rate
(issue 59's cost: the sampled requests give up their hit)."""

# -- the named model and GPU (published figures) --------------------------------------------
MODEL_NAME = "meta-llama/Llama-3.1-8B"
MODEL_SOURCE = "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"
MODEL_LAYERS = 32
MODEL_KV_HEADS = 8
MODEL_Q_HEADS = 32
MODEL_HEAD_DIM = 128
MODEL_HIDDEN = 4096
MODEL_INTERMEDIATE = 14336
MODEL_VOCAB = 128256
MODEL_PARAMS = 8.03e9
MODEL_PARAMS_SOURCE = "https://huggingface.co/meta-llama/Llama-3.1-8B (model card: 8.03B params)"
BF16_BYTES = 2
GPU_NAME = "NVIDIA H100 SXM5 80GB"
GPU_BF16_DENSE_FLOPS = 989e12
GPU_HBM_BYTES_PER_S = 3.35e12
GPU_HBM_CAPACITY = 80e9
GPU_SOURCE = "https://www.nvidia.com/en-us/data-center/h100/ (datasheet: H100 SXM BF16 " \
    "1,979 TFLOPS with sparsity = 989 dense; GPU memory 80 GB; bandwidth 3.35 TB/s)"
NIC_BYTES_PER_S = 50e9
NIC_SOURCE = "NVIDIA DGX H100: one ConnectX-7 400 Gb/s (50 GB/s) per GPU " \
    "(https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html)"
MFU = 0.5
"""Assumption: prefill reaches half the dense BF16 peak (long prompts, FlashAttention)."""
MBU = 0.7
"""Assumption: decode reaches 70% of HBM bandwidth (MBU of tuned engines: 60-85%)."""
MXU_SOURCE = "assumptions (stated, not measured): MFU/MBU as defined in Databricks, " \
    "'LLM Inference Performance Engineering: Best Practices' (2023), " \
    "https://www.databricks.com/blog/llm-inference-performance-engineering-best-practices"
STEP_OVERHEAD_S = 0.001
"""Assumption: fixed GPU-side cost per step (launches with CUDA graphs, sampling)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of GPU memory it may use."""
ACTIVATION_RESERVE = 2e9
"""Assumption: bytes vLLM's profile run keeps for activations and CUDA graphs."""

LAYERS_HELD = 1
"""Layers of the model whose KV this process really holds and moves (of MODEL_LAYERS)."""
BLOCK_TOKENS = 64
"""vLLM block size: 64 tokens x 4 KiB = 256 KiB rdmakv blocks (16 would quadruple the
per-block Python work on this 2-core machine; vLLM supports both)."""
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's chunked-prefill token budget per step (its default for online serving)."""
MAX_MODEL_LEN = 131072

# -- replay ------------------------------------------------------------------------------------
TIME_SCALE = 3.0
"""Replay seconds per trace second: the trace is a whole cluster's traffic; at 1.0 it
offers one modelled H100 more prefill than it can do."""
DEFAULT_START = 3000
"""First request of the default slice: deep enough that conversations return."""
DEFAULT_REQUESTS = 60
MIN_SHARED_BLOCKS = 2
"""A request of the slice continues an earlier one that shares this many trace blocks."""
CONNECTOR_TIMEOUT_S = 2.0
"""rdmakv client timeout: a stalled node's lookups and loads become recomputes after it."""
STALL_S = 10.0
STALL_AT = 0.4
"""The stall starts at this share of the slice's arrival span."""
L1_BYTES = 512 << 20
IDLE_POLL_S = 0.002
"""Sleep of a step with nothing to compute (requests waiting for loads, or none):
vLLM's engine core would spin; here that CPU belongs to the transfer threads."""
RUN_DEADLINE_S = 1800.0
"""A configuration still running after this long is a hang: the run fails."""
NODE_ROOM = 1.15
"""Node pool: the blocks of the earlier turns and the slice, plus room for puts in flight."""
QUICK_REQUESTS = 8
QUICK_START = 242
"""--quick replays the committed slice (the same in every checkout) from here: short
prompts, and one request that continues an earlier conversation (a remote hit)."""
QUICK_OUTPUT_CAP = 16
DEFAULT_OUTPUT_CAP = 1024
KV_SEED = 0x5EED_0F_CAFE
_MIX1 = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants as signed int64
_MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX3 = 0x94D049BB133111EB - (1 << 64)
VERIFY_CHUNK_TOKENS = 8192


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    """Step time of ``MODEL_NAME`` on ``GPU_NAME`` (one GPU, bf16, no TP).

    ``step = sum over prefill tokens of FLOPs / (peak * MFU)
    + [decode in step] (weights + KV of every decode context) / (HBM * MBU) + overhead``.
    Prefill FLOPs per token: ``2 * params`` plus attention ``4 * layers * q_heads *
    head_dim * (position + 1)`` (QK^T and AV over the causal context). The time is the
    whole model's, while this process holds only ``LAYERS_HELD`` layers' KV bytes:
    see :meth:`describe` for why and what that means for the link.
    """

    mfu: float = MFU
    mbu: float = MBU
    overhead_s: float = STEP_OVERHEAD_S

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * MODEL_LAYERS * MODEL_KV_HEADS * MODEL_HEAD_DIM * BF16_BYTES

    @property
    def held_fraction(self) -> float:
        return LAYERS_HELD / MODEL_LAYERS

    @property
    def kv_pool_tokens(self) -> int:
        free = GPU_HBM_CAPACITY * GPU_MEMORY_UTILIZATION - MODEL_PARAMS * BF16_BYTES
        return int((free - ACTIVATION_RESERVE) // self.kv_bytes_per_token)

    def prefill_s(self, start: int, count: int) -> float:
        """Compute time of tokens ``[start, start + count)`` of one request."""
        if count <= 0:
            return 0.0
        positions = count * start + count * (count + 1) / 2  # sum of (pos + 1)
        attn = 4 * MODEL_LAYERS * MODEL_Q_HEADS * MODEL_HEAD_DIM * positions
        flops = 2 * MODEL_PARAMS * count + attn
        return flops / (GPU_BF16_DENSE_FLOPS * self.mfu)

    def decode_s(self, contexts: Sequence[int]) -> float:
        """One decode step over requests with these context lengths."""
        if not contexts:
            return 0.0
        nbytes = MODEL_PARAMS * BF16_BYTES + sum(contexts) * self.kv_bytes_per_token
        return nbytes / (GPU_HBM_BYTES_PER_S * self.mbu)

    def step_s(self, prefills: Sequence[tuple[int, int]], decodes: Sequence[int]) -> float:
        """A step with these (start, count) prefill chunks and decode contexts."""
        if not prefills and not decodes:
            return 0.0
        return (
            sum(self.prefill_s(s, n) for s, n in prefills)
            + self.decode_s(decodes)
            + self.overhead_s
        )

    def describe(self) -> dict[str, Any]:
        held = self.kv_bytes_per_token * self.held_fraction
        return {
            "model": MODEL_NAME,
            "model_config": {
                "layers": MODEL_LAYERS, "kv_heads": MODEL_KV_HEADS, "q_heads": MODEL_Q_HEADS,
                "head_dim": MODEL_HEAD_DIM, "hidden": MODEL_HIDDEN,
                "intermediate": MODEL_INTERMEDIATE, "vocab": MODEL_VOCAB,
                "params": MODEL_PARAMS, "dtype": "bfloat16",
                "source": [MODEL_SOURCE, MODEL_PARAMS_SOURCE],
            },
            "gpu": GPU_NAME,
            "gpu_figures": {
                "bf16_dense_flops": GPU_BF16_DENSE_FLOPS,
                "hbm_bytes_per_s": GPU_HBM_BYTES_PER_S,
                "hbm_capacity_bytes": GPU_HBM_CAPACITY,
                "source": GPU_SOURCE,
            },
            "mfu": self.mfu,
            "mbu": self.mbu,
            "step_overhead_s": self.overhead_s,
            "assumptions_source": MXU_SOURCE,
            "formula": "step = sum_prefill(2*params + 4*layers*q_heads*head_dim*(pos+1)) "
            "/ (peak*MFU) + [decode] (2*params + sum(ctx)*kv_bytes_per_token) / (HBM*MBU) "
            "+ overhead",
            "kv_bytes_per_token_model": self.kv_bytes_per_token,
            "kv_pool_tokens": self.kv_pool_tokens,
            "kv_pool_reasoning": f"{GPU_MEMORY_UTILIZATION} x {GPU_HBM_CAPACITY:.0f} B - "
            f"bf16 weights - {ACTIVATION_RESERVE:.0f} B activations, / kv bytes per token",
            "layers_held": LAYERS_HELD,
            "kv_bytes_per_token_held": int(held),
            "held_fraction": self.held_fraction,
            "block_tokens": BLOCK_TOKENS,
            "block_bytes_held": int(held * BLOCK_TOKENS),
            "geometry_held": f"{LAYERS_HELD} layer x [K,V] x {MODEL_KV_HEADS} heads x "
            f"{MODEL_HEAD_DIM} x bf16 = {int(held)} B/token",
            "reasoning": (
                "Step times are the whole model's; the KV bytes really stored, moved and "
                f"verified are {LAYERS_HELD}/{MODEL_LAYERS} of its layers (the whole model's "
                "KV, 128 KiB/token, does not fit this 2-core, 24 GiB machine). Compute is not "
                "scaled with the bytes because the vLLM scheduler's real CPU time per step "
                "(ms, not modelled) would then dwarf a 1/32-scaled GPU step. So each byte "
                "moved here stands for 1/held_fraction bytes of the full model: the loads "
                "behave like the full model's over a link of link_rate_seen / held_fraction "
                f"(compare: {NIC_SOURCE}, {NIC_BYTES_PER_S:.0f} B/s)."
            ),
        }


# ---------------------------------------------------------------------------------------------
def kv_rows(tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """The stand-in KV of tokens at positions in one layer: int16 words ``[T, heads, 2*dim]``.

    A splitmix64 hash of (token, position, layer), spread over all the row's words
    (each 16-bit word XORs one of the hash's four words with a per-channel constant):
    a function of those three only, as real KV is of the prefix, and cheap to make.
    """
    x = tokens.to(torch.int64) * 1_000_003 + positions.to(torch.int64) * 7919 + layer * 104729
    x = x + KV_SEED
    x = x * _MIX1
    x = (x ^ (x >> 30)) * _MIX2
    x = (x ^ (x >> 27)) * _MIX3
    x = x ^ (x >> 31)
    words = x.view(torch.int16).view(-1, 4)
    width = MODEL_KV_HEADS * 2 * MODEL_HEAD_DIM
    rows = words.repeat(1, width // 4) ^ _CHANNELS
    return rows.view(-1, MODEL_KV_HEADS, 2 * MODEL_HEAD_DIM)


_CHANNELS = torch.from_numpy(
    np.random.default_rng(KV_SEED).integers(
        -(1 << 15), 1 << 15, MODEL_KV_HEADS * 2 * MODEL_HEAD_DIM, dtype=np.int16
    )
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_dir() -> Path:
    """A local model directory with the named model's config.json only (no weights)."""
    d = Path(tempfile.mkdtemp(prefix="rdmakv-serve-model-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": MODEL_HIDDEN,
        "intermediate_size": MODEL_INTERMEDIATE,
        "num_attention_heads": MODEL_Q_HEADS,
        "num_key_value_heads": MODEL_KV_HEADS,
        "head_dim": MODEL_HEAD_DIM,
        "num_hidden_layers": MODEL_LAYERS,
        "vocab_size": MODEL_VOCAB,
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


# ---------------------------------------------------------------------------------------------
@dataclass
class ReqStats:
    """What happened to one request of the replay (times: seconds since the replay began)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_compute: float | None = None
    token_times: list[float] = field(default_factory=list)
    local_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    """Prompt tokens that came from rdmakv and were used (verified, not failed)."""
    asked_remote_tokens: int = 0
    """Tokens the connector offered (some may have failed and been recomputed)."""
    load_started: float | None = None
    load_done: float | None = None
    lookup_asked: float | None = None
    """When the scheduler first asked the connector about the request (it asks when it
    reaches the request in its waiting queue, which may be long after the arrival)."""
    lookup_answered: float | None = None
    """When the scheduler first got an answer (hit or not): until then it holds the
    request back and asks again next step."""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None


@dataclass
class StepLog:
    """Per step: when, the modelled time, the stand-in's CPU work, the scheduler's CPU."""

    t: float
    wall_s: float
    model_s: float
    work_s: float
    sched_s: float
    decodes: int
    prefill_tokens: int


class ServeEngine:
    """The real vLLM scheduler (and, with a node, rdmakv's worker connector) + the stand-in.

    ``node`` None: no connector (the ``prefix_only`` baseline). ``cost`` None: no
    sleeps (the earlier engine that fills the node).
    """

    def __init__(
        self,
        model_dir: Path,
        node: str | None,
        *,
        load_mode: str = "async",
        audit_rate: float = 0.0,
        transport: str = "tcp",
        cost: CostModel | None,
        pool_blocks: int,
    ) -> None:
        ktc = None
        if node is not None:
            ktc = KVTransferConfig(
                kv_connector="RdmakvConnector",
                kv_connector_module_path="rdmakv.connectors.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "node": node,
                    "transport": transport,
                    "l1_bytes": L1_BYTES,
                    "lock_slab": False,
                    "timeout": CONNECTOR_TIMEOUT_S,
                    "offload": "all",
                    "load_mode": load_mode,
                    "audit_rate": audit_rate,
                },
            )
        mc = ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
            dtype="bfloat16",
        )
        vc = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
            ),
            kv_transfer_config=ktc,
        )
        self.vc = vc
        self.cost = cost
        spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=MODEL_KV_HEADS, head_size=MODEL_HEAD_DIM,
            dtype=torch.bfloat16,
        )
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS_HELD)]
        specs: dict[str, Any] = dict.fromkeys(self.layers, spec)
        layout = resolve_kv_cache_layout(vc, [["NHD"]], specs.values())
        vc.cache_config.kv_cache_layout = layout.name
        groups = get_global_kv_cache_groups(vc, [specs])
        budget = spec.page_size_bytes * LAYERS_HELD * pool_blocks
        (kcc,) = get_kv_cache_configs(vc, [specs], [budget], groups)
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.kcc = kcc
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), layout)
        # int16 views of the bf16 pages: the stand-in's KV is raw words (see kv_rows)
        self.words = {n: t.view(torch.int16) for n, t in self.kv.items()}
        # What EngineCore gives every request: the block hashes prefix caching looks up.
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(
            BLOCK_TOKENS, hash_fn, vc.num_hash_lookahead_tokens
        )
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_TOKENS,
        )
        with set_current_vllm_config(vc):
            # Once per process (a test process may have set it up already).
            if not torch.distributed.is_initialized():
                init_distributed_environment(
                    world_size=1, rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    local_rank=0, backend="gloo",
                )
            if not model_parallel_is_initialized():
                initialize_model_parallel(1, 1)
            # vLLM keeps one worker connector per process: forget the previous engine's.
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            if ktc is not None:
                kv_transfer_state.ensure_kv_transfer_initialized(vc, kcc)
        self.worker: Any = kv_transfer_state.get_kv_transfer_group() if ktc else None
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv)  # GPUModelRunner.initialize_kv_cache
        self.requests: dict[str, Request] = {}
        self.stats: dict[str, ReqStats] = {}
        self.blocks: dict[str, list[int]] = {}
        self.steps: list[StepLog] = []
        self.wrong_blocks = 0
        self.wrong_local_blocks = 0
        self.verified_remote_blocks = 0
        self.verified_local_blocks = 0
        self.failed_load_blocks = 0
        self.failed_load_requests = 0
        self.t0 = time.monotonic()
        if self.worker is not None:
            self._time_lookups()

    @property
    def loaded_bytes(self) -> int:
        return 0 if self.worker is None else self.worker.stores.stats.loaded_bytes

    @property
    def connector_seconds(self) -> dict[str, float]:
        """Seconds on the connector's transfer thread: loads (node fetch + slab ->
        paged copy) and saves (engine -> slab copies, handing to the offloader)."""
        if self.worker is None:
            return {"load": 0.0, "fetch": 0.0, "copy": 0.0, "save": 0.0}
        st = self.worker.stores.stats
        return {
            "load": st.fetch_s + st.load_copy_s,
            "fetch": st.fetch_s,
            "copy": st.load_copy_s,
            "save": st.save_s,
        }

    # -- measurement of the lookups (a timing wrapper, behaviour unchanged) -----------------
    def _time_lookups(self) -> None:
        """Note when the scheduler first sees each request's lookup answered, by
        wrapping the real ``answer`` on its instance; behaviour unchanged."""
        lookups = self.sched.connector.lookups
        real_answer = lookups.answer

        def answer(req_id: str) -> Any:
            got = real_answer(req_id)
            st = self.stats.get(req_id)
            if st is not None and st.lookup_answered is None:
                if st.lookup_asked is None:
                    st.lookup_asked = self.now()
                if got is not None:
                    st.lookup_answered = self.now()
            return got

        lookups.answer = answer

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, req_id: str, index: int, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(req_id, prompt, params, None, block_hasher=self.block_hasher)
        self.requests[req_id] = req
        self.stats[req_id] = ReqStats(index, self.now(), len(prompt), max_tokens)
        self.sched.add_request(req)

    # -- the stand-in's forward --------------------------------------------------------------
    def _block_tables(self, out: Any) -> tuple[dict[str, int], set[str]]:
        """Track block tables as the model runner does; returns each scheduled request's
        first computed position and the requests (re)starting this step."""
        starts: dict[str, int] = {}
        fresh: set[str] = set()
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
            starts[new.req_id] = new.num_computed_tokens
            fresh.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = list(ids[0]) if ids is not None else []
                fresh.add(req_id)
            elif ids is not None:
                self.blocks[req_id].extend(ids[0])
            starts[req_id] = cached.num_computed_tokens[i]
        return starts, fresh

    def _forward(self, out: Any, starts: dict[str, int]) -> None:
        """Write the KV of every token computed this step into its paged slot."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = starts[req_id]
            pos = torch.arange(start, start + n)
            toks = torch.tensor(req.all_token_ids[start : start + n], dtype=torch.int64)
            bids = torch.tensor(self.blocks[req_id], dtype=torch.int64)[pos // BLOCK_TOKENS]
            slots = pos % BLOCK_TOKENS
            for layer, name in enumerate(self.layers):
                self.words[name][bids, :, slots, :] = kv_rows(toks, pos, layer)

    def _wrong(self, req_id: str, first_block: int, end_block: int) -> int:
        """Blocks in ``[first_block, end_block)`` of the request not holding its KV."""
        req = self.requests[req_id]
        table = torch.tensor(self.blocks[req_id], dtype=torch.int64)
        wrong = torch.zeros(max(0, end_block - first_block), dtype=torch.bool)
        chunk = VERIFY_CHUNK_TOKENS // BLOCK_TOKENS
        for b0 in range(first_block, end_block, chunk):
            b1 = min(end_block, b0 + chunk)
            pos = torch.arange(b0 * BLOCK_TOKENS, b1 * BLOCK_TOKENS)
            toks = torch.tensor(
                req.all_token_ids[b0 * BLOCK_TOKENS : b1 * BLOCK_TOKENS], dtype=torch.int64
            )
            bids = table[pos // BLOCK_TOKENS]
            slots = pos % BLOCK_TOKENS
            for layer, name in enumerate(self.layers):
                got = self.words[name][bids, :, slots, :]
                bad = (got != kv_rows(toks, pos, layer)).flatten(1).any(1)
                wrong[b0 - first_block : b1 - first_block] |= bad.view(-1, BLOCK_TOKENS).any(1)
        return int(wrong.sum())

    def _verify(self, starts: dict[str, int], fresh: set[str], invalid: set[int]) -> None:
        """Check every block a (re)starting request begins with; blocks the connector
        reported as failed (and everything after the first one) are recomputed by vLLM."""
        for req_id in fresh:
            st = self.stats[req_id]
            full = starts[req_id] // BLOCK_TOKENS
            table = self.blocks[req_id]
            for b in range(full):
                if table[b] in invalid:
                    full = b
                    break
            local_blocks = min(full, st.local_hit_tokens // BLOCK_TOKENS)
            if st.first_compute is None:
                st.remote_hit_tokens = max(0, full * BLOCK_TOKENS - st.local_hit_tokens)
                self.verified_remote_blocks += full - local_blocks
                self.verified_local_blocks += local_blocks
            self.wrong_local_blocks += self._wrong(req_id, 0, local_blocks)
            self.wrong_blocks += self._wrong(req_id, local_blocks, full)

    # -- one engine step ---------------------------------------------------------------------
    def step(self) -> None:
        t_start = time.monotonic()
        out = self.sched.schedule()
        t_sched = time.monotonic()
        for req_id, req in self.requests.items():  # noted as the scheduler decides
            ps = req.prefill_stats
            st = self.stats[req_id]
            if st.first_compute is None and ps is not None and ps.num_prompt_tokens:
                st.local_hit_tokens = ps.num_local_cached_tokens
                st.asked_remote_tokens = ps.num_external_cached_tokens
                if ps.num_external_cached_tokens and st.load_started is None:
                    st.load_started = self.now()
        starts, fresh = self._block_tables(out)
        if self.worker is not None and out.preempted_req_ids:
            self.worker.handle_preemptions(out.kv_connector_metadata)
        with (
            set_current_vllm_config(self.vc),
            set_forward_context(None, self.vc),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out) as kco,
        ):
            self._forward(out, starts)
        invalid = set(kco.invalid_block_ids) if kco is not None else set()
        self._verify(starts, fresh, invalid)
        if kco is not None:
            self.failed_load_blocks += len(invalid)
            self.failed_load_requests += len(kco.failed_recving or ())
            for req_id in kco.finished_recving or ():
                if req_id in self.stats:
                    self.stats[req_id].load_done = self.now()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for req_id in ids:
            req = self.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            start = starts[req_id]
            if start + n >= req.num_prompt_tokens:  # the last prompt chunk or a decode
                sampled.append([self._next_token(req)])
            else:
                sampled.append([])  # a chunk of the prompt: the runner discards its sample
            if start >= req.num_prompt_tokens:
                decodes.append(start + n)
            else:
                prefills.append((start, n))
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kco,
        )
        work = time.monotonic() - t_sched
        model = self.cost.step_s(prefills, decodes) if self.cost is not None else 0.0
        if model > work:
            time.sleep(model - work)
        elif not ids and self.cost is not None:
            time.sleep(IDLE_POLL_S)
        t_update = time.monotonic()
        self.sched.update_from_output(out, mro)
        t_end = time.monotonic()
        now = t_end - self.t0
        for req_id in ids:
            st = self.stats[req_id]
            if st.first_compute is None:
                st.first_compute = t_sched - self.t0
            have = len(self.requests[req_id].output_token_ids)
            while len(st.token_times) < have:
                st.token_times.append(now)
        if ids:
            self.steps.append(
                StepLog(
                    now, t_end - t_start, model, work,
                    (t_sched - t_start) + (t_end - t_update), len(decodes),
                    sum(n for _, n in prefills),
                )
            )

    @staticmethod
    def _next_token(req: Request) -> int:
        """A deterministic sampled token (its KV is written when it is computed next)."""
        return (req.num_tokens * 2654435761 + len(req.request_id)) % MODEL_VOCAB

    def busy(self) -> bool:
        return bool(self.sched.has_requests())

    def flush(self, timeout: float) -> bool:
        """Wait until the worker's saves reached the node."""
        return self.worker is None or bool(self.worker.transfers.flush(timeout))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.sched.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None


# ---------------------------------------------------------------------------------------------
def earlier_turns(trace: Trace, start: int, count: int) -> list[int]:
    """Indices of the requests before ``start`` that the slice's requests continue
    (the latest one sharing the longest prefix, at least MIN_SHARED_BLOCKS blocks)."""
    bt = trace.block_tokens
    chains = [r.hash_ids[: r.full_blocks(bt)] for r in trace]
    # index by the first two blocks: only requests sharing them can share more
    by_head: dict[tuple[int, ...], list[int]] = {}
    for j in range(start):
        if len(chains[j]) >= MIN_SHARED_BLOCKS:
            by_head.setdefault(chains[j][:MIN_SHARED_BLOCKS], []).append(j)
    picked: set[int] = set()
    for i in range(start, min(len(trace), start + count)):
        best, best_j = 0, -1
        for j in by_head.get(chains[i][:MIN_SHARED_BLOCKS], []):
            n = _common(chains[i], chains[j])
            if n >= best:
                best, best_j = n, j
        if best_j >= 0:
            picked.add(best_j)
    return sorted(picked)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _prompt(trace: Trace, r: TraceRequest) -> list[int]:
    return [int(t) for t in trace.prompt_tokens(r)]


def _progress(msg: str) -> None:
    print(f"[serve +{time.monotonic() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


@dataclass
class Plan:
    """What one run replays and how."""

    trace: Trace
    start: int
    count: int
    output_cap: int
    time_scale: float
    stall_s: float
    model_dir: Path
    cost: CostModel
    transport: str = "tcp"

    @property
    def slice(self) -> list[TraceRequest]:
        return self.trace.requests[self.start : self.start + self.count]


def prewarm(plan: Plan, node: str, pool_blocks: int) -> dict[str, Any]:
    """An earlier engine serves the slice's earlier turns (one output token each, no
    sleeps) and its connector saves their prompt blocks to the node."""
    t = time.monotonic()
    turns = earlier_turns(plan.trace, plan.start, plan.count)
    eng = ServeEngine(
        plan.model_dir, node, cost=None, pool_blocks=pool_blocks, transport=plan.transport
    )
    try:
        for k, i in enumerate(turns):
            eng.add(f"warm-{i}", i, _prompt(plan.trace, plan.trace[i]), 1)
            while eng.busy():
                eng.step()
            if k % 10 == 9:
                _progress(f"  earlier engine: {k + 1}/{len(turns)} earlier turns served")
        while eng.busy():
            eng.step()
        if not eng.flush(120.0):
            raise RdmakvError("the earlier engine's saves did not reach the node in 120 s")
        saved = eng.worker.stores.stats.saved_blocks
        wrong = eng.wrong_blocks + eng.wrong_local_blocks
    finally:
        eng.close()
    return {
        "requests": len(turns),
        "saved_blocks": saved,
        "wrong_blocks": wrong,
        "seconds": round(time.monotonic() - t, 1),
    }


def replay(
    eng: ServeEngine, plan: Plan, stall: Callable[[], None] | None = None
) -> None:
    """Feed the slice at its (scaled) arrival times; run until every request finished."""
    reqs = plan.slice
    ts0 = reqs[0].timestamp_ms
    arrivals = [(r.timestamp_ms - ts0) / 1000.0 * plan.time_scale for r in reqs]
    prompts = [_prompt(plan.trace, r) for r in reqs]
    eng.t0 = time.monotonic()
    nxt = 0
    stall_thread = None
    if stall is not None:
        stall_thread = threading.Thread(target=stall, name="serve-stall", daemon=True)
        stall_thread.start()
    last_report = 0.0
    while nxt < len(reqs) or eng.busy():
        now = eng.now()
        if now > RUN_DEADLINE_S:
            raise RdmakvError(f"the replay did not finish in {RUN_DEADLINE_S:.0f} s (a hang?)")
        while nxt < len(reqs) and arrivals[nxt] <= now:
            r = reqs[nxt]
            out_len = max(1, min(r.output_length, plan.output_cap))
            eng.add(f"r{plan.start + nxt}", plan.start + nxt, prompts[nxt], out_len)
            eng.stats[f"r{plan.start + nxt}"].arrival = arrivals[nxt]
            nxt += 1
        if not eng.busy():
            time.sleep(max(0.0, min(arrivals[nxt] - now, 0.05)))
            continue
        eng.step()
        if now - last_report > 10.0:
            last_report = now
            done = sum(1 for s in eng.stats.values() if len(s.token_times) >= s.output_tokens)
            _progress(f"  t={now:.0f}s arrived {nxt}/{len(reqs)} finished {done}")
    if stall_thread is not None:
        stall_thread.join()
    eng.flush(30.0)


# ---------------------------------------------------------------------------------------------
def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(np.asarray(values), q)), 5)


def summarize(eng: ServeEngine, plan: Plan, wall_s: float) -> dict[str, Any]:
    stats = sorted(eng.stats.values(), key=lambda s: s.index)
    ttfts = [s.ttft for s in stats if s.ttft is not None]
    gaps = [b - a for s in stats for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    decode_steps = [st.wall_s for st in eng.steps if st.decodes]
    pure_decode = [st.wall_s for st in eng.steps if st.decodes and not st.prefill_tokens]
    hits = [s for s in stats if s.remote_hit_tokens > 0]
    prompt_tokens = sum(s.prompt_tokens for s in stats)
    out_tokens = sum(len(s.token_times) for s in stats)
    span = max((s.token_times[-1] for s in stats if s.token_times), default=0.0)
    over = [st for st in eng.steps if st.work_s > st.model_s]
    secs = eng.connector_seconds
    loads = [s.load_done - s.load_started for s in stats
             if s.load_done is not None and s.load_started is not None]
    lookups = [
        s.lookup_answered - s.lookup_asked
        for s in stats
        if s.lookup_answered is not None and s.lookup_asked is not None
    ]
    out: dict[str, Any] = {
        "requests": len(stats),
        "finished": sum(1 for s in stats if len(s.token_times) >= s.output_tokens),
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p99_s": _pct(ttfts, 99),
        "ttft_hit_p50_s": _pct([s.ttft for s in hits if s.ttft is not None], 50),
        "ttft_miss_p50_s": _pct(
            [s.ttft for s in stats if s.remote_hit_tokens == 0 and s.ttft is not None], 50
        ),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99),
        "decode_step_p50_s": _pct(decode_steps, 50),
        "decode_step_p99_s": _pct(decode_steps, 99),
        "pure_decode_step_p99_s": _pct(pure_decode, 99),
        "tokens_per_s": round(out_tokens / span, 2) if span else None,
        "output_tokens": out_tokens,
        "hit_rate": round(sum(s.remote_hit_tokens for s in stats) / prompt_tokens, 5),
        "hit_requests": len(hits),
        "hit_request_ids": [s.index for s in hits],
        "local_prefix_hit_rate": round(sum(s.local_hit_tokens for s in stats) / prompt_tokens, 5),
        "offered_remote_tokens": sum(s.asked_remote_tokens for s in stats),
        "bytes_moved": eng.loaded_bytes,
        "wrong_blocks": eng.wrong_blocks,
        "wrong_local_blocks": eng.wrong_local_blocks,
        "verified_remote_blocks": eng.verified_remote_blocks,
        "verified_local_blocks": eng.verified_local_blocks,
        "failed_load_blocks": eng.failed_load_blocks,
        "failed_load_requests": eng.failed_load_requests,
        "load_wait_p50_s": _pct(loads, 50),
        "load_wait_max_s": round(max(loads), 4) if loads else None,
        "link_rate_seen_bytes_per_s": (
            round(eng.loaded_bytes / secs["load"]) if secs["load"] else None
        ),
        "connector_seconds": {k: round(v, 3) for k, v in secs.items()},
        "audits": (
            dataclasses.asdict(eng.worker.stores.audits.stats) if eng.worker is not None else None
        ),
        "lookup_wait_p50_s": _pct(lookups, 50),
        "lookup_wait_max_s": round(max(lookups), 4) if lookups else None,
        "steps": len(eng.steps),
        "steps_cpu_over_model": len(over),
        "steps_cpu_over_model_share": round(len(over) / len(eng.steps), 4) if eng.steps else 0,
        "scheduler_cpu_p50_s": _pct([st.sched_s for st in eng.steps], 50),
        "scheduler_cpu_p99_s": _pct([st.sched_s for st in eng.steps], 99),
        "standin_cpu_p50_s": _pct([st.work_s for st in eng.steps], 50),
        "modelled_step_p50_s": _pct([st.model_s for st in eng.steps], 50),
        "wall_s": round(wall_s, 1),
    }
    if eng.worker is not None:
        st = eng.worker.stores.stats
        out["saved_blocks"] = st.saved_blocks
        out["bytes_saved"] = st.saved_blocks * sum(eng.worker.stores.block_bytes)
        lk = eng.sched.connector.lookups
        if lk is not None:
            out["lookups_expired"] = lk.stats.expired
        rate = out["link_rate_seen_bytes_per_s"]
        if rate:
            out["link_rate_full_model_equiv_bytes_per_s"] = round(rate / plan.cost.held_fraction)
    out["per_request"] = [
        {"i": s.index, "arrival": round(s.arrival, 4), "ttft": s.ttft and round(s.ttft, 4),
         "remote": s.remote_hit_tokens, "local": s.local_hit_tokens,
         "first_compute": s.first_compute and round(s.first_compute, 4),
         "lookup_wait": _since(s.lookup_asked, s.lookup_answered),
         "load_wait": _since(s.load_started, s.load_done)}
        for s in stats
    ]
    return out


def pool_blocks_for(plan: Plan) -> int:
    """The engine's KV pool: what the named GPU holds, in BLOCK_TOKENS blocks."""
    return plan.cost.kv_pool_tokens // BLOCK_TOKENS


def node_pool_bytes(plan: Plan) -> int:
    """The node holds the earlier turns' and the slice's prompt blocks, with room."""
    turns = earlier_turns(plan.trace, plan.start, plan.count)
    tokens = sum(plan.trace[i].input_length for i in turns)
    tokens += sum(r.input_length for r in plan.slice)
    held = plan.cost.kv_bytes_per_token * plan.cost.held_fraction
    block = int(held * BLOCK_TOKENS)
    return int(math.ceil(tokens / BLOCK_TOKENS * NODE_ROOM) + 64) * block


def run_config(
    name: str, plan: Plan, on_engine: Callable[[ServeEngine], None] | None = None
) -> dict[str, Any]:
    """One configuration: fresh node (pre-warmed), fresh scheduler and engine, the replay."""
    t = time.monotonic()
    pool = pool_blocks_for(plan)
    if name == "prefix_only":
        eng = ServeEngine(plan.model_dir, None, cost=plan.cost, pool_blocks=pool)
        try:
            if on_engine is not None:
                on_engine(eng)
            replay(eng, plan)
            return summarize(eng, plan, time.monotonic() - t)
        finally:
            eng.close()
    held = plan.cost.kv_bytes_per_token * plan.cost.held_fraction
    with LocalNodeProcess(
        {
            "pool-size": str(node_pool_bytes(plan)),
            "block-size": str(int(held * BLOCK_TOKENS)),
            "transport": plan.transport,
        },
        extra_args=["--no-lock"],
    ) as node:
        warm = prewarm(plan, node.endpoint, pool)
        _progress(f"  {name}: node pre-warmed ({warm})")
        eng = ServeEngine(
            plan.model_dir, node.endpoint, cost=plan.cost, pool_blocks=pool,
            load_mode="sync" if name == "rdmakv_sync" else "async",
            audit_rate=AUDIT_CONFIGS.get(name, 0.0),
            transport=plan.transport,
        )
        stall_info: dict[str, Any] = {}
        stall = None
        if name.endswith("_stall"):
            reqs = plan.slice
            span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0 * plan.time_scale

            def stall() -> None:
                time.sleep(max(0.0, span * STALL_AT - eng.now()))
                stall_info["from_s"] = round(eng.now(), 3)
                node.pause()
                time.sleep(plan.stall_s)
                node.resume()
                stall_info["to_s"] = round(eng.now(), 3)

        try:
            if on_engine is not None:
                on_engine(eng)
            replay(eng, plan, stall)
            res = summarize(eng, plan, time.monotonic() - t)
        finally:
            eng.close()
        res["prewarm"] = warm
        if stall_info:
            res["stall"] = _stall_summary(res, stall_info)
        return res


def _since(start: float | None, end: float | None) -> float | None:
    return round(end - start, 4) if start is not None and end is not None else None


def _stall_summary(res: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """Requests the stall could hold up (arriving from two timeouts before it to its
    end): how long the connector kept them waiting, and until they were computed."""
    lo, hi = info["from_s"] - 2 * CONNECTOR_TIMEOUT_S, info["to_s"]
    during = [p for p in res["per_request"] if lo <= p["arrival"] <= hi]

    def worst(key: str) -> float | None:
        vals = [p[key] for p in during if p[key] is not None]
        return max(vals) if vals else None

    return {
        **info,
        "seconds": round(info["to_s"] - info["from_s"], 2),
        "timeout_s": CONNECTOR_TIMEOUT_S,
        "requests_exposed": len(during),
        "lookup_wait_max_s": worst("lookup_wait"),
        "load_wait_max_s": worst("load_wait"),
        "arrival_to_compute_max_s": max(
            (round(p["first_compute"] - p["arrival"], 3) for p in during
             if p["first_compute"] is not None), default=None,
        ),
    }


def compare(configs: dict[str, dict[str, Any]]) -> None:
    """Ratios against prefix_only, and the hit requests' TTFT there (their recompute)."""
    base = configs.get("prefix_only")
    if base is None:
        return
    base_ttft = {p["i"]: p["ttft"] for p in base["per_request"]}
    for name, res in configs.items():
        if name == "prefix_only":
            continue
        ids = res["hit_request_ids"]
        rec = [base_ttft[i] for i in ids if base_ttft.get(i) is not None]
        res["ttft_recompute_p50_s"] = _pct(rec, 50)
        hit = res["ttft_hit_p50_s"]
        res["ttft_hit_vs_recompute"] = (
            round(hit / res["ttft_recompute_p50_s"], 3)
            if hit is not None and res["ttft_recompute_p50_s"] else None
        )
        for key in ("decode_step_p99_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s"):
            if res.get(key) is not None and base.get(key):
                res[f"{key.removesuffix('_s')}_vs_prefix_only"] = round(res[key] / base[key], 3)
        if base.get("tokens_per_s") and res.get("tokens_per_s"):
            res["tokens_per_s_vs_prefix_only"] = round(
                res["tokens_per_s"] / base["tokens_per_s"], 3
            )


TABLE_KEYS = (
    "ttft_p50_s", "ttft_p99_s", "ttft_hit_p50_s", "ttft_recompute_p50_s", "itl_p50_s",
    "itl_p99_s", "decode_step_p99_s", "tokens_per_s", "hit_rate", "bytes_moved", "wrong_blocks",
)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    names = list(configs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for name in names:
        ttfts = sorted(p["ttft"] for p in configs[name]["per_request"] if p["ttft"] is not None)
        if ttfts:
            ax.plot(ttfts, np.linspace(0, 1, len(ttfts)), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT, all requests")
    ax.legend(fontsize=8)
    ax = axes[1]
    x = np.arange(len(names))
    for k, (key, label) in enumerate((("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99"),
                                      ("decode_step_p99_s", "decode step p99"))):
        vals = [configs[n].get(key) or 0.0 for n in names]
        ax.bar(x + (k - 1) * 0.27, [v * 1000 for v in vals], 0.27, label=label)
    ax.set_xticks(x, names, rotation=20, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("decode step time")
    ax.legend(fontsize=8)
    ax = axes[2]
    hit = [configs[n].get("ttft_hit_p50_s") or 0.0 for n in names[1:]]
    rec = [configs[n].get("ttft_recompute_p50_s") or 0.0 for n in names[1:]]
    x = np.arange(len(names) - 1)
    ax.bar(x - 0.2, hit, 0.4, label="with rdmakv hit")
    ax.bar(x + 0.2, rec, 0.4, label="same requests, prefix_only")
    ax.set_xticks(x, names[1:], rotation=20, fontsize=8)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("requests with a remote hit")
    ax.legend(fontsize=8)
    meta = result.get("meta", {})
    fig.suptitle(
        f"bench/serve.py: {MODEL_NAME} on {GPU_NAME} (modelled), {meta.get('requests')} "
        f"requests from {meta.get('start')}, {meta.get('commit', '')}", fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def exit_status(results: dict[str, dict[str, Any]]) -> int:
    """1 if any configuration had a wrong block or an unfinished request, else 0."""
    wrong = sum(r["wrong_blocks"] + r["wrong_local_blocks"] for r in results.values())
    unfinished = sum(r["requests"] - r["finished"] for r in results.values())
    if wrong or unfinished:
        print(
            f"bench/serve.py: FAIL: {wrong} wrong block(s), {unfinished} unfinished request(s)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=None,
                   help=f"a Mooncake-format trace (default {DEFAULT_TRACE}, else the "
                   "committed slice)")
    p.add_argument("--start", type=int, default=None,
                   help=f"first request of the slice (default {DEFAULT_START}, or 0 with a "
                   "trace shorter than that)")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="slice length")
    p.add_argument("--full", action="store_true", help="the whole trace from --start")
    p.add_argument("--quick", action="store_true",
                   help=f"CI: {QUICK_REQUESTS} requests of the committed slice from "
                   f"{QUICK_START}, outputs capped at {QUICK_OUTPUT_CAP}, a 3 s stall")
    p.add_argument("--output-cap", type=int, default=DEFAULT_OUTPUT_CAP,
                   help="cap on output tokens per request")
    p.add_argument("--time-scale", type=float, default=TIME_SCALE,
                   help="replay seconds per trace second")
    p.add_argument("--stall", type=float, default=STALL_S, help="node SIGSTOP seconds")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--transport", choices=["tcp", "rdma"], default="tcp",
                   help="node and connector transport (rdma: inside the soft-RoCE VM)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where serve.json/.png go")
    args = p.parse_args(argv)
    if args.quick:
        trace_path = args.trace or FALLBACK_TRACE
        if args.start is None:
            args.start = QUICK_START
    else:
        trace_path = args.trace or (DEFAULT_TRACE if DEFAULT_TRACE.exists() else FALLBACK_TRACE)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS and c not in AUDIT_CONFIGS]
    if bad:
        p.error(f"unknown config(s) {bad}; known: {[*CONFIGS, *AUDIT_CONFIGS]}")
    try:
        trace = load_trace(trace_path)
    except RdmakvError as e:
        print(f"bench/serve.py: error: {e}", file=sys.stderr)
        return 2
    start = args.start if args.start is not None else (
        DEFAULT_START if len(trace) > DEFAULT_START + args.requests else 0
    )
    count = len(trace) - start if args.full else args.requests
    cap = args.output_cap
    stall_s = args.stall
    if args.quick:
        count, cap, stall_s = min(count, QUICK_REQUESTS), min(cap, QUICK_OUTPUT_CAP), 3.0
    count = min(count, len(trace) - start)
    if count <= 0:
        p.error(f"no requests in the slice (trace has {len(trace)}, start {start})")
    plan = Plan(
        trace, start, count, cap, args.time_scale, stall_s, _model_dir(), CostModel(),
        args.transport,
    )
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for name in configs:
        _progress(f"config {name}: {count} requests from {start}")
        results[name] = run_config(name, plan)
        r = results[name]
        _progress(
            f"config {name}: ttft p50 {r['ttft_p50_s']} hit p50 {r['ttft_hit_p50_s']} itl p99 "
            f"{r['itl_p99_s']} hits {r['hit_requests']} wrong {r['wrong_blocks']}"
        )
    compare(results)
    cost = plan.cost.describe()
    cost["time_scale"] = plan.time_scale
    cost["output_cap"] = plan.output_cap
    cost["connector_timeout_s"] = CONNECTOR_TIMEOUT_S
    result = {
        "configs": results,
        "cost_model": cost,
        "meta": {
            "trace": str(trace_path), "start": start, "requests": count,
            "earlier_turns": len(earlier_turns(trace, start, count)),
            "stall_s": stall_s, "transport": plan.transport,
            **provenance(), "seconds": round(time.monotonic() - t0, 1),
        },
    }
    publish(result, args.out, "serve", plot)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
