"""KVStore: the node's pool, index, allocator, leases and eviction behind one lock.

The pool is a :class:`~rdmakv.blocks.slab.Slab` of fixed-size blocks; each value takes
one block (an *extent* = block start address + value length).

Ownership of a pool block, as slab references:

* an uncommitted entry holds 1 reference, owned by the session that allocated
  it; commit hands it to the index, abort/disconnect frees it;
* a committed entry holds 1 reference while it is in the index;
* every lease holds 1 reference until released, expired, or its session ends;
* a GET in progress pins the block (1 reference) until the bytes are sent.

So a block is reused only when nobody can still read or write it. Eviction
(byte-capacity LRU: the pool is the capacity) removes committed entries from
the oldest end whose block has no reference other than the index's -- it
never evicts an extent under lease, being read, or not yet committed. The
index evicts, inside a reserve: it takes the free blocks the store hands it
first, and then reuses an evicted block with its one reference, which passes
from the committed entry to the new uncommitted one.

Leases cannot pin the pool: a session may hold at most ``lease_quota_bytes``
under lease and ``max_leases_per_block`` live leases on one block (a LOOKUP
that would exceed either is refused whole with :class:`LeaseQuotaExceeded`),
and a session's leases on a block end at most ``lease_timeout`` after that
session first leased it, however often it leases it again: so leases never
keep a put from finding room for longer than the lease timeout.
All methods are thread-safe.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rdmakv.blocks.slab import Slab
from rdmakv.defaults import DEFAULT_LEASE_TIMEOUT, DEFAULT_MAX_LEASES_PER_BLOCK
from rdmakv.errors import ConfigError
from rdmakv.node.index import NO_BLOCK, Reserved
from rdmakv.node.leases import Lease, LeaseTable
from rdmakv.node.native_index import NativeIndex
from rdmakv.node.native_loop import GetCounts, GetSource, GetTally, RequestLoop, StoreLock
from rdmakv.transport.base import ExtentGuard, PinnedValues, ReceivingValues
from rdmakv.wire.batches import AllocRequest, GetRequest, KeysRequest, encode_get_answer
from rdmakv.wire.format import (
    EXTENT_DTYPE,
    MAX_BULK_BYTES,
    AllocResult,
    AllocStatus,
    Extent,
    LimitExceeded,
    LookupResult,
)

log = logging.getLogger("rdmakv.node")

DEFAULT_LEASE_QUOTA_SHARE = 2
"""Default per-session lease quota: 1 / this of the pool ..."""
LEASE_QUOTA_FLOOR = MAX_BULK_BYTES
"""... but never below the bulk bytes of one answer (256 MiB), so one client's batched
get always fits: on a pool under twice that, the default quota guards nothing."""


class LeaseQuotaExceeded(LimitExceeded):
    """A leased LOOKUP would take a session over its lease quota."""


@dataclass
class Counters:
    allocs: int = 0
    commits: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    deletes: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    aborted: int = 0
    reclaimed_on_disconnect: int = 0
    no_space: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_committed_one_sided: int = 0
    """Bytes of extents committed that never passed through the node (RDMA WRITE)."""
    lease_refusals: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class KVStore:
    """Thread-safe node state. ``rkey`` is stamped into every extent handed out.

    The keys live in C (:class:`NativeIndex`), which reads the pool's
    refcounts to pick eviction victims and takes a GET's pins in them: the
    pool must share them (``Slab(shared_refcounts=True)``, as ``rdmakv
    serve``'s does)."""

    def __init__(
        self,
        pool: Slab,
        *,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        rkey: int = 0,
        clock: Callable[[], float] = time.monotonic,
        lease_quota_bytes: int | None = None,
        max_leases_per_block: int = DEFAULT_MAX_LEASES_PER_BLOCK,
        guard: ExtentGuard | None = None,
    ) -> None:
        if lease_timeout <= 0:
            raise ConfigError(f"lease timeout must be > 0 seconds, got {lease_timeout}")
        if lease_quota_bytes is None:
            lease_quota_bytes = max(LEASE_QUOTA_FLOOR, pool.nbytes // DEFAULT_LEASE_QUOTA_SHARE)
        if lease_quota_bytes < pool.block_size:
            raise ConfigError(
                f"lease_quota_bytes {lease_quota_bytes} is below one block ({pool.block_size})"
            )
        if max_leases_per_block < 1:
            raise ConfigError(f"max_leases_per_block must be >= 1, got {max_leases_per_block}")
        self.lease_quota_bytes = lease_quota_bytes
        self.max_leases_per_block = max_leases_per_block
        self.pool = pool
        self._base = pool.base_addr
        self.block_size = pool.block_size
        self.lease_timeout = lease_timeout
        self.rkey = rkey
        self._guard = guard  # told of every extent handed to / taken from a session
        self._clock = clock
        refs = pool.refcounts
        if refs is None:
            raise ConfigError(
                "the node's index needs a pool whose refcounts C can read and update "
                "(Slab(..., shared_refcounts=True))"
            )
        self._index = NativeIndex(pool.num_blocks)
        # A lock C takes too: the native loop answers EXISTS and GET under it
        # without Python (rdmakv.node.native_loop).
        self._lock = StoreLock()
        # the index reads them to evict; GET's one native call takes its pins in them
        self._refcounts: array[int] = refs
        self._leases = LeaseTable()
        self.counters = Counters()
        self._native_gets = GetCounts()
        """What native loops' GETs did; :meth:`stats` adds it to :attr:`counters`."""

    # -- helpers (lock held) ------------------------------------------------------
    def _expire(self) -> None:
        sessions: Counter[int] = Counter()
        for lease in self._leases.pop_expired(self._clock()):
            self._revoke_lease(lease)
            self._unpin_lease(lease)
            self.counters.leases_expired += 1
            sessions[lease.session] += 1
        if sessions:
            # A client that held a lease this long is stuck or stalled (a QP
            # that stopped completing): its reads of those extents now fail,
            # which its side reports only as access errors.
            log.warning(
                "%d leases expired after %.0f s unreleased (sessions %s); their blocks "
                "may be evicted, and over RDMA their windows are revoked",
                sum(sessions.values()), self.lease_timeout,
                ", ".join(f"{sid}: {n}" for sid, n in sorted(sessions.items())),
            )

    def _revoke_lease(self, lease: Lease) -> None:
        if self._guard is not None:
            self._guard.revoke(lease.session, [a for _, a, _ in lease.extents], write=False)

    def _unpin_lease(self, lease: Lease) -> None:
        decref = self.pool.decref
        for block, _, _ in lease.extents:
            decref(block)

    def _revoke_writes(self, session: int, blocks: Sequence[int]) -> None:
        if self._guard is not None and blocks:
            base, bs = self._base, self.block_size
            self._guard.revoke(session, [base + b * bs for b in blocks], write=True)

    def _free_pending(self, session: int, blocks: Sequence[int]) -> None:
        """Free the blocks of pending keys the index just forgot."""
        self._revoke_writes(session, blocks)  # before the blocks can be reused
        self.pool.decref_many(blocks)

    # -- control operations ----------------------------------------------------------
    def _reserve(self, session: int, request: AllocRequest) -> Reserved:
        """Per (key, size, digest) item: a new pending key of this session, or
        why not (lock held). The index takes free blocks first, then evicts."""
        pool = self.pool
        n = request.count
        if pool.free_blocks < n:
            self._expire()  # expired leases free blocks for eviction
        spares = pool.alloc_many(min(n, pool.free_blocks))
        try:
            reserved = self._index.reserve(
                session, request, self.block_size, spares, self._refcounts
            )
        except BaseException:
            pool.decref_many(spares)
            raise
        pool.decref_many(spares[reserved.spares_used :])
        c = self.counters
        c.allocs += n
        c.evictions += reserved.evicted
        c.no_space += reserved.statuses.count(AllocStatus.NO_SPACE)
        return reserved

    def alloc(
        self, session: int, items: Sequence[tuple[bytes, int, bytes]]
    ) -> list[AllocResult]:
        """:meth:`alloc_table` as one AllocResult per item."""
        ok = AllocStatus.OK
        return [
            AllocResult(AllocStatus(st), Extent(addr, length, rkey) if st == ok else None)
            for st, addr, length, rkey in self.alloc_table(
                session, AllocRequest.of_items(items)
            ).tolist()
        ]

    def alloc_table(self, session: int, request: AllocRequest) -> npt.NDArray[np.void]:
        """Reserve one extent per (key, size, digest) item; invisible until commit.

        Per item one :data:`~rdmakv.wire.format.EXTENT_DTYPE` record: its status,
        and where that is OK its extent (address, length, rkey); zeros
        elsewhere. Laid out in array passes, not an object per key: ALLOC is
        the node's busiest control request."""
        with self._lock:
            statuses, blocks, _, _ = self._reserve(session, request)
            table = np.zeros(request.count, dtype=EXTENT_DTYPE)
            table["status"] = np.frombuffer(statuses, dtype=np.uint8)
            ok = table["status"] == AllocStatus.OK
            if not ok.any():
                return table
            mine = np.frombuffer(blocks, dtype=np.int64)[ok]
            addrs = mine.astype(np.uint64) * np.uint64(self.block_size) + np.uint64(self._base)
            lengths = self._index.lengths(mine.tolist())  # the sizes reserved
            table["addr"][ok] = addrs
            table["length"][ok] = lengths
            if self._guard is None:
                table["rkey"][ok] = self.rkey
            else:
                extents = list(zip(addrs.tolist(), lengths, strict=True))
                table["rkey"][ok] = self._guard.grant(session, extents, write=True)
        return table

    def alloc_received(self, session: int, request: AllocRequest) -> ReceivingValues:
        """ALLOC for values the node itself receives (PUT): where each
        reserved value goes, and ``received()`` to mark them written (see
        ``commit(require_written=True)``). Nothing is granted to a one-sided
        data path: these bytes never move one-sided."""
        with self._lock:
            statuses, blocks, _, _ = self._reserve(session, request)
            reserved = np.frombuffer(blocks, dtype=np.int64)
            if len(reserved) and reserved.min() == NO_BLOCK:
                reserved = reserved[reserved != NO_BLOCK]
            iov = np.empty((len(reserved), 2), dtype=np.uint64)
            iov[:, 0] = reserved
            iov[:, 0] *= np.uint64(self.block_size)
            iov[:, 0] += np.uint64(self._base)
            iov[:, 1] = np.frombuffer(self._index.lengths_column, dtype=np.uint32)[reserved]
        mine = reserved.tolist()
        nbytes = int(iov[:, 1].sum())

        def received() -> None:
            with self._lock:
                self._index.mark_written(session, mine)
                self.counters.bytes_written += nbytes

        return ReceivingValues(statuses, iov, received)

    def commit(
        self,
        session: int,
        keys: Sequence[bytes] | KeysRequest,
        checksums: Sequence[int] | npt.NDArray[np.uint64],
        *,
        require_written: bool = False,
    ) -> list[bool]:
        """Make this session's uncommitted extents visible, each with the
        writer's checksum of its bytes; False for any other key.

        With ``require_written`` an extent the node did not receive in full
        through PUT stays uncommitted (False): its bytes may be stale.
        """
        with self._lock:
            done = self._index.commit(session, keys, checksums, require_written=require_written)
            blocks = done.blocks
            every = done.committed == len(blocks)  # as a rule: no per-key pass then
            # still under the lock: nobody can see these keys before their
            # write grants are gone
            self._revoke_writes(session, blocks if every else
                                [b for b in blocks if b != NO_BLOCK])
            self.counters.commits += done.committed
            self.counters.bytes_committed_one_sided += done.one_sided
        return [True] * len(blocks) if every else list(map(NO_BLOCK.__ne__, blocks))

    def abort(self, session: int, keys: Sequence[bytes]) -> list[bool]:
        """Free this session's uncommitted extents for ``keys``."""
        with self._lock:
            blocks = self._index.abort(session, keys)
            gone = [b for b in blocks if b != NO_BLOCK]
            self._free_pending(session, gone)
            self.counters.aborted += len(gone)
        return list(map(NO_BLOCK.__ne__, blocks))

    def lookup(self, session: int, keys: Sequence[bytes], lease: bool) -> list[LookupResult | None]:
        """Committed extents (+ digest) for ``keys``.

        With ``lease`` all hits of this call share one lease (one id), which
        pins their blocks until released, expired or the session ends.
        """
        found: list[tuple[Extent, bytes, int] | None] = []
        extents: list[tuple[int, int, int]] = []
        with self._lock:
            self._expire()
            base, bs, rkey = self._base, self.block_size, self.rkey
            index = self._index
            blocks = index.touch_all(keys)
            rows = zip(blocks, index.lengths(blocks), index.digests(blocks),
                       index.checksums(blocks), strict=True)
            for block, length, digest, checksum in rows:
                if block == NO_BLOCK:
                    found.append(None)
                    continue
                addr = base + block * bs
                found.append((Extent(addr, length, rkey), digest, checksum))
                if lease:
                    extents.append((block, addr, length))
            lease_id = 0
            if extents:
                now = self._clock()
                pinned_since = self._check_lease_quota(session, extents, now)
                incref = self.pool.incref
                for block, _, _ in extents:
                    incref(block)
                # Never past lease_timeout after this session first pinned a block.
                deadline = min(now, pinned_since) + self.lease_timeout
                lease_id = self._leases.add(session, extents, deadline, now).lease_id
                self.counters.leases_granted += 1
                if self._guard is not None:
                    rkeys = iter(self._guard.grant(
                        session, [(a, n) for _, a, n in extents], write=False
                    ))
                    found = [
                        None if f is None
                        else (Extent(f[0].addr, f[0].length, next(rkeys)), f[1], f[2])
                        for f in found
                    ]
            hits = len(keys) - blocks.count(NO_BLOCK)
            self.counters.lookups += len(keys)
            self.counters.hits += hits
            self.counters.misses += len(keys) - hits
        return [None if f is None else LookupResult(f[0], lease_id, f[1], f[2]) for f in found]

    def _check_lease_quota(
        self, session: int, extents: list[tuple[int, int, int]], now: float
    ) -> float:
        """Refuse (raise) a lease over the session's quotas; else the earliest time
        this session first pinned one of ``extents`` (``now`` for fresh ones)."""
        held = self._leases.bytes_of(session)
        adding = sum(length for _, _, length in extents)
        if held + adding > self.lease_quota_bytes:
            self.counters.lease_refusals += 1
            raise LeaseQuotaExceeded(
                f"LOOKUP: a lease on {adding} more bytes would take this client to "
                f"{held + adding} leased bytes, over its quota of {self.lease_quota_bytes} "
                "(node.lease_quota_bytes): RELEASE leases after reading"
            )
        pinned_since = now
        asked = Counter(block for block, _, _ in extents)  # repeats in this request count
        for block, repeats in asked.items():
            count, since = self._leases.pin_of(session, block)
            if count + repeats > self.max_leases_per_block:
                self.counters.lease_refusals += 1
                raise LeaseQuotaExceeded(
                    f"LOOKUP: this client holds {count} live leases on one extent and asks "
                    f"for {repeats} more (the most is {self.max_leases_per_block}, "
                    "node.max_leases_per_block): "
                    "RELEASE leases after reading"
                )
            if count:
                pinned_since = min(pinned_since, since)
        return pinned_since

    def release(self, session: int, lease_ids: Sequence[int]) -> int:
        """End this session's leases; unknown/foreign/expired/repeated ids are ignored."""
        n = 0
        with self._lock:
            for lid in lease_ids:
                lease = self._leases.get(lid)
                if lease is None or lease.session != session:
                    continue
                self._leases.remove(lid)
                self._revoke_lease(lease)
                self._unpin_lease(lease)
                self.counters.leases_released += 1
                n += 1
        return n

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove committed keys; a leased block lives on until its leases end."""
        with self._lock:
            blocks = self._index.remove(keys)
            gone = [b for b in blocks if b != NO_BLOCK]
            self.pool.decref_many(gone)
            self.counters.deletes += len(gone)
        return [b != NO_BLOCK for b in blocks]

    def exists(self, keys: Sequence[bytes] | KeysRequest) -> list[bool]:
        """Per key: committed. A present key becomes most recently used: an engine
        asks ``exists`` right before it fetches what was found (vLLM's scheduler
        counts hit tokens, its worker loads them a step later), so those blocks
        must not be the next eviction victims. A decoded EXISTS request is looked
        up where its keys lie (:meth:`IndexBase.touch_keys_flags`)."""
        if isinstance(keys, KeysRequest):
            return list(map(bool, self.exists_flags(keys)))
        with self._lock:
            blocks = self._index.touch_all(keys)
        return [block != NO_BLOCK for block in blocks]

    def exists_flags(self, request: KeysRequest) -> bytes:
        """:meth:`exists` of a decoded EXISTS request as its answer's flags:
        per key one byte, 1 when committed (no Python object per key)."""
        with self._lock:
            return self._index.touch_keys_flags(request)

    def request_loop(self, ahead_bytes: int, timed: bool, get: bool) -> RequestLoop:
        """A native loop answering EXISTS, and GET if ``get``, through a
        session's read-ahead buffer of ``ahead_bytes`` (``timed``: it reports
        each answer's time). The caller gives each call's GET tally to
        :meth:`settle_native_gets`."""
        source = None
        if get:
            source = GetSource(self._refcounts, self._base, self.block_size, self._native_gets)
        return RequestLoop(self._index, self._lock, ahead_bytes, timed, source)

    def settle_native_gets(self, tally: GetTally) -> None:
        """Free the blocks whose last pin a native loop's GET dropped (their
        keys were deleted or evicted while the values went out)."""
        if tally.last:
            with self._lock:
                self.pool.decref_many(tally.last)

    def session_closed(self, session: int) -> None:
        """Reclaim everything a departed session held: uncommitted extents and leases."""
        with self._lock:
            gone = self._index.abandon(session)
            self._free_pending(session, gone)
            self.counters.reclaimed_on_disconnect += len(gone)
            for lease in self._leases.of_session(session):
                self._leases.remove(lease.lease_id)
                self._revoke_lease(lease)
                self._unpin_lease(lease)
                self.counters.leases_released += 1

    def expire_leases(self) -> None:
        with self._lock:
            self._expire()

    def pin_values(self, request: GetRequest) -> PinnedValues:
        """Each requested key's committed value when stored with that digest
        (else a miss), its block pinned until ``unpin()``.

        A lookup and a read in one step (GET): hits become most recently used
        and their blocks are pinned, so nothing evicts or reuses them, until
        unpin() -- the caller sends their bytes in between. No lease: the pin
        never outlives the request.
        """
        # A GET's per-key work is in series with the send of its values, which
        # it limits: one native call does it all, answer and send table included.
        with self._lock:
            found = self._pin_in_c(request)
            if found is None:
                found = self._pin_in_python(request)
            hits = len(found.iov) - 1
            c = self.counters
            c.lookups += request.count
            c.hits += hits
            c.misses += request.count - hits
            c.bytes_read += found.nbytes
        return found

    def _pin_in_c(self, request: GetRequest) -> PinnedValues | None:
        """:meth:`pin_values` in one native call on the index and the pool's
        refcounts; None for a request it does not take (keys of several
        lengths). Lock held."""
        native, refs = self._index, self._refcounts
        pinned = native.pin_request(request, refs, self._base, self.block_size)
        if pinned is None:
            return None

        def unpin() -> None:
            with self._lock:  # the last reference of a block frees it: the pool's
                self.pool.decref_many(native.unpin(refs, pinned.blocks))

        return PinnedValues(pinned.answer, pinned.iov, pinned.nbytes, unpin)

    def _pin_in_python(self, request: GetRequest) -> PinnedValues:
        """:meth:`pin_values` of a request :meth:`_pin_in_c` does not take. Lock held."""
        index, pool = self._index, self.pool
        blocks = index.touch_request(request)
        hits = list(filter(NO_BLOCK.__ne__, blocks))
        pool.incref_many(hits)  # index entries: live blocks
        iov = np.zeros((len(hits) + 1, 2), dtype=np.uint64)
        iov[1:, 0] = np.array(hits, dtype=np.uint64) * np.uint64(self.block_size)
        iov[1:, 0] += np.uint64(self._base)
        iov[1:, 1] = index.lengths(hits)

        def unpin() -> None:
            with self._lock:
                pool.decref_many(hits)

        answer = encode_get_answer(index.lengths(blocks), index.checksums(blocks))
        return PinnedValues(answer, iov, int(iov[1:, 1].sum()), unpin)

    # -- introspection ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire()
            c = self.counters
            out: dict[str, Any] = {k: v for k, v in vars(c).items() if k != "extra"}
            out.update(c.extra)
            native = self._native_gets.read()
            out["lookups"] += native["lookups"]
            out["hits"] += native["hits"]
            out["misses"] += native["lookups"] - native["hits"]
            out["bytes_read"] += native["bytes"]
            out["get_native"] = native["gets"]
            out.update(
                entries=len(self._index),
                pending=self._index.pending_count,
                bytes_stored=self._index.committed_bytes,
                leases_active=len(self._leases),
                lease_quota_bytes=self.lease_quota_bytes,
                leased_extents=self._leases.extent_count,
                block_size=self.block_size,
                blocks_total=self.pool.num_blocks,
                blocks_used=self.pool.used_blocks,
                pool_bytes=self.pool.nbytes,
                lease_timeout_s=self.lease_timeout,
            )
            return out
