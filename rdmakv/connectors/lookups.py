"""Scheduler-side lookups that never make the engine's scheduler wait on the network.

An engine's scheduler asks, per waiting request, how many of its tokens are
cached remotely. Asking the node on the scheduler thread would stall every
request's scheduling for a round trip, and for the whole client timeout when
the node is slow, stalled or dead. A :class:`LookupService` instead takes the
question (:meth:`LookupService.submit`, as soon as a request arrives), answers
it on its own thread, and the scheduler reads the answer when it is in
(:meth:`LookupService.answer`: ``None`` means "ask again next step", which
vLLM supports).

Invariants:

* Only the lookup thread touches the :class:`~rdmakv.connectors.store.GroupStores`
  (its managers are single-threaded); the scheduler thread only queues
  questions and reads answers, under one lock, never waiting on the thread.
* Every question the thread finds queued is answered in one batch: one
  ``exists`` per KV cache group (per node of a cluster) for all of them, so a
  burst of arrivals costs one round trip, not one each.
* A question is answered or *expires* ``timeout`` seconds after it was
  submitted; an expired question reads as "nothing cached" (the request is
  computed, never held back longer). A node failure is all-absent as well
  (:meth:`rdmakv.manager.KVCacheManager.hit_bitmaps`).
* An entry lives from :meth:`LookupService.submit` until
  :meth:`LookupService.forget` (the request was scheduled or finished), so a
  scheduler that asks several times gets one answer and one node call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rdmakv.connectors.store import GroupStores
from rdmakv.errors import ConfigError, RdmakvError

log = logging.getLogger("rdmakv.connectors.lookups")

Bitmaps = list[list[bool]]
"""One hit bitmap per KV cache group (entry ``i``: block ``i`` is cached)."""


@dataclass
class _Question:
    tokens: Sequence[int]
    extra: bytes | None
    deadline: float
    answer: Bitmaps | None = None


@dataclass
class LookupStats:
    """What the service did (read by tests and logs; written under the service's lock)."""

    batches: int = 0
    answered: int = 0
    expired: int = 0


class LookupService:
    """A thread answering "which blocks of this prompt are cached" for a scheduler.

    ``stores`` are the scheduler side's control-only stores; the service owns
    them from here on (:meth:`close` closes them). ``timeout`` bounds how long
    a question may stay unanswered (see the module docstring).
    """

    def __init__(
        self,
        stores: GroupStores,
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"lookup timeout must be > 0 seconds, got {timeout}")
        self.stores = stores
        self.timeout = timeout
        self.stats = LookupStats()
        self._clock = clock
        self._lock = threading.Condition()
        self._questions: dict[str, _Question] = {}
        self._queued: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rdmakv-lookup", daemon=True)
        self._thread.start()

    # -- scheduler thread ------------------------------------------------------------------
    def submit(self, req_id: str, tokens: Sequence[int], extra: bytes | None) -> None:
        """Queue the question for ``req_id`` unless it is already asked (returns at once)."""
        with self._lock:
            if self._closed or req_id in self._questions:
                return
            self._questions[req_id] = _Question(
                tuple(tokens), extra, self._clock() + self.timeout
            )
            self._queued.append(req_id)
            self._lock.notify()

    def answer(self, req_id: str) -> Bitmaps | None:
        """The bitmaps for ``req_id``; ``None`` while the question is out.

        An unknown request is asked now (``None``). An expired question, or a
        closed service, answers "nothing cached" (one empty bitmap per group).
        """
        with self._lock:
            q = self._questions.get(req_id)
            if q is None:
                return None if not self._closed else self._nothing()
            if q.answer is not None:
                return q.answer
            if self._clock() >= q.deadline:
                q.answer = self._nothing()
                self.stats.expired += 1
                log.warning(
                    "request %s: the node did not answer the lookup within %.1f s; no hit",
                    req_id,
                    self.timeout,
                )
                return q.answer
            return None

    def forget(self, req_id: str) -> None:
        """Drop the request's question and answer (it was scheduled or has finished)."""
        with self._lock:
            self._questions.pop(req_id, None)

    def pending(self) -> int:
        """Questions not answered yet (queued or being asked)."""
        with self._lock:
            return sum(q.answer is None for q in self._questions.values())

    def _nothing(self) -> Bitmaps:
        return [[] for _ in self.stores.groups]

    # -- lookup thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch = [
                    (req_id, self._questions[req_id])
                    for req_id in self._queued
                    if req_id in self._questions
                ]
                self._queued = []
            if not batch:
                continue
            try:
                answers = self.stores.hit_bitmaps([(q.tokens, q.extra) for _, q in batch])
            except RdmakvError as e:  # a bad prompt must not kill the thread
                log.warning("rdmakv lookup of %d request(s) failed, no hits: %s", len(batch), e)
                answers = [self._nothing() for _ in batch]
            with self._lock:
                self.stats.batches += 1
                for (_, q), bitmaps in zip(batch, answers, strict=True):
                    if q.answer is None:  # not expired meanwhile
                        q.answer = bitmaps
                        self.stats.answered += 1

    def close(self) -> None:
        """Stop the thread (a node call in progress ends within the client timeout)
        and close the stores."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()
        self.stores.close()


__all__ = ["Bitmaps", "LookupService", "LookupStats"]
