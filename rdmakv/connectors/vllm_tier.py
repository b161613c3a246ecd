"""rdmakv as a secondary tier of vLLM's own KV offloading (vLLM 0.33 ``TieringOffloadingSpec``).

vLLM's OffloadingConnector keeps offloaded KV in a CPU tier it owns (GPU<->CPU
DMA on its own streams, its scheduling, backpressure and metrics) and, since
0.33, cascades that tier's chunks to out-of-tree secondary tiers. This module
is one: chunks go between vLLM's CPU tier and ``rdmakv serve`` nodes (one, a
list, or ``dns://`` with ``replication``), one-sided straight out of and into
vLLM's buffer. One line of config::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name":
      "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592, "secondary_tiers":
      [{"type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier",
        "node": "10.0.0.5:7070"}]}}'

vLLM's factory imports ``module_path`` and takes the attribute named by
``type`` (``rdmakv``, an alias of :class:`RdmakvTier`); every other key of the
tier's dict (except ``backpressure``, vLLM's) reaches the tier: they are
:class:`~rdmakv.connectors.group_stores.StoreOptions` (``node``, ``replication``,
``transport``, ``token_file``, ``timeout``, ``offload``, ``offload_budget``,
``model``, ``metrics_port``, ``rdmakv_config``...) plus vLLM's ``locality``.
Options of rdmakv's own connector that vLLM's CPU tier replaces (``l1_bytes``,
``policy``, ``lock_slab``, ``load_mode``, the audit options) are refused by name, like
unknown keys.

What runs where (all in vLLM's scheduler process; every method below is
called under vLLM's offloading-manager lock and none waits on the network):

* ``lookup`` answers ``RETRY`` until the node answered, then ``HIT`` /
  ``MISS``; the step's questions go out together at ``on_schedule_end`` (one
  ``exists`` per node), and a question unanswered after ``timeout`` is a
  ``MISS``. A chunk whose load failed reads ``MISS`` from then on.
* ``submit_store`` / ``submit_load`` queue the job on rdmakv's I/O thread
  (:class:`~rdmakv.connectors.chunk_tier.ChunkTier`); ``get_finished_jobs``
  reports it, with ``successful_keys`` when only some chunks of a load
  arrived. vLLM keeps a job's CPU chunks pinned until it is reported, and
  rdmakv reports it only once no transfer touches them any more.
* ``drain_jobs`` (vLLM's cache reset) waits for the running and queued jobs;
  ``shutdown`` ends the running one, fails the queued ones and closes the
  connections before vLLM unmaps its buffer.

Keys: vLLM's ``OffloadKey`` (the chained block hash of the chunk's prefix plus
the KV cache group) under rdmakv's namespace: the model (``model`` option, else
vLLM's model name), the KV dtype, the chunk layout (group geometry, tokens per
chunk, bytes per chunk, KV cache layout, canonical or replicated layout) and
the parallel layout (TP/PP/PCP/DCP sizes; left out when vLLM says the bytes
are parallelism agnostic). Engines share chunks when all of that matches and
their block hashes agree (vLLM's default sha256 does across processes; with a
non-cryptographic prefix-caching hash set ``PYTHONHASHSEED`` to one value).

Selective offload: ``offload`` (``reuse``, the default, with
``offload_budget``; ``all``; ``hot``) picks which chunks of a cascade are
sent, on rdmakv's I/O thread as it takes the store job, from the chunk's
depth in its request (vLLM's recorded key position) and the request's
``rdmakv_keep`` hint in ``kv_transfer_params``. ``reuse`` and ``hot`` need
to see a chunk used again while vLLM's CPU tier holds it, which vLLM 0.33
shows a tier only one way (its scheduler never calls ``touch``): under those
policies the tier asks for vLLM's request-level offload policy
(``on_new_request``), so vLLM also cascades each request's CPU-tier hits to
the tier, pinned like any store job; a declined chunk offered that way is
weighed again as used again, an already sent one is skipped without a node
call (:class:`~rdmakv.connectors.chunk_tier.ChunkTier`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found]
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.connectors.chunk_tier import ChunkTier, JobOutcome
from rdmakv.connectors.group_stores import AUDIT_OPTIONS, StoreOptions
from rdmakv.connectors.plan import request_keep_hint
from rdmakv.engine.l1 import block_keep
from rdmakv.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec  # type: ignore[import-not-found]
    from vllm.v1.kv_offload.tiering.backpressure import (  # type: ignore[import-not-found]
        BackpressureDetector,
    )

log = logging.getLogger("rdmakv.connectors.vllm_tier")

KEY_FORMAT = "vllm-tier.v1"
"""Version of the chunk key namespace (what follows it in ``kv_layout``)."""
VLLM_TIER_KEYS = ("locality",)
"""Keys vLLM's factory passes on that are vLLM's, not rdmakv's."""
NOT_FOR_TIER = {
    "l1_bytes": "vLLM's CPU tier is the L1 here: size it with cpu_bytes_to_use",
    "policy": "vLLM's CPU tier evicts: set eviction_policy in kv_connector_extra_config",
    "lock_slab": "the tier's memory is vLLM's CPU tier, which vLLM allocates",
    "load_mode": "vLLM schedules the loads of its offloading connector",
    **dict.fromkeys(
        AUDIT_OPTIONS, "KV audits exist in the vLLM connector only: the tier sees no recompute"
    ),
}
"""Options of rdmakv's connector that make no sense for the tier, and why."""


def tier_options(raw: Mapping[str, Any]) -> StoreOptions:
    """The tier's :class:`StoreOptions` from its config dict (vLLM's keys left out);
    a bad, unknown or inapplicable key is a one-line :class:`ConfigError` naming it."""
    for key, why in NOT_FOR_TIER.items():
        if key in raw:
            raise ConfigError(f'rdmakv tier option "{key}" does not apply to the tier ({why})')
    return StoreOptions.from_mapping(raw, ignore=VLLM_TIER_KEYS)


def tier_namespace(spec: Any, options: StoreOptions, chunk_bytes: int) -> KeyNamespace:
    """What must match for two engines to share chunks (module docstring)."""
    cfg = spec.config
    layers = hashlib.blake2b(
        "\n".join(n for g in cfg.groups for n in g.layer_names).encode(), digest_size=8
    ).hexdigest()
    groups = ",".join(f"{g.tokens_per_block}x{len(g.layer_names)}" for g in cfg.groups)
    p = cfg.parallel
    parallel = (
        "agnostic" if p.is_parallelism_agnostic or cfg.replicated_layout
        else f"tp{p.tp_size}pp{p.pp_size}pcp{p.pcp_size}dcp{p.dcp_size}ws{p.world_size}"
    )
    return KeyNamespace(
        model=options.model or cfg.model.name,
        dtype=str(cfg.model.dtype).removeprefix("torch."),
        kv_layout=(
            f"{KEY_FORMAT}:groups={groups}:layers={layers}:hash={cfg.cache.tokens_per_hash}"
            f":chunk={cfg.cache.blocks_per_chunk}x{cfg.worker_kv_bytes_per_block}B"
            f"/{chunk_bytes}B:layout={cfg.kv_cache_layout}:canonical={cfg.canonical_layout}"
            f":replicated={cfg.replicated_layout}:{parallel}"
        ),
    )


class RdmakvTier(SecondaryTierManager):  # type: ignore[misc]
    """rdmakv nodes behind vLLM's CPU tier; see the module docstring.

    Built by vLLM's ``SecondaryTierFactory`` with the tier's config dict as
    keyword arguments. Owns a :class:`ChunkTier` (its threads and node
    connections) over ``primary_kv_view`` until :meth:`shutdown`.
    """

    medium: ClassVar[Any] = Medium.CPU  # the nodes keep KV in DRAM
    # a remote store: not a hit in this host's memory (vLLM's HOST)
    cache_hit_source: ClassVar[Any] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        locality = config.get("locality")
        try:
            self.locality = Locality(locality) if locality is not None else Locality.REMOTE
        except ValueError as e:
            raise ConfigError(
                f'rdmakv tier option "locality" must be LOCAL or REMOTE, got {locality!r}'
            ) from e
        options = tier_options(config)
        self._chunk_tokens: list[int] = [
            t * offloading_spec.blocks_per_chunk for t in offloading_spec.tokens_per_block
        ]
        self.core = ChunkTier(
            primary_kv_view,
            self.block_size_bytes,
            tier_namespace(offloading_spec, options, self.block_size_bytes),
            options,
            label=str(offloading_spec.config.engine_id),
        )
        log.info(
            "rdmakv tier %s: chunks of %d bytes to %s over %s (offload %s)",
            tier_type, self.block_size_bytes, options.node, self.core.transport_name,
            options.offload,
        )

    # -- lookups -----------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.core.lookup(key, req_context.req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # request level: vLLM offers the request's CPU-tier hits too (module docstring)
        return RequestOffloadingContext(
            policy=OffloadPolicy.REQUEST_LEVEL if self.core.wants_every_use
            else OffloadPolicy.CHUNK_LEVEL
        )

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.core.release_owner(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.core.flush_lookups()

    # -- jobs --------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        ctx = job_metadata.req_context
        keys = list(job_metadata.keys)
        self.core.store(
            job_metadata.job_id, keys, job_metadata.chunk_ids,
            plan=functools.partial(self._plan, keys, ctx),
        )

    def _plan(
        self, keys: list[OffloadKey], ctx: ReqContext
    ) -> tuple[list[int], list[bool | None]]:
        """Each chunk's index in its request (0 when vLLM recorded no position) and
        its reuse hint. Runs on rdmakv's I/O thread: vLLM records a key's position
        before it stores the key and never changes it, so reading it later is safe."""
        hint = request_keep_hint(ctx.kv_transfer_params, ctx.req_id)
        depths: list[int] = []
        keeps: list[bool | None] = []
        for key in keys:
            tokens = self._chunk_tokens[get_offload_group_idx(key)]
            end = ctx.get_offload_key_position(key)
            depth = 0 if end is None else max(0, -(-int(end) // tokens) - 1)
            depths.append(depth)
            keeps.append(block_keep(hint, depth, tokens))
        return depths, keeps

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.core.load(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [_job_result(out) for out in self.core.finished()]

    def has_pending_work(self) -> bool:
        return self.core.busy()

    def drain_jobs(self) -> None:
        self.core.drain()

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.core.close()

    def config_info(self) -> dict[str, Any]:
        return self.core.describe()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("node", "transport", "offload", "replication", "chunk_bytes")


def _job_result(out: JobOutcome) -> JobResult:
    """vLLM's report of a finished job: ``successful_keys`` only where a load
    moved some chunks and not others (vLLM frees the others' rows)."""
    partial = out.is_load and not out.success and any(out.ok)
    return JobResult(
        job_id=out.job_id,
        success=out.success,
        successful_keys=(
            [OffloadKey(n) for n, ok in zip(out.names, out.ok, strict=True) if ok]
            if partial else None
        ),
        transfer_time=out.seconds,
        transfer_bytes=out.nbytes,
    )


rdmakv = RdmakvTier
"""The name vLLM's config uses: ``{"type": "rdmakv", "module_path": "rdmakv.connectors.vllm_tier"}``
(vLLM's factory takes the attribute of ``module_path`` named by ``type``)."""

__all__ = ["KEY_FORMAT", "RdmakvTier", "rdmakv", "tier_namespace", "tier_options"]
