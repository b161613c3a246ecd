"""TCP congestion control of rdmakv's connections, on real nodes and sockets.

Both ends ask for :data:`~rdmakv.transport.congestion.DEFAULT_CONGESTION` (or
``RDMAKV_TCP_CONGESTION``); a refusal keeps the system default, is logged
once with its fix, and changes nothing else: puts and gets work as before.
The node's side is read with ``ss`` (iproute2), the client's with getsockopt.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeProcess

from rdmakv import doctor
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.transport import congestion

SYSTEM_DEFAULT = Path("/proc/sys/net/ipv4/tcp_congestion_control")
AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
NO_SUCH = "rdmakv_none"  # no kernel has an algorithm of this name

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_CONGESTION") or not SYSTEM_DEFAULT.exists(),
    reason="no TCP_CONGESTION socket option on this platform (Linux only)",
)


def _other_algorithm() -> str:
    """An algorithm this process may set that is not the system default, so a
    socket running it shows the setting took effect; skip when there is none."""
    default = SYSTEM_DEFAULT.read_text().strip()
    for name in AVAILABLE.read_text().split():
        if name == default:
            continue
        with socket.socket() as s:
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            except OSError:
                continue
            return name
    pytest.skip(f"no congestion control besides {default!r} may be set here "
                f"(available: {AVAILABLE.read_text().strip()})")


def _node_side(port: int) -> list[str]:
    """The algorithm of each established connection the node at ``port`` accepted."""
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed: cannot read the node's sockets")
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        check=True, capture_output=True, text=True,
    ).stdout
    known = set(AVAILABLE.read_text().split())
    return [tok for tok in out.split() if tok in known]


def _roundtrip(client: KVClient, slab: Slab) -> None:
    h = slab.alloc()
    slab.view(h)[:] = os.urandom(slab.block_size)
    want = bytes(slab.view(h))
    assert client.put([b"cc-key"], [h], slab.block_size, [bytes(16)]) == [True]
    slab.view(h)[:] = b"\0" * slab.block_size
    assert client.get([b"cc-key"], [h], [bytes(16)]) == [True]
    assert bytes(slab.view(h)) == want


def test_both_ends_run_the_algorithm_asked_for(
    node_factory: Callable[..., NodeProcess], client_slab: Slab,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = _other_algorithm()
    monkeypatch.setenv(congestion.ENV_VAR, name)  # the node process inherits it
    node = node_factory()
    with KVClient("127.0.0.1", node.port, client_slab) as client:
        assert client._ch is not None
        assert congestion.congestion_of(client._ch.sock) == name
        assert _node_side(node.port) == [name]
        _roundtrip(client, client_slab)


def test_a_refused_algorithm_keeps_the_system_default_and_says_why_once(
    node_factory: Callable[..., NodeProcess], client_slab: Slab,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    default = SYSTEM_DEFAULT.read_text().strip()
    monkeypatch.setenv(congestion.ENV_VAR, NO_SUCH)
    node = node_factory()
    with (
        caplog.at_level(logging.INFO, logger="rdmakv.transport"),
        KVClient("127.0.0.1", node.port, client_slab) as a,
        KVClient("127.0.0.1", node.port, client_slab) as b,
    ):
        for c in (a, b):
            assert c._ch is not None
            assert congestion.congestion_of(c._ch.sock) == default
        _roundtrip(a, client_slab)
        assert _node_side(node.port) == [default, default]
    refusals = [r.getMessage() for r in caplog.records if NO_SUCH in r.getMessage()]
    assert len(refusals) == 1, refusals  # two connections, one line
    assert "refused" in refusals[0] and f"modprobe tcp_{NO_SUCH}" in refusals[0]
    assert "refused" in node.stderr() and NO_SUCH in node.stderr()


def test_system_leaves_the_kernel_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(congestion.ENV_VAR, congestion.SYSTEM)
    assert congestion.wanted_congestion() is None
    with socket.socket() as s:
        congestion.apply_congestion(s)
        assert congestion.congestion_of(s) == SYSTEM_DEFAULT.read_text().strip()


def test_default_is_cubic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(congestion.ENV_VAR, raising=False)
    assert congestion.wanted_congestion() == congestion.DEFAULT_CONGESTION == "cubic"


def test_doctor_reports_what_connections_run_and_why_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(congestion.ENV_VAR, NO_SUCH)
    report = doctor.diagnose()
    default = SYSTEM_DEFAULT.read_text().strip()
    assert report.tcp_congestion.startswith(f"{default}; '{NO_SUCH}' refused")
    assert f"tcp congestion control: {report.tcp_congestion}" in doctor.render(report)
    name = _other_algorithm()
    monkeypatch.setenv(congestion.ENV_VAR, name)
    assert doctor.diagnose().tcp_congestion == name
