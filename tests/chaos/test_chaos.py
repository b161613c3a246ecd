"""Chaos cases (issue 13 part 4): node and wire faults against real nodes.

Each case runs through every :class:`~conftest.Mode`: a KVCacheManager on one
node, on a cluster ``a,b,c`` with replication 1 and 2, and a ClusterClient
directly with replication 1 and 2. The nodes are real ``rdmakv serve``
processes on 127.0.0.1; wire faults go through :class:`WireProxy`, a real TCP
forwarder in front of each node.

Every case asserts, whatever the fault:

* **0 wrong values**: every block a read returns is compared byte for byte
  with what was put for its key (a miss is fine, a wrong block never is);
* **misses, not exceptions**: no exception escapes the manager's
  put/acquire/exists/hit_bitmap or the cluster client's put/get/exists (any
  exception fails the case, and so does one in a background thread);
* **service restored**: once the fault is over, a fresh put/get round hits
  every block.

Where the outcome is determined, a case also checks availability: while a
node is dead or stopped, every block some live replica holds still hits
(so with replication 2 every block hits).

No timing assertions: each client wait is bounded by a 1 s client timeout,
and the pytest timeout catches a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from conftest import NodeProcess

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmakvError

from .conftest import NODE_OPTS, ChaosEnv
from .targets import BLOCK_BYTES, CLIENT_TIMEOUT_S, ReadResult, Target
from .wire_proxy import Direction, Kind, WireProxy

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.timeout(150),
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
]

WAIT_S = 40.0
"""How long service may take to come back (cluster backoff included)."""
MID_TRANSFER = 40_000
"""A stream offset inside block data: past the first control frames of a batch,
before the end of the victim's share of it."""
KILL_WAIT_S = 15.0
"""How long a SIGKILLed node may take to be gone (its threads exit one by one)."""
FLIP_GAP = 64 * 1024
"""About one flipped bit per this many bytes (a few per batch)."""
FLIP_ROUNDS = 4

EnvFactory = Callable[..., ChaosEnv]


# -- checks ----------------------------------------------------------------------------------
def assert_no_wrong(r: ReadResult, what: str, proxies: Sequence[WireProxy] = ()) -> None:
    flips = [f for p in proxies for f in p.flips]
    assert not r.wrong, (
        f"{what}: {len(r.wrong)} of {r.hits} blocks read back differ from what was put "
        f"({r.wrong[:4]}...); {len(flips)} bits flipped on the wire, first {flips[:4]}"
    )


def wait_until(
    pred: Callable[[], bool], what: str, last: Sequence[object] = (), limit: float = WAIT_S
) -> None:
    """Poll ``pred`` until True; on giving up, the message shows ``last`` (the
    caller's record of the latest attempt)."""
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {limit:.0f}s waiting for {what}; last: {last}")
        time.sleep(0.1)


def assert_restored(t: Target, proxies: Sequence[WireProxy] = ()) -> None:
    """A fresh batch is put and read back whole, and every cluster client uses
    every node again (with replication 2 a round is whole with one node still
    backing off: that is not restored redundancy). Retried until the clients'
    backoff lets them; no wrong block on the way."""
    last: list[ReadResult] = []

    def fresh_round() -> bool:
        b = t.new_batch()
        t.write(b)
        r = t.read(b)
        assert_no_wrong(r, "fresh round after the fault", proxies)
        last[:] = [r]
        return r.complete and t.all_up()

    wait_until(fresh_round, f"service to be restored ({t.name})", last)


def baseline(t: Target) -> object:
    """A batch written with no fault and read back whole (the case's precondition)."""
    b = t.new_batch()
    t.write(b)
    r = t.read(b)
    assert_no_wrong(r, "baseline")
    assert r.complete, f"baseline read {r.hits} of {r.total} blocks"
    return b


# -- kill -9 -----------------------------------------------------------------------------------
def test_kill9_between_batches(chaos_env: EnvFactory) -> None:
    env = chaos_env(wired=False)
    t = env.target
    b0 = baseline(t)
    env.victim.kill()
    dead = {env.victim_id}

    r = t.read(b0)
    assert_no_wrong(r, "read after kill -9")
    assert r.hits >= t.live_hits(b0, dead), f"blocks of live nodes missed: {r}"
    b1 = t.new_batch()
    t.write(b1)  # the dead node's share is dropped, never raised
    r = t.read(b1)
    assert_no_wrong(r, "write+read with a node dead")
    assert r.hits >= t.live_hits(b1, dead), f"blocks of live nodes missed: {r}"

    env.victim.start()  # same port, empty store
    assert_restored(t)


@pytest.mark.parametrize("op", ["get", "put"])
def test_kill9_mid_batch(chaos_env: EnvFactory, op: str) -> None:
    """The node is SIGKILLed when MID_TRANSFER bytes of the batch have passed
    (its proxy fires the kill before forwarding the next byte)."""
    env = chaos_env(wired=True)
    t, victim = env.target, env.victim
    dead = {env.victim_id}
    d = Direction.DOWN if op == "get" else Direction.UP
    b = baseline(t) if op == "get" else t.new_batch()  # armed after the baseline's bytes
    env.victim_proxy.call_at(d, MID_TRANSFER, victim.kill)
    if op == "put":
        t.write(b)
    r = t.read(b)
    fired = (Kind.CALL, d) in env.victim_proxy.fired
    assert fired, "the kill did not fire: the batch never reached the offset"
    # The proxy's thread may still be inside kill(), and a process is gone
    # only once its last thread is.
    wait_until(lambda: not victim.alive(), "the node to exit after SIGKILL", limit=KILL_WAIT_S)
    assert_no_wrong(r, f"{op} with the node killed mid-batch")
    assert r.hits >= t.live_hits(b, dead), f"blocks of live nodes missed: {r}"

    victim.start()
    assert_restored(t)


# -- SIGSTOP / SIGCONT ---------------------------------------------------------------------------
def test_sigstop_then_sigcont(chaos_env: EnvFactory) -> None:
    env = chaos_env(wired=False)
    t = env.target
    b0 = baseline(t)
    dead = {env.victim_id}
    env.victim.pause()
    try:
        r = t.read(b0)  # the stopped node's share waits one client timeout, then misses
        assert_no_wrong(r, "read with a node stopped")
        assert r.hits >= t.live_hits(b0, dead), f"blocks of live nodes missed: {r}"
        b1 = t.new_batch()
        t.write(b1)
        r = t.read(b1)
        assert_no_wrong(r, "write+read with a node stopped")
        assert r.hits >= t.live_hits(b1, dead), f"blocks of live nodes missed: {r}"
    finally:
        env.victim.resume()

    results: list[ReadResult] = []

    def old_batch_back() -> bool:
        results[:] = [t.read(b0)]
        assert_no_wrong(results[0], "read after SIGCONT")
        return results[0].complete

    wait_until(old_batch_back, "the resumed node to serve its blocks again", results)
    assert_restored(t)


# -- connection drops / stalls mid-transfer ------------------------------------------------------
WIRE_FAULTS = [
    # (kind, stream offset from arming, every connection)
    ("cut", 30, False),  # inside the first control frame
    ("cut", 700, False),  # inside a key list / reply table
    ("cut", 2_500, False),
    ("cut", MID_TRANSFER, False),  # inside block data
    ("cut", MID_TRANSFER, True),  # every connection, the client's retry included
    ("stall", MID_TRANSFER, False),  # the connection goes silent mid-transfer
]


def arm(proxy: WireProxy, d: Direction, kind: str, nbytes: int, every: bool) -> None:
    if kind == "cut":
        proxy.cut_after(d, nbytes, every=every)
    else:
        proxy.stall_after(d, nbytes)


def test_connection_drop_mid_put(chaos_env: EnvFactory) -> None:
    env = chaos_env(wired=True)
    t, proxy = env.target, env.victim_proxy
    for kind, nbytes, every in WIRE_FAULTS:
        what = f"{kind} after {nbytes} client->node bytes{' (every connection)' if every else ''}"
        fired = len(proxy.fired)
        arm(proxy, Direction.UP, kind, nbytes, every)
        b = t.new_batch()
        t.write(b)
        proxy.clear()
        assert len(proxy.fired) > fired, f"{what}: the fault never fired"
        r = t.read(b)  # whatever was stored must be right
        assert_no_wrong(r, f"read after a put with {what}")
        assert_restored(t)


def test_connection_drop_mid_get(chaos_env: EnvFactory) -> None:
    env = chaos_env(wired=True)
    t, proxy = env.target, env.victim_proxy
    b = baseline(t)
    for kind, nbytes, every in WIRE_FAULTS:
        what = f"{kind} after {nbytes} node->client bytes{' (every connection)' if every else ''}"
        fired = len(proxy.fired)
        arm(proxy, Direction.DOWN, kind, nbytes, every)
        r = t.read(b)
        proxy.clear()
        assert len(proxy.fired) > fired, f"{what}: the fault never fired"
        assert_no_wrong(r, f"get with {what}")

        # only a connection broke: the nodes still hold every block, and the
        # clients use the victim again (before the next fault is aimed at it)
        def whole(what: str = what) -> bool:
            r = t.read(b)
            assert_no_wrong(r, f"read after {what}")
            return r.complete and t.all_up()

        wait_until(whole, f"every block to hit again after {what}")
    assert_restored(t)


# -- corrupted bytes on the wire -------------------------------------------------------------------
@pytest.mark.parametrize(
    "direction", [Direction.DOWN, Direction.UP], ids=["node-to-client", "client-to-node"]
)
def test_corrupted_bytes_on_the_wire(chaos_env: EnvFactory, direction: Direction) -> None:
    """Random single-bit flips (about one per FLIP_GAP bytes, seeded) in one
    direction of every node's stream, block data included. A flipped block
    must be a miss, never returned as a hit; nothing may raise."""
    env = chaos_env(wired=True)
    t = env.target
    batches = [baseline(t)] if direction is Direction.DOWN else []
    for i, p in enumerate(env.proxies):
        p.flip_bits(direction, mean_gap=FLIP_GAP, seed=1000 * i + 7)
    try:
        for _ in range(FLIP_ROUNDS):
            if direction is Direction.UP:
                batches.append(t.new_batch())
                t.write(batches[-1])  # corrupted on the way to the node
            assert_no_wrong(
                t.read(batches[-1]), f"read with bits flipped {direction.value}", env.proxies
            )
    finally:
        for p in env.proxies:
            p.clear()
    assert sum(len(p.flips) for p in env.proxies) >= FLIP_ROUNDS, "too few flips to mean much"
    for b in batches:  # what the nodes stored, read over a clean wire
        assert_no_wrong(
            t.read(b),
            f"clean read of blocks written with bits flipped {direction.value}",
            env.proxies,
        )
    assert_restored(t, env.proxies)


FLIP_OFFSET = 5_000
"""Stream offset of the one flipped bit: past the GET answer's / PUT request's
header and entries (under 200 bytes), inside the 16 KiB of block data that follows."""


@pytest.mark.parametrize(
    "direction", [Direction.DOWN, Direction.UP], ids=["node-to-client", "client-to-node"]
)
def test_one_flipped_bit_in_block_data_is_never_a_hit(
    node_factory: Callable[..., NodeProcess], direction: Direction
) -> None:
    """The smallest corruption: one bit of one block's data, one KVClient. The
    get may miss or raise (KVClient's contract: callers catch RdmakvError), but
    a hit must carry the bytes that were put."""
    node = node_factory(**NODE_OPTS)
    with (
        Slab(4 * BLOCK_BYTES, BLOCK_BYTES, lock=False) as slab,
        WireProxy(node.address) as proxy,
        KVClient(proxy.host, proxy.port, slab, transport="tcp", timeout=CLIENT_TIMEOUT_S) as c,
    ):
        src, dst = slab.alloc(), slab.alloc()
        slab.numpy(src)[:] = np.arange(BLOCK_BYTES, dtype=np.uint32).astype(np.uint8)
        digest = bytes(range(16))
        if direction is Direction.UP:
            proxy.flip_at(direction, FLIP_OFFSET, bit=3)
        assert c.put([b"flip-key"], [src], BLOCK_BYTES, [digest]) == [True]
        if direction is Direction.DOWN:
            proxy.flip_at(direction, FLIP_OFFSET, bit=3)
        try:
            got = c.get_sizes([b"flip-key"], [dst], [digest])
        except RdmakvError:
            got = [None]
        assert len(proxy.flips) == 1, "the bit was not flipped"
        if got[0] is not None:
            diff = np.flatnonzero(slab.numpy(src) != slab.numpy(dst)).tolist()
            assert not diff, (
                f"a hit of {got[0]} bytes differs from what was put at block offsets {diff} "
                f"(flipped {proxy.flips[0]})"
            )
        # service restored: a fresh key round-trips over the clean wire
        assert c.put([b"fresh-key"], [src], BLOCK_BYTES, [digest]) == [True]
        assert c.get_sizes([b"fresh-key"], [dst], [digest]) == [BLOCK_BYTES]
        assert bytes(slab.view(src)) == bytes(slab.view(dst))


# -- restart on the same port ------------------------------------------------------------------
def test_node_restart_same_port(chaos_env: EnvFactory) -> None:
    env = chaos_env(wired=False)
    t = env.target
    b0 = baseline(t)
    env.victim.kill()
    env.victim.start()  # a new, empty node on the same port; the clients were idle

    r = t.read(b0)
    assert_no_wrong(r, "read after the restart")
    assert r.hits >= t.live_hits(b0, {env.victim_id}), f"blocks of live nodes missed: {r}"
    assert_restored(t)

    # the old blocks hit again once an engine puts them again
    results: list[ReadResult] = []

    def reput() -> bool:
        t.rewrite(b0)
        results[:] = [t.read(b0)]
        assert_no_wrong(results[0], "read after re-put")
        return results[0].complete

    wait_until(reput, "re-put blocks to hit", results)
