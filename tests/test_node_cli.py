"""`rdmakv serve` / `rdmakv stats` argument handling."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import pytest

from rdmakv.cli import parse_size
from rdmakv.errors import ConfigError
from rdmakv.transport.tcp import loop as tcp


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("256KiB", 256 * 1024),
        ("1GiB", 1 << 30),
        ("16k", 16000),
        ("1.5MiB", 3 << 19),
        (" 2 mb ", 2_000_000),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1", "0", "1 GiB extra"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.timeout(60)
def test_serve_refuses_bad_options_clearly(tmp_path: object) -> None:
    run = [sys.executable, "-m", "rdmakv.cli"]
    out = subprocess.run(
        [*run, "serve", "--pool-size", "lots"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "bad size 'lots'" in out.stderr
    out = subprocess.run(
        [*run, "serve", "--port", "0", "--pool-size", "64KiB", "--block-size", "1MiB", "--no-lock"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "larger than the slab capacity" in out.stderr
    out = subprocess.run(
        [*run, "serve", "--port", "0", "--token-file", "/nonexistent/tok"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "cannot read token file" in out.stderr
    out = subprocess.run(
        [*run, "stats", "no-port-here"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "HOST:PORT" in out.stderr


def test_serve_auto_is_the_default_and_serves_tcp_without_rdma(node_factory: Any) -> None:
    node = node_factory()  # no --transport: the default
    assert "transports=tcp" in node.ready_line or "transports=tcp,rdma" in node.ready_line


def test_optional_transport_that_fails_to_come_up_is_left_out() -> None:
    """``auto`` must not crash the node when RDMA set-up fails (e.g. registration refused)."""
    from rdmakv.errors import RdmaError
    from rdmakv.node import KVNode
    from rdmakv.transport import TransportSpec, get_transport, register_transport

    def broken_node_path(pool: object, **_: object) -> NoReturn:
        raise RdmaError("ibv_reg_mr: Cannot allocate memory (injected)")

    tcp = get_transport("tcp")
    register_transport(TransportSpec("broken-rdma", tcp.client, broken_node_path))
    node = KVNode(
        pool_size=1 << 20,
        block_size=1 << 16,
        port=0,
        transports=["broken-rdma"],
        lock_pool=False,
        optional_transports=True,
    )
    try:
        assert node.transports == ("tcp",)
    finally:
        node.pool.close()
    with pytest.raises(RdmaError, match="injected"):
        KVNode(
            pool_size=1 << 20,
            block_size=1 << 16,
            port=0,
            transports=["broken-rdma"],
            lock_pool=False,
        )


# -- config file, environment and flags; clean start-up failures; JSON logs -------------------
# Real `rdmakv serve` processes (no --port unless a test wants one: the file or
# the environment must be what picks it).

RUN = [sys.executable, "-m", "rdmakv.cli"]
SMALL = ["--pool-size", "4MiB", "--block-size", "64KiB", "--no-lock"]
READY_TIMEOUT_S = 60.0


def _clean_env(**extra: str) -> dict[str, str]:
    """os.environ without rdmakv settings (the test's own), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RDMAKV_NODE_", "RDMAKV_CLIENT_", "RDMAKV_LOG_", "RDMAKV_CONFIG",
                             "RDMAKV_TCP_SEND_PLAN"))
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A port something else listens on while the block runs."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield int(s.getsockname()[1])


@contextlib.contextmanager
def _serve(args: list[str], env: dict[str, str], stderr: Path) -> Iterator[int]:
    """Start ``rdmakv serve ARGS``; yield the port of its ready line; SIGTERM at the end."""
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            [*RUN, *args], stdout=subprocess.PIPE, stderr=err, env=env, text=True
        )
    try:
        out = proc.stdout
        assert out is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        assert line and "ready on " in line[0], (line, stderr.read_text())
        yield int(line[0].split("ready on ", 1)[1].split()[0].rsplit(":", 1)[1])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def _fails(args: list[str], env: dict[str, str] | None = None) -> str:
    """Run a command that must not start; its stderr, checked to be one clean line."""
    out = subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=60, env=env or _clean_env()
    )
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_serve_config_with_wrong_key_fails_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "node.yaml"
    cfg.write_text("node:\n  port: 0\n  pool_sise: 4MiB\n")
    line = _fails(["serve", "--config", str(cfg)])
    assert line.startswith(f"rdmakv serve: error: config file {cfg}: node.pool_sise: unknown key")
    assert "allowed keys: host, port, pool_size, block_size" in line


def test_serve_config_with_wrong_type_or_value_fails_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "node.yaml"
    cfg.write_text("node:\n  port: seven\n  transport: rdmaa\n")
    line = _fails(["serve", "--config", str(cfg)])
    assert "node.port: input should be a valid integer" in line and "'seven'" in line
    assert "node.transport: 'rdmaa' is not one of tcp, rdma, auto" in line
    # The same file named by RDMAKV_CONFIG.
    line = _fails(["serve"], _clean_env(RDMAKV_CONFIG=str(cfg)))
    assert "node.transport: 'rdmaa' is not one of tcp, rdma, auto" in line
    # A bad environment value names the variable.
    line = _fails(["serve"], _clean_env(RDMAKV_NODE_LEASE_TIMEOUT_S="-1"))
    assert "environment variable RDMAKV_NODE_LEASE_TIMEOUT_S: node.lease_timeout_s:" in line
    line = _fails(["serve"], _clean_env(RDMAKV_NODE_PORTT="1"))
    assert "RDMAKV_NODE_PORTT: no such setting" in line


def test_a_bad_tcp_send_plan_stops_a_command_in_one_line_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "node.yaml"
    cfg.write_text("tcp:\n  send_plan: fastest\n")
    line = _fails(["serve", "--config", str(cfg)])
    assert line == (f"rdmakv serve: error: config file {cfg}: tcp.send_plan: 'fastest' is not "
                    "one of 512k-ahead, 512k-after, 128k-ahead, 128k-after")
    line = _fails(["demo"], _clean_env(RDMAKV_TCP_SEND_PLAN="128k"))
    assert line.startswith("rdmakv demo: error: environment variable RDMAKV_TCP_SEND_PLAN: "
                           "tcp.send_plan: '128k' is not one of 512k-ahead, ")


@pytest.mark.skipif(not tcp.native_checksums(), reason="sends do not hash as they go here")
def test_every_command_sends_with_the_configured_tcp_plan(tmp_path: Path) -> None:
    """The command applies tcp.send_plan to its process before it runs
    (``serve`` and ``demo`` as ``doctor``, which reports the plan in use)."""
    cfg = tmp_path / "rdmakv.yaml"
    cfg.write_text("tcp:\n  send_plan: 128k-after\n")
    for env in (_clean_env(RDMAKV_CONFIG=str(cfg)),
                _clean_env(RDMAKV_TCP_SEND_PLAN="512k-after")):
        out = subprocess.run([*RUN, "doctor"], capture_output=True, text=True, timeout=60, env=env)
        want = "512k-after" if "RDMAKV_TCP_SEND_PLAN" in env else "128k-after"
        assert f"tcp send plan: {want} (tcp.send_plan sets it;" in out.stdout, out.stdout


def test_serve_config_file_errors(tmp_path: Path) -> None:
    line = _fails(["serve", "--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: cannot read it: No such file or directory" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("node:\n  port: 1\n  host: [x\n")
    line = _fails(["serve", "--config", str(bad)])
    assert f"config file {bad}: YAML syntax error at line " in line


def test_serve_environment_overrides_file_and_flag_overrides_environment(tmp_path: Path) -> None:
    with _held_port() as taken:
        cfg = tmp_path / "node.yaml"
        # The file names a port something else holds: serving there would fail.
        cfg.write_text(
            f"node:\n  host: 127.0.0.1\n  port: {taken}\n  pool_size: 4MiB\n"
            "  block_size: 64KiB\n  lock_pool: false\n"
        )
        wanted = _free_port()
        env = _clean_env(RDMAKV_NODE_PORT=str(wanted))
        with _serve(["serve", "--config", str(cfg)], env, tmp_path / "a.err") as port:
            assert port == wanted
        # The flag beats the environment (which names the held port now).
        env = _clean_env(RDMAKV_NODE_PORT=str(taken), RDMAKV_CONFIG=str(cfg))
        with _serve(["serve", "--port", "0"], env, tmp_path / "b.err") as port:
            assert port not in (taken, 0)
        # Without flag or variable the file's port is used: here, in use.
        line = _fails(["serve", "--config", str(cfg)])
        assert f"127.0.0.1:{taken} is already in use" in line


def test_serve_port_in_use_is_one_line(tmp_path: Path) -> None:
    with _held_port() as taken:
        line = _fails(["serve", "--port", str(taken), *SMALL])
        assert line.startswith(f"rdmakv serve: error: 127.0.0.1:{taken} is already in use")
        assert "--port" in line and "stop the process holding it" in line
        line = _fails(["serve", "--port", "0", "--metrics-port", str(taken), *SMALL])
        assert f"metrics address 127.0.0.1:{taken} is already in use" in line
        assert "--metrics-port" in line


def test_serve_unbindable_addresses_are_one_line() -> None:
    line = _fails(["serve", "--host", "no-such-host.invalid", "--port", "0", *SMALL])
    assert "host name 'no-such-host.invalid' does not resolve" in line and "--host" in line
    # TEST-NET-2 (RFC 5737): never an address of this machine.
    line = _fails(["serve", "--host", "198.51.100.7", "--port", "0", *SMALL])
    assert "198.51.100.7 is not an address of this machine" in line


def test_serve_token_file_failures(tmp_path: Path) -> None:
    line = _fails(["serve", "--port", "0", "--token-file", str(tmp_path / "nope"), *SMALL])
    assert "cannot read token file" in line and "No such file or directory" in line
    assert "--token-file" in line
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    line = _fails(["serve", "--port", "0", "--token-file", str(empty), *SMALL])
    assert f"token file '{empty}' is empty" in line
    line = _fails(["serve", "--port", "0", "--token-file", str(tmp_path), *SMALL])
    assert "cannot read token file" in line and "Is a directory" in line


def test_serve_pool_failures() -> None:
    line = _fails(["serve", "--port", "0", "--pool-size", "1000TiB", "--no-lock"])
    assert "cannot allocate a 1000TiB pool" in line and "--pool-size" in line
    line = _fails(["serve", "--port", "0", "--pool-size", "64KiB", "--block-size", "1MiB"])
    assert "larger than the slab capacity" in line


def test_serve_rdma_without_device_is_one_line() -> None:
    from rdmakv.transport import available_transports

    if "rdma" in available_transports():
        pytest.skip("this machine has a usable RDMA device")
    line = _fails(["serve", "--port", "0", "--transport", "rdma", *SMALL])
    assert "--transport rdma" in line and "rdmakv doctor" in line and "--transport tcp" in line


def test_clients_against_no_node_name_the_address(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there
    line = _fails(["stats", f"127.0.0.1:{port}"])
    assert f"is `rdmakv serve` running at 127.0.0.1:{port}?" in line
    cfg = tmp_path / "client.yaml"
    cfg.write_text(f"client:\n  nodes: 127.0.0.1:{port}\n  transport: tcp\n")
    out = subprocess.run(
        [*RUN, "demo", "--config", str(cfg), "--requests", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"rdmakv demo: error: connect to 127.0.0.1:{port}" in out.stderr
    assert "check the address (--nodes / client.nodes" in out.stderr
    line = _fails(["stats"])
    assert "no nodes to ask" in line


def test_stats_reads_the_client_section(node_factory: Any, tmp_path: Path) -> None:
    node = node_factory(token=b"sesame")
    token = tmp_path / "token"
    token.write_bytes(b"sesame")
    cfg = tmp_path / "client.yaml"
    cfg.write_text(f"client:\n  nodes: {node.endpoint}\n  token_file: {token}\n  timeout_s: 10\n")
    out = subprocess.run(
        [*RUN, "stats", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["block_size"] == 64 * 1024  # the node's, so it answered


def test_json_logs_are_one_object_per_line(tmp_path: Path) -> None:
    err = tmp_path / "serve.err"
    with _serve(["--log-format", "json", "-v", "serve", "--port", "0", *SMALL], _clean_env(), err):
        pass
    lines = err.read_text().splitlines()
    assert lines, "no log records"
    records = [json.loads(line) for line in lines]
    for r in records:
        assert set(r) >= {"ts", "level", "logger", "msg"}
        datetime.fromisoformat(r["ts"])
    assert any(r["msg"] == "node stopped" for r in records)
    # The variable does the same, and the option also works after the command.
    err = tmp_path / "env.err"
    env = _clean_env(RDMAKV_LOG_FORMAT="json")
    with _serve(["serve", "--port", "0", *SMALL], env, err):
        pass
    assert all(json.loads(line)["logger"] for line in err.read_text().splitlines())
    err = tmp_path / "after.err"
    with _serve(["serve", "--log-format", "json", "--port", "0", *SMALL], _clean_env(), err):
        pass
    assert all(json.loads(line)["level"] for line in err.read_text().splitlines())
    # A start-up failure is a JSON record too.
    record = json.loads(_fails(["--log-format", "json", "serve", "--token-file", "/nonexistent"]))
    assert record["level"] == "error" and "cannot read token file" in record["msg"]


def test_json_formatter_keeps_exceptions_on_one_line() -> None:
    from rdmakv.logformat import JsonFormatter

    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord(
            "rdmakv.x", logging.ERROR, __file__, 1, "failed: %s", ("why",), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["msg"] == "failed: why" and obj["logger"] == "rdmakv.x"
    assert obj["level"] == "error" and "ValueError: boom" in obj["exc_info"]


def test_demo_reads_the_client_section(node_factory: Any, tmp_path: Path) -> None:
    node = node_factory(pool_size="64MiB", block_size="256KiB")
    cfg = tmp_path / "client.yaml"
    cfg.write_text(f"client:\n  nodes: {node.endpoint}\n  transport: tcp\n  offload: all\n")
    out = subprocess.run(
        [*RUN, "demo", "--config", str(cfg), "--requests", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr
    assert "offload (all)" in out.stdout and " 0 wrong blocks" in out.stdout
    assert "rdmakv node ready" not in out.stdout  # no local node: the configured one


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's init may not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.timeout(120)
def test_a_node_started_by_a_killed_process_stops_with_it() -> None:
    """LocalNodeProcess's node ends when the process that started it is
    SIGKILLed without closing it (the pipe on the node's stdin closes): a
    crashed bench or test leaves no `rdmakv serve` behind."""
    script = (
        "import sys, time\n"
        "from rdmakv.node.process import LocalNodeProcess\n"
        "n = LocalNodeProcess({'pool-size': '4MiB', 'block-size': '64KiB'}, "
        "extra_args=['--no-lock'])\n"
        "print(n.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert starter.stdout is not None
        node_pid = int(starter.stdout.readline())
        assert not _exited(node_pid)
        starter.kill()
        starter.wait(30)
        deadline = time.monotonic() + 60
        while not _exited(node_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exited(node_pid), f"node {node_pid} outlived the process that started it"
    finally:
        starter.kill()
        with contextlib.suppress(ProcessLookupError):
            if not _exited(node_pid):
                os.kill(node_pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_killed_node_is_not_alive_while_another_thread_waits_for_it(node: Any) -> None:
    """``alive()`` is False once the node died, even while another thread is
    inside ``Popen.wait()`` for it (a fault proxy's thread running ``kill()``:
    the chaos suite's kill mid-batch). ``Popen.poll()`` answers None then; an
    ``alive()`` built on it alone said a dead node was alive (CI, stop 44).

    The other thread's wait is stood in for by holding the lock it would hold
    (CPython's ``Popen._waitpid_lock``), which makes the window deterministic.
    A killed process is dead only once its last thread has gone (its main
    thread shows as a zombie in /proc before that), so this waits for
    ``alive()`` to turn False rather than checking it once."""
    proc = node.proc
    with proc._waitpid_lock:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while node.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not node.alive(), "alive() still True 30 s after SIGKILL"
        assert proc.poll() is None  # the window: poll() alone cannot tell
    node.kill()  # reaps it; alive() stays False
    assert proc.returncode == -signal.SIGKILL
    assert not node.alive()
