"""L1Cache: block key -> slab block, with byte capacity, eviction and offload.

Ownership of slab references (one :class:`~rdmakv.blocks.slab.Slab` refcount each):

* every resident entry holds one (the cache's);
* every pending offload holds one (queued or being sent, until the consumer's
  ``done`` has been drained): eviction never frees a block whose bytes are
  still being sent;
* every successful ``get`` / ``acquire_prefix`` hands the caller one per block,
  which the caller gives back with :meth:`L1Cache.release` -- a lease that lasts
  until release, however long; held entries are never evicted;
* ``allocate`` hands the caller one fresh block, which :meth:`L1Cache.insert`
  takes over.

An entry can be evicted only when the cache's reference is the only one left
(``refcount == 1``). When room is needed and every candidate is held,
``allocate`` / ``insert`` raise :class:`~rdmakv.errors.SlabExhausted` -- a held
block is never overwritten.

Capacity is counted in whole slab blocks (an entry occupies one block whatever
its ``nbytes``), so ``used_bytes <= capacity_bytes`` holds after every call.
Blocks pending offload after eviction (COLD) or allocated but not yet inserted
are outside the cache's capacity but inside the slab: size the slab as the
capacity plus the offload queue's bound.

Every value carries the digest of its tokens and parent key (see
:mod:`rdmakv.blocks.keys`); a lookup that supplies a digest gets a miss -- and the
stale entry is dropped -- when they differ, so a key collision never returns
another block's KV.

Not thread-safe: one engine thread drives a cache. Only the offload queue is
shared with a transport thread (see :mod:`rdmakv.engine.l1.offload`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdmakv.blocks.keys import KEY_BYTES, BlockKey
from rdmakv.blocks.slab import Slab
from rdmakv.engine.l1.offload import OffloadItem, OffloadQueue
from rdmakv.engine.l1.offload_policies import OffloadMode, OffloadPolicy, make_offload_policy
from rdmakv.engine.l1.policies import (
    S3FIFO_GHOST_FRACTION,
    S3FIFO_SMALL_FRACTION,
    EvictionPolicy,
    make_policy,
)
from rdmakv.errors import ConfigError, InvalidHandle, SlabExhausted
from rdmakv.wire.format import check_digest, check_key


@dataclass
class L1Stats:
    """Counters since the cache was created.

    ``hits``/``misses`` count blocks: a prefix lookup adds one hit per leading
    hit block and one miss for the block it stopped at (if any). A digest
    mismatch counts as a miss and in ``digest_mismatches``. ``bytes_offloaded``
    counts bytes offered to the offload queue and accepted.
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    offloads: int = 0
    bytes_offloaded: int = 0
    offloads_dropped: int = 0
    digest_mismatches: int = 0


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    handle: int
    nbytes: int
    digest: bytes
    # Accepted by the offload queue while resident, or fetched from the remote
    # tier in the first place: either way the remote tier has (or will have) it.
    offered: bool = False
    depth: int = 0  # index of the block in its request's chain (for the offload policy)
    keep: bool | None = None  # the request's reuse hint (for the offload policy)


class L1Cache:
    """Byte-capacity cache of KV blocks in a slab.

    Invariants: the cache holds one slab reference per resident entry; a pending
    offload holds another (so eviction never frees a block whose bytes are still
    being sent); an acquire holds one per block until release. See the module
    docstring for the full ownership rules. Single-threaded.

    ``policy`` is ``"lru"``, ``"fifo"`` or ``"s3fifo"`` (``small_fraction`` and
    ``ghost_fraction`` size S3FIFO's small and ghost queues relative to the
    capacity in blocks). ``offload`` is a mode name (``none``, ``all``, ``hot``,
    ``cold``, ``reuse``; ``offload_budget`` sets ``reuse``'s byte budget) or an
    :class:`~rdmakv.engine.l1.offload_policies.OffloadPolicy` object owned by this
    cache from now on; any policy that offloads needs ``offload_queue``.
    """

    def __init__(
        self,
        slab: Slab,
        capacity_bytes: int | None = None,
        policy: str = "lru",
        offload: OffloadMode | str | OffloadPolicy = OffloadMode.NONE,
        offload_queue: OffloadQueue | None = None,
        *,
        offload_budget: float | None = None,
        small_fraction: float = S3FIFO_SMALL_FRACTION,
        ghost_fraction: float = S3FIFO_GHOST_FRACTION,
    ) -> None:
        if not isinstance(slab, Slab):
            raise ConfigError(f"slab must be a Slab, got {type(slab).__name__}")
        bs = slab.block_size
        if capacity_bytes is None:
            capacity_bytes = slab.nbytes
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        # Compared in whole blocks: the capacity rounds down like the slab does.
        if not 1 <= capacity_bytes // bs <= slab.num_blocks:
            raise ConfigError(
                f"capacity_bytes {capacity_bytes} must be between one block ({bs}) "
                f"and the slab size ({slab.nbytes})"
            )
        self.slab = slab
        self.block_size = bs
        self.capacity_blocks = capacity_bytes // bs
        self.capacity_bytes = self.capacity_blocks * bs
        self.offload_policy: OffloadPolicy = make_offload_policy(
            offload, self.capacity_blocks, budget=offload_budget
        )
        if self.offload_policy.needs_queue and offload_queue is None:
            raise ConfigError(
                f"offload mode {self.offload_policy.name!r} needs an offload_queue"
            )
        self.offload_queue = offload_queue
        self.policy: EvictionPolicy = make_policy(
            policy,
            self.capacity_blocks,
            self._on_hot,
            small_fraction=small_fraction,
            ghost_fraction=ghost_fraction,
        )
        self._entries: dict[BlockKey, _Entry] = {}
        self._by_handle: dict[int, _Entry] = {}
        # handle -> (references handed out by get/acquire, nbytes): lets release()
        # refuse handles it never gave out instead of stealing the cache's own ref.
        self._held: dict[int, list[int]] = {}
        # handle -> offload references in flight: they keep the block alive but do
        # not pin the entry (an entry may leave the cache while its bytes are sent).
        self._sending: Counter[int] = Counter()
        self._held_total = 0
        self._stats = L1Stats()

    # -- introspection -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def offload_mode(self) -> str:
        """The offload policy's name (``"all"``, ``"reuse"``, ...)."""
        return self.offload_policy.name

    @property
    def used_bytes(self) -> int:
        """Bytes of slab blocks held by resident entries."""
        return len(self._entries) * self.block_size

    @property
    def stats(self) -> L1Stats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

    @property
    def held_handles(self) -> int:
        """References currently handed out by get/acquire_prefix and not released."""
        return self._held_total

    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is resident. No references, no policy side effects."""
        return key in self._entries

    __contains__ = contains

    def count_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are resident. No references, no side effects."""
        n = 0
        for k in keys:
            if k not in self._entries:
                break
            n += 1
        return n

    def nbytes_of(self, handle: int) -> int:
        """Valid bytes of a resident or held block."""
        e = self._by_handle.get(handle)
        if e is not None:
            return e.nbytes
        held = self._held.get(handle)
        if held is not None:
            return held[1]
        raise InvalidHandle(f"block handle {handle!r} is neither resident nor held in this cache")

    def digest_of(self, key: BlockKey) -> bytes | None:
        """The stored digest of ``key``, or None if not resident. No side effects."""
        e = self._entries.get(key)
        return None if e is None else e.digest

    # -- writing -------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh slab block for the caller to fill; the caller owns its one reference.

        Evicts as needed so that one more entry fits the capacity and the slab
        has a free block. Raises :class:`SlabExhausted` when nothing evictable
        is left. Hand the block to :meth:`insert`, or ``slab.decref`` it.
        """
        self.poll_offload()
        while self.used_bytes + self.block_size > self.capacity_bytes or not self.slab.free_blocks:
            if not self._evict_one():
                raise SlabExhausted(self._no_room("allocate a block"))
        return self.slab.alloc()

    def insert(
        self,
        key: BlockKey,
        handle: int,
        nbytes: int,
        digest: bytes,
        *,
        from_remote: bool = False,
        depth: int = 0,
        keep: bool | None = None,
    ) -> bool:
        """Make ``handle`` (filled with ``nbytes`` valid bytes) the value of ``key``.

        Invalid arguments raise before anything changes (the caller keeps its
        reference). Otherwise the caller's reference is taken over: kept by the
        new entry, or dropped when ``key`` is already present (returns False)
        or when no room can be made (raises :class:`SlabExhausted`).

        ``from_remote=True`` marks a block fetched from the remote tier: it is
        never offered for offload (no mode), since the remote tier has it.
        ``depth`` (the block's index in its request's chain) and ``keep`` (the
        request's reuse hint) are what the offload policy decides on.
        """
        key = check_key(key, length=KEY_BYTES)
        digest = check_digest(digest)
        self._check_nbytes(nbytes)
        _check_offload_context(depth, keep)
        if not self.slab.is_live(handle):
            raise InvalidHandle(f"cannot insert block handle {handle!r}: it is not allocated")
        if handle in self._by_handle:
            raise InvalidHandle(
                f"cannot insert block handle {handle} under a second key: it already "
                "holds a resident entry"
            )
        if handle in self._held:
            # Its references are read leases from get/acquire, not ownership:
            # taking one over would let a later release() free a resident block.
            raise InvalidHandle(
                f"cannot insert block handle {handle}: it is held as a read lease from "
                "this cache; insert blocks from allocate()"
            )
        return self._insert(key, handle, nbytes, digest, from_remote, depth, keep)

    def _insert(
        self,
        key: BlockKey,
        handle: int,
        nbytes: int,
        digest: bytes,
        from_remote: bool,
        depth: int = 0,
        keep: bool | None = None,
    ) -> bool:
        """insert() after validation: owns the caller's reference from here on."""
        self.poll_offload()
        if key in self._entries:
            self.slab.decref(handle)
            return False
        while self.used_bytes + self.block_size > self.capacity_bytes:
            if not self._evict_one():
                self.slab.decref(handle)
                raise SlabExhausted(self._no_room("insert a block"))
        e = _Entry(key, handle, nbytes, digest, offered=from_remote, depth=depth, keep=keep)
        self._entries[key] = e
        self._by_handle[handle] = e
        self.policy.insert(key)
        self._stats.inserts += 1
        if not from_remote and self.offload_policy.on_insert(key, depth, keep):
            self._offer(e)
        return True

    def put(
        self,
        key: BlockKey,
        data: bytes | bytearray | memoryview | np.ndarray[Any, Any],
        digest: bytes,
        *,
        from_remote: bool = False,
        depth: int = 0,
        keep: bool | None = None,
    ) -> bool:
        """Copy ``data`` into a fresh block and insert it; False if ``key`` is present."""
        key = check_key(key, length=KEY_BYTES)
        digest = check_digest(digest)
        _check_offload_context(depth, keep)
        src = _as_bytes_view(data)
        self._check_nbytes(src.nbytes)
        if key in self._entries:
            return False
        h = self.allocate()
        try:
            self.slab.view(h, src.nbytes)[:] = src
        except BaseException:
            self.slab.decref(h)
            raise
        return self._insert(key, h, src.nbytes, digest, from_remote, depth, keep)

    def drop(self, key: BlockKey) -> bool:
        """Remove ``key`` if resident (holders keep their blocks until release)."""
        e = self._entries.get(key)
        if e is None:
            return False
        self._drop(e)
        return True

    def clear(self) -> None:
        """Drop every entry; held and pending blocks stay alive until released / done."""
        for e in list(self._entries.values()):
            self._drop(e)
        self.poll_offload()

    # -- reading -------------------------------------------------------------
    def get(self, key: BlockKey, digest: bytes | None = None) -> int | None:
        """The block of ``key`` with one reference for the caller, or None on a miss.

        With ``digest``, a stored value whose digest differs is a miss and is
        dropped (it answers some other prefix). Release the handle when done.
        """
        key = check_key(key, length=KEY_BYTES)
        if digest is not None:
            digest = check_digest(digest)
        e = self._lookup(key, digest)
        if e is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._hold(e)
        self.policy.access(key)
        return e.handle

    def acquire_prefix(
        self, keys: Sequence[BlockKey], digests: Sequence[bytes] | None = None
    ) -> list[int]:
        """Handles of the leading hits of ``keys`` (length = hit count), each with one reference.

        Stops at the first miss or digest mismatch. Release the handles when done.
        """
        if digests is not None and len(digests) != len(keys):
            raise ConfigError(f"acquire_prefix got {len(keys)} keys but {len(digests)} digests")
        keys = [check_key(k, length=KEY_BYTES) for k in keys]
        if digests is not None:
            digests = [check_digest(d) for d in digests]
        out: list[int] = []
        for i, k in enumerate(keys):
            e = self._lookup(k, None if digests is None else digests[i])
            if e is None:
                self._stats.misses += 1
                break
            self._stats.hits += 1
            self._hold(e)
            self.policy.access(k)
            out.append(e.handle)
        return out

    def release(self, handles: Iterable[int]) -> None:
        """Give back references obtained from :meth:`get` / :meth:`acquire_prefix`.

        All-or-nothing: a handle not held through this cache (or released more
        often than acquired) raises :class:`InvalidHandle` and releases nothing.
        """
        want = Counter(handles)
        for h, n in want.items():
            held = self._held.get(h)
            if held is None or held[0] < n:
                have = 0 if held is None else held[0]
                raise InvalidHandle(
                    f"cannot release block handle {h!r} {n} time(s): this cache handed "
                    f"out {have} reference(s) to it"
                )
        for h, n in want.items():
            held = self._held[h]
            held[0] -= n
            self._held_total -= n
            if held[0] == 0:
                del self._held[h]
            for _ in range(n):
                self.slab.decref(h)

    # -- offload -------------------------------------------------------------
    def poll_offload(self) -> int:
        """Drop the references of offloads the consumer has finished; returns how many."""
        q = self.offload_queue
        if q is None:
            return 0
        finished = q.drain_completed()
        for it in finished:
            self._sending[it.handle] -= 1
            if not self._sending[it.handle]:
                del self._sending[it.handle]
            self.slab.decref(it.handle)
        return len(finished)

    def _offer(self, e: _Entry, *, transfer: bool = False) -> None:
        """Offer ``e`` to the queue; the item holds a reference (the cache's, if ``transfer``)."""
        q = self.offload_queue
        assert q is not None  # guaranteed by __init__ for every mode that offers
        if not transfer:
            self.slab.incref(e.handle)
        if q.offer(OffloadItem(e.key, e.handle, e.nbytes, e.digest)):
            self._sending[e.handle] += 1
            self._stats.offloads += 1
            self._stats.bytes_offloaded += e.nbytes
            e.offered = True
        else:
            self.slab.decref(e.handle)
            self._stats.offloads_dropped += 1

    def _on_hot(self, key: BlockKey) -> None:
        e = self._entries.get(key)
        # Once per resident entry; a refused (dropped) offer may be retried on a
        # later hot signal, when the queue may have room.
        if e is not None and not e.offered and self.offload_policy.on_hot(key, e.depth, e.keep):
            self._offer(e)

    # -- internals -----------------------------------------------------------
    def _lookup(self, key: BlockKey, digest: bytes | None) -> _Entry | None:
        e = self._entries.get(key)
        if e is None:
            return None
        if digest is not None and digest != e.digest:
            self._stats.digest_mismatches += 1
            self._drop(e)
            return None
        return e

    def _hold(self, e: _Entry) -> None:
        self.slab.incref(e.handle)
        self._held_total += 1
        held = self._held.get(e.handle)
        if held is None:
            self._held[e.handle] = [1, e.nbytes]
        else:
            held[0] += 1

    def _can_evict(self, key: BlockKey) -> bool:
        # No reader holds it. A pending offload does not pin the entry: its own
        # reference keeps the bytes alive until sent, so under a fast producer
        # the cache keeps evicting instead of filling up with in-flight blocks.
        h = self._entries[key].handle
        return self.slab.refcount(h) - self._sending[h] == 1

    def _evict_one(self) -> bool:
        key = self.policy.victim(self._can_evict)
        if key is None:
            return False
        e = self._entries.pop(key)
        del self._by_handle[e.handle]
        self._stats.evictions += 1
        if not e.offered and self.offload_policy.on_evict(key, e.depth, e.keep):
            self._offer(e, transfer=True)
        else:
            self.slab.decref(e.handle)
        return True

    def evict_all(self) -> int:
        """Evict every entry no reader holds, through the offload policy; returns how many.

        Unlike :meth:`clear`, each entry leaves as an eviction would, so a
        policy that sends blocks at eviction (``cold``) sends them now: call it
        before a planned shutdown to hand L1's unsent blocks to the remote tier.
        """
        n = 0
        while self._evict_one():
            n += 1
        return n

    def _drop(self, e: _Entry) -> None:
        del self._entries[e.key]
        del self._by_handle[e.handle]
        self.policy.remove(e.key)
        self.slab.decref(e.handle)

    def _check_nbytes(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ConfigError(f"nbytes must be an int, got {nbytes!r}")
        if not 0 < nbytes <= self.block_size:
            raise ConfigError(f"nbytes {nbytes} outside (0, block_size={self.block_size}]")

    def _no_room(self, what: str) -> str:
        return (
            f"L1 cache cannot {what}: {len(self._entries)} entries use "
            f"{self.used_bytes}/{self.capacity_bytes} bytes, slab has "
            f"{self.slab.free_blocks}/{self.slab.num_blocks} free blocks, and every "
            f"resident block is held ({self.held_handles} reader references, "
            f"{self._pending_refs()} offloads queued)"
        )

    def _pending_refs(self) -> int:
        q = self.offload_queue
        return 0 if q is None else len(q)

    def __repr__(self) -> str:
        return (
            f"L1Cache(policy={self.policy.name}, entries={len(self)}, "
            f"used={self.used_bytes}/{self.capacity_bytes}, offload={self.offload_mode})"
        )


def _check_offload_context(depth: int, keep: bool | None) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"depth must be a block index >= 0, got {depth!r}")
    if keep is not None and not isinstance(keep, bool):
        raise ConfigError(f"keep must be True, False or None, got {keep!r}")


def _as_bytes_view(data: bytes | bytearray | memoryview | np.ndarray[Any, Any]) -> memoryview:
    """``data`` as a flat byte memoryview (copying only non-contiguous arrays)."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise ConfigError("put() data must not be an object array")
        flat: memoryview = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        return flat
    try:
        mv = memoryview(data)
    except TypeError as e:
        raise ConfigError(
            f"put() data must be bytes-like or a numpy array, got {type(data).__name__}"
        ) from e
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
