"""Eviction policies against simple list-based reference models (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.engine.l1.policies import (
    S3FIFO_MAX_FREQ,
    FIFOPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from rdmakv.errors import ConfigError

KEYS = [bytes([i]) * 16 for i in range(12)]

# -- reference models: plain lists, one obvious step at a time --------------------


class RefLRU:
    def __init__(self, reorder_on_hit: bool = True) -> None:
        self.order: list[bytes] = []
        self.hot: list[bytes] = []
        self.reorder = reorder_on_hit

    def insert(self, k: bytes) -> None:
        self.order.append(k)

    def access(self, k: bytes) -> None:
        if self.reorder:
            self.order.remove(k)
            self.order.append(k)
        self.hot.append(k)

    def remove(self, k: bytes) -> None:
        self.order.remove(k)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        for k in self.order:
            if can_evict(k):
                self.order.remove(k)
                return k
        return None

    def resident(self) -> list[bytes]:
        return list(self.order)


class RefS3FIFO:
    """S3FIFO as in the paper's pseudo-code, evicting one key per call, held keys skipped."""

    def __init__(self, small_target: int, ghost_limit: int) -> None:
        self.small: list[bytes] = []
        self.main: list[bytes] = []
        self.ghost: list[bytes] = []
        self.freq: dict[bytes, int] = {}
        self.hot: list[bytes] = []
        self.small_target = small_target
        self.ghost_limit = ghost_limit

    def insert(self, k: bytes) -> None:
        self.freq[k] = 0
        if k in self.ghost:
            self.ghost.remove(k)
            self.main.append(k)
        else:
            self.small.append(k)

    def access(self, k: bytes) -> None:
        self.freq[k] = min(self.freq[k] + 1, S3FIFO_MAX_FREQ)
        if k in self.main:
            self.hot.append(k)

    def remove(self, k: bytes) -> None:
        del self.freq[k]
        (self.small if k in self.small else self.main).remove(k)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        if len(self.small) >= self.small_target or not self.main:
            return self._evict_small(can_evict) or self._evict_main(can_evict)
        return self._evict_main(can_evict) or self._evict_small(can_evict)

    def _evict_small(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        i = 0
        while i < len(self.small):
            k = self.small[i]
            if self.freq[k] >= 1:
                self.small.pop(i)
                self.freq[k] = 0
                self.main.append(k)
                self.hot.append(k)
            elif can_evict(k):
                self.small.pop(i)
                del self.freq[k]
                if self.ghost_limit > 0:
                    self.ghost.append(k)
                    if len(self.ghost) > self.ghost_limit:
                        self.ghost.pop(0)
                return k
            else:
                i += 1
        return None

    def _evict_main(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        while True:
            moved = False
            i = 0
            for _ in range(len(self.main)):
                k = self.main[i]
                if self.freq[k] > 0:
                    self.freq[k] -= 1
                    self.main.append(self.main.pop(i))
                    moved = True
                elif can_evict(k):
                    self.main.pop(i)
                    del self.freq[k]
                    return k
                else:
                    i += 1
            if not moved:
                return None

    def resident(self) -> list[bytes]:
        return self.small + self.main


# -- op sequences ---------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "access", "access", "remove", "evict"]),
        st.integers(0, len(KEYS) - 1),
        st.frozensets(st.integers(0, len(KEYS) - 1), max_size=4),  # held keys for evict
    ),
    min_size=20,  # short runs never reach eviction, promotion or ghost hits
    max_size=120,
)


def _run(policy: object, ref: object, ops: list[tuple[str, int, frozenset[int]]], cap: int) -> None:
    """Drive both with the same ops, like a cache of ``cap`` entries would."""
    resident: set[bytes] = set()
    for op, i, held_idx in ops:
        k = KEYS[i]
        if op in ("access", "remove") and resident:
            # Aim at a resident key so hits are common, not a rare coincidence.
            k = sorted(resident)[i % len(resident)]
        held = {KEYS[j] for j in held_idx}
        if op == "insert" and k not in resident:
            if len(resident) >= cap:
                v1 = policy.victim(lambda x, h=held: x not in h)  # type: ignore[attr-defined]
                v2 = ref.victim(lambda x, h=held: x not in h)  # type: ignore[attr-defined]
                assert v1 == v2
                if v1 is None:
                    continue
                resident.discard(v1)
            policy.insert(k)  # type: ignore[attr-defined]
            ref.insert(k)  # type: ignore[attr-defined]
            resident.add(k)
        elif op == "access" and k in resident:
            policy.access(k)  # type: ignore[attr-defined]
            ref.access(k)  # type: ignore[attr-defined]
        elif op == "remove" and k in resident:
            policy.remove(k)  # type: ignore[attr-defined]
            ref.remove(k)  # type: ignore[attr-defined]
            resident.discard(k)
        elif op == "evict":
            v1 = policy.victim(lambda x, h=held: x not in h)  # type: ignore[attr-defined]
            v2 = ref.victim(lambda x, h=held: x not in h)  # type: ignore[attr-defined]
            assert v1 == v2
            assert v1 is None or v1 not in held
            if v1 is not None:
                resident.discard(v1)
        assert len(policy) == len(resident)  # type: ignore[arg-type]
        assert all(x in policy for x in resident)  # type: ignore[operator]


@settings(max_examples=150, deadline=None)
@given(ops=OPS, cap=st.integers(1, 8))
def test_lru_matches_reference(ops: list[tuple[str, int, frozenset[int]]], cap: int) -> None:
    hot: list[bytes] = []
    p = LRUPolicy(cap, hot.append)
    ref = RefLRU()
    _run(p, ref, ops, cap)
    assert p.order() == ref.resident()
    assert hot == ref.hot


@settings(max_examples=150, deadline=None)
@given(ops=OPS, cap=st.integers(1, 8))
def test_fifo_matches_reference(ops: list[tuple[str, int, frozenset[int]]], cap: int) -> None:
    hot: list[bytes] = []
    p = FIFOPolicy(cap, hot.append)
    ref = RefLRU(reorder_on_hit=False)
    _run(p, ref, ops, cap)
    assert p.order() == ref.resident()
    assert hot == ref.hot


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    cap=st.integers(1, 10),
    small_fraction=st.sampled_from([0.1, 0.3, 0.5]),
    ghost_fraction=st.sampled_from([0.0, 0.2, 0.9, 1.0]),
)
def test_s3fifo_matches_reference(
    ops: list[tuple[str, int, frozenset[int]]],
    cap: int,
    small_fraction: float,
    ghost_fraction: float,
) -> None:
    hot: list[bytes] = []
    p = S3FIFOPolicy(cap, hot.append, small_fraction=small_fraction, ghost_fraction=ghost_fraction)
    ref = RefS3FIFO(p.small_target, p.ghost_limit)
    _run(p, ref, ops, cap)
    assert p.small_keys() == ref.small
    assert p.main_keys() == ref.main
    assert p.ghost_keys() == ref.ghost
    assert {k: p.freq(k) for k in ref.freq} == ref.freq
    assert hot == ref.hot


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.binary(min_size=16, max_size=16), max_size=400), cap=st.integers(1, 20))
def test_s3fifo_ghost_stays_bounded(keys: list[bytes], cap: int) -> None:
    """A stream of one-hit wonders: the ghost never grows past its bound."""
    p = S3FIFOPolicy(cap)
    for k in keys:
        if k in p:
            p.access(k)
            continue
        while len(p) >= cap:
            assert p.victim(lambda _k: True) is not None
        p.insert(k)
        assert len(p.ghost_keys()) <= p.ghost_limit
    assert p.ghost_limit == round(0.9 * cap)


def test_s3fifo_one_hit_wonders_leave_main_alone() -> None:
    """The scan resistance S3FIFO exists for: a hot set in main survives a scan."""
    cap = 10
    p = S3FIFOPolicy(cap)
    hot = [bytes([1, i]) * 8 for i in range(5)]
    for k in hot:
        p.insert(k)
        p.access(k)  # accessed while small -> promoted on the next small eviction
    for i in range(100):
        k = bytes([2, i]) * 8
        while len(p) >= cap:
            p.victim(lambda _k: True)
        p.insert(k)
    assert set(hot) <= set(p.main_keys())


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    p = S3FIFOPolicy(4)
    a, b = KEYS[0], KEYS[1]
    p.insert(a)
    assert p.victim(lambda _k: True) == a
    assert p.ghost_keys() == [a]
    p.insert(a)
    assert p.main_keys() == [a] and p.ghost_keys() == []
    p.insert(b)
    assert p.small_keys() == [b]


def test_victim_none_when_everything_held() -> None:
    for name in ("lru", "fifo", "s3fifo"):
        p = make_policy(name, 4)
        for k in KEYS[:4]:
            p.insert(k)
            p.access(k)
        assert p.victim(lambda _k: False) is None
        assert len(p) == 4


def test_make_policy_rejects_unknown_names_and_bad_knobs() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy 'arc'"):
        make_policy("arc", 4)
    with pytest.raises(ConfigError, match="small_fraction"):
        make_policy("s3fifo", 4, small_fraction=1.5)
    with pytest.raises(ConfigError, match="ghost_fraction"):
        make_policy("s3fifo", 4, ghost_fraction=-0.1)
    with pytest.raises(ConfigError, match="capacity"):
        S3FIFOPolicy(0)
    assert make_policy("S3FIFO", 4).name == "s3fifo"
