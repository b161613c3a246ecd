"""Prometheus metrics for nodes and engines (the names are listed in :mod:`.node` and
:mod:`.client`; ``deploy/grafana`` charts exactly these).

* node: ``rdmakv serve --metrics-port N`` -> :class:`~rdmakv.metrics.node.NodeMetrics`
  served by :class:`~rdmakv.metrics.http.MetricsServer` (``/metrics``, ``/healthz``,
  ``/readyz``);
* engine: :class:`~rdmakv.metrics.engine.ClientMetrics` over a ``KVCacheManager``,
  registered in the engine's registry or served by :func:`start_http_server`.
"""

from rdmakv.metrics.http import MetricsServer
from rdmakv.metrics.node import NodeMetrics

__all__ = ["MetricsServer", "NodeMetrics"]
