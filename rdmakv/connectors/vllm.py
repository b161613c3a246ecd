"""vLLM v1 KV connector: vLLM's paged KV cache <-> rdmakv (L1 slab + KV node).

Load it through vLLM's connector factory, no patching::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "RdmakvConnector",
        "kv_connector_module_path": "rdmakv.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node": "10.0.0.5:7070"}}'

(options of ``kv_connector_extra_config``: :class:`~rdmakv.connectors.group_stores.StoreOptions`;
``"rdmakv_config": PATH`` takes their defaults from an rdmakv config file's ``client``
section; ``docs/engines.md`` has the whole story). Checked against vLLM 0.33.0.

How one request flows (no engine thread waits on the network):

1. *Scheduler side* (engine-core process): ``on_new_request`` hands the
   prompt to a :class:`~rdmakv.connectors.lookups.LookupService` thread, which
   asks the node which blocks are cached, per KV cache group, batching the
   questions that arrived meanwhile. ``get_num_new_matched_tokens`` answers
   ``None`` (vLLM asks again next step) until the answer is in, then the
   longest common hit beyond vLLM's own prefix-cache hit
   (:class:`~rdmakv.connectors.plan.RequestBook`); an unanswered lookup
   expires after the client timeout as no hit. ``update_state_after_alloc``
   records the engine blocks to fill; ``build_connector_meta`` ships a
   :class:`~rdmakv.connectors.plan.StepPlan` (loads, saves, preemptions) to
   the workers.
2. *Worker side* (each TP rank): ``register_kv_caches`` wraps each group's
   layer tensors in a :class:`~rdmakv.connectors.paged.PagedGroupCopier` and
   starts a :class:`~rdmakv.connectors.transfers.TransferWorker` thread.
   ``bind_connector_metadata`` queues the planned loads (L1, then the node,
   then the copy into vLLM's blocks) before the forward pass, so they overlap
   it, and ``wait_for_save`` the step's new prompt blocks
   (copy into slab blocks, then the offloader thread writes them to the
   node); ``get_transfer_results`` reports what finished.
3. Loads are asynchronous (``load_mode: async``, the default): the request
   waits in ``WAITING_FOR_REMOTE_KVS`` while the others run.
   ``load_mode: sync`` makes ``start_load_kv`` wait for the step's loads.
4. Failures become recomputation: a single-group model reports unfilled
   blocks through ``get_block_ids_with_load_errors`` (in the pass that reports
   the load finished); a hybrid model (several groups) reports failed requests
   through ``get_transfer_results(...).failed_recving`` (vLLM refuses
   block-level reports with several groups). A failed request is never
   offered a hit again. Set ``"kv_load_failure_policy": "recompute"`` (vLLM's
   default "fail" aborts such requests).
5. A finished request with a save is held (``request_finished`` returns True)
   until its saves' copies ran (``finished_sending``); a preempted request's
   queued saves are dropped in ``handle_preemptions`` before vLLM reuses its
   blocks.

6. Audits (``audit_rate``; :mod:`rdmakv.connectors.audit`): a sampled request
   with a hit is offered none; its plan's ``audits`` make the workers fetch
   the blocks it would have loaded and compare them with what vLLM computed
   (in the save). A mismatch quarantines the namespace on that worker, which
   reports it through ``build_connector_worker_meta`` (vLLM aggregates the
   ranks' :class:`RdmakvWorkerMetadata` into ``update_connector_output``): the
   scheduler side then offers no hit to anyone, and the worker tells the node
   (REPORT, shown by ``rdmakv stats``). An operator's clearance (the worker's
   metrics endpoint) travels the same way back and, through
   ``StepPlan.clear_quarantine``, to every rank. At start-up both sides check
   the namespace's fingerprint record (:mod:`rdmakv.connectors.fingerprint`).

Keys: the namespace is the model (name + revision, or the ``model`` option),
the KV dtype, each group's page geometry and, under tensor parallelism, the
rank's KV-head slice (:func:`rdmakv.engine.manager.tp_namespace`: TP sizes holding the
same heads share blocks; MLA shares across all ranks). Each group's spec is in
every key. Tensor parallelism: the scheduler side checks TP rank 0's keys;
every rank loads on its own and reports what it could not fill, and vLLM
combines the ranks' reports (a block any rank failed is recomputed on all), so
all ranks always use the same prefix without an extra collective.

Limits (say so, don't guess): mamba/state groups and cross-attention specs are
refused at start-up with a clear error; pipeline parallelism is refused; only
prompt blocks are saved;
``wait_for_layer_load`` / ``save_kv_layer`` are no-ops (whole blocks move
outside the forward pass), so CUDA graphs need no piecewise mode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    FullAttentionSpec as VllmFullAttentionSpec,
)
from vllm.v1.kv_cache_interface import (
    SlidingWindowSpec as VllmSlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]

from rdmakv.blocks.keys import KeyNamespace, extra_bytes
from rdmakv.connectors.fingerprint import engine_fingerprint
from rdmakv.connectors.group_stores import LOAD_ASYNC, GroupStores, StoreOptions
from rdmakv.connectors.lookups import LookupService
from rdmakv.connectors.paged import PagedGroupCopier, PageSpec
from rdmakv.connectors.plan import RequestBook, StepPlan, request_keep_hint
from rdmakv.connectors.transfers import TransferWorker
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup, KVCacheSpec, SlidingWindowSpec
from rdmakv.engine.l1 import KeepHint
from rdmakv.engine.manager import tp_namespace
from rdmakv.errors import ConfigError, RdmakvError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rdmakv.connectors.vllm")

NULL_BLOCK_ID = 0
"""vLLM's null block: stands in for sliding-window blocks that left the window."""
KEY_FORMAT = "vllm-paged.v1"
"""Version of the slab block format (see rdmakv.connectors.paged) in the key namespace."""
SCHEDULER_TP_RANK = 0
"""The scheduler side has no rank of its own; it checks rank 0's keys."""


class RdmakvConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step (picklable plain data)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"RdmakvConnectorMetadata(loads={len(p.loads)}, saves={len(p.saves)}, "
            f"audits={len(p.audits)}, async={p.async_loads})"
        )


class RdmakvWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers tell the scheduler side after a step: namespaces whose remote
    KV an audit quarantined (label -> reason) or an operator cleared.

    vLLM aggregates the ranks' objects with :meth:`aggregate` (every rank's
    report counts: one rank's wrong KV is a wrong output) and hands the result
    to the scheduler side's ``update_connector_output``.
    """

    def __init__(self, quarantined: dict[str, str], cleared: set[str]) -> None:
        self.quarantined = quarantined
        self.cleared = cleared

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, RdmakvWorkerMetadata):
            raise ConfigError(f"cannot aggregate {type(other).__name__} into RdmakvWorkerMetadata")
        quarantined = {**self.quarantined, **other.quarantined}
        return RdmakvWorkerMetadata(quarantined, (self.cleared | other.cleared) - set(quarantined))


class RdmakvConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """rdmakv as a vLLM v1 KV connector (both roles; vLLM makes one instance per role).

    Scheduler side: a :class:`~rdmakv.connectors.lookups.LookupService` thread
    owns the control-only stores; the scheduler thread only reads answers.
    Worker side: a :class:`~rdmakv.connectors.transfers.TransferWorker` thread
    owns the stores and copiers from ``register_kv_caches`` on; the engine
    thread only queues jobs and reads results.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("RdmakvConnector needs the KVCacheConfig (vLLM >= 0.33 passes it)")
        self.options = StoreOptions.from_mapping(
            self._kv_transfer_config.kv_connector_extra_config or {}
        )
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning(
                'kv_load_failure_policy is "%s": a block rdmakv cannot load will fail its '
                'request instead of being recomputed; set "kv_load_failure_policy": "recompute"',
                policy,
            )
        self.groups, self.page_specs, self.layer_names = _groups(kv_cache_config)
        block_bytes = [
            s.page_bytes * len(names)
            for s, names in zip(self.page_specs, self.layer_names, strict=True)
        ]
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        namespace = _namespace(
            vllm_config, self.options, self.page_specs, kv_cache_config, self.is_scheduler
        )
        self.stores = GroupStores(
            namespace,
            self.groups,
            block_bytes,
            self.options,
            scheduler=self.is_scheduler,
            fingerprint=_fingerprint(vllm_config, namespace),
        )
        self.lookups: LookupService | None = None
        if self.is_scheduler:
            self.lookups = LookupService(self.stores, self.options.timeout)
        self.book = RequestBook(
            self.groups,
            self._lookup,
            null_block=NULL_BLOCK_ID,
            async_loads=self.options.load_mode == LOAD_ASYNC,
            audit_rate=self.options.audit_rate,
        )
        if self.stores.guard.refused is not None:
            self.book.remote_reported({self.stores.guard.label: self.stores.guard.refused}, ())
        self.transfers: TransferWorker | None = None
        self._bad_blocks: set[int] = set()

    # ----------------------------------------------------------------- scheduler side
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a miss is never an error

    def _need_lookups(self) -> LookupService:
        if self.lookups is None:
            raise ConfigError("lookups run on the scheduler side of the connector only")
        return self.lookups

    def _lookup(
        self, req_id: str, tokens: Sequence[int], extra: bytes | None
    ) -> list[list[bool]] | None:
        lookups = self._need_lookups()
        lookups.submit(req_id, tokens, extra)
        return lookups.answer(req_id)

    def on_new_request(self, request: Any) -> None:
        # Ask the node as the request arrives: by the time the scheduler reaches
        # it, the answer is usually in and costs the scheduler no step.
        try:
            self._need_lookups().submit(
                request.request_id, list(request.all_token_ids), _extra(request)
            )
        except RdmakvError as e:
            log.warning("request %s: rdmakv lookup not started: %s", request.request_id, e)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            return self.book.num_new_matched_tokens(
                request.request_id,
                list(request.all_token_ids),
                num_computed_tokens,
                _extra(request),
            )
        except RdmakvError as e:  # never let a lookup problem stop the scheduler
            log.warning("request %s: rdmakv lookup failed, no hit: %s", request.request_id, e)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # The answer is used: a request that comes back (preempted) is asked anew.
        self._need_lookups().forget(request.request_id)
        self.book.after_alloc(
            request.request_id,
            list(request.all_token_ids),
            request.num_prompt_tokens,
            _extra(request),
            blocks.get_block_ids(),
            num_external_tokens,
            keep=_keep(request),
        )

    def build_connector_meta(self, scheduler_output: Any) -> RdmakvConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self.book.scheduled(new.req_id, new.num_computed_tokens, block_ids=new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.book.scheduled(req_id, cached.num_computed_tokens[i], block_ids=ids)
            else:
                self.book.scheduled(req_id, cached.num_computed_tokens[i], new_block_ids=ids)
        plan = self.book.build(
            scheduler_output.num_scheduled_tokens, scheduler_output.preempted_req_ids or ()
        )
        return RdmakvConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, RdmakvWorkerMetadata):
            self.book.remote_reported(meta.quarantined, meta.cleared)
        failed = self.book.load_results(
            finished=connector_output.finished_recving or (),
            failed=connector_output.failed_recving or (),
            bad_blocks=connector_output.invalid_block_ids or (),
        )
        if failed:
            log.info("rdmakv loads failed for %d request(s); vLLM recomputes them", len(failed))

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._need_lookups().forget(request.request_id)
        # Held: a save of it may still read its blocks; the workers report it in
        # finished_sending once their saves are done, and vLLM frees the blocks then.
        return self.book.finished(request.request_id), None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    # -------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.transfers is not None:
            raise ConfigError("register_kv_caches was called twice")
        copiers = []
        for k, (names, spec) in enumerate(zip(self.layer_names, self.page_specs, strict=True)):
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ConfigError(
                    f"KV cache group {k}: vLLM registered no tensor for layers {missing}"
                )
            copier = PagedGroupCopier(
                [(n, kv_caches[n]) for n in names], spec, null_block=NULL_BLOCK_ID
            )
            if copier.block_bytes != self.stores.block_bytes[k]:
                raise ConfigError(
                    f"KV cache group {k}: tensors give {copier.block_bytes}-byte blocks, "
                    f"the spec {self.stores.block_bytes[k]}"
                )
            copiers.append(copier)
        self.transfers = TransferWorker(
            self.stores, copiers, null_block=NULL_BLOCK_ID, timeout=self.options.timeout
        )

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RdmakvConnectorMetadata):
            raise ConfigError(
                f"connector metadata is {type(meta).__name__}, not RdmakvConnectorMetadata"
            )
        return meta.plan

    def _need_transfers(self) -> TransferWorker:
        if self.transfers is None:
            raise ConfigError("register_kv_caches was not called before the first transfer")
        return self.transfers

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, RdmakvConnectorMetadata):
            preempted = kv_connector_metadata.plan.preempted
            if preempted and self.transfers is not None:
                self.transfers.drop_saves(preempted)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, RdmakvConnectorMetadata) or self.transfers is None:
            return
        plan = connector_metadata.plan
        if not plan.loads or not plan.async_loads:
            return
        # Asynchronous loads start now, before the forward pass, not in
        # start_load_kv after it: the fetch overlaps the forward and is usually
        # reported at the end of this step, so the request runs in the next one.
        # The loaded blocks belong to waiting requests (this forward never touches
        # them); the copies wait for the engine's work so far (its zeroing of
        # freshly allocated blocks ran before this call).
        self.transfers.load(plan.loads, report_async=True, after=self.transfers.mark())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan.clear_quarantine:
            self.stores.guard.clear()
        if plan.audits:
            self._need_transfers().audit(plan.audits)  # before this step's saves
        if not plan.loads or plan.async_loads:
            return  # asynchronous loads were queued in bind_connector_metadata
        transfers = self._need_transfers()
        # load_mode "sync": this step's forward needs them
        transfers.wait(transfers.load(plan.loads, report_async=False))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads fill every layer before the request runs

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are saved after the forward pass

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan.saves:
            transfers = self._need_transfers()
            transfers.save(plan.saves, after=transfers.mark())

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if self.transfers is None:
            return KVConnectorTransferResults()
        r = self.transfers.results(finished_req_ids)
        # Reported with (never after) the pass that reports the request as loaded.
        self._bad_blocks |= r.bad_blocks
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def build_connector_worker_meta(self) -> RdmakvWorkerMetadata | None:
        """Quarantines and clearances since the last step, for the scheduler side
        (:class:`RdmakvWorkerMetadata`) and, from the transfer thread, the node."""
        report = self.stores.guard.take_report()
        if report is None:
            return None
        if self.transfers is not None:
            self.transfers.submit(partial(self.stores.report_to_node, report))
        return RdmakvWorkerMetadata(report.quarantined, report.cleared)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.close()  # closes the stores
            self.lookups = None
        elif self.transfers is not None:
            self.transfers.close()  # closes the stores
            self.transfers = None
        else:
            self.stores.close()


def _groups(kv_cache_config: Any) -> tuple[list[KVCacheGroup], list[PageSpec], list[list[str]]]:
    """rdmakv groups, page specs and layer names of vLLM's KVCacheConfig (unknown specs: error)."""
    groups: list[KVCacheGroup] = []
    pages: list[PageSpec] = []
    names: list[list[str]] = []
    for k, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        ours: KVCacheSpec
        if isinstance(spec, VllmSlidingWindowSpec):
            ours = SlidingWindowSpec(spec.block_size, spec.sliding_window)
        elif isinstance(spec, VllmFullAttentionSpec):
            ours = FullAttentionSpec(spec.block_size)
        else:
            raise ConfigError(
                f"KV cache group {k} has a {type(spec).__name__}: the rdmakv connector handles "
                "full and sliding-window attention only"
            )
        groups.append(KVCacheGroup(k, ours))
        pages.append(
            PageSpec(
                spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype
            )
        )
        names.append(list(g.layer_names))
    if not groups:
        raise ConfigError("vLLM's KVCacheConfig has no KV cache groups")
    return groups, pages, names


def _namespace(
    vllm_config: Any,
    options: StoreOptions,
    pages: list[PageSpec],
    kv_cache_config: Any,
    scheduler: bool,
) -> KeyNamespace:
    model = options.model
    mc = vllm_config.model_config
    if model is None and mc is not None:
        model = str(mc.model) + (f"@{mc.revision}" if getattr(mc, "revision", None) else "")
    if not model:
        raise ConfigError('no model to name the keys: set a model or the "model" connector option')
    geometry = ";".join(
        f"{len(g.layer_names)}x{p.num_heads}h{p.head_size}+{p.head_size_v}"
        for p, g in zip(pages, kv_cache_config.kv_cache_groups, strict=True)
    )
    parallel = vllm_config.parallel_config
    if int(parallel.pipeline_parallel_size) > 1:
        # Each PP stage holds other layers; the scheduler side sees all of them, so
        # its keys could not match any stage's. Refuse rather than never hit.
        raise ConfigError("the rdmakv vLLM connector does not support pipeline parallelism yet")
    base = KeyNamespace(
        model=model,
        dtype=str(pages[0].dtype).removeprefix("torch."),
        kv_layout=f"{KEY_FORMAT}:{geometry}",
    )
    tp_size = int(parallel.tensor_parallel_size)
    if tp_size == 1:
        return base
    if scheduler:
        rank = SCHEDULER_TP_RANK
    else:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
            get_tensor_model_parallel_rank,
        )

        rank = int(get_tensor_model_parallel_rank())
    total_heads = mc.get_total_num_kv_heads() if mc is not None else pages[0].num_heads * tp_size
    # Names the rank's head slice, so TP sizes holding the same heads share blocks
    # and MLA (one latent "head" on every rank) shares across all ranks.
    return tp_namespace(base, tp_rank=rank, tp_size=tp_size, num_kv_heads=int(total_heads))


def _fingerprint(vllm_config: Any, namespace: KeyNamespace) -> dict[str, Any] | None:
    """This engine's fingerprint record (:mod:`rdmakv.connectors.fingerprint`)."""
    mc = vllm_config.model_config
    if mc is None:
        return None
    return engine_fingerprint(
        model=namespace.model,
        revision=getattr(mc, "revision", None),
        model_path=str(mc.model),
        model_dtype=str(getattr(mc, "dtype", None)),
        quantization=getattr(mc, "quantization", None),
        namespace=namespace,
    )


def _keep(request: Any) -> KeepHint:
    """The request's offload hint (docs/offload.md): ``kv_transfer_params``'
    ``rdmakv_keep`` or session fields, else vLLM's own ``session_id`` (the
    OpenAI-compatible server's ``session_id`` request field)."""
    params = getattr(request, "kv_transfer_params", None)
    session = getattr(request, "session_id", None)
    if session is not None and (params is None or isinstance(params, Mapping)):
        params = {"session_id": session, **(params or {})}
    return request_keep_hint(params, request.request_id)


def _extra(request: Any) -> bytes | None:
    """Per-request key extra: LoRA, multimodal inputs, cache salt (all change KV, not tokens)."""
    lora = request.lora_request
    mm = [f.identifier for f in (request.mm_features or ()) if getattr(f, "identifier", None)]
    return extra_bytes(
        lora_name=lora.lora_name if lora is not None else None,
        mm_hashes=mm,
        cache_salt=request.cache_salt,
    )


__all__ = ["RdmakvConnector", "RdmakvConnectorMetadata", "RdmakvWorkerMetadata"]
