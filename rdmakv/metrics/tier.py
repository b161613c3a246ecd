"""TierMetrics: the metrics of rdmakv's secondary tiers in this process, read at scrape time.

Each tier (:class:`~rdmakv.connectors.chunk_tier.ChunkTier`) already counts
what it did (:class:`TierStats`, defined here so that this module needs
nothing of the tier's: no import circle); one collector,
registered once in the process registry, reads every live tier when
scraped, so the scheduler thread pays nothing. Several tiers in one process
(several engines) are told apart by the ``tier`` label (vLLM's engine id).

Names:

* ``rdmakv_tier_chunks_total{tier,op="store|load",outcome="ok|failed|declined|hot|known"}``
  (``declined``: the offload policy did not send it; ``hot``: sent later, on reuse;
  ``known``: offered again while on the node, not sent);
* ``rdmakv_tier_bytes_total{tier,direction="put|get"}``;
* ``rdmakv_tier_lookup_keys_total{tier,answer="found|absent"}`` (answered by a node;
  questions that expired are in ``rdmakv_tier_lookups_expired_total``);
* ``rdmakv_tier_jobs_expired_total{tier}`` (failed without a node call: not started
  within the client timeout).

vLLM itself charts the tier's read/write bytes and times, job failures and
lookup delays from the job results (``vllm:kv_offload_tiering_*``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from rdmakv.errors import ConfigError
from rdmakv.metrics.engine import start_http_server
from rdmakv.metrics.http import MetricsServer

log = logging.getLogger("rdmakv.metrics.tier")


@dataclass
class TierStats:
    """What the tier did (counted by its threads; read by metrics and tests)."""

    lookup_keys: int = 0
    lookup_found: int = 0
    stored_chunks: int = 0
    declined_chunks: int = 0
    hot_chunks: int = 0
    """Declined chunks the policy sent when they were offered again (used again)."""
    known_chunks: int = 0
    """Chunks offered again that were sent already (no node call)."""
    failed_store_chunks: int = 0
    loaded_chunks: int = 0
    failed_load_chunks: int = 0
    expired_jobs: int = 0
    put_bytes: int = 0
    get_bytes: int = 0


class CountedTier(Protocol):
    """What the collector reads of a tier (:class:`~rdmakv.connectors.chunk_tier.ChunkTier`)."""

    @property
    def stats(self) -> TierStats: ...

    @property
    def expired_lookups(self) -> int: ...


class TierMetrics(Collector):
    """The process's one tier collector; :meth:`attach` / :meth:`detach` a tier."""

    _instance: TierMetrics | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, CountedTier] = {}
        self._servers: dict[str, MetricsServer] = {}

    @classmethod
    def attach(cls, label: str, tier: CountedTier, port: int | None) -> TierMetrics:
        """Count ``tier`` under ``label`` (made unique in the process); serve the
        process registry on ``port`` too when given (a taken port is logged)."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
                REGISTRY.register(cls._instance)
            me = cls._instance
        with me._lock:
            name, n = label or "rdmakv", 1
            while name in me._tiers:
                n += 1
                name = f"{label or 'rdmakv'}#{n}"
            me._tiers[name] = tier
        if port is not None:
            try:
                server = start_http_server(port)
            except ConfigError as e:  # several engines on one host may share the setting
                log.warning("rdmakv tier metrics not served: %s", e)
            else:
                with me._lock:
                    me._servers[name] = server
        return me

    def detach(self, tier: CountedTier) -> None:
        """Stop counting ``tier`` (and stop its metrics server, if it started one)."""
        with self._lock:
            names = [k for k, t in self._tiers.items() if t is tier]
            servers = [self._servers.pop(k) for k in names if k in self._servers]
            for k in names:
                del self._tiers[k]
        for s in servers:
            s.close()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            tiers = list(self._tiers.items())
        chunks = CounterMetricFamily(
            "rdmakv_tier_chunks", "Chunks of store and load jobs, by outcome.",
            labels=["tier", "op", "outcome"],
        )
        moved = CounterMetricFamily(
            "rdmakv_tier_bytes", "Value bytes moved to (put) and from (get) the nodes.",
            labels=["tier", "direction"],
        )
        keys = CounterMetricFamily(
            "rdmakv_tier_lookup_keys", "Chunk lookups a node answered, by answer.",
            labels=["tier", "answer"],
        )
        expired_lookups = CounterMetricFamily(
            "rdmakv_tier_lookups_expired",
            "Chunk lookups unanswered within the client timeout (read as absent).",
            labels=["tier"],
        )
        expired_jobs = CounterMetricFamily(
            "rdmakv_tier_jobs_expired",
            "Jobs failed without a node call (not started within the client timeout).",
            labels=["tier"],
        )
        for name, t in tiers:
            s = t.stats
            for op, outcome, n in (
                ("store", "ok", s.stored_chunks),
                ("store", "failed", s.failed_store_chunks),
                ("store", "declined", s.declined_chunks),
                ("store", "hot", s.hot_chunks),
                ("store", "known", s.known_chunks),
                ("load", "ok", s.loaded_chunks),
                ("load", "failed", s.failed_load_chunks),
            ):
                chunks.add_metric([name, op, outcome], n)
            moved.add_metric([name, "put"], s.put_bytes)
            moved.add_metric([name, "get"], s.get_bytes)
            keys.add_metric([name, "found"], s.lookup_found)
            keys.add_metric([name, "absent"], s.lookup_keys - s.lookup_found)
            expired_lookups.add_metric([name], t.expired_lookups)
            expired_jobs.add_metric([name], s.expired_jobs)
        yield from (chunks, moved, keys, expired_lookups, expired_jobs)


__all__ = ["CountedTier", "TierMetrics", "TierStats"]
