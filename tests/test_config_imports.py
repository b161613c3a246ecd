"""rdmakv.config stays a low layer: importing it loads no node, client, protocol or
native code, and the defaults it shares with those are one set of values."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

from rdmakv import defaults
from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster import ClusterClient
from rdmakv.client.node_client import KVClient
from rdmakv.client.streams import check_streams
from rdmakv.config import ClientConfig, NodeConfig
from rdmakv.connectors.group_stores import StoreOptions
from rdmakv.node import KVNode
from rdmakv.node.admission import SessionLimits
from rdmakv.node.store import KVStore

ROOT = Path(__file__).resolve().parent.parent


def _modules_after(statement: str) -> dict[str, list[str]]:
    """The rdmakv modules, and the heavy third-party ones, a fresh interpreter has
    loaded after ``statement``."""
    script = (
        f"{statement}; import sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rdmakv')); "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('numpy', 'xxhash', 'torch', '_cffi_backend')))"
    )
    # cwd=ROOT puts this checkout first on sys.path, whichever rdmakv is installed.
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    ours, heavy = proc.stdout.splitlines()
    return {"rdmakv": ast.literal_eval(ours), "heavy": ast.literal_eval(heavy)}


def test_importing_the_configuration_loads_only_errors_and_defaults() -> None:
    loaded = _modules_after("import rdmakv.config")
    assert loaded["rdmakv"] == ["rdmakv", "rdmakv.config", "rdmakv.defaults", "rdmakv.errors"]
    assert loaded["heavy"] == []


def test_importing_the_package_loads_no_slab_until_it_is_asked_for() -> None:
    assert _modules_after("import rdmakv")["rdmakv"] == ["rdmakv", "rdmakv.errors"]
    loaded = _modules_after("from rdmakv import Slab")
    assert "rdmakv.blocks.slab" in loaded["rdmakv"] and "numpy" in loaded["heavy"]


def test_the_defaults_module_imports_nothing() -> None:
    tree = ast.parse((ROOT / "rdmakv" / "defaults.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imports == []


def test_the_schema_defaults_are_the_node_and_client_defaults() -> None:
    node, limits = NodeConfig(), SessionLimits()
    for name in (
        "handshake_timeout_s",
        "idle_timeout_s",
        "max_sessions",
        "max_sessions_per_source",
        "max_unauthenticated",
        "max_unauthenticated_per_source",
    ):
        assert getattr(node, name) == getattr(limits, name), name
    with Slab(4096, 4096, lock=False, shared_refcounts=True) as pool:
        store = KVStore(pool)
        assert node.lease_timeout_s == store.lease_timeout
        assert node.max_leases_per_block == store.max_leases_per_block
    # where a node listens, and what a client waits and keeps: one value each
    def default(fn: object, name: str) -> object:
        return inspect.signature(fn).parameters[name].default  # type: ignore[arg-type]

    assert (node.host, node.port, node.metrics_host) == (
        default(KVNode, "host"), default(KVNode, "port"), default(KVNode, "metrics_host"))
    client = ClientConfig()
    options = StoreOptions(node="h:1")
    assert client.timeout_s == default(KVClient, "timeout") == options.timeout
    assert client.replication == default(ClusterClient, "replication") == options.replication
    assert (client.l1_size, client.offload) == (options.l1_bytes, options.offload)
    streams = ClientConfig.model_fields["streams"].metadata
    most = next(m.le for m in streams if hasattr(m, "le"))
    assert most == defaults.MAX_STREAMS
    check_streams(most)  # the client takes the schema's largest value
