"""The node's index in plain Python: the oracle the native one is checked against.

:class:`Index` keeps the contract of :class:`rdmakv.node.index.IndexBase`
with dicts (it was the node's index where the native core was not built,
before the core became required): tests/test_node_store.py runs random
batches of every operation against it and
:class:`~rdmakv.node.native_index.NativeIndex` and asserts the same answers,
the same LRU order and the same pending keys.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rdmakv.node.index import NO_BLOCK, IndexBase, Refcounts, Reserved
from rdmakv.wire.batches import AllocRequest, KeysRequest
from rdmakv.wire.format import MAX_KEY_LEN, AllocStatus

_NO_DIGEST = b""


@dataclass(slots=True)
class _Pending:
    """One pending key of the Python index; its size is the length column's."""

    key: bytes
    block: int
    owner: int
    written: bool = False


class Index(IndexBase):
    """Committed keys in an ``OrderedDict`` (key -> block) in LRU order, oldest
    first, pending ones in dicts by key and by block."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._keys = [b""] * (num_blocks + 1)  # per block: its key (remove_block)
        self._digests = [_NO_DIGEST] * (num_blocks + 1)
        self._pending: dict[bytes, _Pending] = {}
        self._pending_at: dict[int, _Pending] = {}  # the same, by block

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def pending_blocks(self, owner: int | None = None) -> list[int]:
        return [b for b, p in self._pending_at.items() if owner is None or p.owner == owner]

    def _drop_pending(self, p: _Pending) -> int:
        del self._pending[p.key], self._pending_at[p.block]
        return p.block

    def abort(self, owner: int, keys: Sequence[bytes]) -> list[int]:
        out = []
        for key in keys:
            p = self._pending.get(key)
            out.append(NO_BLOCK if p is None or p.owner != owner else self._drop_pending(p))
        return out

    def abandon(self, owner: int) -> list[int]:
        mine = [p for p in self._pending_at.values() if p.owner == owner]
        return [self._drop_pending(p) for p in mine]

    def mark_written(self, owner: int, blocks: Sequence[int]) -> None:
        at = self._pending_at
        for block in blocks:
            p = at.get(block)
            if p is not None and p.owner == owner:
                p.written = True

    def digests(self, blocks: Sequence[int]) -> list[bytes]:
        return [_NO_DIGEST if b == NO_BLOCK else self._digests[b] for b in blocks]

    def _reserve(
        self,
        owner: int,
        request: AllocRequest,
        max_size: int,
        spares: Sequence[int],
        refcounts: Refcounts,
    ) -> tuple[Reserved, int]:
        items = request.items
        for block in spares:
            if not 0 <= block < self.num_blocks or block in self._pending_at or self._keys[block]:
                raise ValueError(f"spare block {block} is out of range or holds a key")
        statuses = bytearray(len(items))
        blocks = array("q", [NO_BLOCK]) * len(items)
        lru, pending, at = self._lru, self._pending, self._pending_at
        used = evicted = evicted_bytes = 0
        for i, (key, size, digest) in enumerate(items):
            if not (0 < size <= max_size and 0 < len(key) <= MAX_KEY_LEN):
                statuses[i] = AllocStatus.TOO_LARGE
                continue
            if key in lru or key in pending:
                statuses[i] = AllocStatus.EXISTS if key in lru else AllocStatus.BUSY
                continue
            if used < len(spares):
                block = spares[used]
                used += 1
            else:
                victim = next((b for b in lru.values() if refcounts[b] == 1), None)
                if victim is None:  # every committed block is leased or being read
                    statuses[i] = AllocStatus.NO_SPACE
                    continue
                block = victim
                evicted += 1
                evicted_bytes += self._lengths[block]
                self._remove_block(block)
            blocks[i] = block
            pending[key] = at[block] = _Pending(key, block, owner)
            self._lengths[block] = size
            self._digests[block] = digest
        return Reserved(statuses, blocks, used, evicted), evicted_bytes

    def _commit(
        self,
        owner: int,
        keys: Sequence[bytes] | KeysRequest,
        checksums: Sequence[int] | npt.NDArray[np.uint64],
        require_written: bool,
    ) -> tuple[list[int], int, int]:
        if isinstance(keys, KeysRequest):
            keys = keys.keys
        if isinstance(checksums, np.ndarray):
            checksums = checksums.tolist()
        pending, lengths, sums, lru = self._pending, self._lengths, self._checksums, self._lru
        out: list[int] = []
        nbytes = one_sided = 0
        for key, checksum in zip(keys, checksums, strict=True):
            p = pending.get(key)
            if p is None or p.owner != owner or (require_written and not p.written):
                out.append(NO_BLOCK)
                continue
            block = self._drop_pending(p)  # a repeat of the key in this batch: a miss
            sums[block] = checksum
            nbytes += lengths[block]
            if not p.written:
                one_sided += lengths[block]
            lru[key] = block
            self._keys[block] = key
            out.append(block)
        return out, nbytes, one_sided

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return list(map(self._lru.__contains__, keys))

    def touch_all(self, keys: Sequence[bytes]) -> list[int]:
        lru = self._lru
        found = [lru.get(key, NO_BLOCK) for key in keys]
        move = lru.move_to_end
        for key, block in zip(keys, found, strict=True):
            if block != NO_BLOCK:
                move(key)
        return found

    def touch_matching(self, keys: Sequence[bytes], digests: Sequence[bytes]) -> list[int]:
        get, move, stored = self._lru.get, self._lru.move_to_end, self._digests
        found: list[int] = []
        add = found.append
        for key, digest in zip(keys, digests, strict=True):
            block = get(key, NO_BLOCK)
            if block == NO_BLOCK or stored[block] != digest:
                add(NO_BLOCK)
                continue
            move(key)
            add(block)
        return found

    def oldest_blocks(self) -> Iterator[int]:
        return iter(self._lru.values())

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._lru.items())

    def _remove(self, keys: Sequence[bytes]) -> list[int]:
        pop = self._lru.pop
        blocks = [pop(key, NO_BLOCK) for key in keys]
        for block in blocks:
            self._keys[block] = b""  # NO_BLOCK: the spare row's
        return blocks

    def _remove_block(self, block: int) -> None:
        del self._lru[self._keys[block]]
        self._keys[block] = b""
