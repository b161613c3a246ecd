"""OffloadQueue: byte bound, never-blocking offers, consumer hand-off across threads."""

from __future__ import annotations

import threading

import pytest

from rdmakv.engine.l1.offload import OffloadItem, OffloadQueue
from rdmakv.engine.l1.offload_policies import OffloadMode
from rdmakv.errors import ConfigError


def item(i: int, nbytes: int = 100) -> OffloadItem:
    return OffloadItem(key=i.to_bytes(16, "little"), handle=i, nbytes=nbytes, digest=b"d" * 16)


def test_mode_parsing() -> None:
    assert OffloadMode.parse("HOT") is OffloadMode.HOT
    assert OffloadMode.parse(" cold ") is OffloadMode.COLD
    assert OffloadMode.parse("All") is OffloadMode.ALL
    assert OffloadMode.parse("none") is OffloadMode.NONE
    assert OffloadMode.parse(OffloadMode.ALL) is OffloadMode.ALL
    with pytest.raises(ConfigError, match="unknown offload mode 'warm'; expected one of"):
        OffloadMode.parse("warm")
    with pytest.raises(ConfigError, match="unknown offload mode 3"):
        OffloadMode.parse(3)  # type: ignore[arg-type]


def test_bound_drops_and_counts_instead_of_blocking() -> None:
    q = OffloadQueue(250)
    assert q.offer(item(1))
    assert q.offer(item(2))
    assert not q.offer(item(3))  # 300 > 250
    assert q.offer(item(4, nbytes=50))  # exactly at the bound is fine
    assert not q.offer(item(5, nbytes=1))
    assert q.pending_bytes == 250
    assert (q.dropped, q.dropped_bytes, q.accepted, q.accepted_bytes) == (2, 101, 3, 250)
    got = q.take(10)
    assert [it.handle for it in got] == [1, 2, 4]
    assert q.pending_bytes == 250  # taken is still pending until done
    q.done(got[:1])
    assert q.pending_bytes == 150
    assert q.offer(item(6))
    assert [it.handle for it in q.drain_completed()] == [1]
    assert q.drain_completed() == []


def test_take_respects_max_items_and_timeout_zero() -> None:
    q = OffloadQueue(10_000)
    assert q.take(5) == []
    for i in range(5):
        q.offer(item(i))
    assert [it.handle for it in q.take(2)] == [0, 1]
    assert len(q) == 3
    assert q.take(1, timeout=0.01)[0].handle == 2


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="max_pending_bytes must be a positive int"):
        OffloadQueue(0)
    q = OffloadQueue(100)
    with pytest.raises(ConfigError, match="max_items must be positive"):
        q.take(0)
    with pytest.raises(ConfigError, match="timeout must be >= 0"):
        q.take(1, timeout=-1)
    with pytest.raises(ConfigError, match="nbytes=0"):
        q.offer(item(1, nbytes=0))
    with pytest.raises(ConfigError, match="not pending"):
        q.done([item(1)])


@pytest.mark.timeout(60)
def test_blocking_take_wakes_on_offer_and_close() -> None:
    q = OffloadQueue(1000)
    got: list[list[OffloadItem]] = []
    t = threading.Thread(target=lambda: got.append(q.take(4, timeout=None)))
    t.start()
    q.offer(item(7))
    t.join(timeout=30)
    assert not t.is_alive()
    assert [it.handle for it in got[0]] == [7]

    t2 = threading.Thread(target=lambda: got.append(q.take(4, timeout=None)))
    t2.start()
    q.close()
    t2.join(timeout=30)
    assert not t2.is_alive()
    assert got[1] == []
    assert not q.offer(item(8))  # closed: refused and counted
    assert q.dropped == 1


def test_close_discards_queued_items_into_completed() -> None:
    q = OffloadQueue(1000)
    q.offer(item(1))
    q.offer(item(2))
    taken = q.take(1)
    q.close()
    assert [it.handle for it in q.drain_completed()] == [2]
    assert q.pending_bytes == 100  # the taken item is still the consumer's
    q.done(taken)
    assert q.pending_bytes == 0


@pytest.mark.timeout(120)
def test_concurrent_producer_and_consumer_balance() -> None:
    """Every accepted item is taken exactly once and every pending byte comes back."""
    q = OffloadQueue(2_000)
    n = 5_000
    seen: list[int] = []
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set() or len(q):
            batch = q.take(16, timeout=0.05)
            seen.extend(it.handle for it in batch)
            q.done(batch)

    t = threading.Thread(target=consume)
    t.start()
    accepted = [i for i in range(n) if q.offer(item(i))]
    stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert seen == accepted
    assert q.accepted == len(accepted) and q.dropped == n - len(accepted)
    assert q.pending_bytes == 0
    assert sorted(it.handle for it in q.drain_completed()) == accepted
