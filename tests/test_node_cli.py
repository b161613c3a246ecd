"""`rdmakv serve` / `rdmakv stats` argument handling."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, NoReturn

import pytest

from rdmakv.cli import parse_size
from rdmakv.errors import ConfigError


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

    def broken_node_path(pool: object) -> NoReturn:
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
