"""Shared fixtures: real ``rdmakv serve`` processes on 127.0.0.1.

``node_factory(**options)`` starts a node (``--port 0`` unless given: the node
picks a free port and reports it on its ready line, so parallel tests never
race for ports) and returns a :class:`NodeProcess`; every node a test started
is killed at teardown. ``node`` is one default node. Options map to CLI flags:
``pool_size="64MiB"`` -> ``--pool-size 64MiB``; ``token=b"..."`` writes a token
file and passes ``--token-file``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdmakv.slab import Slab

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
DEFAULT_POOL = "32MiB"
DEFAULT_BLOCK = "64KiB"


class NodeProcess:
    """A running ``rdmakv serve``; ``restart()`` comes back on the same port."""

    def __init__(self, tmp: Path, options: dict[str, Any]) -> None:
        self.tmp = tmp
        self.options = {"pool_size": DEFAULT_POOL, "block_size": DEFAULT_BLOCK, **options}
        self.host = "127.0.0.1"
        self.port = int(self.options.pop("port", 0))
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""
        self.stderr_path = tmp / f"node-{id(self)}.stderr"
        self.start()

    def argv(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "rdmakv.cli",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--no-lock",
        ]
        for name, value in self.options.items():
            if name == "token":
                path = self.tmp / f"token-{id(self)}"
                path.write_bytes(value)
                args += ["--token-file", str(path)]
            else:
                args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def start(self) -> None:
        err = self.stderr_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        err.close()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(READY_TIMEOUT_S)
        if not line or "ready on" not in line[0]:
            self.kill()
            raise RuntimeError(
                f"rdmakv serve did not become ready: {line!r}\n{self.stderr_path.read_text()}"
            )
        self.ready_line = line[0].strip()
        self.port = int(self.ready_line.split("ready on ", 1)[1].split()[0].rsplit(":", 1)[1])

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the node dies without any cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def terminate(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(STOP_TIMEOUT_S)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    nodes: list[NodeProcess] = []

    def make(**options: Any) -> NodeProcess:
        n = NodeProcess(tmp_path, options)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.kill()
        if n.proc is not None and n.proc.stdout is not None:
            n.proc.stdout.close()


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory()


@pytest.fixture
def client_slab() -> Iterator[Slab]:
    """A 16 MiB client slab of 64 KiB blocks (the default node block size)."""
    slab = Slab(16 * 1024 * 1024, 64 * 1024, lock=False)
    yield slab
    slab.close()
