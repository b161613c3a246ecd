"""ClientMetrics: an engine's rdmakv metrics, read from its KVCacheManagers at scrape time.

The managers already count what an operator needs (``ManagerStats``, the L1's
``L1Stats``, the offload queue and offloader, a cluster's counters); a
custom collector turns those into metrics when scraped, so the engine's step
pays nothing. The one live instrument is the fetch-latency histogram, fed by
``KVCacheManager.on_remote_get`` once per batched node get.

Names (the Grafana dashboard in ``deploy/grafana`` uses exactly these):

* ``rdmakv_client_hits_total{tier="l1|node"}``, ``rdmakv_client_misses_total``
  (blocks asked of the node and not found);
* ``rdmakv_client_offload_total{outcome="queued|dropped|stored|failed"}`` (blocks);
* ``rdmakv_client_bytes_total{transport,direction="put|get"}``;
* ``rdmakv_client_node_down_total`` (a cluster node went down; with a single
  node: failed node calls, each one a batch of misses);
* ``rdmakv_client_fetch_seconds`` (histogram);
* with a connector: ``rdmakv_client_audit_checks_total``,
  ``rdmakv_client_audit_mismatches_total``, ``rdmakv_client_audit_max_diff``
  (histogram) and ``rdmakv_client_quarantined`` (gauge, 0/1):
  :mod:`rdmakv.connectors.audit`.

Where engines can carry them: vLLM and SGLang expose the process-global
``prometheus_client.REGISTRY`` on their own ``/metrics`` (the default here),
but the connector's workers and scheduler run in other processes than the API
server; set ``PROMETHEUS_MULTIPROC_DIR`` as those engines document, or give
each engine process its own port with :func:`start_http_server` (config key
``client.metrics_port``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rdmakv.metrics.http import MetricsServer, Route

if TYPE_CHECKING:
    from rdmakv.engine.manager import KVCacheManager


class AuditCounts(Protocol):
    checks: int
    mismatches: int


class Quarantine(Protocol):
    @property
    def reason(self) -> str | None: ...


class AuditSource(Protocol):
    """What the collector reads of the connector's audits
    (:class:`~rdmakv.connectors.audit.AuditLedger`; a protocol, so metrics import
    nothing of the connectors above them)."""

    on_result: Callable[[float], None] | None

    @property
    def stats(self) -> AuditCounts: ...

    @property
    def guard(self) -> Quarantine: ...

AUDIT_DIFF_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
"""Relative KV diff of an audit: 0 is exact; bf16 rounding is ~4e-3."""
FETCH_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
)


class ClientMetrics:
    """Registers one collector for ``managers`` (e.g. one per KV cache group) in ``registry``.

    Lifetime: call :meth:`close` when the managers go away; it unregisters
    the collector and the histogram and unhooks the managers.
    """

    def __init__(
        self,
        managers: Sequence[KVCacheManager],
        registry: CollectorRegistry = REGISTRY,
        audits: AuditSource | None = None,
    ) -> None:
        self.registry = registry
        self._managers = list(managers)
        self._audits = audits
        self._collector = _ClientCollector(self._managers, audits)
        registry.register(self._collector)
        self.audit_diff: Histogram | None = None
        if audits is not None:
            self.audit_diff = Histogram(
                "rdmakv_client_audit_max_diff",
                "Per audited request: max abs KV diff relative to the block's magnitude "
                "(0 = identical bytes).",
                buckets=AUDIT_DIFF_BUCKETS,
                registry=registry,
            )
            audits.on_result = self.audit_diff.observe
        self.fetch_seconds = Histogram(
            "rdmakv_client_fetch_seconds",
            "Time of one batched get from the node tier (misses and failures included).",
            buckets=FETCH_BUCKETS,
            registry=registry,
        )
        for m in self._managers:
            m.on_remote_get = self.fetch_seconds.observe

    def close(self) -> None:
        for m in self._managers:
            m.on_remote_get = None
        self.registry.unregister(self._collector)
        self.registry.unregister(self.fetch_seconds)
        if self._audits is not None and self.audit_diff is not None:
            self._audits.on_result = None
            self.registry.unregister(self.audit_diff)


def start_http_server(
    port: int,
    host: str = "0.0.0.0",
    registry: CollectorRegistry = REGISTRY,
    routes: Mapping[tuple[str, str], Route] | None = None,
) -> MetricsServer:
    """Serve ``registry`` on ``/metrics`` (and ``/healthz``, ``/readyz``, ``routes``)
    from this process."""
    return MetricsServer(registry, host=host, port=port, routes=routes)


class _ClientCollector(Collector):
    def __init__(self, managers: list[KVCacheManager], audits: AuditSource | None) -> None:
        self._managers = managers
        self._audits = audits

    def collect(self) -> Iterator[Metric]:
        hits = {"l1": 0, "node": 0}
        misses = node_down = 0
        offload = {"queued": 0, "dropped": 0, "stored": 0, "failed": 0}
        moved: dict[tuple[str, str], int] = {}
        for m in self._managers:
            hits["l1"] += m.stats.l1_hit_blocks
            hits["node"] += m.stats.l2_hit_blocks
            misses += m.stats.l2_miss_blocks
            node_down += _node_down(m)
            transport = m.transport_name or "none"
            key = (transport, "get")
            moved[key] = moved.get(key, 0) + m.stats.bytes_fetched
            if m.queue is not None:
                offload["queued"] += m.queue.accepted
                offload["dropped"] += m.queue.dropped
            if m.offloader is not None:
                offload["stored"] += m.offloader.sent_blocks
                offload["failed"] += m.offloader.failed_blocks
                key = (transport, "put")
                moved[key] = moved.get(key, 0) + m.offloader.sent_bytes
        fam = CounterMetricFamily(
            "rdmakv_client_hits", "Blocks served from cache, by tier.", labels=["tier"]
        )
        for tier, n in hits.items():
            fam.add_metric([tier], n)
        yield fam
        yield CounterMetricFamily(
            "rdmakv_client_misses", "Blocks asked of the node tier and not found.", value=misses
        )
        fam = CounterMetricFamily(
            "rdmakv_client_offload", "Blocks offered to the node tier, by outcome.",
            labels=["outcome"],
        )
        for outcome, n in offload.items():
            fam.add_metric([outcome], n)
        yield fam
        fam = CounterMetricFamily(
            "rdmakv_client_bytes", "Value bytes moved to (put) and from (get) the node tier.",
            labels=["transport", "direction"],
        )
        for (transport, direction), n in sorted(moved.items()):
            fam.add_metric([transport, direction], n)
        yield fam
        yield CounterMetricFamily(
            "rdmakv_client_node_down",
            "Node-down events (cluster), or failed node calls (a single node).",
            value=node_down,
        )
        if self._audits is not None:
            a = self._audits.stats
            yield CounterMetricFamily(
                "rdmakv_client_audit_checks",
                "Audited requests (recomputed and compared with the cached KV).",
                value=a.checks,
            )
            yield CounterMetricFamily(
                "rdmakv_client_audit_mismatches",
                "Audited requests whose cached KV differed from the computed KV.",
                value=a.mismatches,
            )
            yield GaugeMetricFamily(
                "rdmakv_client_quarantined",
                "1 while this process's namespace has remote KV off (audit quarantine or "
                "fingerprint conflict).",
                value=int(self._audits.guard.reason is not None),
            )


def _node_down(m: KVCacheManager) -> int:
    counters: Any = getattr(m.client, "counters", None)  # a ClusterClient has them
    if isinstance(counters, dict):
        return int(counters.get("node_down_events", 0))
    return m.stats.l2_errors
