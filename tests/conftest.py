"""Shared fixtures: real ``rdmakv serve`` processes on 127.0.0.1.

``node_factory(**options)`` starts a node (``--port 0`` unless given: the node
picks a free port and reports it on its ready line, so parallel tests never
race for ports) and returns a :class:`NodeProcess`; every node a test started
is killed at teardown. ``node`` is one default node. Options map to CLI flags:
``pool_size="64MiB"`` -> ``--pool-size 64MiB``; ``token=b"..."`` writes a token
file and passes ``--token-file``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdmakv.node.process import LocalNodeProcess
from rdmakv.slab import Slab

DEFAULT_POOL = "32MiB"
DEFAULT_BLOCK = "64KiB"


class NodeProcess(LocalNodeProcess):
    """A test node: small defaults, stderr kept in the test's tmp dir, no mlock.

    ``token=b"..."`` becomes a token file passed as ``--token-file``; other
    options map to CLI flags (``pool_size="64MiB"`` -> ``--pool-size 64MiB``).
    """

    def __init__(self, tmp: Path, options: dict[str, Any]) -> None:
        opts = {"pool_size": DEFAULT_POOL, "block_size": DEFAULT_BLOCK, **options}
        port = int(opts.pop("port", 0))
        token = opts.pop("token", None)
        if token is not None:
            path = tmp / f"token-{id(self)}"
            path.write_bytes(token)
            opts["token_file"] = str(path)
        super().__init__(
            {k: str(v) for k, v in opts.items()},
            port=port,
            stderr_path=tmp / f"node-{id(self)}.stderr",
            extra_args=["--no-lock"],
        )

    def stderr(self) -> str:
        assert self.stderr_path is not None
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
        n.close()


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory()


@pytest.fixture
def client_slab() -> Iterator[Slab]:
    """A 16 MiB client slab of 64 KiB blocks (the default node block size)."""
    slab = Slab(16 * 1024 * 1024, 64 * 1024, lock=False)
    yield slab
    slab.close()
