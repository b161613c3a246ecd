"""Per-group KV stores of a connector: a manager per KV cache group, and what a connector adds.

A hybrid model's groups differ in layers (and possibly block sizes), so each
group gets its own manager: its own slab of group-block-sized blocks, sharing
one node. Those managers belong to one
:class:`~rdmakv.engine.groups.HybridKVCacheManager` (it builds them, looks up
across them and closes them); the group is part of every key
(:meth:`KVCacheGroup.key_extra`), so groups never see each other's blocks even
on one node. This module adds what is the connector's: its options, paged
loads and saves, audits and metrics.

Used by both connector sides:

* scheduler side: :meth:`GroupStores.hit_bitmaps` answers "which blocks are
  cached" for a batch of prompts (the L1 of that process plus one batched node
  call per group), on the :class:`~rdmakv.connectors.lookups.LookupService` thread;
* worker side: :meth:`GroupStores.load` / :meth:`GroupStores.save` execute a
  :class:`~rdmakv.connectors.plan.Transfer` through a
  :class:`~rdmakv.connectors.paged.PagedGroupCopier` per group.

Failures become misses: a node error, a missing block or a slab shortage is
logged and counted, and a load reports the engine blocks it could not fill;
nothing raises into the engine's step. Blocks handed out by a manager are
always given back before a call returns (no lease outlives a call).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.client.remote import check_address
from rdmakv.client.streams import check_streams
from rdmakv.config import load_config, parse_size
from rdmakv.connectors.audit import (
    AuditLedger,
    GuardReport,
    NamespaceGuard,
    PendingAudit,
    block_diff,
    check_audit_options,
    namespace_label,
)
from rdmakv.connectors.copy_stream import CopyStream
from rdmakv.connectors.fingerprint import check_fingerprint
from rdmakv.connectors.paged import PagedGroupCopier
from rdmakv.connectors.plan import Transfer
from rdmakv.defaults import DEFAULT_L1_BYTES, DEFAULT_OFFLOAD, DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.engine.groups import GroupLayout, HybridKVCacheManager
from rdmakv.engine.hybrid import KVCacheGroup
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.metrics.engine import ClientMetrics, start_http_server
from rdmakv.metrics.http import HTTP_OK, MetricsServer, Route
from rdmakv.transport.tcp import loop as tcp

log = logging.getLogger("rdmakv.connectors")

SCHEDULER_L1_BLOCKS = 1
"""The scheduler side never holds KV; its managers get the smallest L1 possible."""


LOAD_ASYNC = "async"
"""Load mode: a request with a hit waits for its blocks while the engine runs the others."""
LOAD_SYNC = "sync"
"""Load mode: a step's loads finish before its forward pass (the whole batch waits)."""
LOAD_MODES = (LOAD_ASYNC, LOAD_SYNC)

AUDIT_OPTIONS = ("audit_rate", "audit_tolerance", "audit_quarantine")
"""Options of the vLLM connector's audit (:mod:`rdmakv.connectors.audit`); other
connectors refuse them rather than ignore them."""

QUARANTINE_PATH = "/rdmakv/quarantine"
"""Metrics-server endpoint (worker side): GET the namespace's quarantine state."""
QUARANTINE_CLEAR_PATH = "/rdmakv/quarantine/clear"
"""Metrics-server endpoint (worker side): POST to lift an audit quarantine."""

CONFIG_OPTION = "rdmakv_config"
"""Connector option naming an rdmakv YAML file (docs/config.md) whose ``client`` section
gives the defaults of the other options."""
_FROM_CLIENT_SECTION = {
    "nodes": "node",
    "replication": "replication",
    "streams": "streams",
    "transport": "transport",
    "timeout_s": "timeout",
    "token_file": "token_file",
    "l1_size": "l1_bytes",
    "offload": "offload",
    "offload_budget": "offload_budget",
    "metrics_port": "metrics_port",
}
"""``client`` config key -> the :class:`StoreOptions` option it is a default for."""


@dataclass(frozen=True)
class StoreOptions:
    """Connector settings, as given in an engine's connector config dict.

    ``node`` names the remote tier (required: the scheduler side sees only
    what reached it): ``HOST:PORT`` of an ``rdmakv serve`` node, a
    comma-separated list of them or ``dns://NAME:PORT`` for a cluster
    (:mod:`rdmakv.client.remote`), with ``replication`` copies of each block, or
    ``streams`` connections to one node (:mod:`rdmakv.client.streams`; unset: 2
    over RDMA, over TCP 2 on a host of 2 usable CPUs or more, else 1; the
    scheduler side, which moves no KV, one). Sizes
    accept ints or strings like ``"4GiB"``.

    Where a value comes from, highest first: the option in the engine's dict;
    an ``RDMAKV_CLIENT_*`` environment variable; the ``client`` section of the
    rdmakv config file (``"rdmakv_config": PATH`` in the dict, else
    ``$RDMAKV_CONFIG``); the default here. ``given`` holds the options that
    were set by any of those (the rest are defaults).
    """

    node: str
    transport: str = "auto"
    l1_bytes: int = DEFAULT_L1_BYTES
    policy: str = "lru"
    offload: str = DEFAULT_OFFLOAD
    offload_budget: float | None = None
    token: str | None = None
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    lock_slab: bool = True
    model: str | None = None
    replication: int = DEFAULT_REPLICATION
    streams: int | None = None
    metrics_port: int | None = None
    """Serve this process's rdmakv metrics on ``/metrics`` (worker side; None = off)."""
    load_mode: str = LOAD_ASYNC
    """``async`` or ``sync`` (see :data:`LOAD_ASYNC`, :data:`LOAD_SYNC`, docs/engines.md)."""
    audit_rate: float = 0.0
    """Share of requests with a remote hit that are recomputed and compared
    (:mod:`rdmakv.connectors.audit`); 0 = off, 1 = every one."""
    audit_tolerance: float = 0.0
    """0 = the audit wants identical bytes; else the max abs diff relative to a
    block's magnitude (engines whose kernels are not batch-invariant)."""
    audit_quarantine: bool = True
    """An audit mismatch switches the namespace's remote hits and stores off."""
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_mapping(
        cls,
        raw: Mapping[str, Any],
        *,
        ignore: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> StoreOptions:
        """Parse a config dict; unknown keys are an error naming them (typos never pass).

        ``env`` (default ``os.environ``) supplies ``RDMAKV_CONFIG`` and the
        ``RDMAKV_CLIENT_*`` overrides of the config file.
        """
        known = {f.name for f in fields(cls)} - {"given"}
        unknown = sorted(set(raw) - known - set(ignore) - {CONFIG_OPTION})
        if unknown:
            raise ConfigError(
                f"unknown rdmakv connector option(s) {unknown}; known: "
                f"{sorted([*known, CONFIG_OPTION])}"
            )
        values = {**_config_defaults(raw.get(CONFIG_OPTION), env)}
        values.update((k, v) for k, v in raw.items() if k in known)
        if not values.get("node"):
            raise ConfigError(
                'rdmakv connector option "node" (HOST:PORT of rdmakv serve, a list of them, '
                "or dns://NAME:PORT) is required (or client.nodes in the rdmakv config file)"
            )
        if "l1_bytes" in values:
            values["l1_bytes"] = _size(values["l1_bytes"], "l1_bytes")
        if "timeout" in values:
            values["timeout"] = float(values["timeout"])
            if values["timeout"] <= 0:
                raise ConfigError(f"timeout must be > 0 seconds, got {values['timeout']}")
        r = values.get("replication", DEFAULT_REPLICATION)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"replication must be an int >= 1, got {r!r}")
        check_streams(values.get("streams"))
        if values.get("load_mode", LOAD_ASYNC) not in LOAD_MODES:
            raise ConfigError(
                f"load_mode must be one of {list(LOAD_MODES)}, got {values['load_mode']!r}"
            )
        check_audit_options(
            values.get("audit_rate", 0.0),
            values.get("audit_tolerance", 0.0),
            values.get("audit_quarantine", True),
        )
        port = values.get("metrics_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port <= 65535):
            raise ConfigError(f"metrics_port must be a port in 0..65535 or null, got {port!r}")
        # a malformed address (or streams for a cluster) fails at start-up
        check_address(values["node"], streams=values.get("streams"))
        return cls(**values, given=frozenset(values))

    def secret(self) -> str | None:
        """The node token: ``token``, or the contents of ``token_file``."""
        if self.token_file is not None:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read token_file {self.token_file!r}: {e}") from e
        return self.token


def _config_defaults(path: object, env: Mapping[str, str] | None) -> dict[str, Any]:
    """The options the rdmakv config (file at ``path`` or $RDMAKV_CONFIG, plus the
    environment) sets in its ``client`` section, under their connector names.
    Its ``tcp`` section is the process's, applied here: this is where an engine
    process loads its rdmakv config, before its connector moves a byte."""
    if path is not None and not isinstance(path, str | Path):
        raise ConfigError(f'"{CONFIG_OPTION}" must be the path of a YAML file, got {path!r}')
    config = load_config(path, env)
    tcp.set_send_plan(config.tcp.send_plan)
    client = config.client
    return {
        option: getattr(client, key)
        for key, option in _FROM_CLIENT_SECTION.items()
        if key in client.model_fields_set
    }


def _size(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = parse_size(value)
    else:
        raise ConfigError(f"{what} must be an int or a size string, got {type(value).__name__}")
    if size <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return size


@dataclass
class StoreStats:
    """What the connector did, for logs, benchmarks and tests (written by the one
    thread that runs the loads and saves)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    failed_load_blocks: int = 0
    saved_blocks: int = 0
    failed_save_blocks: int = 0
    fetch_s: float = 0.0
    """Time spent getting the blocks of loads into the slab (L1, then the node)."""
    load_copy_s: float = 0.0
    """Time spent copying loaded blocks from the slab into the engine's blocks."""
    save_s: float = 0.0
    """Time spent in saves (engine -> slab copies, audit comparisons, handing to L1)."""


class GroupStores:
    """A connector's stores: ``cache``, one manager per group; ``block_bytes[k]`` is
    group ``k``'s block size in bytes.

    ``scheduler=True`` makes control-only stores (tiny L1, no offload, one
    stream unless ``streams`` is set): the scheduler side only asks what is
    cached. Invariants: this object owns ``cache`` (and through it every
    group's manager and node clients) and its metrics server from ``__init__``
    (which closes what it opened if it fails) until :meth:`close`; a block a
    call takes from a manager is given back before that call returns, except
    the blocks of a :class:`PendingAudit`, held until :meth:`end_audit`.
    """

    def __init__(
        self,
        namespace: KeyNamespace,
        groups: Sequence[KVCacheGroup],
        block_bytes: Sequence[int],
        options: StoreOptions,
        *,
        scheduler: bool = False,
        fingerprint: Mapping[str, Any] | None = None,
    ) -> None:
        if len(groups) != len(block_bytes) or not groups:
            raise ConfigError(f"{len(groups)} groups but {len(block_bytes)} block sizes")
        self.block_bytes = list(block_bytes)
        self.stats = StoreStats()
        self.namespace = namespace
        self.guard = NamespaceGuard(namespace_label(namespace))
        self.audits = AuditLedger(
            self.guard, tolerance=options.audit_tolerance, quarantine=options.audit_quarantine
        )
        self.metrics: ClientMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.cache = HybridKVCacheManager(
            namespace=namespace,
            groups=_layouts(groups, self.block_bytes, options.l1_bytes, scheduler),
            node=options.node,
            transport=options.transport,
            policy=options.policy,
            offload="none" if scheduler else options.offload,
            offload_budget=None if scheduler else options.offload_budget,
            token=options.secret(),
            timeout=options.timeout,
            lock_slab=options.lock_slab and not scheduler,
            replication=options.replication,
            # the scheduler side only looks keys up: no second QP
            streams=1 if scheduler and options.streams is None else options.streams,
        )
        try:
            if fingerprint is not None:
                conflict = check_fingerprint(self.managers[0], namespace, fingerprint)
                if conflict is not None:
                    log.error("rdmakv: %s; remote hits under %s refused", conflict,
                              self.guard.label)
                    self.guard.refuse(conflict)
            if options.metrics_port is not None and not scheduler:
                self._serve_metrics(options.metrics_port)
        except BaseException:
            self.close()
            raise

    @property
    def groups(self) -> list[KVCacheGroup]:
        """The KV cache groups, in the engine's order."""
        return self.cache.groups

    @property
    def managers(self) -> list[KVCacheManager]:
        """``managers[k]`` serves ``groups[k]`` (``cache``'s; empty once closed)."""
        return self.cache.managers

    def _serve_metrics(self, port: int) -> None:
        """Export the managers' metrics in the process registry (the engine's own
        ``/metrics`` shows them where it serves that registry) and on ``port``."""
        self.metrics = ClientMetrics(self.managers, audits=self.audits)
        try:
            self.metrics_server = start_http_server(port, routes=self.operator_routes())
        except ConfigError as e:
            # Several workers of one engine on one host share the setting: the
            # first one serves; the others still count into their registry.
            log.warning("rdmakv client metrics not served: %s", e)

    def operator_routes(self) -> dict[tuple[str, str], Route]:
        """The metrics server's operator endpoints: ``GET`` :data:`QUARANTINE_PATH`
        (the namespace's state and audit counts) and ``POST``
        :data:`QUARANTINE_CLEAR_PATH` (lift an audit quarantine; the scheduler
        side learns it with the next step)."""

        def state() -> tuple[int, bytes]:
            doc = {
                "namespace": self.guard.label,
                "quarantined": self.guard.quarantined,
                "refused": self.guard.refused,
                "audits": asdict(self.audits.stats),
            }
            return HTTP_OK, json.dumps(doc).encode() + b"\n"

        def clear() -> tuple[int, bytes]:
            cleared = self.guard.clear()
            if cleared:
                log.warning("rdmakv: audit quarantine of %s cleared by an operator",
                            self.guard.label)
            return HTTP_OK, json.dumps({"cleared": cleared, "namespace": self.guard.label}
                                       ).encode() + b"\n"

        return {("GET", QUARANTINE_PATH): state, ("POST", QUARANTINE_CLEAR_PATH): clear}

    # -- scheduler side --------------------------------------------------------------------
    def hit_bitmaps(
        self, prompts: Sequence[tuple[Sequence[int], bytes | None]]
    ) -> list[list[list[bool]]]:
        """Per ``(tokens, extra)`` and per group: which full blocks are cached (L1, then the
        node), with one batched node call per group for all the prompts together."""
        return self.cache.batch_hit_bitmaps([(tokens, extra, None) for tokens, extra in prompts])

    # -- worker side -----------------------------------------------------------------------
    def load(
        self,
        transfer: Transfer,
        copiers: Sequence[PagedGroupCopier],
        null_block: int | None,
        stream: CopyStream,
        after: Any = None,
    ) -> set[int]:
        """Fill the transfer's engine blocks from rdmakv; returns the block ids not filled.

        The slab -> engine copies run on ``stream`` after the engine work ``after``
        marks, and have completed on return.
        Under a quarantine or fingerprint refusal nothing is loaded (all failed:
        the engine recomputes)."""
        if self.guard.reason is not None:
            failed_all = transfer.engine_block_ids(null_block)
            self.stats.failed_load_blocks += len(failed_all)
            return failed_all
        failed: set[int] = set()
        for g, part, copier, mgr in zip(
            self.groups, transfer.groups, copiers, self.managers, strict=True
        ):
            wanted = [
                (part.first_block + j, b) for j, b in enumerate(part.block_ids) if b != null_block
            ]
            if not wanted:
                continue
            # Exactly the blocks the engine gave real ids for (a sliding window
            # needs only its last blocks), L1 first, then one batched node fetch.
            got: list[int | None] = []
            started = time.perf_counter()
            try:
                got = self.cache.acquire_blocks(
                    g.group_id,
                    transfer.tokens[: part.end_block * g.block_size],
                    [i for i, _ in wanted],
                    extra=transfer.extra,
                )
                fetched = time.perf_counter()
                self.stats.fetch_s += fetched - started
                have = [(h, b) for h, (_, b) in zip(got, wanted, strict=True) if h is not None]
                failed.update(b for h, (_, b) in zip(got, wanted, strict=True) if h is None)
                stream.run(
                    partial(copier.load, mgr.slab, [h for h, _ in have], [b for _, b in have]),
                    after,
                )
                self.stats.load_copy_s += time.perf_counter() - fetched
                self.stats.loaded_blocks += len(have)
                self.stats.loaded_bytes += len(have) * copier.block_bytes
            except RdmakvError as e:
                log.warning(
                    "request %s: load of group %d failed: %s", transfer.req_id, g.group_id, e
                )
                failed.update(b for _, b in wanted)
            finally:
                mgr.release([h for h in got if h is not None])
        self.stats.failed_load_blocks += len(failed)
        return failed

    def save(
        self,
        transfer: Transfer,
        copiers: Sequence[PagedGroupCopier],
        null_block: int | None,
        stream: CopyStream,
        after: Any = None,
        audit: PendingAudit | None = None,
    ) -> int:
        """Store the transfer's engine blocks (null blocks skipped); returns how many were saved.

        The engine -> slab copies run on ``stream`` after the engine work ``after``
        marks (:meth:`CopyStream.engine_mark`) and have completed on return: the
        engine may reuse the blocks from then on. ``audit``: the request's
        fetched blocks; each one this save computed is compared and released
        (:meth:`_compare`). Under a quarantine or fingerprint refusal nothing
        is stored (an audit still compares what it fetched)."""
        started = time.perf_counter()
        try:
            return self._save(transfer, copiers, null_block, stream, after, audit)
        finally:
            self.stats.save_s += time.perf_counter() - started

    def _save(
        self,
        transfer: Transfer,
        copiers: Sequence[PagedGroupCopier],
        null_block: int | None,
        stream: CopyStream,
        after: Any,
        audit: PendingAudit | None,
    ) -> int:
        saved = 0
        for k, (g, part, copier, mgr) in enumerate(
            zip(self.groups, transfer.groups, copiers, self.managers, strict=True)
        ):
            tokens = transfer.tokens[: part.end_block * g.block_size]
            for first, ids in _runs(part.first_block, part.block_ids, null_block):
                audited = audit is not None and any(
                    first + j in audit.fetched[k] for j in range(len(ids))
                )
                if self.guard.reason is not None and not audited:
                    continue
                handles: list[int] = []
                try:
                    handles = mgr.allocate_for(len(ids))
                    stream.run(partial(copier.save, mgr.slab, handles, ids), after)
                except RdmakvError as e:
                    mgr.discard(handles)
                    self.stats.failed_save_blocks += len(ids)
                    log.warning(
                        "request %s: save of %d blocks skipped: %s", transfer.req_id, len(ids), e
                    )
                    continue
                if audit is not None and audited:
                    self._compare(audit, k, copier, tokens, transfer.extra, first, handles)
                if self.guard.reason is not None:
                    mgr.discard(handles)
                    continue
                try:
                    self.cache.put(
                        g.group_id, tokens, handles, extra=transfer.extra, first_block=first,
                        keep=transfer.keep,
                    )
                except RdmakvError as e:  # put takes the handles over even when it fails
                    self.stats.failed_save_blocks += len(ids)
                    log.warning(
                        "request %s: put of %d blocks failed: %s", transfer.req_id, len(ids), e
                    )
                    continue
                saved += len(ids)
        self.stats.saved_blocks += saved
        return saved

    # -- audits (worker side, transfer thread) -----------------------------------------------
    def node_errors(self) -> int:
        """Failed node calls so far, over all groups."""
        return sum(m.stats.l2_errors for m in self.managers)

    def fetch_audit(self, transfer: Transfer, null_block: int | None) -> PendingAudit:
        """Hold the blocks ``transfer`` would have loaded (L1, then one node fetch per
        group); blocks not found are not audited. Release with :meth:`end_audit`."""
        audit = PendingAudit(transfer.req_id, [{} for _ in self.groups])
        for k, (g, part) in enumerate(zip(self.groups, transfer.groups, strict=True)):
            wanted = [part.first_block + j for j, b in enumerate(part.block_ids) if b != null_block]
            if not wanted:
                continue
            try:
                got = self.cache.acquire_blocks(
                    g.group_id,
                    transfer.tokens[: part.end_block * g.block_size],
                    wanted,
                    extra=transfer.extra,
                )
            except RdmakvError as e:
                log.warning("request %s: audit fetch of group %d failed: %s",
                            transfer.req_id, g.group_id, e)
                continue
            audit.fetched[k] = {i: h for i, h in zip(wanted, got, strict=True) if h is not None}
        return audit

    def report_to_node(self, report: GuardReport) -> None:
        """Tell the node (``rdmakv stats``: ``quarantined_namespaces``) what changed
        in the guard; best effort: a node that cannot record it is logged."""
        client = self.managers[0].client if self.managers else None
        if client is None:
            return
        changes: list[tuple[str, str | None]] = [*report.quarantined.items()]
        changes += [(label, None) for label in report.cleared]
        for label, reason in changes:
            try:
                if not client.report(label, reason):
                    log.warning("the node does not record quarantine reports (older "
                                "rdmakv); %s not reported", label)
            except RdmakvError as e:
                log.warning("quarantine of %s not reported to the node: %s", label, e)

    def end_audit(self, audit: PendingAudit) -> None:
        """Release what ``audit`` still holds and record its outcome."""
        for mgr, fetched in zip(self.managers, audit.fetched, strict=True):
            mgr.release(list(fetched.values()))
            fetched.clear()
        self.audits.finished(audit)

    def _compare(
        self,
        audit: PendingAudit,
        k: int,
        copier: PagedGroupCopier,
        tokens: Sequence[int],
        extra: bytes | None,
        first: int,
        computed: Sequence[int],
    ) -> None:
        """Compare group ``k``'s freshly computed blocks ``first..`` (slab ``computed``)
        with the audit's fetched ones, then release those."""
        mgr = self.managers[k]
        chain: Any = None
        for j, h in enumerate(computed):
            fetched = audit.fetched[k].pop(first + j, None)
            if fetched is None:
                continue
            try:
                diff = block_diff(
                    copier.block_layers(mgr.slab, h), copier.block_layers(mgr.slab, fetched)
                )
                if chain is None:
                    chain = mgr.keyer.chain(tokens, self.groups[k].key_extra(extra))
                self.audits.compared(
                    audit, diff, key=chain[first + j][1], group=k, block=first + j
                )
            finally:
                mgr.release([fetched])

    def flush(self, timeout: float) -> bool:
        """Wait until every group's offloads reached the node (see ``cache.flush``)."""
        return self.cache.flush(timeout)

    def close(self) -> None:
        """Stop the metrics, then close ``cache`` (every group's manager); idempotent."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.cache.close()


def _layouts(
    groups: Sequence[KVCacheGroup], block_bytes: Sequence[int], l1_bytes: int, scheduler: bool
) -> list[GroupLayout]:
    """Each group with its block bytes and L1: ``l1_bytes`` split evenly (a worker), or
    the smallest L1 possible (the scheduler side, which never holds KV)."""
    share = l1_bytes // len(groups)
    layouts: list[GroupLayout] = []
    for group, nbytes in zip(groups, block_bytes, strict=True):
        l1 = nbytes * SCHEDULER_L1_BLOCKS if scheduler else share
        if l1 < nbytes:
            raise ConfigError(
                f"l1_bytes {l1_bytes} leaves {share} bytes per group, less than "
                f"one {nbytes}-byte block"
            )
        layouts.append(GroupLayout(group, nbytes, l1))
    return layouts


def _runs(
    first: int, block_ids: Sequence[int], null_block: int | None
) -> list[tuple[int, list[int]]]:
    """Maximal runs of consecutive non-null blocks as ``(first request block, ids)``."""
    runs: list[tuple[int, list[int]]] = []
    for j, b in enumerate(block_ids):
        if b == null_block:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == first + j:
            runs[-1][1].append(b)
        else:
            runs.append((first + j, [b]))
    return runs


__all__ = [
    "AUDIT_OPTIONS",
    "CONFIG_OPTION",
    "LOAD_ASYNC",
    "LOAD_MODES",
    "LOAD_SYNC",
    "GroupStores",
    "StoreOptions",
    "StoreStats",
]
