"""Read leases: while a lease is held, its extents are neither evicted nor reused.

A lease is taken by ``lookup(lease=True)`` -- one lease per LOOKUP request,
covering every extent that request found (all its hits carry the same lease
id) -- and ends at whichever comes first: the client releases it, its deadline
passes (so a dead client cannot pin memory forever), or the client's
connection closes. A lease holds one reference on each of its pool blocks;
the store drops those references when the lease ends.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Lease:
    lease_id: int
    session: int
    deadline: float
    extents: list[tuple[int, int, int]]  # (block, addr, length)


_HEAP_SLACK = 2
_HEAP_MIN_COMPACT = 1024


class LeaseTable:
    """Active leases by id, by session and by (session, block), with a deadline heap.

    Not thread-safe (the store's lock guards it).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Lease] = {}
        self._by_session: dict[int, set[int]] = {}
        self._bytes_by_session: dict[int, int] = {}  # leased bytes, repeats counted
        # (session, block) -> [count of this session's leases on it, addr, length,
        #                      when this session's continuous pin of it began]
        self._by_block: dict[tuple[int, int], list[Any]] = {}
        # (deadline, id); ids already released are skipped lazily.
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1
        self.extent_count = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def add(
        self, session: int, extents: list[tuple[int, int, int]], deadline: float, now: float
    ) -> Lease:
        lease = Lease(self._next_id, session, deadline, extents)
        self._next_id += 1
        self._by_id[lease.lease_id] = lease
        self._by_session.setdefault(session, set()).add(lease.lease_id)
        by_block = self._by_block
        nbytes = 0
        for block, addr, length in extents:
            nbytes += length
            rec = by_block.get((session, block))
            if rec is None:
                by_block[(session, block)] = [1, addr, length, now]
            else:
                rec[0] += 1
        self._bytes_by_session[session] = self._bytes_by_session.get(session, 0) + nbytes
        self.extent_count += len(extents)
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
        if lease is None:
            return None
        mine = self._by_session[lease.session]
        mine.discard(lease_id)
        if not mine:
            del self._by_session[lease.session]
            del self._bytes_by_session[lease.session]
        else:
            self._bytes_by_session[lease.session] -= sum(n for _, _, n in lease.extents)
        by_block = self._by_block
        for block, _, _ in lease.extents:
            key = (lease.session, block)
            rec = by_block[key]
            rec[0] -= 1
            if rec[0] == 0:
                del by_block[key]
        self.extent_count -= len(lease.extents)
        return lease

    def of_session(self, session: int) -> list[Lease]:
        return [self._by_id[i] for i in self._by_session.get(session, ())]

    def bytes_of(self, session: int) -> int:
        """Bytes ``session`` holds under lease (a block leased twice counts twice)."""
        return self._bytes_by_session.get(session, 0)

    def pin_of(self, session: int, block: int) -> tuple[int, float]:
        """(live leases ``session`` holds on ``block``, when its pin began; 0.0 if none)."""
        rec = self._by_block.get((session, block))
        return (0, 0.0) if rec is None else (rec[0], rec[3])

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is <= now."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, lid = heapq.heappop(self._heap)
            lease = self.remove(lid)
            if lease is not None:
                out.append(lease)
        return out
