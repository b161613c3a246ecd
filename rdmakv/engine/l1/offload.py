"""Offload: the bounded hand-off queue between the L1 cache and the remote tier.

Which blocks are offered, and when, is the offload policy's business
(:mod:`rdmakv.engine.l1.offload_policies`). The L1 cache (engine thread) *offers*
blocks; a transport thread *takes* them, sends their bytes, and says it is
*done*. The queue is bounded by pending bytes:
past the bound an offer is refused at once and counted, so a slow network never
stalls the engine -- the block simply is not offloaded.

Ownership: an :class:`OffloadItem` in the queue (or taken and not yet done)
stands for one slab reference held on the producer's behalf, so the block cannot
be reused while its bytes are being sent. ``done`` releases the pending bytes
immediately (back-pressure eases at once) but does *not* touch the slab, which is
single-threaded: finished items wait in a completion list until the producer
calls :meth:`OffloadQueue.drain_completed` on its own thread and drops the
references. One producer per queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from rdmakv.blocks.keys import BlockKey
from rdmakv.errors import ConfigError


@dataclass
class OffloadItem:
    """One block to send: ``nbytes`` valid bytes of slab block ``handle``."""

    key: BlockKey
    handle: int
    nbytes: int
    digest: bytes


class OffloadQueue:
    """FIFO of :class:`OffloadItem`, bounded by pending bytes. Thread-safe.

    *Pending* bytes are those offered and not yet ``done`` (queued or being
    sent). ``offer`` never blocks; ``take`` may wait up to its timeout.
    """

    def __init__(self, max_pending_bytes: int) -> None:
        if (
            isinstance(max_pending_bytes, bool)
            or not isinstance(max_pending_bytes, int)
            or max_pending_bytes <= 0
        ):
            raise ConfigError(
                f"max_pending_bytes must be a positive int, got {max_pending_bytes!r}"
            )
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._items: deque[OffloadItem] = deque()
        self._completed: list[OffloadItem] = []
        self._closed = False
        self.pending_bytes = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self.accepted = 0
        self.accepted_bytes = 0
        self.drained = 0  # items handed back to the producer by drain_completed

    # -- producer side -------------------------------------------------------
    def offer(self, item: OffloadItem) -> bool:
        """Enqueue ``item``; False (counted in :attr:`dropped`) if it would exceed the bound.

        On False the producer keeps its reference and must drop it itself.
        """
        if item.nbytes <= 0:
            raise ConfigError(f"offload item for handle {item.handle} has nbytes={item.nbytes}")
        with self._cond:
            if self._closed or self.pending_bytes + item.nbytes > self.max_pending_bytes:
                self.dropped += 1
                self.dropped_bytes += item.nbytes
                return False
            self.pending_bytes += item.nbytes
            self.accepted += 1
            self.accepted_bytes += item.nbytes
            self._items.append(item)
            self._cond.notify()
            return True

    def drain_completed(self) -> list[OffloadItem]:
        """Items the consumer finished (or that were discarded); producer drops their refs."""
        with self._cond:
            out, self._completed = self._completed, []
            self.drained += len(out)
            return out

    # -- consumer side -------------------------------------------------------
    def take(self, max_items: int, timeout: float | None = 0) -> list[OffloadItem]:
        """Up to ``max_items`` items, oldest first.

        ``timeout=0`` returns at once (possibly empty); ``None`` waits until at
        least one item arrives or the queue is closed; a positive value waits at
        most that many seconds. Taken items stay pending until :meth:`done`.
        """
        if max_items <= 0:
            raise ConfigError(f"max_items must be positive, got {max_items}")
        if timeout is not None and timeout < 0:
            raise ConfigError(f"timeout must be >= 0 or None, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items and not self._closed:
                if deadline is None:
                    self._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            n = min(max_items, len(self._items))
            return [self._items.popleft() for _ in range(n)]

    def done(self, items: Iterable[OffloadItem]) -> None:
        """The consumer has finished with ``items`` (sent or failed): free their pending bytes."""
        items = list(items)
        total = sum(it.nbytes for it in items)
        with self._cond:
            if total > self.pending_bytes:
                # More done() than offers: a consumer bug; fail loudly, change nothing.
                raise ConfigError(
                    f"OffloadQueue.done() for {total} bytes, but only "
                    f"{self.pending_bytes} are pending: items that were not pending"
                )
            self.pending_bytes -= total
            self._completed.extend(items)

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Refuse new offers, wake waiting consumers, and discard queued items.

        Discarded items go to the completion list so the producer still drops
        their references; items already taken remain the consumer's to finish.
        """
        with self._cond:
            self._closed = True
            while self._items:
                it = self._items.popleft()
                self.pending_bytes -= it.nbytes
                self._completed.append(it)
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        """Items queued and not yet taken."""
        with self._cond:
            return len(self._items)
