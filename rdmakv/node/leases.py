"""Read leases: while a lease is held, its extent is neither evicted nor reused.

A lease is taken by ``lookup(lease=True)`` and ends at whichever comes first:
the client releases it, its deadline passes (so a dead client cannot pin memory
forever), or the client's connection closes. Each lease holds one reference
on its pool block; the store drops that reference when the lease ends.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple


class Lease(NamedTuple):
    lease_id: int
    session: int
    block: int
    addr: int
    length: int
    deadline: float


_HEAP_SLACK = 2
_HEAP_MIN_COMPACT = 1024


class LeaseTable:
    """Active leases by id and by session, with a deadline heap. Not thread-safe."""

    def __init__(self) -> None:
        self._by_id: dict[int, Lease] = {}
        self._by_session: dict[int, dict[int, Lease]] = {}
        self._by_block: dict[tuple[int, int], dict[int, Lease]] = {}  # (session, block)
        # (deadline, id); stale ids (already released) are skipped lazily.
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, session: int, block: int, addr: int, length: int, deadline: float) -> Lease:
        lease = Lease(self._next_id, session, block, addr, length, deadline)
        self._next_id += 1
        self._by_id[lease.lease_id] = lease
        self._by_session.setdefault(session, {})[lease.lease_id] = lease
        self._by_block.setdefault((session, block), {})[lease.lease_id] = lease
        heapq.heappush(self._heap, (deadline, lease.lease_id))
        if len(self._heap) > _HEAP_SLACK * len(self._by_id) + _HEAP_MIN_COMPACT:
            # Released leases leave stale heap entries: rebuild so metadata stays
            # proportional to live leases.
            self._heap = [(le.deadline, le.lease_id) for le in self._by_id.values()]
            heapq.heapify(self._heap)
        return lease

    def get(self, lease_id: int) -> Lease | None:
        return self._by_id.get(lease_id)

    def remove(self, lease_id: int) -> Lease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is not None:
            mine = self._by_session[lease.session]
            del mine[lease_id]
            if not mine:
                del self._by_session[lease.session]
            bkey = (lease.session, lease.block)
            same = self._by_block[bkey]
            del same[lease_id]
            if not same:
                del self._by_block[bkey]
        return lease

    def covering(self, session: int, block: int) -> Lease | None:
        """Any lease ``session`` holds on ``block`` (all of them name the same value)."""
        same = self._by_block.get((session, block))
        return next(iter(same.values())) if same else None

    def of_session(self, session: int) -> list[Lease]:
        return list(self._by_session.get(session, {}).values())

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is <= now."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, lid = heapq.heappop(self._heap)
            lease = self.remove(lid)
            if lease is not None:
                out.append(lease)
        return out
