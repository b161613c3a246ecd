"""What the chaos cases drive: a KVCacheManager pair or a ClusterClient, one API.

A :class:`Target` writes batches of blocks and reads them back, checking every
block it gets byte for byte against what was put for that key. The cases in
``test_chaos.py`` only call :meth:`Target.write`, :meth:`Target.read` and
:meth:`Target.rewrite`; any exception out of them is a test failure (the
manager and the cluster client promise misses, never exceptions, on node
faults).

* :class:`ManagerTarget`: a *writer* manager (offload ``all``: its offloader
  thread puts every block on the remote tier) and a *reader* manager (offload
  ``none``) whose L1 is emptied before each read, so every read is a remote
  fetch. Block bytes are a function of the block key (:func:`kv_bytes`), as an
  engine's KV is a function of the tokens.
* :class:`ClusterTarget`: a :class:`ClusterClient` over a slab; each key's
  source block holds random bytes, reads land in separate destination blocks.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdmakv.blocks.keys import BlockKey, KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster import ClusterClient
from rdmakv.engine.manager import KVCacheManager

CLIENT_TIMEOUT_S = 1.0
"""Every remote wait of every client here (small, so that stalls resolve fast)."""
BLOCK_TOKENS = 4
BLOCK_BYTES = 16 * 1024
VOCAB = 32000
PROMPT_BLOCKS = 32
PROMPTS_PER_BATCH = 2
FLUSH_S = 10.0
"""Bound on waiting for the writer's offloads after a write (not asserted: a
faulty node may drop them)."""
CLUSTER_KEYS = 96
CLUSTER_SLAB_BYTES = 64 * 1024 * 1024
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 2.0


def kv_bytes(key: BlockKey, nbytes: int = BLOCK_BYTES) -> np.ndarray[Any, Any]:
    """The KV an engine would have computed for block ``key``: a function of the key only."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@dataclasses.dataclass
class ReadResult:
    """One read of a batch: blocks that hit, blocks asked for, and every hit
    whose bytes differ from what was put (a description each)."""

    hits: int
    total: int
    wrong: list[str]

    @property
    def complete(self) -> bool:
        return self.hits == self.total and not self.wrong


class Target(abc.ABC):
    """Writes and reads batches of blocks through one client API (module doc)."""

    name: str

    @abc.abstractmethod
    def new_batch(self) -> Any:
        """A batch of blocks never written before (distinct keys and bytes)."""

    @abc.abstractmethod
    def write(self, batch: Any) -> None:
        """Put every block of ``batch`` (waits, bounded, for it to reach the nodes)."""

    @abc.abstractmethod
    def rewrite(self, batch: Any) -> None:
        """Put ``batch`` again, as a client that no longer caches it would."""

    @abc.abstractmethod
    def read(self, batch: Any) -> ReadResult:
        """Read every block of ``batch`` from the nodes, checking every hit's bytes."""

    @abc.abstractmethod
    def live_hits(self, batch: Any, dead: set[str]) -> int:
        """The hits a read of ``batch`` must give while the nodes ``dead`` (client-side
        ids) are unusable and the others hold the whole batch."""

    @abc.abstractmethod
    def clients(self) -> list[object]:
        """The remote-tier clients that carry this target's traffic."""

    def all_up(self) -> bool:
        """Every cluster client uses every member again (none is backing off)."""
        return all(
            len(c.up_members) == len(c.members)
            for c in self.clients()
            if isinstance(c, ClusterClient)
        )

    @abc.abstractmethod
    def close(self) -> None: ...

    def _owners(self, client: object, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        if isinstance(client, ClusterClient):
            return client.owners(keys)
        return [(self.spec,)] * len(keys)

    spec: str


@dataclasses.dataclass
class Prompts:
    tokens: list[np.ndarray[Any, Any]]


class ManagerTarget(Target):
    """A writer and a reader :class:`KVCacheManager` on remote tier ``spec``."""

    def __init__(self, spec: str, replication: int, seed: int) -> None:
        self.name = f"manager({spec}, R={replication})"
        self.spec = spec
        common: dict[str, Any] = {
            "namespace": KeyNamespace(model="chaos-model", dtype="float16", kv_layout="NHD"),
            "block_tokens": BLOCK_TOKENS,
            "block_bytes": BLOCK_BYTES,
            "node": spec,
            "transport": "tcp",
            "timeout": CLIENT_TIMEOUT_S,
            "lock_slab": False,
            "replication": replication,
        }
        per_batch = PROMPT_BLOCKS * PROMPTS_PER_BATCH
        self.writer = KVCacheManager(
            **common,
            l1_bytes=4 * per_batch * BLOCK_BYTES,
            offload="all",
            max_pending_offload_bytes=2 * per_batch * BLOCK_BYTES,
        )
        try:
            self.reader = KVCacheManager(
                **common, l1_bytes=2 * PROMPT_BLOCKS * BLOCK_BYTES, offload="none"
            )
        except BaseException:
            self.writer.close()
            raise
        self._seeds = itertools.count(seed)

    def new_batch(self) -> Prompts:
        out = []
        for _ in range(PROMPTS_PER_BATCH):
            rng = np.random.default_rng(next(self._seeds))
            out.append(rng.integers(0, VOCAB, PROMPT_BLOCKS * BLOCK_TOKENS, dtype=np.int32))
        return Prompts(out)

    def write(self, batch: Prompts) -> None:
        m = self.writer
        for tokens in batch.tokens:
            keys = m.keyer.keys(tokens)
            handles = m.allocate_for(len(keys))
            for h, key in zip(handles, keys, strict=True):
                m.block_view(h)[:] = kv_bytes(key)
            m.put(tokens, handles)
        m.flush(FLUSH_S)

    def rewrite(self, batch: Prompts) -> None:
        # an engine that evicted the prefix computes it again: fresh L1 entries,
        # offloaded like any new block
        for tokens in batch.tokens:
            for key in self.writer.keyer.keys(tokens):
                self.writer.l1.drop(key)
        self.write(batch)

    def read(self, batch: Prompts) -> ReadResult:
        m = self.reader
        m.l1.clear()  # every block must come from the remote tier
        hits = total = 0
        wrong: list[str] = []
        for p, tokens in enumerate(batch.tokens):
            keys = m.keyer.keys(tokens)
            total += len(keys)
            m.exists(tokens)  # lookups: answers may be anything, but never an exception
            m.hit_bitmap(tokens)
            got = m.acquire(tokens)
            try:
                for i, h in enumerate(got.handles):
                    if not np.array_equal(m.block_view(h), kv_bytes(keys[i])):
                        diff = int(np.count_nonzero(m.block_view(h) != kv_bytes(keys[i])))
                        wrong.append(f"prompt {p} block {i}: {diff} bytes differ")
                hits += got.num_blocks
            finally:
                m.release(got)
        return ReadResult(hits, total, wrong)

    def live_hits(self, batch: Prompts, dead: set[str]) -> int:
        # a prefix hit stops at the first block no live replica holds
        n = 0
        for tokens in batch.tokens:
            keys = self.reader.keyer.keys(tokens)
            for owners in self._owners(self.reader.client, keys):
                if not set(owners) - dead:
                    break
                n += 1
        return n

    def clients(self) -> list[object]:
        # the writer's blocks travel on its offloader's own client
        assert self.writer.offloader is not None
        return [self.writer.offloader.client, self.reader.client]

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            self.reader.close()


@dataclasses.dataclass
class Blocks:
    keys: list[bytes]
    src: list[int]
    dst: list[int]
    digests: list[bytes]


class ClusterTarget(Target):
    """A :class:`ClusterClient` on ``spec`` over its own slab."""

    def __init__(self, spec: str, replication: int, seed: int) -> None:
        self.name = f"cluster({spec}, R={replication})"
        self.spec = spec
        self.slab = Slab(CLUSTER_SLAB_BYTES, BLOCK_BYTES, lock=False)
        try:
            self.client = ClusterClient(
                spec,
                self.slab,
                transport="tcp",
                timeout=CLIENT_TIMEOUT_S,
                replication=replication,
                backoff_base_s=BACKOFF_BASE_S,
                backoff_cap_s=BACKOFF_CAP_S,
            )
        except BaseException:
            self.slab.close()
            raise
        self._seeds = itertools.count(seed)
        self._batches: list[Blocks] = []

    def new_batch(self) -> Blocks:
        seed = next(self._seeds)
        if len(self._batches) * 2 * CLUSTER_KEYS + 2 * CLUSTER_KEYS > self.slab.num_blocks:
            self._free(self._batches.pop(0))  # the oldest batch is not needed any more
        keys = [
            hashlib.blake2b(f"chaos/{seed}/{i}".encode(), digest_size=16).digest()
            for i in range(CLUSTER_KEYS)
        ]
        src = self.slab.alloc_many(CLUSTER_KEYS)
        dst = self.slab.alloc_many(CLUSTER_KEYS)
        rng = np.random.default_rng(seed)
        digests = []
        for h in src:
            self.slab.numpy(h)[:] = rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
            digests.append(hashlib.blake2b(self.slab.view(h), digest_size=16).digest())
        b = Blocks(keys, src, dst, digests)
        self._batches.append(b)
        return b

    def _free(self, b: Blocks) -> None:
        for h in (*b.src, *b.dst):
            self.slab.decref(h)

    def write(self, batch: Blocks) -> None:
        self.client.put(batch.keys, batch.src, BLOCK_BYTES, batch.digests)

    def rewrite(self, batch: Blocks) -> None:
        self.write(batch)

    def read(self, batch: Blocks) -> ReadResult:
        for h in batch.dst:
            self.slab.numpy(h)[:] = 0
        got = self.client.get_sizes(batch.keys, batch.dst, batch.digests)
        self.client.exists(batch.keys)  # a lookup: any answer, but never an exception
        wrong = []
        for i, (s, d, n) in enumerate(zip(batch.src, batch.dst, got, strict=True)):
            if n is None:
                continue
            if n != BLOCK_BYTES or bytes(self.slab.view(s)) != bytes(self.slab.view(d)):
                diff = int(np.count_nonzero(self.slab.numpy(s) != self.slab.numpy(d)))
                wrong.append(f"key {i}: length {n}, {diff} bytes differ")
        return ReadResult(sum(n is not None for n in got), len(got), wrong)

    def live_hits(self, batch: Blocks, dead: set[str]) -> int:
        return sum(1 for owners in self._owners(self.client, batch.keys) if set(owners) - dead)

    def clients(self) -> list[object]:
        return [self.client]

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.slab.close()
