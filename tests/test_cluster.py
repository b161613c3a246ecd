"""ClusterClient over several real ``rdmakv serve`` processes (issue 10 items 1-3).

Placement, membership parsing and backoff are unit-tested; everything else
talks to real nodes on 127.0.0.1 (``node_factory``). The only fake is the DNS
resolver of the membership tests; the nodes it names are real processes on
distinct loopback addresses (127.0.0.2, ...) sharing one port, as the pods of
a headless Service would. No timing assertions: wall-clock bounds are generous
and only catch hangs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import NodeProcess

from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster import (
    ClusterClient,
    DnsMembership,
    NodeClient,
    NodeHealth,
    Rendezvous,
    StaticMembership,
    parse_members,
    weight,
)
from rdmakv.client.node_client import KVClient
from rdmakv.errors import AuthError, ConfigError, ConnectionLost
from rdmakv.node.process import LocalNodeProcess

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096
NODE_OPTS = {"block_size": "4KiB", "pool_size": "8MiB"}  # 2048 values per node
TIMEOUT = 1.0  # client timeout: short, so that faults resolve quickly
HANG_BOUND_S = 10 * TIMEOUT  # a call slower than this is a hang
WAIT_S = 20.0  # how long to wait for a node to come back
N_KEYS = 1000


# -- helpers -------------------------------------------------------------------------------
def make_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def fill(slab: Slab, handles: Sequence[int], seed: int) -> list[bytes]:
    """Distinct random bytes in each block; returns each block's digest."""
    rng = np.random.default_rng(seed)
    out = []
    for h in handles:
        slab.numpy(h)[:] = rng.integers(0, 256, slab.block_size, dtype=np.uint8)
        out.append(hashlib.blake2b(slab.view(h), digest_size=16).digest())
    return out


def clear(slab: Slab, handles: Sequence[int]) -> None:
    for h in handles:
        slab.numpy(h)[:] = 0


def wrong_values(
    slab: Slab, src: Sequence[int], dst: Sequence[int], got: Sequence[int | None]
) -> int:
    """Hits whose bytes differ from what was put."""
    return sum(
        1 for s, d, n in zip(src, dst, got, strict=True)
        if n is not None and bytes(slab.view(s)) != bytes(slab.view(d))
    )


def start_nodes(factory: Callable[..., NodeProcess], n: int, **opts: Any) -> list[NodeProcess]:
    """``n`` nodes started concurrently (each start is a Python process boot)."""
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda _: factory(**{**NODE_OPTS, **opts}), range(n)))


def wait_until(pred: Callable[[], bool], what: str, limit: float = WAIT_S) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def dead_endpoint(factory: Callable[..., NodeProcess]) -> str:
    """An address that refuses connections (a node that was there and died)."""
    node = factory(**NODE_OPTS)
    node.kill()
    return node.endpoint


@pytest.fixture
def slab() -> Iterator[Slab]:
    """8 MiB of 4 KiB blocks: 1000 source + 1000 destination blocks fit."""
    s = Slab(8 * 1024 * 1024, BLOCK, lock=False)
    yield s
    s.close()


class Data:
    """N_KEYS keys, each with its own source block of distinct bytes and a destination."""

    def __init__(self, slab: Slab, tag: str, seed: int) -> None:
        self.slab = slab
        self.keys = make_keys(tag, N_KEYS)
        self.src = slab.alloc_many(N_KEYS)
        self.dst = slab.alloc_many(N_KEYS)
        self.digests = fill(slab, self.src, seed)

    def put(self, c: NodeClient, idx: Sequence[int] | None = None) -> list[bool]:
        idx = range(N_KEYS) if idx is None else idx
        return c.put([self.keys[i] for i in idx], [self.src[i] for i in idx], BLOCK,
                     [self.digests[i] for i in idx])

    def get(self, c: NodeClient) -> tuple[set[int], int]:
        """(indexes that hit, number of wrong values) of one batched get of every key."""
        clear(self.slab, self.dst)
        got = c.get_sizes(self.keys, self.dst, self.digests)
        hits = {i for i, n in enumerate(got) if n is not None}
        assert all(got[i] == BLOCK for i in hits)
        return hits, wrong_values(self.slab, self.src, self.dst, got)


def owned_by(c: ClusterClient, keys: Sequence[bytes], node_id: str) -> set[int]:
    return {i for i, owners in enumerate(c.owners(keys)) if owners[0] == node_id}


# -- placement (unit) -------------------------------------------------------------------------
def test_vectorised_weights_match_the_scalar_reference() -> None:
    ids = [f"10.0.0.{i}:7480" for i in range(5)]
    ring = Rendezvous(ids)
    keys = [os.urandom(16) for _ in range(200)] + [b"short", b"x" * 40]  # odd lengths hashed
    w = ring.weights(keys)
    for i, k in enumerate(keys):
        for j, node in enumerate(ring.nodes):
            assert int(w[i, j]) == weight(node, k)
    ranks = ring.rank(keys, 3)
    for i, k in enumerate(keys):
        best = sorted(ring.nodes, key=lambda n: -weight(n, k))[:3]
        assert [ring.nodes[j] for j in ranks[i]] == best
    assert [o[0] for o in ring.owners(keys, 2)] == [ring.nodes[j] for j in ring.rank(keys)[:, 0]]


def test_placement_is_the_same_in_another_process() -> None:
    """Deterministic across processes: no hash(), no random seed (PYTHONHASHSEED varies)."""
    ids = ["a:1", "b:2", "c:3", "d:4"]
    keys = make_keys("xproc", 64)
    code = (
        "import hashlib;from rdmakv.client.cluster import Rendezvous;"
        "k=[hashlib.blake2b(f'xproc/{i}'.encode(),digest_size=16).digest() for i in range(64)];"
        "print(Rendezvous(['d:4','c:3','b:2','a:1']).rank(k,2).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == str(Rendezvous(ids).rank(keys, 2).tolist())


def test_keys_spread_evenly() -> None:
    """Keys from a seeded generator: with fresh random keys each run, 4000 keys
    left a node's count outside the 10% band about once in a thousand runs
    (3.7 standard deviations, four nodes), a failure of chance, not of the hash."""
    ring = Rendezvous([f"kv-{i}.kv:7480" for i in range(4)])
    rng = random.Random(20261128)
    for n, tolerance in ((4000, 0.10), (100_000, 0.03)):
        keys = [rng.randbytes(16) for _ in range(n)]
        counts = np.bincount(ring.rank(keys)[:, 0], minlength=4)
        assert np.all(np.abs(counts - n / 4) <= tolerance * n / 4), counts


@pytest.mark.parametrize("replicas", [1, 2])
def test_membership_change_moves_only_the_keys_of_the_node_that_came_or_went(
    replicas: int,
) -> None:
    four = [f"10.1.0.{i}:7480" for i in range(4)]
    five = [*four, "10.1.0.9:7480"]
    keys = [os.urandom(16) for _ in range(20_000)]
    before = Rendezvous(four).owners(keys, replicas)
    after = Rendezvous(five).owners(keys, replicas)
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    # every changed placement now includes the newcomer; the rest keep their order
    for i in moved:
        assert "10.1.0.9:7480" in after[i]
        assert [n for n in after[i] if n != "10.1.0.9:7480"] == list(before[i][: replicas - 1])
    assert abs(len(moved) / len(keys) - replicas / 5) < 0.02
    # and back 5 -> 4: only keys placed on the node that left change
    for a, b in zip(after, before, strict=True):
        assert a == b or "10.1.0.9:7480" in a


def test_node_health_backoff_doubles_to_the_cap() -> None:
    h = NodeHealth(0.5, 4.0)
    assert h.up and h.backoff_s() == 0
    assert h.failed(100.0, "refused") is True  # up -> down
    assert (h.backoff_s(), h.retry_at) == (0.5, 100.5)
    assert not h.probe_due(100.4) and h.probe_due(100.5)
    steps = []
    for _ in range(5):
        assert h.failed(200.0, "again") is False
        steps.append(h.backoff_s())
    assert steps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert h.succeeded() is True and h.up and h.succeeded() is False
    with pytest.raises(ConfigError):
        NodeHealth(2.0, 1.0)


# -- membership specs (unit) --------------------------------------------------------------------
def test_parse_members_accepts_the_documented_forms() -> None:
    one = parse_members("kv-0:7480")
    assert isinstance(one, StaticMembership) and one.resolve() == ("kv-0:7480",)
    many = parse_members(" b:2 , a:1,[::1]:7480 ")
    assert many.resolve() == ("[::1]:7480", "a:1", "b:2") and many.refresh_s is None
    assert parse_members(["x:1", "y:2"]).resolve() == ("x:1", "y:2")
    fake = lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", a[1]))]  # noqa: E731
    dns = parse_members("dns://kv.ns.svc.cluster.local:7480", resolve=fake, refresh_s=2.0)
    assert isinstance(dns, DnsMembership) and dns.refresh_s == 2.0
    assert dns.resolve() == ("10.0.0.7:7480",)
    assert dns.describe() == "dns://kv.ns.svc.cluster.local:7480"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty cluster spec"),
        ("kv-0", "has no port"),
        ("kv-0:http", "is not a number"),
        ("kv-0:0", "outside 1..65535"),
        ("kv-0:70000", "outside 1..65535"),
        (":7480", "has no host"),
        ("a:1,,b:2", "empty entry"),
        ("a:1,a:1", "listed more than once"),
        ("::1:7480", "IPv6 address in brackets"),
        ("[::1:7480", "unbalanced"),
        ("dns://kv", "needs a port"),
        ("dns://a:1,b:2", "not a list"),
        ("redis://kv:6379", "unknown scheme"),
        ("a:1,dns://kv:7480", "only allowed alone"),
        ("a b:1", "not a host name"),
    ],
)
def test_parse_members_rejects_bad_specs_clearly(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_members(spec)


def test_dns_membership_dedupes_and_reports_failures() -> None:
    answers: list[Any] = []

    def resolve(name: str, port: int, family: int, kind: int) -> list[Any]:
        assert (name, port, family, kind) == ("kv", 7480, socket.AF_INET, socket.SOCK_STREAM)
        return answers

    m = DnsMembership("kv", 7480, resolve=resolve)
    answers[:] = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 7480))
                  for ip in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]
    assert m.resolve() == ("10.0.0.1:7480", "10.0.0.2:7480")
    answers.clear()
    with pytest.raises(ConnectionLost, match="no addresses"):
        m.resolve()
    m2 = DnsMembership("kv", 7480, resolve=lambda *a: (_ for _ in ()).throw(
        socket.gaierror(-2, "Name or service not known")))
    with pytest.raises(ConnectionLost, match="cannot resolve cluster name 'kv'"):
        m2.resolve()
    with pytest.raises(ConfigError, match="refresh_s"):
        DnsMembership("kv", 7480, refresh_s=0)


# -- real nodes -------------------------------------------------------------------------------
def test_round_trip_over_four_nodes_bytes_verified_and_spread_even(
    node_factory: Callable[..., NodeProcess], slab: Slab
) -> None:
    nodes = start_nodes(node_factory, 4)
    data = Data(slab, "rt", seed=1)
    with ClusterClient([n.endpoint for n in nodes], slab, timeout=TIMEOUT) as c:
        assert isinstance(c, NodeClient) and c.transport_name == "tcp"
        assert data.put(c) == [True] * N_KEYS
        hits, wrong = data.get(c)
        assert hits == set(range(N_KEYS)) and wrong == 0
        assert c.get(data.keys[:3], data.dst[:3], data.digests[:3]) == [True] * 3
        # a digest that does not match is a miss, on whichever node the key lives
        assert c.get_sizes(data.keys[:2], data.dst[:2], [bytes(16)] * 2) == [None, None]
        # 4000 keys in all: every node holds about a quarter
        more = make_keys("rt-more", 3 * N_KEYS)
        handles = [data.src[i % N_KEYS] for i in range(len(more))]
        digests = [data.digests[i % N_KEYS] for i in range(len(more))]
        assert c.put(more, handles, BLOCK, digests) == [True] * len(more)
        st = c.stats()
        assert st["total"]["entries"] == 4 * N_KEYS
        assert st["total"]["bytes_stored"] == 4 * N_KEYS * BLOCK
        assert st["cluster"]["up"] == 4 and st["cluster"]["members"] == 4
        per_node = {n: s["entries"] for n, s in st["nodes"].items()}
        assert set(per_node) == {n.endpoint for n in nodes}
        assert all(abs(v - N_KEYS) <= 0.1 * N_KEYS for v in per_node.values()), per_node
        # each key is where the placement says, and only there
        for node in nodes:
            mine = owned_by(c, data.keys, node.endpoint)
            with KVClient(*node.address, None) as direct:
                assert direct.exists(data.keys) == [i in mine for i in range(N_KEYS)]
        assert c.exists([*data.keys[:5], b"absent-key-0000"]) == [True] * 5 + [False]
        assert c.delete(data.keys[:5]) == [True] * 5
        assert c.exists(data.keys[:6]) == [False] * 5 + [True]
        assert c.put([], [], BLOCK, []) == [] and c.get([], [], []) == []
        with pytest.raises(ConfigError):  # caller errors still raise, before anything is sent
            c.put(data.keys[:2], data.src[:1], BLOCK, data.digests[:2])
        with pytest.raises(ConfigError):
            c.get(data.keys[:1], data.dst[:1], [b"short"])
    with pytest.raises(ConfigError, match="closed"):
        c.exists(data.keys[:1])


def test_kill_9_mid_workload_misses_then_node_serves_again(
    node_factory: Callable[..., NodeProcess], slab: Slab
) -> None:
    nodes = start_nodes(node_factory, 4)
    data = Data(slab, "kill", seed=2)
    c = ClusterClient([n.endpoint for n in nodes], slab, timeout=TIMEOUT)
    assert data.put(c) == [True] * N_KEYS
    victim = nodes[1]
    lost = owned_by(c, data.keys, victim.endpoint)
    kept = set(range(N_KEYS)) - lost
    rounds: list[tuple[float, set[int], int]] = []  # (seconds, hits, wrong values)
    stop = threading.Event()
    failure: list[BaseException] = []

    def workload() -> None:
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                hits, wrong = data.get(c)
                rounds.append((time.monotonic() - t0, hits, wrong))
        except BaseException as e:
            failure.append(e)

    worker = threading.Thread(target=workload)
    worker.start()
    wait_until(lambda: len(rounds) >= 3, "gets to be flowing")
    victim.kill()
    killed_at = len(rounds)
    wait_until(lambda: len(rounds) >= killed_at + 5 or bool(failure), "gets after the kill")
    stop.set()
    worker.join(HANG_BOUND_S)
    assert not worker.is_alive() and not failure, failure
    assert all(wrong == 0 for _, _, wrong in rounds)
    assert all(seconds < HANG_BOUND_S for seconds, _, _ in rounds)
    assert all(kept <= hits for _, hits, _ in rounds)  # the other nodes never missed
    assert rounds[-1][1] == kept  # the dead node's keys are misses
    assert c.up_members == tuple(n.endpoint for n in sorted(nodes, key=lambda n: n.endpoint)
                                 if n is not victim)
    counters = c.counters
    assert counters["node_down_events"] == 1 and counters["gets_unavailable"] >= len(lost)
    st = c.stats()
    assert "error" in st["nodes"][victim.endpoint] and st["cluster"]["up"] == 3
    # puts to the dead node are dropped and counted, never raised
    assert data.put(c) == [i in kept for i in range(N_KEYS)]
    assert c.counters["puts_dropped"] >= len(lost)

    victim.start()  # same port, empty store
    lost_idx = sorted(lost)
    wait_until(lambda: all(data.put(c, lost_idx)), "the restarted node to take puts")
    hits, wrong = data.get(c)
    assert hits == set(range(N_KEYS)) and wrong == 0
    assert c.counters["node_up_events"] == 1 and len(c.up_members) == 4
    c.close()


def test_sigstop_one_node_the_others_keep_serving(
    node_factory: Callable[..., NodeProcess], slab: Slab
) -> None:
    nodes = start_nodes(node_factory, 4)
    data = Data(slab, "stop", seed=3)
    with ClusterClient([n.endpoint for n in nodes], slab, timeout=TIMEOUT) as c:
        assert data.put(c) == [True] * N_KEYS
        stalled = nodes[2]
        kept = set(range(N_KEYS)) - owned_by(c, data.keys, stalled.endpoint)
        stalled.pause()
        try:
            for _ in range(3):
                t0 = time.monotonic()
                hits, wrong = data.get(c)
                assert time.monotonic() - t0 < HANG_BOUND_S
                assert hits == kept and wrong == 0
            t0 = time.monotonic()
            assert c.exists(data.keys) == [i in kept for i in range(N_KEYS)]
            assert time.monotonic() - t0 < HANG_BOUND_S
        finally:
            stalled.resume()
        wait_until(lambda: data.get(c) == (set(range(N_KEYS)), 0), "the resumed node to serve")
        assert c.counters["node_down_events"] >= 1 and c.counters["node_up_events"] >= 1


def test_replication_2_every_key_hits_with_one_node_dead(
    node_factory: Callable[..., NodeProcess], slab: Slab
) -> None:
    nodes = start_nodes(node_factory, 4)
    data = Data(slab, "r2", seed=4)
    with ClusterClient([n.endpoint for n in nodes], slab, timeout=TIMEOUT, replication=2) as c:
        half = list(range(N_KEYS // 2))
        assert data.put(c, half) == [True] * len(half)
        assert c.stats()["total"]["entries"] == 2 * len(half)  # two copies of each
        assert all(len(set(o)) == 2 for o in c.owners(data.keys))
        victim = nodes[0]
        victim.kill()
        hits, wrong = data.get(c)  # the first get finds the node dead mid-call
        assert hits == set(half) and wrong == 0
        assert c.counters["replica_retries"] > 0
        hits, wrong = data.get(c)  # later gets skip it
        assert hits == set(half) and wrong == 0
        assert c.exists(data.keys) == [i in set(half) for i in range(N_KEYS)]
        # puts with a replica down still store the key once; the other copy is counted dropped
        rest = list(range(N_KEYS // 2, N_KEYS))
        assert data.put(c, rest) == [True] * len(rest)
        assert c.counters["puts_dropped"] == sum(
            1 for o in c.owners([data.keys[i] for i in rest]) if victim.endpoint in o
        )
        hits, wrong = data.get(c)
        assert hits == set(range(N_KEYS)) and wrong == 0


def test_construction_skips_a_dead_node_but_not_all(
    node_factory: Callable[..., NodeProcess], slab: Slab, caplog: pytest.LogCaptureFixture
) -> None:
    alive = node_factory(**NODE_OPTS)
    dead = dead_endpoint(node_factory)
    data = Data(slab, "ctor", seed=5)
    with caplog.at_level(logging.WARNING, logger="rdmakv.client.cluster"):
        c = ClusterClient(f"{alive.endpoint},{dead}", slab, timeout=TIMEOUT)
    assert any(dead in r.getMessage() and "unreachable" in r.getMessage() for r in caplog.records)
    assert c.members == tuple(sorted([alive.endpoint, dead]))
    assert c.up_members == (alive.endpoint,)
    on_alive = owned_by(c, data.keys, alive.endpoint)
    assert 0 < len(on_alive) < N_KEYS
    assert data.put(c) == [i in on_alive for i in range(N_KEYS)]
    assert c.counters["puts_dropped"] == N_KEYS - len(on_alive)
    assert data.get(c) == (on_alive, 0)
    assert c.stats()["nodes"][dead]["error"].startswith("down")
    c.close()

    other_dead = dead_endpoint(node_factory)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost) as info:
        ClusterClient([dead, other_dead], slab, timeout=TIMEOUT)
    assert dead in str(info.value) and other_dead in str(info.value)
    assert time.monotonic() - t0 < HANG_BOUND_S  # connects ran concurrently, each bounded


def test_wrong_token_everywhere_is_an_auth_error(
    node_factory: Callable[..., NodeProcess], slab: Slab
) -> None:
    nodes = [node_factory(**NODE_OPTS, token=b"s3cret") for _ in range(2)]
    with pytest.raises(AuthError):
        ClusterClient([n.endpoint for n in nodes], slab, token=b"wrong", timeout=TIMEOUT)
    with ClusterClient([n.endpoint for n in nodes], slab, token=b"s3cret", timeout=TIMEOUT) as c:
        assert len(c.up_members) == 2


# -- DNS membership over real nodes ---------------------------------------------------------------
class FakeDns:
    """A resolver whose answer the test changes: the A records of one name."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.addresses: list[str] = []
        self.calls = 0

    def __call__(self, name: str, port: int, family: int, kind: int) -> list[Any]:
        assert (name, port) == ("kv.test.svc", self.port)
        self.calls += 1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in self.addresses]


@pytest.fixture
def loopback_nodes(tmp_path: Path) -> Iterator[list[LocalNodeProcess]]:
    """Five nodes on 127.0.0.2..6, all on one port (like pods behind one Service)."""
    first = LocalNodeProcess(NODE_OPTS, host="127.0.0.2", stderr_path=tmp_path / "n2.stderr",
                             extra_args=["--no-lock"])
    nodes = [first]
    try:
        with ThreadPoolExecutor(4) as ex:
            nodes += ex.map(
                lambda i: LocalNodeProcess(NODE_OPTS, host=f"127.0.0.{i}", port=first.port,
                                           stderr_path=tmp_path / f"n{i}.stderr",
                                           extra_args=["--no-lock"]),
                range(3, 7),
            )
        yield nodes
    finally:
        for n in nodes:
            n.kill()
            n.close()


def test_dns_membership_4_to_5_only_moved_keys_miss(
    loopback_nodes: list[LocalNodeProcess], slab: Slab
) -> None:
    port = loopback_nodes[0].port
    dns = FakeDns(port)
    dns.addresses = [n.host for n in loopback_nodes[:4]]
    members = DnsMembership("kv.test.svc", port, resolve=dns, refresh_s=0.1)
    data = Data(slab, "dns", seed=6)
    with ClusterClient(members, slab, timeout=TIMEOUT) as c:
        assert c.members == tuple(n.endpoint for n in loopback_nodes[:4])
        assert data.put(c) == [True] * N_KEYS
        before = c.owners(data.keys)

        newcomer = loopback_nodes[4]
        dns.addresses.append(newcomer.host)  # a pod joins; the client notices on its own
        wait_until(lambda: c.exists([]) == [] and len(c.members) == 5, "the 5th member")
        after = c.owners(data.keys)
        moved = {i for i in range(N_KEYS) if before[i] != after[i]}
        assert all(after[i] == (newcomer.endpoint,) for i in moved)
        assert 0.15 < len(moved) / N_KEYS < 0.25  # ideal 1/5
        hits, wrong = data.get(c)
        assert hits == set(range(N_KEYS)) - moved and wrong == 0  # only moved keys miss
        assert data.put(c, sorted(moved)) == [True] * len(moved)
        assert data.get(c) == (set(range(N_KEYS)), 0)
        assert c.counters["membership_changes"] == 1

        leaving = loopback_nodes[0]  # 5 -> 4: a pod goes away
        dns.addresses.remove(leaving.host)
        assert c.refresh() is True and leaving.endpoint not in c.members
        gone = {i for i in range(N_KEYS) if after[i] == (leaving.endpoint,)}
        assert data.get(c) == (set(range(N_KEYS)) - gone, 0)

        dns.addresses.clear()  # a failed re-resolution keeps the members
        calls = dns.calls
        wait_until(lambda: c.exists([]) == [] and dns.calls > calls + 1, "re-resolutions")
        assert len(c.members) == 4 and c.counters["membership_errors"] >= 1
