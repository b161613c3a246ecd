"""Check the Grafana dashboard against rdmakv's metric names (deploy/check.sh).

``dashboard_metric_names(path)`` returns every metric name the dashboard's PromQL
(panel targets and template-variable queries) refers to; ``unknown_metric_names``
returns those outside ``NODE_METRICS`` / ``CLIENT_METRICS`` (the names rdmakv.metrics
exports). Invariant kept by CI: the dashboard names only metrics that rdmakv exports,
so a renamed metric cannot leave a silently empty panel.

Run as a script: ``python deploy/check_dashboard.py DASHBOARD.json [--exposed FILE]
[--client]`` prints the names and exits 1 naming any unknown one. The static lists
can drift from the code too, so ``--exposed`` requires every ``rdmakv_node_*`` name
to appear in a real node's ``/metrics`` saved in FILE, and ``--client`` every
``rdmakv_client_*`` name in what ``rdmakv.metrics.engine.ClientMetrics`` exports.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

# Metric families and their kind, as rdmakv/metrics/ exports them. Counters carry
# their _total suffix; histograms are queried as _bucket/_sum/_count. (The ops
# contract's rdmakv_node_connections_total is exported as
# rdmakv_node_sessions_accepted_total.)
NODE_METRICS: dict[str, str] = {
    "rdmakv_node_ready": "gauge",
    "rdmakv_node_info": "gauge",
    "rdmakv_node_keys": "gauge",
    "rdmakv_node_pool_used_bytes": "gauge",
    "rdmakv_node_pool_capacity_bytes": "gauge",
    "rdmakv_node_puts_total": "counter",
    "rdmakv_node_lookups_total": "counter",
    "rdmakv_node_hits_total": "counter",
    "rdmakv_node_misses_total": "counter",
    "rdmakv_node_evictions_total": "counter",
    "rdmakv_node_leases_active": "gauge",
    "rdmakv_node_leases_granted_total": "counter",
    "rdmakv_node_leases_expired_total": "counter",
    "rdmakv_node_reclaimed_extents_total": "counter",
    "rdmakv_node_refused_total": "counter",
    "rdmakv_node_uncommitted_extents": "gauge",
    "rdmakv_node_connections": "gauge",
    "rdmakv_node_sessions_accepted_total": "counter",
    "rdmakv_node_bytes_total": "counter",
    "rdmakv_node_request_seconds": "histogram",
}
CLIENT_METRICS: dict[str, str] = {
    "rdmakv_client_hits_total": "counter",
    "rdmakv_client_misses_total": "counter",
    "rdmakv_client_offload_total": "counter",
    "rdmakv_client_bytes_total": "counter",
    "rdmakv_client_node_down_total": "counter",
    "rdmakv_client_fetch_seconds": "histogram",
    "rdmakv_client_audit_checks_total": "counter",
    "rdmakv_client_audit_mismatches_total": "counter",
    "rdmakv_client_audit_max_diff": "histogram",
    "rdmakv_client_quarantined": "gauge",
}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w$.:])([A-Za-z_:][\w:]*)(\s*\()?")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*),\s*[A-Za-z_]\w*\s*\)\s*$", re.S)
_LABEL_NAMES_ONLY = re.compile(r"^\s*label_values\s*\(\s*[A-Za-z_]\w*\s*\)\s*$")


def allowed_metric_names() -> set[str]:
    """Every series name the contract allows a query to use."""
    names: set[str] = set()
    for name, kind in (NODE_METRICS | CLIENT_METRICS).items():
        if kind == "histogram":
            names.update(name + s for s in HISTOGRAM_SUFFIXES)
        else:
            names.add(name)
    return names


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in one PromQL expression (Grafana's $variables are ignored).

    Strings, label matchers, ranges and by/on/... groupings are removed first, so
    label names and values never count; an identifier followed by ``(`` is a function.
    """
    e = _STRING.sub('""', expr)
    e = _MATCHERS.sub(" ", e)
    e = _RANGE.sub(" ", e)
    e = _GROUPING.sub(" ", e)
    names: set[str] = set()
    for m in _IDENT.finditer(e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def _grafana_query_names(query: str) -> set[str]:
    """Names in a template-variable query: PromQL, or Grafana's label_values(...)."""
    if _LABEL_NAMES_ONLY.match(query):
        return set()
    m = _LABEL_VALUES.match(query)
    return promql_metric_names(m.group(1) if m else query)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # collapsed rows nest their panels


class Query(NamedTuple):
    """One query of the dashboard: where it is, its text, and whether it is a
    template-variable query (which may use Grafana's label_values(...) syntax)."""

    where: str
    text: str
    variable: bool

    def metric_names(self) -> set[str]:
        return _grafana_query_names(self.text) if self.variable else promql_metric_names(self.text)


def dashboard_queries(path: str | Path) -> list[Query]:
    """Every query of the dashboard at ``path``: panel targets, then variables."""
    dash = json.loads(Path(path).read_text())
    out: list[Query] = []
    for p in _panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                where = f"panel {p.get('title')!r} target {t.get('refId')}"
                out.append(Query(where, t["expr"], False))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q
        if q:
            out.append(Query(f"variable ${v.get('name')}", q, True))
    return out


def dashboard_metric_names(path: str | Path) -> set[str]:
    """Every metric name the dashboard at ``path`` queries."""
    names: set[str] = set()
    for q in dashboard_queries(path):
        names |= q.metric_names()
    return names


def unknown_metric_names(path: str | Path) -> dict[str, list[str]]:
    """Names outside the contract, each with where the dashboard uses it."""
    allowed = allowed_metric_names()
    bad: dict[str, list[str]] = {}
    for q in dashboard_queries(path):
        for name in sorted(q.metric_names() - allowed):
            bad.setdefault(name, []).append(q.where)
    return bad


def exposed_series_names(text: str) -> set[str]:
    """Series names a Prometheus text exposition can produce.

    From the ``# TYPE`` lines too, so a labelled counter with no sample yet (no
    child created) still counts as exposed.
    """
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                name, kind = parts[2], parts[3]
                if kind == "histogram":
                    names.update(name + s for s in HISTOGRAM_SUFFIXES)
                elif kind == "counter" and not name.endswith("_total"):
                    names.add(name + "_total")  # OpenMetrics drops the suffix here
                else:
                    names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def client_series_names() -> set[str]:
    """Series names rdmakv's engine-side metrics export (an empty ClientMetrics)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from rdmakv.connectors.audit import AuditLedger, NamespaceGuard
    from rdmakv.metrics.engine import ClientMetrics

    registry = CollectorRegistry()
    # With an audit ledger, as a connector's workers export them.
    audits = AuditLedger(NamespaceGuard("check"), tolerance=0.0, quarantine=True)
    metrics = ClientMetrics([], registry=registry, audits=audits)
    try:
        return exposed_series_names(generate_latest(registry).decode())
    finally:
        metrics.close()


def _missing(names: set[str], prefix: str, exposed: set[str], what: str, path: str) -> int:
    missing = sorted(n for n in names if n.startswith(prefix) and n not in exposed)
    for name in missing:
        print(f"{path}: {name} is not in {what}", file=sys.stderr)
    if not missing:
        print(f"{path}: every {prefix}* name is in {what}")
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dashboard")
    ap.add_argument(
        "--exposed", help="a node's /metrics text: every rdmakv_node_* name must be in it"
    )
    ap.add_argument("--client", action="store_true", help="check names against ClientMetrics")
    args = ap.parse_args(argv)
    try:
        names = dashboard_metric_names(args.dashboard)
    except (OSError, ValueError) as e:
        print(f"{args.dashboard}: cannot read the dashboard: {e}", file=sys.stderr)
        return 1
    print(f"{args.dashboard}: {len(names)} metric names: {' '.join(sorted(names))}")
    rc = 0
    for name, wheres in unknown_metric_names(args.dashboard).items():
        print(
            f"{args.dashboard}: {name} is not an rdmakv metric (used in {'; '.join(wheres)})",
            file=sys.stderr,
        )
        rc = 1
    if args.exposed:
        exposed = exposed_series_names(Path(args.exposed).read_text())
        rc |= _missing(names, "rdmakv_node_", exposed, "the node's /metrics", args.dashboard)
    if args.client:
        exposed = client_series_names()
        rc |= _missing(names, "rdmakv_client_", exposed, "ClientMetrics", args.dashboard)
    return rc


if __name__ == "__main__":
    sys.exit(main())
