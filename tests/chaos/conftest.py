"""Fixtures of the chaos suite: real nodes, optional fault proxies, one client API.

``chaos_env(wired=...)`` starts the nodes of the test's :class:`Mode` (real
``rdmakv serve`` processes from ``node_factory``), optionally puts a
:class:`~wire_proxy.WireProxy` in front of each (``wired=True``: the client
talks to the proxies, so the case can cut, stall or corrupt the byte stream),
and builds the :class:`~targets.Target` on top. Everything is torn down at the
end of the test, clients first.

The ``chaos`` marker lets CI run this suite as its own step
(``pytest -m chaos tests/chaos``) and leave it out of the quick one
(``-m "not chaos"``).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import NodeProcess

from .targets import ClusterTarget, ManagerTarget, Target
from .wire_proxy import WireProxy

NODE_OPTS = {"pool_size": "32MiB", "block_size": "16KiB", "transport": "tcp"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "chaos: fault injection against real nodes (kill -9, SIGSTOP, connection drops, "
        "corrupted bytes, restarts); run as a separate CI step with -m chaos",
    )


@dataclasses.dataclass(frozen=True)
class Mode:
    """Which client API the case drives, over how many nodes, with what replication."""

    api: str  # "manager" (KVCacheManager) or "cluster" (ClusterClient directly)
    nodes: int
    replication: int

    @property
    def id(self) -> str:
        return f"{self.api}-{self.nodes}node{'s' if self.nodes > 1 else ''}-r{self.replication}"


MODES = [
    Mode("manager", 1, 1),
    Mode("manager", 3, 1),
    Mode("manager", 3, 2),
    Mode("cluster", 3, 1),
    Mode("cluster", 3, 2),
]


@dataclasses.dataclass
class ChaosEnv:
    """The nodes, their proxies (empty unless wired) and the target of one case.

    ``victim`` is the node the case harms (the only one, or the second of
    three); ``victim_id`` is how the client names it (its proxy when wired).
    """

    mode: Mode
    nodes: list[NodeProcess]
    proxies: list[WireProxy]
    target: Target

    @property
    def victim(self) -> NodeProcess:
        return self.nodes[len(self.nodes) // 2]

    @property
    def victim_proxy(self) -> WireProxy:
        return self.proxies[len(self.nodes) // 2]

    @property
    def victim_id(self) -> str:
        return self.victim_proxy.endpoint if self.proxies else self.victim.endpoint


@pytest.fixture(params=MODES, ids=lambda m: m.id)
def mode(request: pytest.FixtureRequest) -> Mode:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def chaos_env(
    mode: Mode, node_factory: Callable[..., NodeProcess], request: pytest.FixtureRequest
) -> Iterator[Callable[..., ChaosEnv]]:
    made: list[ChaosEnv] = []
    proxies: list[WireProxy] = []
    seed = zlib.crc32(request.node.nodeid.encode())  # distinct data per case, reproducible

    def make(*, wired: bool) -> ChaosEnv:
        with ThreadPoolExecutor(mode.nodes) as ex:
            nodes = list(ex.map(lambda _: node_factory(**NODE_OPTS), range(mode.nodes)))
        mine = [WireProxy(n.address) for n in nodes] if wired else []
        proxies.extend(mine)
        spec = ",".join(p.endpoint for p in mine) if wired else ",".join(n.endpoint for n in nodes)
        kind = ManagerTarget if mode.api == "manager" else ClusterTarget
        env = ChaosEnv(mode, nodes, mine, kind(spec, mode.replication, seed))
        made.append(env)
        return env

    yield make
    try:
        for env in made:
            env.target.close()
    finally:
        for p in proxies:
            p.close()
