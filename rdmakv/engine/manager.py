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
* ``prefetch`` starts a background fetch (own thread, own connection) into
  freshly allocated blocks; the fetched blocks enter L1 on the engine thread
  at the next manager call (or :meth:`poll`).

Only *full* blocks are cached: a request's trailing partial block is never
stored or looked up (it cannot be shared until it fills). ``exists`` and
``acquire`` therefore answer in multiples of ``block_tokens``; the engine
recomputes the partial tail.

Tensor parallelism: every TP rank runs its own manager over its own slice of
the KV (see :func:`tp_namespace` for keys that let different TP sizes share
blocks where the bytes are identical). ``acquire(..., tp_group=g)`` is a
collective: the ranks all-reduce MIN the number of blocks each obtained, keep
that many and release the rest, so every rank restores the same prefix even
when one rank's fetch failed. The wait is bounded by the process group's own
timeout (``init_process_group(timeout=...)``).

Hybrid models (several KV cache groups) use one manager per group; see
:mod:`rdmakv.engine.groups`, which builds on :meth:`KVCacheManager.hit_bitmap`
and :meth:`KVCacheManager.acquire_blocks`.

Failures of the node become misses: every remote call is bounded by the
client timeout and an :class:`~rdmakv.errors.RdmakvError` from it is logged and
counted, never raised into the engine's lookup path.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdmakv.blocks.keys import BlockKey, BlockKeyer, KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import NodeClient
from rdmakv.client.remote import check_address, open_remote
from rdmakv.defaults import DEFAULT_OFFLOAD, DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.engine.l1 import (
    KeepHint,
    L1Cache,
    OffloadItem,
    OffloadMode,
    OffloadPolicy,
    OffloadQueue,
    block_keep,
    check_keep_hint,
    make_offload_policy,
)
from rdmakv.errors import ConfigError, RdmakvError, SlabExhausted

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
    future: Future[tuple[list[int | None], bool]]
    done: Future[int] = field(default_factory=Future)


class Offloader:
    """Background thread: drains an :class:`OffloadQueue` into batched node puts.

    Owns its own :class:`~rdmakv.client.node_client.NodeClient` (its own connections) so a
    long put never delays the engine's lookups. Items are always marked done -- sent or not --
    so the L1 gets its references back; failures are counted, never retried
    (the block stays in L1, and a later offer may send it).
    """

    def __init__(
        self, queue: OffloadQueue, client: NodeClient, batch_blocks: int = DEFAULT_OFFLOAD_BATCH
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
    ``node`` names the remote tier (:mod:`rdmakv.client.remote`): ``"host:port"`` of a
    KV node, ``"a:7480,b:7480"`` or ``"dns://name:7480"`` for a cluster whose
    members each hold a rendezvous share of the keys (``replication`` copies
    of each), or None for an L1-only cache. ``streams`` connections to one
    node split a large batch across them (:mod:`rdmakv.client.streams`; None: 2 over
    RDMA, and over TCP 2 on a host of 2 usable CPUs or more, else 1).
    ``offload`` picks which computed blocks are sent to the node: a mode name
    (``reuse``, the default: every block unless the request's ``keep`` hint
    says otherwise, or only ``offload_budget`` of the bytes; ``all``, ``cold``,
    ``hot``, ``none``) or an :class:`~rdmakv.engine.l1.OffloadPolicy` object for this
    manager alone. docs/offload.md says which to pick, with figures.
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
        offload: OffloadMode | str | OffloadPolicy = DEFAULT_OFFLOAD,
        offload_budget: float | None = None,
        max_pending_offload_bytes: int | None = None,
        token: bytes | str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        lock_slab: bool = True,
        replication: int = DEFAULT_REPLICATION,
        streams: int | None = None,
    ) -> None:
        if l1_bytes < block_bytes:
            raise ConfigError(f"l1_bytes {l1_bytes} is smaller than one block ({block_bytes})")
        self.keyer = BlockKeyer(namespace, block_tokens)
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        offload_policy = make_offload_policy(
            offload if node is not None else OffloadMode.NONE,
            l1_bytes // block_bytes,
            budget=offload_budget if node is not None else None,
        )
        pending = max_pending_offload_bytes or max(
            block_bytes, l1_bytes // DEFAULT_PENDING_FRACTION
        )
        # The slab holds the L1 capacity plus what may be pending offload or in
        # flight from the node, so neither can starve the other.
        self.slab = Slab(l1_bytes + pending, block_bytes, lock=lock_slab)
        self.queue = OffloadQueue(pending) if offload_policy.needs_queue else None
        self.l1 = L1Cache(self.slab, l1_bytes, policy, offload_policy, self.queue)
        self.stats = ManagerStats()
        self.on_remote_get: Callable[[float], None] | None = None
        """Called with the seconds of each batched node get (metrics hook; None = off)."""
        self.client: NodeClient | None = None
        self.offloader: Offloader | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._prefetches: list[_Prefetch] = []
        self._prefetch_client: NodeClient | None = None
        self._new_client: Callable[[], NodeClient] | None = None
        if node is not None:
            check_address(node, streams=streams)  # a bad address fails here, before any connect

            def new_client() -> NodeClient:
                return open_remote(
                    node,
                    self.slab,
                    token=token,
                    transport=transport,
                    timeout=timeout,
                    replication=replication,
                    streams=streams,
                )

            self._new_client = new_client
            # Fails fast (ConnectionLost naming the address) when the node is
            # unreachable at start: a wrong address should be loud. Later node
            # failures become misses, and the clients reconnect on their own.
            self.client = new_client()
            if self.queue is not None:
                try:
                    self.offloader = Offloader(self.queue, new_client())
                except BaseException:
                    self.client.close()
                    raise

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
        keep: KeepHint = None,
    ) -> int:
        """Cache blocks ``first_block..`` of ``tokens`` held in ``handles``; return the new count.

        Takes over the caller's reference on every handle (from
        :meth:`allocate_for`). Handles beyond the full blocks of ``tokens`` are
        an error (partial blocks are not cached).

        ``keep`` is the request's reuse hint for the offload policy: True when
        the application says this prefix will be asked for again (e.g. a chat
        session that stays open), False when it will not, None when unknown,
        or a token count N: the first N tokens will be asked for again (a
        system prompt, a document), the rest will not. ``reuse`` sends the
        blocks hinted to be kept first and holds the others back until they
        prove reuse; the other modes ignore it.
        """
        keep = check_keep_hint(keep)
        chain = self.keyer.chain(tokens, extra)
        last = first_block + len(handles)
        if first_block < 0 or last > len(chain):
            raise ConfigError(
                f"put of blocks [{first_block}, {last}) but {len(tokens)} tokens hold "
                f"{len(chain)} full blocks of {self.block_tokens}"
            )
        self.poll()
        new = 0
        for depth, ((_, key, digest), h) in enumerate(
            zip(chain[first_block:last], handles, strict=True), start=first_block
        ):
            new += self.l1.insert(
                key, h, self.block_bytes, digest, depth=depth,
                keep=block_keep(keep, depth, self.block_tokens),
            )
        return new

    # -- reading -----------------------------------------------------------------------
    def acquire(
        self,
        tokens: Tokens,
        *,
        extra: bytes | None = None,
        max_tokens: int | None = None,
        tp_group: Any = None,
    ) -> Acquired:
        """Hold the longest cached prefix of ``tokens``: L1 first, then one batched node fetch.

        ``max_tokens`` caps the prefix (e.g. at what :meth:`exists` promised the
        scheduler): the node fetch allocates room for every block it asks for,
        so without a cap a long, mostly-uncached request makes L1 evict up to
        that many blocks before the misses are known (their blocks are freed
        right after). Blocks the node lacks, or whose digest differs, are
        misses; the hit stops at the first one. A failing node gives the L1
        hits only, within the client timeout.

        ``tp_group`` (a ``torch.distributed`` process group, or the default
        group with ``torch.distributed.group.WORLD``) makes this a collective:
        every rank of the group must call it for the same request, and all
        of them end up holding the same number of blocks, the minimum over the
        ranks (blocks beyond it are released here).

        The caller owns one reference per returned block until :meth:`release`.
        """
        self.poll()
        chain = self.keyer.chain(tokens, extra)
        if max_tokens is not None:
            if max_tokens < 0:
                raise ConfigError(f"max_tokens must be >= 0, got {max_tokens}")
            chain = chain[: max_tokens // self.block_tokens]
        keys = [k for _, k, _ in chain]
        digests = [d for _, _, d in chain]
        handles = self.l1.acquire_prefix(keys, digests)
        got = Acquired(handles, self.block_tokens, l1_blocks=len(handles))
        self.stats.l1_hit_blocks += len(handles)
        if len(handles) < len(keys) and self.client is not None:
            fetched = self._fetch(keys[len(handles) :], digests[len(handles) :], leading=True)
            handles.extend(h for h in fetched if h is not None)
        if tp_group is not None:
            self.truncate(got, agree_min(got.num_blocks, tp_group))
        return got

    def truncate(self, acquired: Acquired, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` blocks of ``acquired``; release the rest now."""
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        extra_handles = acquired.handles[num_blocks:]
        if extra_handles:
            self.l1.release(extra_handles)
            del acquired.handles[num_blocks:]
            acquired.l1_blocks = min(acquired.l1_blocks, num_blocks)

    def hit_bitmap(
        self, tokens: Tokens, *, extra: bytes | None = None, max_blocks: int | None = None
    ) -> list[bool]:
        """Per full block of ``tokens`` (up to ``max_blocks``): present in L1 or on the node.

        Not a prefix answer: block ``i`` may be present after an absent one
        (what sliding-window and state groups need). Answered from the L1 index
        plus one batched ``exists`` for the blocks L1 lacks. Presence is by key
        only (no digest check, no lease): :meth:`acquire_blocks` verifies, and
        may still find a block gone. A failing node counts as absent.
        """
        return self.hit_bitmaps([(tokens, extra, max_blocks)])[0]

    def hit_bitmaps(
        self, prompts: Sequence[tuple[Tokens, bytes | None, int | None]]
    ) -> list[list[bool]]:
        """:meth:`hit_bitmap` of several ``(tokens, extra, max_blocks)`` at once.

        The blocks L1 lacks, over all of them, go to the node in one batched
        ``exists``: a scheduler step's lookups cost one round trip, not one each.
        """
        self.poll()
        bitmaps: list[list[bool]] = []
        absent: list[tuple[int, int]] = []
        absent_keys: list[BlockKey] = []
        for p, (tokens, extra, max_blocks) in enumerate(prompts):
            keys = self.keyer.keys(tokens, extra)
            if max_blocks is not None:
                keys = keys[:max_blocks]
            bitmap = [self.l1.contains(k) for k in keys]
            for i, present in enumerate(bitmap):
                if not present:
                    absent.append((p, i))
                    absent_keys.append(keys[i])
            bitmaps.append(bitmap)
        if absent and self.client is not None:
            remote = self._remote_exists(absent_keys)
            for (p, i), present in zip(absent, remote, strict=True):
                bitmaps[p][i] = present
        return bitmaps

    def acquire_blocks(
        self, tokens: Tokens, indices: Sequence[int], *, extra: bytes | None = None
    ) -> list[int | None]:
        """Hold blocks ``indices`` of ``tokens`` (not necessarily a prefix): a handle or None each.

        L1 first (digest-checked), then one batched node fetch for the rest;
        fetched blocks enter L1. The caller owns one reference per returned
        handle until :meth:`release` (pass the non-None handles).
        """
        self.poll()
        chain = self.keyer.chain(tokens, extra)
        for i in indices:
            if not 0 <= i < len(chain):
                raise ConfigError(
                    f"block index {i} out of range: {len(tokens)} tokens hold {len(chain)} "
                    f"full blocks of {self.block_tokens}"
                )
        if len(set(indices)) != len(indices):
            raise ConfigError(f"acquire_blocks got duplicate block indices: {list(indices)}")
        out: list[int | None] = []
        missing: list[int] = []
        for pos, i in enumerate(indices):
            _, key, digest = chain[i]
            h = self.l1.get(key, digest)
            out.append(h)
            if h is None:
                missing.append(pos)
            else:
                self.stats.l1_hit_blocks += 1
        if missing and self.client is not None:
            keys = [chain[indices[p]][1] for p in missing]
            digests = [chain[indices[p]][2] for p in missing]
            for pos, h in zip(missing, self._fetch(keys, digests, leading=False), strict=True):
                out[pos] = h
        return out

    def _fetch(
        self, keys: list[BlockKey], digests: list[bytes], *, leading: bool
    ) -> list[int | None]:
        """Fetch ``keys`` from the node into L1: a held handle or None per key.

        With ``leading``, only the leading run of hits is kept (a prefix). When
        L1 cannot make room for all of them, the keys at the end get None.
        """
        blocks = self._allocate_upto(len(keys))
        n = len(blocks)
        sizes: list[int | None] = [None] * len(keys)
        if n:
            sizes[:n] = self._remote_get(keys[:n], blocks, digests[:n])
        return self._admit(keys, digests, blocks, sizes, hold=True, leading=leading)

    def _remote_get(
        self, keys: list[BlockKey], blocks: list[int], digests: list[bytes]
    ) -> list[int | None]:
        """One batched verified node get; any node failure is all misses (counted, logged)."""
        assert self.client is not None
        started = time.perf_counter()
        try:
            return self.client.get_sizes(keys, blocks, digests)
        except RdmakvError as e:
            self.stats.l2_errors += 1
            log.warning("remote get of %d blocks failed, treating as misses: %s", len(keys), e)
            return [None] * len(keys)
        finally:
            if self.on_remote_get is not None:
                self.on_remote_get(time.perf_counter() - started)

    def _remote_exists(self, keys: list[BlockKey]) -> list[bool]:
        """One batched node exists; any node failure is all absent (counted, logged)."""
        assert self.client is not None
        try:
            return self.client.exists(keys)
        except RdmakvError as e:
            self.stats.l2_errors += 1
            log.warning("remote exists of %d blocks failed, counting as absent: %s", len(keys), e)
            return [False] * len(keys)

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
        leading: bool,
    ) -> list[int | None]:
        """Enter fetched blocks into L1 and free the others; per key a held handle or None.

        ``blocks[i]`` was fetched for ``keys[i]`` (there may be fewer blocks than
        keys); a block is a hit when the node returned a whole block for it. Takes
        over every block's reference: it becomes the L1 entry's or is freed.
        """
        out: list[int | None] = [None] * len(keys)
        stop = False
        for i, h in enumerate(blocks):
            hit = not stop and sizes[i] == self.block_bytes
            if leading and not hit:
                stop = True
            if not hit:
                self.slab.decref(h)
                self.stats.l2_miss_blocks += 1
                continue
            try:
                self.l1.insert(keys[i], h, self.block_bytes, digests[i], from_remote=True)
            except SlabExhausted:
                # insert() dropped the block; every other entry is held: nothing to do
                # but report a miss (the engine recomputes it).
                self.stats.l2_miss_blocks += 1
                stop = stop or leading
                continue
            self.stats.l2_hit_blocks += 1
            self.stats.bytes_fetched += self.block_bytes
            if hold:
                out[i] = self.l1.get(keys[i], digests[i])
                if out[i] is None:  # cannot happen single-threaded; be loud if it does
                    raise RdmakvError(f"block {i} vanished from L1 right after insert")
        self.stats.l2_miss_blocks += len(keys) - len(blocks)
        return out

    def exists(self, tokens: Tokens, *, extra: bytes | None = None) -> int:
        """How many leading tokens would hit (a multiple of ``block_tokens``).

        Answered from the L1 index, then -- only if L1 misses a block -- at most
        one batched node ``exists`` for the blocks after the L1 prefix, never a
        round trip per block. Takes no references: a block may be evicted before
        :meth:`acquire`, which then returns fewer. A failing node counts as misses.
        """
        self.poll()
        keys = self.keyer.keys(tokens, extra)
        n = self.l1.count_prefix(keys)
        if n < len(keys) and self.client is not None:
            for present in self._remote_exists(keys[n:]):
                if not present:
                    break
                n += 1
        return n * self.block_tokens

    def prefetch(self, tokens: Tokens, *, extra: bytes | None = None) -> Future[int]:
        """Start fetching the blocks of ``tokens`` that L1 lacks; never blocks on the node.

        The node I/O runs on a background thread, on its own node connection,
        into freshly allocated blocks.
        The fetched leading hits enter L1 (not held) on the engine thread at the
        next manager call, or :meth:`poll` / :meth:`wait_prefetches`; the
        returned future then gives how many blocks arrived (0 on node failure).
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
    ) -> tuple[list[int | None], bool]:
        """On the prefetch thread: one batched get on the prefetch connection.

        Its own connection (opened on first use), so the engine's lookups never
        queue behind a prefetch. Returns the sizes and whether the node failed
        (counted on the engine thread: the stats are not thread-safe).
        """
        started = time.perf_counter()
        try:
            if self._prefetch_client is None:
                assert self._new_client is not None
                self._prefetch_client = self._new_client()
            return self._prefetch_client.get_sizes(keys, blocks, digests), False
        except RdmakvError as e:
            log.warning("prefetch of %d blocks failed, treating as misses: %s", len(keys), e)
            return [None] * len(keys), True
        finally:
            observe = self.on_remote_get  # prometheus histograms are thread-safe
            if observe is not None:
                observe(time.perf_counter() - started)

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
            sizes, failed = p.future.result()
            self.stats.l2_errors += failed
            before = self.stats.l2_hit_blocks
            self._admit(p.keys, p.digests, p.handles, sizes, hold=False, leading=True)
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
            self.poll()  # admit (or free) the blocks of finished prefetches
        if self._prefetch_client is not None:
            self._prefetch_client.close()
            self._prefetch_client = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.l1.clear()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def agree_min(value: int, group: Any) -> int:
    """The minimum of ``value`` over the ranks of a ``torch.distributed`` group (a collective).

    Every rank of ``group`` must call it, in the same order relative to other
    collectives. The wait is bounded by the group's timeout (set at
    ``init_process_group``); torch raises when it expires. torch is imported
    here, not at module import: an L1/node-only user does not pay for it.
    """
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def tp_namespace(
    base: KeyNamespace, *, tp_rank: int, tp_size: int, num_kv_heads: int
) -> KeyNamespace:
    """The key namespace of one TP rank's blocks, shared wherever the bytes are identical.

    A rank's KV block holds the KV heads that rank owns, so what decides
    whether two ranks (of the same or of different TP sizes) can share a block
    is the *head slice*, not the rank number. This names the slice in the
    layout (``kv_layout + "|kv_heads=a:b/H"``) instead of setting the
    namespace's ``tp_rank``/``tp_size``:

    * a rank holding every head (``tp_size == 1``, or ``num_kv_heads == 1`` as
      with MLA's single latent KV replicated on all ranks) gets ``base``
      unchanged: every TP size shares those blocks;
    * heads split evenly (``num_kv_heads % tp_size == 0``): rank ``r`` holds
      ``[r*H/tp, (r+1)*H/tp)``; TP sizes that give the same slice share keys;
    * heads replicated (``tp_size % num_kv_heads == 0``, more ranks than heads,
      vLLM's rule): rank ``r`` holds head ``r * H // tp``; ranks holding the same
      head share keys, so replicated heads are stored once on the node, and
      e.g. TP=4 and TP=8 over 4 heads share every block.
    """
    for name, v in (("tp_size", tp_size), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank!r}")
    heads = num_kv_heads
    if heads % tp_size == 0:
        per = heads // tp_size
        first, last = tp_rank * per, (tp_rank + 1) * per
    elif tp_size % heads == 0:
        first = tp_rank * heads // tp_size
        last = first + 1
    else:
        raise ConfigError(
            f"num_kv_heads={heads} and tp_size={tp_size}: one must divide the other "
            "(the KV heads cannot be split evenly across the ranks)"
        )
    if first == 0 and last == heads:
        return base
    return dataclasses.replace(base, kv_layout=f"{base.kv_layout}|kv_heads={first}:{last}/{heads}")
