"""Scheduler-side request bookkeeping for engine connectors (engine independent).

The engine's scheduler asks, per waiting request, how many tokens beyond its
local prefix-cache hit can be loaded from rdmakv; later it tells which engine
blocks it allocated, and once per step which requests run and how far. A
:class:`RequestBook` turns those calls into a :class:`StepPlan`: which blocks
each worker must *load* from rdmakv before the forward pass and which freshly
computed blocks it must *save* after it.

Rules it enforces:

* Only full blocks move; a hit never covers the request's last token (the
  engine must compute at least one token to sample from), and a hit is
  aligned to every group's block size (:func:`rdmakv.engine.hybrid.longest_common_hit`).
* Loads are *asynchronous* by default (``async_loads``): the request waits
  for its blocks while the engine runs the others. Hybrid models (more than
  one KV cache group) always report loads asynchronously: the engine cannot
  take block-level failure reports for several groups, so a failure is
  reported per request.
* The lookup may not have answered yet: the book then answers ``None``
  ("ask again"), never waits.
* A request with a save in some plan is *held* when it finishes: the engine
  keeps its blocks until the workers report its saves done.
* A request whose load failed is never offered an external hit again (the
  engine would otherwise retry the same failing load forever); the blocks it
  recomputes are saved as usual.
* Only prompt blocks are saved: generated tokens may still change (speculative
  decoding) and are rarely shared.
* The engine's null block (a sliding-window block that fell out of the window)
  is never loaded or saved.

* A request picked for an audit (``audit_rate``; the same requests in every
  process: a hash of the request id) is offered no hit: the engine computes
  it all, and the plan's ``audits`` name the engine blocks that will hold
  the hit's positions, so the workers compare them with the fetched blocks.
* While :attr:`RequestBook.remote_off` is not empty (a fingerprint conflict, a
  worker's audit quarantine), no request is offered a hit.

A book entry lives from the first scheduler question about a request until
:meth:`RequestBook.finished`. Not thread-safe: the engine's scheduler thread
owns it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rdmakv.connectors.audit import audit_sampled
from rdmakv.engine.hybrid import KVCacheGroup, longest_common_hit
from rdmakv.engine.l1 import KeepHint
from rdmakv.errors import ConfigError

log = logging.getLogger("rdmakv.connectors")

HitLookup = Callable[[str, Sequence[int], bytes | None], list[list[bool]] | None]
"""``(req_id, tokens, extra) -> one hit bitmap per group`` (entry ``i``: block ``i`` is
cached), or None while the answer is not in yet."""

KEEP_PARAM = "rdmakv_keep"
"""The explicit hint in a request's transfer parameters (vLLM: ``kv_transfer_params``):
true, false, or a token count N (the first N tokens will be asked for again)."""
SESSION_PARAMS = ("prompt_cache_key", "session_id", "conversation_id")
"""OpenAI-style fields that name a group of requests sharing a prefix (a
prompt-cache key, a chat session, a conversation): a request carrying one
will be continued or joined, so its prefix is kept (``True``) unless
:data:`KEEP_PARAM` says otherwise."""

MIN_TOKENS_TO_COMPUTE = 1
"""The engine must compute at least this many tokens itself (it samples from them)."""


@dataclass(frozen=True)
class GroupBlocks:
    """Blocks of one KV cache group to move for one request.

    ``block_ids[j]`` is the engine block holding request block
    ``first_block + j``; the null block may appear and is skipped.
    """

    first_block: int
    block_ids: tuple[int, ...]

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.block_ids)


@dataclass(frozen=True)
class Transfer:
    """One request's load or save: a token prefix and, per group, the blocks in it.

    ``tokens`` is the prefix the blocks belong to (the key chain input); it
    covers at least every listed block. ``extra`` is the request's key extra
    (LoRA, multimodal hashes, cache salt; :func:`rdmakv.blocks.keys.extra_bytes`).
    ``keep`` is the request's reuse hint for the offload policy of a save
    (:meth:`rdmakv.engine.manager.KVCacheManager.put`).
    """

    req_id: str
    tokens: tuple[int, ...]
    extra: bytes | None
    groups: tuple[GroupBlocks, ...]
    keep: KeepHint = None

    def engine_block_ids(self, null_block: int | None) -> set[int]:
        return {b for g in self.groups for b in g.block_ids if b != null_block}


@dataclass(frozen=True)
class StepPlan:
    """What the workers do in one engine step. Plain data: it crosses process boundaries."""

    loads: tuple[Transfer, ...] = ()
    saves: tuple[Transfer, ...] = ()
    async_loads: bool = False
    preempted: tuple[str, ...] = ()
    """Requests the engine preempted this step: their blocks are reused right away."""
    audits: tuple[Transfer, ...] = ()
    """Sampled requests offered no hit (:mod:`rdmakv.connectors.audit`): the blocks
    they would have loaded, fetched to compare with what the engine computes into
    the same engine blocks this step (their saves come in this plan or later)."""
    clear_quarantine: bool = False
    """An operator cleared an audit quarantine on some worker: every worker clears
    its own (a TP engine's other ranks may serve no endpoint of their own)."""


@dataclass
class _Request:
    tokens: Sequence[int]
    num_prompt: int
    extra: bytes | None
    block_ids: list[list[int]]
    saved_blocks: list[int]
    keep: KeepHint = None
    num_computed: int = 0
    load_start: int = 0
    load_end: int = 0
    loaded_block_ids: set[int] = field(default_factory=set)


class RequestBook:
    """Per-request state of a connector's scheduler side; see the module docstring.

    ``lookup`` answers which blocks of each group are cached, or not yet
    (:class:`~rdmakv.connectors.lookups.LookupService` provides it).
    ``async_loads`` makes every load asynchronous (hybrid models always are).
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        lookup: HitLookup,
        *,
        null_block: int | None = 0,
        async_loads: bool = True,
        audit_rate: float = 0.0,
    ) -> None:
        if not groups:
            raise ConfigError("a connector needs at least one KV cache group")
        self.groups = list(groups)
        self.lookup = lookup
        self.null_block = null_block
        self.hybrid = len(self.groups) > 1
        self.async_loads = async_loads or self.hybrid
        self._held: set[str] = set()
        self._reqs: dict[str, _Request] = {}
        self._no_external: set[str] = set()
        self._pending_loads: list[Transfer] = []
        self._inflight: dict[str, _Request] = {}
        self._asked: dict[str, int] = {}
        self.audit_rate = audit_rate
        self._audit_hits: dict[str, int] = {}
        self._pending_audits: list[Transfer] = []
        self._clear_pending = False
        self.remote_off: dict[str, str] = {}
        """Why remote hits are off (namespace label -> reason): a fingerprint conflict
        or a worker's audit quarantine. While not empty, no request gets a hit."""

    # -- questions from the scheduler ------------------------------------------------------
    def num_new_matched_tokens(
        self, req_id: str, tokens: Sequence[int], num_computed: int, extra: bytes | None
    ) -> tuple[int | None, bool]:
        """``(tokens loadable beyond num_computed, load is asynchronous)``; ``(None,
        False)`` while the lookup is out. No side effects on what is cached; remembers
        ``num_computed`` for :meth:`after_alloc`."""
        if num_computed < 0:
            raise ConfigError(f"num_computed must be >= 0, got {num_computed}")
        self._asked[req_id] = num_computed
        limit = len(tokens) - MIN_TOKENS_TO_COMPUTE
        if req_id in self._no_external or limit <= num_computed or self.remote_off:
            return 0, False
        hits = self.lookup(req_id, tokens, extra)
        if hits is None:
            return None, False
        hit = longest_common_hit(self.groups, hits, limit)
        n = max(0, hit - num_computed)
        if n > 0 and audit_sampled(req_id, self.audit_rate):
            self._audit_hits[req_id] = hit  # computed in full, then compared
            return 0, False
        self._audit_hits.pop(req_id, None)
        return n, self.async_loads and n > 0

    def after_alloc(
        self,
        req_id: str,
        tokens: Sequence[int],
        num_prompt: int,
        extra: bytes | None,
        block_ids: Sequence[Sequence[int]],
        num_external: int,
        num_computed: int | None = None,
        keep: KeepHint = None,
    ) -> None:
        """The engine allocated ``block_ids`` (per group) and will load ``num_external`` tokens.

        ``num_computed`` defaults to the value of the last
        :meth:`num_new_matched_tokens` call for this request. ``keep`` is the
        request's reuse hint, carried into its saves.
        """
        self._check_groups(block_ids)
        start = self._asked.get(req_id, 0) if num_computed is None else num_computed
        req = self._reqs.get(req_id)
        if req is None:
            computed = start
            req = _Request(
                tokens=tokens,
                num_prompt=num_prompt,
                extra=extra,
                block_ids=[list(b) for b in block_ids],
                saved_blocks=[computed // g.block_size for g in self.groups],
                keep=keep,
                num_computed=computed,
            )
            self._reqs[req_id] = req
        else:
            req.block_ids = [list(b) for b in block_ids]
            req.tokens = tokens
        if num_external <= 0:
            # Nothing to load (or the second call after an async load); an audited
            # hit is fetched to compare with what the engine computes.
            hit = self._audit_hits.pop(req_id, None)
            if hit is not None:
                self._plan_audit(req_id, tokens, extra, block_ids, start, hit)
            return
        end = start + num_external
        parts = []
        for g, ids in zip(self.groups, block_ids, strict=True):
            first, last = start // g.block_size, end // g.block_size
            if last > len(ids):
                raise ConfigError(
                    f"request {req_id}: group {g.group_id} has {len(ids)} blocks, "
                    f"a load to token {end} needs {last}"
                )
            parts.append(GroupBlocks(first, tuple(ids[first:last])))
        load = Transfer(req_id, tuple(tokens[:end]), extra, tuple(parts))
        req.load_start, req.load_end = start, end
        req.loaded_block_ids = load.engine_block_ids(self.null_block)
        # Blocks below the hit end are cached already: never save them again.
        req.saved_blocks = [end // g.block_size for g in self.groups]
        self._pending_loads.append(load)

    def _plan_audit(
        self,
        req_id: str,
        tokens: Sequence[int],
        extra: bytes | None,
        block_ids: Sequence[Sequence[int]],
        start: int,
        hit: int,
    ) -> None:
        """The audit of blocks ``[start, hit)`` (tokens) into the engine blocks computing
        them; blocks not allocated yet (chunked prefill) are not audited."""
        parts = []
        end = start
        for g, ids in zip(self.groups, block_ids, strict=True):
            first = start // g.block_size
            last = min(hit // g.block_size, len(ids))
            parts.append(GroupBlocks(first, tuple(ids[first:last]) if last > first else ()))
            end = max(end, last * g.block_size)
        if end > start:
            self._pending_audits.append(Transfer(req_id, tuple(tokens[:end]), extra, tuple(parts)))

    def remote_reported(self, quarantined: Mapping[str, str], cleared: Iterable[str]) -> None:
        """The workers' :class:`~rdmakv.connectors.audit.GuardReport` (or this side's own
        fingerprint check): namespaces whose remote KV is off now, or on again."""
        for label in cleared:
            self._clear_pending = True  # the other workers follow (StepPlan.clear_quarantine)
            if self.remote_off.pop(label, None) is not None:
                log.warning("rdmakv: remote hits of %s are on again (quarantine cleared)", label)
        for label, reason in quarantined.items():
            if label not in self.remote_off:
                log.warning("rdmakv: remote hits off for %s: %s", label, reason)
            self.remote_off[label] = reason

    def scheduled(
        self,
        req_id: str,
        num_computed: int,
        *,
        block_ids: Sequence[Sequence[int]] | None = None,
        new_block_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """A request runs this step from ``num_computed`` tokens: full ``block_ids``
        (new or resumed request) or ``new_block_ids`` appended per group."""
        req = self._reqs.get(req_id)
        if req is None:
            return
        if block_ids is not None:
            self._check_groups(block_ids)
            req.block_ids = [list(b) for b in block_ids]
            # After a preemption everything past num_computed is recomputed.
            req.saved_blocks = [
                min(s, num_computed // g.block_size)
                for s, g in zip(req.saved_blocks, self.groups, strict=True)
            ]
        if new_block_ids is not None:
            self._check_groups(new_block_ids)
            for have, extra_ids in zip(req.block_ids, new_block_ids, strict=True):
                have.extend(extra_ids)
        req.num_computed = num_computed

    def build(self, num_scheduled: Mapping[str, int], preempted: Iterable[str] = ()) -> StepPlan:
        """The plan of this step; resets the pending loads. ``preempted`` are the
        requests the engine preempted this step (the workers drop their saves)."""
        saves: list[Transfer] = []
        for req_id, n in num_scheduled.items():
            req = self._reqs.get(req_id)
            if req is None:
                continue
            end_tokens = min(req.num_computed + n, req.num_prompt, len(req.tokens))
            parts = []
            furthest = 0
            for k, g in enumerate(self.groups):
                first = req.saved_blocks[k]
                last = min(end_tokens // g.block_size, len(req.block_ids[k]))
                if last <= first:
                    parts.append(GroupBlocks(first, ()))
                    continue
                parts.append(GroupBlocks(first, tuple(req.block_ids[k][first:last])))
                req.saved_blocks[k] = last
                furthest = max(furthest, last * g.block_size)
            if furthest:
                self._held.add(req_id)
                saves.append(
                    Transfer(
                        req_id, tuple(req.tokens[:furthest]), req.extra, tuple(parts), req.keep
                    )
                )
        loads = tuple(self._pending_loads)
        self._pending_loads = []
        for load in loads:
            self._inflight[load.req_id] = self._reqs[load.req_id]
        audits = tuple(self._pending_audits)
        self._pending_audits = []
        clear, self._clear_pending = self._clear_pending, False
        return StepPlan(
            loads, tuple(saves), self.async_loads, tuple(preempted), audits, clear
        )

    # -- feedback ----------------------------------------------------------------------------
    def load_results(
        self,
        finished: Iterable[str] = (),
        failed: Iterable[str] = (),
        bad_blocks: Iterable[int] = (),
    ) -> set[str]:
        """Record the workers' load outcome; returns the requests whose load failed.

        ``failed`` are request ids (hybrid models), ``bad_blocks`` engine block
        ids (single group/sync). A failed request is never offered a hit again,
        and its unloaded blocks become due for saving once recomputed.
        """
        bad = set(bad_blocks)
        failed_ids = set(failed)
        done = set(finished)
        for req_id, req in list(self._inflight.items()):
            if req_id in failed_ids or req.loaded_block_ids & bad:
                failed_ids.add(req_id)
            if req_id in failed_ids or req_id in done or not self.async_loads:
                self._inflight.pop(req_id, None)
        for req_id in failed_ids:
            self._no_external.add(req_id)
            entry = self._reqs.get(req_id)
            if entry is not None:
                entry.saved_blocks = [
                    min(s, entry.load_start // g.block_size)
                    for s, g in zip(entry.saved_blocks, self.groups, strict=True)
                ]
        return failed_ids

    def finished(self, req_id: str) -> bool:
        """The request is gone: forget it. True when it is held: a save of it was
        planned, and the engine must keep its blocks until the workers report it."""
        self._reqs.pop(req_id, None)
        self._inflight.pop(req_id, None)
        self._no_external.discard(req_id)
        self._asked.pop(req_id, None)
        self._audit_hits.pop(req_id, None)
        if req_id in self._held:
            self._held.discard(req_id)
            return True
        return False

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def _check_groups(self, per_group: Sequence[Sequence[int]]) -> None:
        if len(per_group) != len(self.groups):
            raise ConfigError(
                f"block ids for {len(per_group)} KV cache groups, the connector has "
                f"{len(self.groups)}"
            )


__all__ = ["GroupBlocks", "HitLookup", "RequestBook", "StepPlan", "Transfer"]


def request_keep_hint(params: Mapping[str, Any] | None, request_id: str = "?") -> KeepHint:
    """The offload hint (``KVCacheManager.put(keep=)``) a request's fields carry.

    ``params`` are the request's transfer parameters (vLLM: the request's
    ``kv_transfer_params``, which the OpenAI-compatible server fills from the
    request body's ``kv_transfer_params``). :data:`KEEP_PARAM` wins when
    valid: ``true``/``false``, or an integer token count >= 0. Otherwise a
    non-empty string in one of :data:`SESSION_PARAMS` means ``True``.
    Otherwise ``None`` (no hint: the budget decides). A bad value never
    fails a request: it is ignored with a warning naming the request and the
    field, and the next field is tried.
    """
    if not params:
        return None
    if not isinstance(params, Mapping):
        log.warning(
            "request %s: transfer parameters must be a mapping, got %s; no offload hint",
            request_id, type(params).__name__,
        )
        return None
    value = params.get(KEEP_PARAM)
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return value
    if value is not None:
        log.warning(
            "request %s: %r must be true, false or a token count >= 0, got %r; ignored",
            request_id, KEEP_PARAM, value,
        )
    for name in SESSION_PARAMS:
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, str) and value.strip():
            return True
        log.warning(
            "request %s: %r must be a non-empty string, got %r; ignored", request_id, name, value
        )
    return None
