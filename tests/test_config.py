"""rdmakv.config: the schema, the loader (file + RDMAKV_* environment), its error
messages, the generated docs, and the connectors' ``rdmakv_config`` option."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest

from rdmakv.config import (
    NOT_CONFIG_ENV,
    SECTIONS,
    OffloadMode,
    RdmakvConfig,
    TcpSendPlan,
    env_var,
    format_size,
    load_config,
    render_docs,
)
from rdmakv.connectors.group_stores import StoreOptions
from rdmakv.defaults import DEFAULT_L1_BYTES, DEFAULT_TCP_SEND_PLAN
from rdmakv.engine.l1.offload_policies import OFFLOAD_MODES
from rdmakv.errors import ConfigError
from rdmakv.transport.tcp import loop as tcp

DOCS = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _write(tmp_path: Path, text: str, name: str = "rdmakv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path | None = None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env or {})
    return str(info.value)


# -- the schema and the loader ---------------------------------------------------------------


def test_defaults_without_file_or_environment() -> None:
    cfg = load_config(None, {})
    assert cfg == RdmakvConfig()
    assert (cfg.node.host, cfg.node.port, cfg.node.pool_size) == ("127.0.0.1", 7480, 1 << 30)
    assert cfg.node.metrics_port is None and cfg.node.lock_pool
    assert cfg.client.nodes is None and cfg.client.l1_size == DEFAULT_L1_BYTES
    assert (cfg.log.level, cfg.log.format) == ("info", "text")
    assert cfg.client.model_fields_set == set()


def test_the_contract_example_file_loads(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
node:
  host: 0.0.0.0            # bind address
  port: 7480
  pool_size: 8GiB
  block_size: 256KiB
  transport: auto
  lease_timeout_s: 30
  token_file: /etc/rdmakv/token
  lock_pool: true
  metrics_host: 0.0.0.0
  metrics_port: 9480
client:
  nodes: dns://rdmakv-nodes.rdmakv.svc.cluster.local:7480
  replication: 1
  transport: auto
  timeout_s: 5
  token_file: /etc/rdmakv/token
  l1_size: 4GiB
  offload: reuse
  offload_budget: 1.0
  metrics_port: null
log:
  level: info
  format: text
""",
    )
    cfg = load_config(path, {})
    assert cfg.node.pool_size == 8 << 30 and cfg.node.block_size == 256 << 10
    assert cfg.node.metrics_port == 9480 and cfg.node.lease_timeout_s == 30.0
    assert cfg.client.l1_size == 4 << 30 and cfg.client.offload_budget == 1.0
    assert "l1_size" in cfg.client.model_fields_set


def test_empty_or_comment_only_file_is_all_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "# nothing yet\n"), {}) == RdmakvConfig()


def test_file_from_rdmakv_config_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, "node:\n  port: 7999\n")
    assert load_config(None, {"RDMAKV_CONFIG": str(path)}).node.port == 7999
    other = _write(tmp_path, "node:\n  port: 7001\n", "other.yaml")
    # An explicit path beats the variable.
    assert load_config(other, {"RDMAKV_CONFIG": str(path)}).node.port == 7001


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "node:\n  port: 7480\n  host: 10.0.0.1\nclient:\n  nodes: a:1\n")
    env = {
        "RDMAKV_NODE_PORT": "7481",
        "RDMAKV_NODE_POOL_SIZE": "8GiB",
        "RDMAKV_NODE_LOCK_POOL": "false",
        "RDMAKV_NODE_METRICS_PORT": "null",
        "RDMAKV_CLIENT_NODES": "a:7480,b:7480",
        "RDMAKV_CLIENT_TIMEOUT_S": "2.5",
        "RDMAKV_LOG_FORMAT": "json",
        "RDMAKV_LOG_LEVEL": "",  # empty: unset
        # Not configuration: ignored.
        "RDMAKV_TCP_RECV_SPIN_US": "100",
        "RDMAKV_REQUIRE_RDMA": "1",
        "RDMAKV_NODE": "x",
    }
    cfg = load_config(path, env)
    assert cfg.node.port == 7481 and cfg.node.host == "10.0.0.1"
    assert cfg.node.pool_size == 8 << 30 and cfg.node.lock_pool is False
    assert cfg.node.metrics_port is None
    assert cfg.client.nodes == "a:7480,b:7480" and cfg.client.timeout_s == 2.5
    assert (cfg.log.format, cfg.log.level) == ("json", "info")


def test_text_settings_keep_the_raw_environment_text() -> None:
    # YAML would read these as an int, a float and a bool; they are text settings.
    cfg = load_config(
        None,
        {
            "RDMAKV_NODE_HOST": "::1",
            "RDMAKV_NODE_TOKEN_FILE": "007",
            "RDMAKV_CLIENT_NODES": "10.0.0.5:7480",
        },
    )
    assert (cfg.node.host, cfg.node.token_file) == ("::1", "007")
    assert cfg.client.nodes == "10.0.0.5:7480"


@pytest.mark.parametrize(
    ("value", "expected"), [("8GiB", 8 << 30), ("16k", 16000), ("4096", 4096), (4096, 4096)]
)
def test_sizes(tmp_path: Path, value: object, expected: int) -> None:
    text = f"node:\n  pool_size: {value}\n"
    assert load_config(_write(tmp_path, text), {}).node.pool_size == expected


def test_offload_modes_match_the_l1() -> None:
    assert set(get_args(OffloadMode)) == set(OFFLOAD_MODES)


def test_tcp_send_plans_match_the_tcp_loop() -> None:
    assert get_args(TcpSendPlan) == tuple(tcp.SEND_PLANS)
    assert RdmakvConfig().tcp.send_plan == DEFAULT_TCP_SEND_PLAN in tcp.SEND_PLANS


def test_tcp_send_plan_from_the_file_or_the_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, "tcp:\n  send_plan: 128k-after\n")
    assert load_config(path, {}).tcp.send_plan == "128k-after"
    env = {"RDMAKV_TCP_SEND_PLAN": "512k-after"}
    assert load_config(path, env).tcp.send_plan == "512k-after"
    assert load_config(None, env).tcp.model_fields_set == {"send_plan"}


def test_tcp_variables_that_are_not_configuration_are_left_alone() -> None:
    # the receive spin is read where the native core loads, the congestion control
    # where a connection opens
    env = {"RDMAKV_TCP_RECV_SPIN_US": "50", "RDMAKV_TCP_CONGESTION": "reno"}
    assert load_config(None, env).tcp.send_plan == DEFAULT_TCP_SEND_PLAN
    # every other RDMAKV_TCP_* variable the package reads is one of them
    package = Path(__file__).resolve().parent.parent / "rdmakv"
    read = {m for f in package.rglob("*.py")
            for m in re.findall(r'"(RDMAKV_TCP_[A-Z_]+)"', f.read_text())}
    assert read - {env_var("tcp", key) for key in SECTIONS["tcp"].model_fields} == NOT_CONFIG_ENV
    msg = _error(env={"RDMAKV_TCP_SEND_PLANS": "512k-ahead"})
    assert msg.startswith("environment variable RDMAKV_TCP_SEND_PLANS: no such setting")
    assert "allowed: RDMAKV_TCP_SEND_PLAN" in msg


def test_format_size() -> None:
    assert [format_size(n) for n in (1 << 30, 256 << 10, 3 << 20, 1000)] == [
        "1GiB",
        "256KiB",
        "3MiB",
        "1000",
    ]


# -- error messages ----------------------------------------------------------------------------


def test_unknown_key_names_it_and_the_allowed_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "node:\n  pool_sise: 1GiB\n")
    msg = _error(path)
    assert msg.startswith(f"config file {path}: node.pool_sise: unknown key; allowed keys: ")
    assert "host, port, pool_size, block_size" in msg


def test_unknown_section(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, "nodes:\n  port: 1\n"))
    assert "nodes: unknown key; allowed sections: node, client, tcp, log" in msg


def test_bad_literal_lists_the_allowed_values(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, "node:\n  transport: rdmaa\n"))
    assert "node.transport: 'rdmaa' is not one of tcp, rdma, auto" in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node:\n  port: 70000\n", "node.port: input should be less than or equal to 65535"),
        ("node:\n  port: abc\n", "node.port: input should be a valid integer"),
        ("node:\n  pool_size: lots\n", "node.pool_size: bad size 'lots'"),
        ("node:\n  pool_size: true\n", "node.pool_size: must be a size in bytes"),
        ("node:\n  lease_timeout_s: 0\n", "node.lease_timeout_s: input should be greater than 0"),
        ("client:\n  replication: 0\n", "client.replication: input should be greater than or"),
        ("client:\n  offload_budget: 1.5\n", "client.offload_budget: input should be less than"),
        ("client:\n  offload: some\n", "'some' is not one of none, all, hot, cold, reuse"),
        ("log:\n  format: jsn\n", "log.format: 'jsn' is not one of text, json"),
        ("tcp:\n  send_plan: fast\n", "tcp.send_plan: 'fast' is not one of 512k-ahead, "
         "512k-after, 128k-ahead, 128k-after"),
        ("node: 5\n", "node: must be a mapping of keys (host, port,"),
        ("- node\n", "must be a mapping of sections (node, client, tcp, log), got a list"),
    ],
)
def test_bad_values_name_key_and_rule(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    msg = _error(path)
    assert msg.startswith(f"config file {path}: ")
    assert expected in msg


def test_every_problem_in_one_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "node:\n  port: -1\n  transport: x\nlog:\n  level: loud\n")
    msg = _error(path, {"RDMAKV_CLIENT_REPLICATION": "zero"})
    assert msg.count(f"config file {path}") == 1  # each source named once
    for part in ("node.port", "node.transport", "log.level", "RDMAKV_CLIENT_REPLICATION"):
        assert part in msg
    assert "\n" not in msg


def test_yaml_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "node:\n  port: 7480\n  host: [oops\n")
    msg = _error(path)
    assert msg.startswith(f"config file {path}: YAML syntax error at line ")


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, "node:\n  port: 1\n  port: 2\n"))
    assert "at line 3" in msg and "key 'port' is given twice" in msg


def test_missing_file(tmp_path: Path) -> None:
    msg = _error(tmp_path / "nope.yaml")
    assert "nope.yaml: cannot read it: No such file or directory" in msg
    assert "--config or RDMAKV_CONFIG" in msg


def test_environment_errors_name_the_variable() -> None:
    msg = _error(env={"RDMAKV_NODE_PORT": "seven"})
    assert msg.startswith("environment variable RDMAKV_NODE_PORT: node.port: ")
    msg = _error(env={"RDMAKV_LOG_FORMAT": "xml"})
    assert "RDMAKV_LOG_FORMAT: log.format: 'xml' is not one of text, json" in msg


def test_unknown_section_variable_is_an_error() -> None:
    msg = _error(env={"RDMAKV_NODE_POOL_SISE": "1GiB"})
    assert msg.startswith("environment variable RDMAKV_NODE_POOL_SISE: no such setting")
    assert "RDMAKV_NODE_POOL_SIZE" in msg
    assert "RDMAKV_CLIENT_NODE" in _error(env={"RDMAKV_CLIENT_NODE": "a:1"})


# -- docs --------------------------------------------------------------------------------------


def test_committed_docs_are_the_generated_docs() -> None:
    assert DOCS.read_text() == render_docs(), (
        "docs/config.md is stale: python -m rdmakv.config --docs > docs/config.md"
    )


def test_docs_list_every_key_once_with_its_variable() -> None:
    docs = render_docs()
    for section, model in SECTIONS.items():
        for key, field in model.model_fields.items():
            row = f"| `{section}.{key}` |"
            assert docs.count(row) == 1
            line = next(x for x in docs.splitlines() if x.startswith(row))
            assert f"`{env_var(section, key)}`" in line
            assert field.description and field.description in line
    assert "| `node.pool_size` | size | `1GiB` |" in docs
    assert "| `node.port` | int (>= 0, <= 65535) | `7480` |" in docs
    assert "| `node.transport` | tcp \\| rdma \\| auto | `auto` |" in docs


# -- connectors: rdmakv_config -------------------------------------------------------------------


def _client_file(tmp_path: Path) -> Path:
    return _write(
        tmp_path,
        """
client:
  nodes: 10.0.0.5:7480,10.0.0.6:7480
  replication: 2
  transport: tcp
  timeout_s: 3
  token_file: /etc/rdmakv/token
  l1_size: 2GiB
  offload: all
""",
    )


def test_connector_options_from_rdmakv_config(tmp_path: Path) -> None:
    path = _client_file(tmp_path)
    opts = StoreOptions.from_mapping({"rdmakv_config": str(path)}, env={})
    assert opts.node == "10.0.0.5:7480,10.0.0.6:7480"
    assert (opts.replication, opts.transport, opts.timeout) == (2, "tcp", 3.0)
    assert (opts.token_file, opts.l1_bytes, opts.offload) == ("/etc/rdmakv/token", 2 << 30, "all")
    assert opts.policy == "lru" and opts.offload_budget is None  # not in the file: defaults
    assert opts.given == {
        "node",
        "replication",
        "transport",
        "timeout",
        "token_file",
        "l1_bytes",
        "offload",
    }


def test_connector_explicit_options_beat_environment_beats_file(tmp_path: Path) -> None:
    path = _client_file(tmp_path)
    raw: dict[str, Any] = {"rdmakv_config": str(path), "timeout": 9, "l1_bytes": "64MiB"}
    env = {"RDMAKV_CLIENT_TIMEOUT_S": "7", "RDMAKV_CLIENT_REPLICATION": "1"}
    opts = StoreOptions.from_mapping(raw, env=env)
    assert opts.timeout == 9.0 and opts.l1_bytes == 64 << 20  # the engine's dict wins
    assert opts.replication == 1  # environment over the file
    assert opts.transport == "tcp"  # the file


def test_connector_config_from_rdmakv_config_variable(tmp_path: Path) -> None:
    path = _client_file(tmp_path)
    opts = StoreOptions.from_mapping({"model": "m"}, env={"RDMAKV_CONFIG": str(path)})
    assert opts.node.startswith("10.0.0.5") and opts.model == "m"


def test_connector_without_config_is_unchanged() -> None:
    opts = StoreOptions.from_mapping({"node": "h:1"}, env={})
    assert opts == StoreOptions(node="h:1") and opts.given == {"node"}
    assert "l1_bytes" not in opts.given  # SGLang sizes its staging slab itself then


@pytest.mark.skipif(not tcp.native_checksums(), reason="sends do not hash as they go here")
def test_connector_applies_the_tcp_section_to_its_process(tmp_path: Path) -> None:
    """An engine process's TCP sends follow its rdmakv config's tcp.send_plan,
    set as the connector reads the config (file or environment)."""
    before = tcp.send_plan_name()
    assert before is not None
    path = _write(tmp_path, "tcp:\n  send_plan: 128k-ahead\n")
    try:
        StoreOptions.from_mapping({"node": "h:1", "rdmakv_config": str(path)}, env={})
        assert tcp.send_plan_name() == "128k-ahead"
        StoreOptions.from_mapping({"node": "h:1"}, env={"RDMAKV_TCP_SEND_PLAN": "512k-after"})
        assert tcp.send_plan_name() == "512k-after"
    finally:
        tcp.set_send_plan(before)


def test_connector_bad_rdmakv_config_fails_clearly(tmp_path: Path) -> None:
    path = _write(tmp_path, "client:\n  transport: rdmaa\n")
    with pytest.raises(ConfigError, match=r"client.transport: 'rdmaa' is not one of tcp"):
        StoreOptions.from_mapping({"node": "h:1", "rdmakv_config": str(path)}, env={})
    with pytest.raises(ConfigError, match="cannot read it"):
        StoreOptions.from_mapping({"rdmakv_config": str(tmp_path / "none.yaml")}, env={})
    with pytest.raises(ConfigError, match="must be the path of a YAML file"):
        StoreOptions.from_mapping({"node": "h:1", "rdmakv_config": 5}, env={})
    with pytest.raises(ConfigError, match=r"client.nodes in the rdmakv config file"):
        StoreOptions.from_mapping({"rdmakv_config": str(_write(tmp_path, "", "e.yaml"))}, env={})
