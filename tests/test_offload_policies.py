"""Offload policies: each mode's decisions, reuse's ghost, hints and byte budget, in L1."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.blocks.keys import KEY_BYTES
from rdmakv.blocks.slab import Slab
from rdmakv.engine.l1 import (
    OFFLOAD_MODES,
    AllOffload,
    ColdOffload,
    HotOffload,
    L1Cache,
    NoOffload,
    OffloadMode,
    OffloadQueue,
    ReuseOffload,
    make_offload_policy,
)
from rdmakv.engine.l1.offload_policies import HINTED, OPEN, PROVEN, SeenFilter
from rdmakv.errors import ConfigError, MemoryLockWarning

BS = 64


def key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


def hashed_key(i: int) -> bytes:
    """A key like the real ones: uniform bytes (reuse splits the edge depth by them)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=KEY_BYTES).digest()


def digest(k: bytes) -> bytes:
    return hashlib.blake2b(k, digest_size=16).digest()


@pytest.fixture
def slab() -> Iterator[Slab]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryLockWarning)
        s = Slab(32 * BS, BS)
    yield s
    s.close()


# -- the simple modes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "insert", "hot", "evict"),
    [
        (NoOffload(), False, False, False),
        (AllOffload(), True, False, False),
        (HotOffload(), False, True, False),
        (ColdOffload(), False, False, True),
    ],
)
def test_simple_modes_answer_at_one_moment_each(
    policy: NoOffload, insert: bool, hot: bool, evict: bool
) -> None:
    for keep in (None, True, False):  # the simple modes ignore hints
        assert policy.on_insert(key(1), 3, keep) is insert
        assert policy.on_hot(key(1), 3, keep) is hot
        assert policy.on_evict(key(1), 3, keep) is evict
    assert policy.needs_queue is (policy.name != "none")


def test_make_offload_policy_parses_names_and_refuses_bad_input() -> None:
    assert OFFLOAD_MODES == ("none", "all", "hot", "cold", "reuse")
    assert isinstance(make_offload_policy(" Reuse ", 100), ReuseOffload)
    assert isinstance(make_offload_policy(OffloadMode.COLD, 100), ColdOffload)
    p = make_offload_policy("reuse", 100, budget=0.25)
    assert isinstance(p, ReuseOffload) and p.budget == 0.25
    mine = HotOffload()
    assert make_offload_policy(mine, 100) is mine  # a policy object is used as is
    with pytest.raises(ConfigError, match="unknown offload mode 'warm'; expected one of"):
        make_offload_policy("warm", 100)
    with pytest.raises(ConfigError, match="applies only to offload mode 'reuse', not 'all'"):
        make_offload_policy("all", 100, budget=0.5)
    with pytest.raises(ConfigError, match="not a policy object"):
        make_offload_policy(mine, 100, budget=0.5)


@pytest.mark.parametrize("budget", [0, 0.0, -0.5, 1.5, math.nan, True, "0.5", None])
def test_reuse_budget_must_be_a_share(budget: object) -> None:
    with pytest.raises(ConfigError, match="offload budget must be"):
        ReuseOffload(100, budget)  # type: ignore[arg-type]


def test_reuse_other_knobs_are_checked() -> None:
    with pytest.raises(ConfigError, match="capacity_blocks must be positive"):
        ReuseOffload(0)
    with pytest.raises(ConfigError, match="ghost_factor must be >= 0"):
        ReuseOffload(10, ghost_factor=-1)
    with pytest.raises(ConfigError, match="window must be a positive number"):
        ReuseOffload(10, window=0)


# -- reuse -----------------------------------------------------------------------------


def only_proven(p: ReuseOffload, depth_limit: int = 0) -> ReuseOffload:
    """Set the limit to send hinted and proven blocks, and open ones shallower than
    ``depth_limit``, none at it."""
    p.limit_class, p.depth_limit, p.edge_share = OPEN, depth_limit, 0.0
    return p


def test_reuse_hints_win_over_the_budget() -> None:
    p = only_proven(ReuseOffload(10, 0.5, window=4))  # the budget rule sends nothing
    assert p.on_insert(key(1), 50, True)
    assert not p.on_insert(key(2), 0, False)
    assert not p.on_insert(key(3), 0, None)
    assert p.offered_hint == 1 and p.offered_prefix == 0


def test_reuse_ghost_sends_a_block_computed_again_after_eviction_unsent() -> None:
    p = only_proven(ReuseOffload(10, 0.5))
    assert not p.on_insert(key(1), 5, None)
    assert not p.on_evict(key(1), 5, None)  # never sends at eviction
    assert p.in_ghost(key(1))
    # Computed again: its reuse is proven, and a hint saying otherwise loses.
    assert p.on_insert(key(1), 5, False)
    assert p.offered_ghost == 1 and not p.in_ghost(key(1))
    assert not p.on_insert(key(1), 5, None)  # the ghost entry was used up


def test_reuse_hot_blocks_are_sent_while_proven_reuse_fits() -> None:
    p = ReuseOffload(10, 0.1)
    assert p.on_hot(key(9), 3, None) and p.offered_hot == 1
    p.limit_class, p.depth_limit, p.edge_share = PROVEN, 2, 0.0
    assert p.on_hot(key(10), 1, None) and not p.on_hot(key(11), 2, None)
    assert p.on_hot(key(12), 7, True)  # hinted: a better class than the limit


@settings(max_examples=100, deadline=None)
@given(evictions=st.lists(st.integers(0, 200), max_size=300), capacity=st.integers(1, 20))
def test_reuse_ghost_is_bounded(evictions: list[int], capacity: int) -> None:
    p = ReuseOffload(capacity, ghost_factor=2.0)
    for i in evictions:
        p.on_evict(key(i), 0, None)
        assert p.ghost_size <= 2 * capacity
    if evictions:  # FIFO: the last eviction is always remembered
        assert p.in_ghost(key(evictions[-1]))


def test_reuse_depth_limit_spends_the_budget_and_carries_what_was_not_spent() -> None:
    p = ReuseOffload(100, 0.5, window=10)
    # Nothing measured yet: the budget's share of first blocks, nothing deeper.
    assert (p.depth_limit, p.edge_share) == (0, 0.5)
    for d in range(1, 11):
        assert not p.on_insert(key(d), d, None)
    # The 10th insert closed the window: nothing of its budget (5) was spent, so
    # the next may spend 10, which buys every depth seen (1..10, one each).
    assert p.depth_limit == math.inf
    assert all(p.on_insert(key(20 + d), d, None) for d in range(1, 11))
    # That window spent its 5 and the 5 carried: the debt is 0. Decayed, the two
    # windows weigh 15 blocks, budget 7.5, and depths 1..10 weigh 1.5 each:
    # depths 1..5 fit, none at 6.
    assert (p.depth_limit, p.edge_share) == (6, 0.0)
    assert p.on_insert(key(101), 5, None)
    assert not p.on_insert(key(102), 6, None)


def test_reuse_splits_the_edge_depth_by_key() -> None:
    p = ReuseOffload(100, 0.5, window=8)
    for i in range(8):
        p.on_insert(hashed_key(i), 0, None)  # every chain is one block long
    assert p.depth_limit == 0 and 0.0 < p.edge_share < 1.0
    sent = sum(p.on_insert(hashed_key(100 + i), 0, None) for i in range(400))
    assert 120 < sent < 280  # about half, by key: never all-or-nothing


def test_reuse_forced_sends_come_out_of_the_budget() -> None:
    p = ReuseOffload(100, 0.5, window=10)
    for d in range(6):
        p.on_insert(key(d), d, None)
    for i in range(4):
        p.on_hot(key(50 + i), 0, None)  # 4 proven reuses
    for i in range(4):
        p.on_insert(key(60 + i), 0, True)  # and 4 hinted blocks: 10 inserts
    # Budget 5 of 10 computed; sent: 4 proven, 4 hinted (and key(0), under the
    # first guess): 4 over. What is left (1) buys a quarter of the 4 hinted
    # blocks at depth 0, by key; nothing proven, nothing by depth alone.
    assert (p.limit_class, p.depth_limit, p.edge_share) == (HINTED, 0, 0.25)
    assert not p.on_insert(key(99), 0, None)
    assert not p.on_hot(key(98), 0, None)


def test_reuse_rations_hints_and_proven_reuse_by_depth_beyond_the_budget() -> None:
    """Where nearly everything is proven (agent loops), the budget still holds."""
    p = ReuseOffload(100, 0.25, window=40)
    for d in range(40):
        p.on_insert(key(d), d, None)
        p.on_evict(key(d), d, None)
    assert p.limit_class == OPEN
    # The same chain, computed again: every block proven, sent while the limit
    # (set for open blocks) allows; the recomputations add nothing to all's base.
    sent = [p.on_insert(key(d), d, None) for d in range(40)]
    assert sent == [True] * 40
    # 40 sent for a base that did not grow: nothing goes, hints included, until
    # that debt is paid.
    assert (p.limit_class, p.depth_limit, p.edge_share) == (HINTED, 0, 0.0)
    for d in range(40):
        p.on_evict(key(d), d, None)
    assert not any(p.on_insert(key(d), d, True) for d in range(40))
    # New blocks pay it back at a quarter each; then the budget's share goes again.
    fresh = [p.on_insert(hashed_key(i), 0, None) for i in range(400)]
    assert not any(fresh[:120])
    assert 0.15 * 160 <= sum(fresh[240:]) <= 0.35 * 160
    total = p.offered_hint + p.offered_ghost + p.offered_hot + p.offered_prefix
    assert total <= 0.25 * 440 + 10  # all's base: 440 distinct blocks


def test_reuse_recomputed_blocks_do_not_count_as_computed() -> None:
    """A block computed twice because reuse did not send it costs 'all' nothing: the
    budget is a share of all's bytes, so the recomputation is not part of the base."""
    p = only_proven(ReuseOffload(100, 0.5, window=10))
    for d in range(5):
        assert not p.on_insert(key(d), d, None)  # 5 candidates, unsent
        p.on_evict(key(d), d, None)
    for d in range(5):
        assert p.on_insert(key(d), d, None)  # computed again: proven, sent; 10 inserts
    # Base 5 (not 10): budget 2.5, and 5 were sent: nothing more goes. With a
    # base of 10 the budget (5) would have been spent exactly, and open blocks
    # at depth 0 would be next.
    assert (p.limit_class, p.depth_limit, p.edge_share) == (PROVEN, 0, 0.0)


def test_seen_filter_remembers_one_generation_and_forgets_after_two() -> None:
    f = SeenFilter(100)
    assert all(f.add(hashed_key(i)) for i in range(100))
    assert not any(f.add(hashed_key(i)) for i in range(100))  # all remembered
    fresh = sum(f.add(hashed_key(1000 + i)) for i in range(200))
    assert fresh >= 197  # new keys are new (false positives: ~0.5%)
    assert sum(f.add(hashed_key(i)) for i in range(100)) >= 97  # two generations on: new


@settings(max_examples=60, deadline=None)
@given(
    budget=st.sampled_from([0.2, 0.4, 0.6, 0.8]),
    lengths=st.lists(st.integers(1, 40), min_size=200, max_size=400),
)
def test_reuse_long_run_share_tracks_the_budget(budget: float, lengths: list[int]) -> None:
    """Chains of random lengths, nothing proven: the share sent follows the budget."""
    p = ReuseOffload(400, budget, window=50)
    sent = total = 0
    i = 0
    for n in lengths:
        for d in range(n):
            sent += p.on_insert(hashed_key(i), d, None)
            total += 1
            i += 1
    # The first window guesses (first blocks only, at the budget's share); after
    # that each window follows the last ones' depths, which random lengths shake,
    # and the debt term pulls the long-run share back to the budget.
    first = min(total, 50)
    assert abs(sent - budget * total) <= 0.5 * first + 0.1 * total


def test_reuse_budget_one_sends_everything() -> None:
    p = ReuseOffload(10, 1.0, window=2)
    for i in range(20):
        p.on_hot(key(1000 + i), 0, None)  # forced sends cannot eat into budget 1
        assert p.on_insert(key(i), 100 + i, None)


# -- in the L1 cache --------------------------------------------------------------------


def test_reuse_in_l1_ghost_and_hot_through_real_evictions(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    policy = only_proven(ReuseOffload(2, 0.5), 1)  # only depth 0 goes without proof
    c = L1Cache(slab, capacity_bytes=2 * BS, policy="lru", offload=policy, offload_queue=q)
    assert c.offload_mode == "reuse"
    c.put(key(0), b"a" * BS, digest(key(0)), depth=0)
    c.put(key(1), b"b" * BS, digest(key(1)), depth=1)
    assert [it.key for it in q.take(10)] == [key(0)]  # depth 0 < limit
    h = c.get(key(1))  # a re-hit: proven while resident
    assert h is not None
    c.release([h])
    assert [it.key for it in q.take(10)] == [key(1)]
    c.put(key(2), b"c" * BS, digest(key(2)), depth=2)
    c.put(key(3), b"d" * BS, digest(key(3)), depth=3)  # evicts 0 and 1 (sent), then 2
    c.put(key(4), b"e" * BS, digest(key(4)), depth=4)  # evicts 2, unsent: ghost
    assert q.take(10) == [] and policy.in_ghost(key(2))
    c.put(key(2), b"c" * BS, digest(key(2)), depth=2)  # computed again
    assert [it.key for it in q.take(10)] == [key(2)]
    assert policy.offered_ghost == 1 and policy.offered_hot == 1


def test_l1_passes_depth_and_keep_and_checks_them(slab: Slab) -> None:
    seen: list[tuple[bytes, int, bool | None]] = []

    class Recorder(NoOffload):
        name = "recorder"
        needs_queue = True

        def on_insert(self, key: bytes, depth: int, keep: bool | None) -> bool:
            seen.append((key, depth, keep))
            return False

        def on_evict(self, key: bytes, depth: int, keep: bool | None) -> bool:
            seen.append((key, -depth, keep))
            return False

    c = L1Cache(slab, capacity_bytes=BS, offload=Recorder(), offload_queue=OffloadQueue(BS))
    c.put(key(1), b"x" * BS, digest(key(1)), depth=7, keep=True)
    c.put(key(2), b"y" * BS, digest(key(2)), depth=8, keep=False)  # evicts key 1
    assert seen == [(key(1), 7, True), (key(1), -7, True), (key(2), 8, False)]
    with pytest.raises(ConfigError, match="depth must be a block index >= 0, got -1"):
        c.put(key(3), b"z" * BS, digest(key(3)), depth=-1)
    with pytest.raises(ConfigError, match="keep must be True, False or None, got 1"):
        c.put(key(3), b"z" * BS, digest(key(3)), keep=1)  # type: ignore[arg-type]
    assert key(3) not in c and key(2) in c  # bad input changed nothing


def test_evict_all_sends_cold_blocks_and_spares_held_ones(slab: Slab) -> None:
    q = OffloadQueue(100 * BS)
    c = L1Cache(slab, capacity_bytes=4 * BS, offload="cold", offload_queue=q)
    for i in range(3):
        c.put(key(i), bytes([i]) * BS, digest(key(i)))
    held = c.get(key(1))
    assert held is not None
    assert c.evict_all() == 2
    assert [it.key for it in q.take(10)] == [key(0), key(2)]
    assert len(c) == 1 and key(1) in c  # held by a reader: stays
    c.release([held])
