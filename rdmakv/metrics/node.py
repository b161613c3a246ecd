"""NodeMetrics: a KV node's Prometheus metrics (``rdmakv serve --metrics-port``).

Cost model: nothing is counted per block. Store and session counters already
exist (``KVNode.stats()``, kept under the store lock per batch); a custom
collector turns them into metrics **at scrape time**. The only per-request
work is one histogram observation per served request (a batch), through a
child resolved once per opcode.

Names (the Grafana dashboard in ``deploy/grafana`` uses exactly these):

* gauges: ``rdmakv_node_ready``, ``rdmakv_node_info{version,node_id,transports}``,
  ``rdmakv_node_keys``, ``rdmakv_node_pool_used_bytes``,
  ``rdmakv_node_pool_capacity_bytes``, ``rdmakv_node_leases_active``,
  ``rdmakv_node_connections``, ``rdmakv_node_uncommitted_extents``
* counters: ``rdmakv_node_puts_total`` (committed keys), ``rdmakv_node_lookups_total``,
  ``rdmakv_node_hits_total``, ``rdmakv_node_misses_total``, ``rdmakv_node_evictions_total``,
  ``rdmakv_node_leases_granted_total``, ``rdmakv_node_leases_expired_total``,
  ``rdmakv_node_reclaimed_extents_total``, ``rdmakv_node_sessions_accepted_total``,
  ``rdmakv_node_refused_total{reason}``, ``rdmakv_node_bytes_total{transport,direction}``
* histogram: ``rdmakv_node_request_seconds{op}``
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REQUEST_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
"""Seconds: a control request on loopback takes ~0.1 ms, a 256 MiB GET seconds."""

REFUSAL_REASONS = ("bad_frame", "bad_token", "over_limit", "timeout")
"""``refused_<reason>`` keys of ``KVNode.stats()``, one label value each: ``over_limit``
counts requests over a protocol limit or lease quota and connections shed or refused
by the connection limits; ``timeout`` connections closed at the handshake deadline or
the idle timeout."""

_GAUGES = (
    ("rdmakv_node_keys", "Committed keys in the index.", "entries"),
    ("rdmakv_node_leases_active", "Read leases currently held.", "leases_active"),
    ("rdmakv_node_connections", "Client sessions open now.", "sessions_active"),
    ("rdmakv_node_uncommitted_extents", "Extents allocated and not yet committed.", "pending"),
    ("rdmakv_node_pool_capacity_bytes", "Bytes in the registered pool.", "pool_bytes"),
)
_COUNTERS = (
    ("rdmakv_node_puts", "Keys committed (stored).", "commits"),
    ("rdmakv_node_lookups", "Keys looked up for reading.", "lookups"),
    ("rdmakv_node_hits", "Looked-up keys found.", "hits"),
    ("rdmakv_node_misses", "Looked-up keys not found.", "misses"),
    ("rdmakv_node_evictions", "Committed keys evicted to make room.", "evictions"),
    ("rdmakv_node_leases_granted", "Read leases granted.", "leases_granted"),
    ("rdmakv_node_leases_expired", "Read leases that timed out unreleased.", "leases_expired"),
    (
        "rdmakv_node_reclaimed_extents",
        "Uncommitted extents freed because their session ended.",
        "reclaimed_on_disconnect",
    ),
    ("rdmakv_node_sessions_accepted", "Client sessions accepted since start.", "sessions_total"),
)
_BYTES = (
    # (transport, direction, stats key): tcp bytes pass through the node; rdma
    # bytes never do, so they are the extents committed / leased one-sided.
    ("tcp", "in", "bytes_written"),
    ("tcp", "out", "bytes_read"),
    ("rdma", "in", "bytes_committed_one_sided"),
    ("rdma", "out", "bytes_leased_one_sided"),
)


class NodeMetrics:
    """The registry of one node; ``stats`` is ``KVNode.stats`` and ``ready`` its readiness."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        ready: Callable[[], bool],
        info: Callable[[], Mapping[str, str]],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(stats, ready, info))
        self._requests = Histogram(
            "rdmakv_node_request_seconds",
            "Time to serve one request (a batch), by operation.",
            ["op"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )

    def request_timer(self, op: str) -> Callable[[float], None]:
        """The ``observe`` of the histogram child for ``op`` (resolve once, call per request)."""
        return self._requests.labels(op=op).observe


class _NodeCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        ready: Callable[[], bool],
        info: Callable[[], Mapping[str, str]],
    ) -> None:
        self._stats = stats
        self._ready = ready
        self._info = info

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "rdmakv_node_ready", "1 once the pool is registered and clients are accepted.",
            value=1 if self._ready() else 0,
        )
        labels = self._info()
        info = GaugeMetricFamily(
            "rdmakv_node_info", "Constant 1, labelled with what this node is.",
            labels=list(labels),
        )
        info.add_metric(list(labels.values()), 1)
        yield info
        for name, doc, key in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=s.get(key, 0))
        yield GaugeMetricFamily(
            "rdmakv_node_pool_used_bytes",
            "Pool bytes in use: committed, uncommitted, leased or being read.",
            value=s.get("blocks_used", 0) * s.get("block_size", 0),
        )
        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        refused = CounterMetricFamily(
            "rdmakv_node_refused", "Requests and connections refused, by reason.", labels=["reason"]
        )
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], s.get(f"refused_{reason}", 0))
        yield refused
        moved = CounterMetricFamily(
            "rdmakv_node_bytes",
            "Value bytes moved, by transport and direction (in = puts, out = gets).",
            labels=["transport", "direction"],
        )
        for transport, direction, key in _BYTES:
            moved.add_metric([transport, direction], s.get(key, 0))
        yield moved
