"""KVCacheManager: the engine-facing API over L1 (local slab) and L2 (a KV node).

An engine computes KV for token blocks, hands the blocks to :meth:`put`, and
later asks :meth:`acquire` for the longest cached prefix of a new request:
the L1 cache answers first, and the blocks it misses are fetched from the node
with one batched lookup + one-sided read, verified against the digest of their
own tokens (a wrong block is a miss), and entered into L1.

Ownership and threads:

* Everything except the :class:`Offloader` runs on the caller's (engine)
  thread; the L1 cache and the slab are single-threaded.
* ``allocate_for`` hands the caller one slab reference per block; ``put`` takes
  it over (the block becomes an L1 entry or is dropped).
* ``acquire`` hands the caller one reference per hit block (an
  :class:`Acquired`); the blocks stay valid and unevictable until ``release``.
* Offloads selected by the L1 offload mode go through a bounded queue to an
  :class:`Offloader` thread with its own node connection: a slow or dead node
  drops offloads (counted), it never blocks the engine.
* ``prefetch`` starts a background fetch into freshly allocated blocks; the
  fetched blocks enter L1 on the engine thread at the next manager call (or
  :meth:`poll`).

Only *full* blocks are cached: a request's trailing partial block is never
stored or looked up (it cannot be shared until it fills).

Failures of the node become misses: every remote call is bounded by the
client timeout and an :class:`~rdmakv.errors.RdmakvError` from it is logged and
counted, never raised into the engine's lookup path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdmakv.client import KVClient
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.keys import BlockKey, BlockKeyer, KeyNamespace
from rdmakv.l1 import L1Cache, OffloadItem, OffloadMode, OffloadQueue
from rdmakv.slab import Slab

log = logging.getLogger("rdmakv.manager")

Tokens = Sequence[int] | np.ndarray[Any, Any]

DEFAULT_OFFLOAD_BATCH = 64
"""Blocks per offload put: large enough to amortise the ALLOC/COMMIT round trips."""
OFFLOAD_POLL_S = 0.05
"""How long the offloader waits for work before checking whether it should stop."""
DEFAULT_PENDING_FRACTION = 4
"""Default offload bound: a quarter of the L1 capacity may be in flight."""


@dataclass
class ManagerStats:
    """Counters of the manager itself (the L1 keeps its own in ``l1.stats``)."""

    l1_hit_blocks: int = 0
    l2_hit_blocks: int = 0
    l2_miss_blocks: int = 0
    l2_errors: int = 0
    bytes_fetched: int = 0
    prefetched_blocks: int = 0


@dataclass
class Acquired:
    """The longest cached prefix of a request, held until :meth:`KVCacheManager.release`.

    ``handles[i]`` is the slab block holding KV of block ``i``; ``l1_blocks``
    of them came from L1, the rest were fetched from the node just now.
    """

    handles: list[int]
    block_tokens: int
    l1_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.handles)

    @property
    def num_tokens(self) -> int:
        return len(self.handles) * self.block_tokens

    @property
    def l2_blocks(self) -> int:
        return len(self.handles) - self.l1_blocks


@dataclass
class _Prefetch:
    keys: list[BlockKey]
    digests: list[bytes]
    handles: list[int]
    future: Future[list[int | None]]
    done: Future[int] = field(default_factory=Future)


class Offloader:
    """Background thread: drains an :class:`OffloadQueue` into batched node puts.

    Owns its own :class:`KVClient` (its own connection) so a long put never
    delays the engine's lookups. Items are always marked done -- sent or not --
    so the L1 gets its references back; failures are counted, never retried
    (the block stays in L1, and a later offer may send it).
    """

    def __init__(
        self, queue: OffloadQueue, client: KVClient, batch_blocks: int = DEFAULT_OFFLOAD_BATCH
    ) -> None:
        if batch_blocks <= 0:
            raise ConfigError(f"offload batch must be positive, got {batch_blocks}")
        self.queue = queue
        self.client = client
        self.batch_blocks = batch_blocks
        self.sent_blocks = 0
        self.sent_bytes = 0
        self.failed_blocks = 0
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="rdmakv-offload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            items = self.queue.take(self.batch_blocks, timeout=OFFLOAD_POLL_S)
            if not items:
                with self._idle:
                    self._idle.notify_all()
                continue
            with self._idle:
                self._busy = True
            try:
                self._send(items)
            finally:
                self.queue.done(items)
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()

    def _send(self, items: list[OffloadItem]) -> None:
        try:
            stored = self.client.put(
                [it.key for it in items],
                [it.handle for it in items],
                [it.nbytes for it in items],
                [it.digest for it in items],
            )
        except RdmakvError as e:
            self.failed_blocks += len(items)
            log.warning("offload of %d blocks failed: %s", len(items), e)
            return
        for it, ok in zip(items, stored, strict=True):
            if ok:
                self.sent_blocks += 1
                self.sent_bytes += it.nbytes
            else:
                self.failed_blocks += 1

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty and no batch is in flight; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy and len(self.queue) == 0, timeout)

    def close(self) -> None:
        self.queue.close()
        self._stop.set()
        self._thread.join()
        self.client.close()


class KVCacheManager:
    """Prefix cache over an L1 slab and an optional remote KV node.

    ``block_tokens`` tokens make one block of ``block_bytes`` bytes of KV.
    ``node`` is ``"host:port"`` of a KV node, or None for an L1-only cache.
    """

    def __init__(
        self,
        *,
        namespace: KeyNamespace,
        block_tokens: int,
        block_bytes: int,
        l1_bytes: int,
        node: str | None = None,
        transport: str = "auto",
        policy: str = "lru",
        offload: OffloadMode | str = OffloadMode.HOT,
        max_pending_offload_bytes: int | None = None,
        token: bytes | str | None = None,
        timeout: float = 5.0,
        lock_slab: bool = True,
    ) -> None:
        if l1_bytes < block_bytes:
            raise ConfigError(f"l1_bytes {l1_bytes} is smaller than one block ({block_bytes})")
        self.keyer = BlockKeyer(namespace, block_tokens)
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        mode = OffloadMode.parse(offload) if node is not None else OffloadMode.NONE
        pending = max_pending_offload_bytes or max(
            block_bytes, l1_bytes // DEFAULT_PENDING_FRACTION
        )
        # The slab holds the L1 capacity plus what may be pending offload or in
        # flight from the node, so neither can starve the other.
        self.slab = Slab(l1_bytes + pending, block_bytes, lock=lock_slab)
        self.queue = OffloadQueue(pending) if mode is not OffloadMode.NONE else None
        self.l1 = L1Cache(self.slab, l1_bytes, policy, mode, self.queue)
        self.stats = ManagerStats()
        self.client: KVClient | None = None
        self.offloader: Offloader | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._prefetches: list[_Prefetch] = []
        if node is not None:
            host, port = _split_address(node)
            self.client = KVClient(
                host, port, self.slab, token=token, transport=transport, timeout=timeout
            )
            if self.queue is not None:
                self.offloader = Offloader(
                    self.queue,
                    KVClient(
                        host, port, self.slab, token=token, transport=transport, timeout=timeout
                    ),
                )

    @property
    def transport_name(self) -> str | None:
        return None if self.client is None else self.client.transport_name

    # -- writing -----------------------------------------------------------------------
    def allocate_for(self, num_blocks: int) -> list[int]:
        """Slab blocks for ``num_blocks`` blocks about to be computed (caller owns them).

        Hand them to :meth:`put` once filled, or back with :meth:`discard`.
        """
        self.poll()
        out: list[int] = []
        try:
            for _ in range(num_blocks):
                out.append(self.l1.allocate())
        except RdmakvError:
            self.discard(out)
            raise
        return out

    def discard(self, handles: Sequence[int]) -> None:
        """Give back blocks from :meth:`allocate_for` that will not be put."""
        for h in handles:
            self.slab.decref(h)

    def put(
        self,
        tokens: Tokens,
        handles: Sequence[int],
        *,
        extra: bytes | None = None,
        first_block: int = 0,
    ) -> int:
        """Cache blocks ``first_block..`` of ``tokens`` held in ``handles``; return the new count.

        Takes over the caller's reference on every handle (from
        :meth:`allocate_for`). Handles beyond the full blocks of ``tokens`` are
        an error (partial blocks are not cached).
        """
        chain = self.keyer.chain(tokens, extra)
        last = first_block + len(handles)
        if first_block < 0 or last > len(chain):
            raise ConfigError(
                f"put of blocks [{first_block}, {last}) but {len(tokens)} tokens hold "
                f"{len(chain)} full blocks of {self.block_tokens}"
            )
        self.poll()
        new = 0
        for (_, key, digest), h in zip(chain[first_block:last], handles, strict=True):
            new += self.l1.insert(key, h, self.block_bytes, digest)
        return new

    # -- reading -----------------------------------------------------------------------
    def acquire(self, tokens: Tokens, *, extra: bytes | None = None) -> Acquired:
        """Hold the longest cached prefix of ``tokens``: L1 first, then one batched node fetch."""
        self.poll()
        chain = self.keyer.chain(tokens, extra)
        keys = [k for _, k, _ in chain]
        digests = [d for _, _, d in chain]
        handles = self.l1.acquire_prefix(keys, digests)
        got = Acquired(handles, self.block_tokens, l1_blocks=len(handles))
        self.stats.l1_hit_blocks += len(handles)
        if len(handles) < len(keys) and self.client is not None:
            handles.extend(self._fetch(keys[len(handles) :], digests[len(handles) :]))
        return got

    def _fetch(self, keys: list[BlockKey], digests: list[bytes]) -> list[int]:
        """Fetch the leading hits of ``keys`` into L1; handles held for the caller."""
        assert self.client is not None
        blocks = self._allocate_upto(len(keys))
        if not blocks:
            return []
        keys, digests = keys[: len(blocks)], digests[: len(blocks)]
        try:
            sizes = self.client.get_sizes(keys, blocks, digests)
        except RdmakvError as e:
            self.stats.l2_errors += 1
            log.warning("remote lookup of %d blocks failed, treating as misses: %s", len(keys), e)
            sizes = [None] * len(keys)
        return self._admit(keys, digests, blocks, sizes, hold=True)

    def _allocate_upto(self, n: int) -> list[int]:
        """Up to ``n`` fresh blocks: fewer when L1 cannot make room (fetch less, not fail)."""
        out: list[int] = []
        for _ in range(n):
            try:
                out.append(self.l1.allocate())
            except RdmakvError:
                break
        return out

    def _admit(
        self,
        keys: list[BlockKey],
        digests: list[bytes],
        blocks: list[int],
        sizes: Sequence[int | None],
        *,
        hold: bool,
    ) -> list[int]:
        """Enter the leading fetched blocks into L1; free the rest. Returns held handles."""
        n = 0
        while n < len(sizes) and sizes[n] == self.block_bytes:
            n += 1
        self.stats.l2_hit_blocks += n
        self.stats.l2_miss_blocks += len(keys) - n
        self.stats.bytes_fetched += n * self.block_bytes
        held: list[int] = []
        for i, h in enumerate(blocks):
            if i >= n:
                self.slab.decref(h)
                continue
            self.l1.insert(keys[i], h, self.block_bytes, digests[i], from_remote=True)
            if hold:
                got = self.l1.acquire_prefix([keys[i]], [digests[i]])
                if not got:  # cannot happen single-threaded; be loud if it does
                    raise RdmakvError(f"block {i} vanished from L1 right after insert")
                held.extend(got)
        return held

    def exists(self, tokens: Tokens, *, extra: bytes | None = None) -> int:
        """How many leading tokens would hit: L1 index, then at most one node call."""
        self.poll()
        keys = self.keyer.keys(tokens, extra)
        n = self.l1.count_prefix(keys)
        if n < len(keys) and self.client is not None:
            try:
                present = self.client.exists(keys[n:])
            except RdmakvError as e:
                self.stats.l2_errors += 1
                log.warning("remote exists failed, counting as misses: %s", e)
                present = []
            for p in present:
                if not p:
                    break
                n += 1
        return n * self.block_tokens

    def prefetch(self, tokens: Tokens, *, extra: bytes | None = None) -> Future[int]:
        """Start fetching the blocks of ``tokens`` that L1 lacks; the future gives how many arrived.

        The fetched blocks enter L1 (not held) on the engine thread at the next
        manager call; :meth:`poll` does just that.
        """
        self.poll()
        chain = self.keyer.chain(tokens, extra)
        keys = [k for _, k, _ in chain]
        n = self.l1.count_prefix(keys)
        done: Future[int] = Future()
        if n == len(keys) or self.client is None:
            done.set_result(0)
            return done
        blocks = self._allocate_upto(len(keys) - n)
        if not blocks:
            done.set_result(0)
            return done
        keys = keys[n : n + len(blocks)]
        digests = [d for _, _, d in chain][n : n + len(blocks)]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rdmakv-prefetch")
        fut = self._executor.submit(self._prefetch_io, keys, blocks, digests)
        self._prefetches.append(_Prefetch(keys, digests, blocks, fut, done))
        return done

    def _prefetch_io(
        self, keys: list[BlockKey], blocks: list[int], digests: list[bytes]
    ) -> list[int | None]:
        assert self.client is not None
        try:
            return self.client.get_sizes(keys, blocks, digests)
        except RdmakvError as e:
            log.warning("prefetch of %d blocks failed, treating as misses: %s", len(keys), e)
            self.stats.l2_errors += 1
            return [None] * len(keys)

    def poll(self) -> None:
        """Engine-thread housekeeping: admit finished prefetches, reclaim sent offloads."""
        self.l1.poll_offload()
        if not self._prefetches:
            return
        still: list[_Prefetch] = []
        for p in self._prefetches:
            if not p.future.done():
                still.append(p)
                continue
            sizes = p.future.result()
            before = self.stats.l2_hit_blocks
            self._admit(p.keys, p.digests, p.handles, sizes, hold=False)
            arrived = self.stats.l2_hit_blocks - before
            self.stats.prefetched_blocks += arrived
            p.done.set_result(arrived)
        self._prefetches = still

    def wait_prefetches(self, timeout: float | None = None) -> None:
        """Block until every started prefetch has finished, then admit them."""
        for p in list(self._prefetches):
            p.future.result(timeout)
        self.poll()

    def release(self, acquired: Acquired | Sequence[int]) -> None:
        """Give back the blocks of an :meth:`acquire` (or a list of its handles)."""
        handles = acquired.handles if isinstance(acquired, Acquired) else acquired
        self.l1.release(handles)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for pending offloads to reach the node; False if they did not in time."""
        if self.offloader is None:
            return True
        ok = self.offloader.flush(timeout)
        self.poll()
        return ok

    def block_view(self, handle: int) -> np.ndarray[Any, Any]:
        """Zero-copy uint8 view of a held or allocated block."""
        return self.slab.numpy(handle)

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.l1.clear()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"node address must be HOST:PORT, got {address!r}")
    return host, int(port)
