"""Lookups that never make an engine's scheduler wait on the network.

An engine's scheduler asks, per waiting request (or per chunk), what is
cached remotely. Asking the node on the scheduler thread would stall every
request's scheduling for a round trip, and for the whole client timeout when
the node is slow, stalled or dead. A :class:`BatchLookups` instead takes the
question (:meth:`BatchLookups.ask`), answers it on its own thread, and the
scheduler reads the answer when it is in (:meth:`BatchLookups.answer`:
``None`` means "ask again later": vLLM's ``None`` from
``get_num_new_matched_tokens``, a tier's ``RETRY``).

Two users, one mechanism:

* :class:`LookupService` (rdmakv's vLLM connector): one question per request,
  its prompt; the answer is a hit bitmap per KV cache group.
* the vLLM secondary tier (:mod:`rdmakv.connectors.chunk_tier`): one
  question per chunk key; the answer is whether the node holds it. Its
  questions are *deferred* (``wake=False``) and sent together at the end of
  the scheduler step (:meth:`BatchLookups.flush`), so one step costs one
  round trip per node.

Invariants:

* Only the lookup thread calls ``answer_batch`` (what it touches is
  single-threaded there); the scheduler thread only queues questions and
  reads answers, under one lock, never waiting on the thread.
* Every question the thread finds queued is answered in one batch (one call
  of ``answer_batch``), so a burst of questions costs one round trip, not one
  each.
* A question is answered or *expires* ``timeout`` seconds after it was asked;
  an expired question reads as the ``nothing`` answer (no hit): the work is
  computed, never held back longer. A failed ``answer_batch``
  (:class:`~rdmakv.errors.RdmakvError`) answers ``nothing`` as well.
* An entry lives from :meth:`BatchLookups.ask` until
  :meth:`BatchLookups.forget`, so a scheduler that asks several times gets
  one answer and one node call; :meth:`BatchLookups.settle` overrides an
  answer the caller learnt better (a load that failed: no hit any more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rdmakv.connectors.group_stores import GroupStores
from rdmakv.errors import ConfigError, RdmakvError

log = logging.getLogger("rdmakv.connectors.lookups")

Bitmaps = list[list[bool]]
"""One hit bitmap per KV cache group (entry ``i``: block ``i`` is cached)."""
Prompt = tuple[Sequence[int], bytes | None]
"""A connector's question: the prompt's tokens and its key extra."""

Id = TypeVar("Id", bound=Hashable)
Q = TypeVar("Q")
A = TypeVar("A")


@dataclass
class _Question(Generic[Q, A]):
    question: Q
    deadline: float
    answer: A | None = None


@dataclass
class LookupStats:
    """What the service did (read by tests and logs; written under the service's lock)."""

    batches: int = 0
    answered: int = 0
    expired: int = 0


class BatchLookups(Generic[Id, Q, A]):
    """A thread answering a scheduler's questions in batches (see the module docstring).

    ``answer_batch`` answers a list of questions, in order, with one remote
    call; ``nothing`` is the answer of an expired or failed question.
    ``timeout`` bounds how long a question may stay unanswered. ``on_close``
    runs once the thread stopped (it closes what ``answer_batch`` used).
    """

    def __init__(
        self,
        answer_batch: Callable[[list[Q]], Sequence[A]],
        nothing: Callable[[], A],
        timeout: float,
        *,
        on_close: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "rdmakv-lookup",
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"lookup timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.stats = LookupStats()
        self._answer_batch = answer_batch
        self._nothing = nothing
        self._on_close = on_close
        self._clock = clock
        # The scheduler's calls take the bare lock (no Python-level Condition frames:
        # a tier asks once per chunk, many per step); the thread waits on the Condition.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._questions: dict[Id, _Question[Q, A]] = {}
        self._queued: list[Id] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- scheduler thread ------------------------------------------------------------------
    def ask(self, qid: Id, question: Q, *, wake: bool = True) -> A | None:
        """Queue ``question`` as ``qid`` unless that is already asked (returns at once),
        and return its answer as :meth:`answer` does (``None`` while it is out).

        ``wake=False`` defers it to the next :meth:`flush` (or the next woken
        question): a step's questions then go out as one batch."""
        with self._mutex:
            if not self._closed and qid not in self._questions:
                self._questions[qid] = _Question(question, self._clock() + self.timeout)
                self._queued.append(qid)
                if wake:
                    self._lock.notify()
                return None
            return self._answer(qid)

    def flush(self) -> None:
        """Send the deferred questions now (one batch)."""
        with self._lock:
            if self._queued:
                self._lock.notify()

    def answer(self, qid: Id) -> A | None:
        """The answer for ``qid``; ``None`` while the question is out (or never asked).

        An expired question, or a closed service, answers ``nothing``.
        """
        with self._mutex:
            return self._answer(qid)

    def _answer(self, qid: Id) -> A | None:
        q = self._questions.get(qid)
        if q is None:
            return None if not self._closed else self._nothing()
        if q.answer is not None:
            return q.answer
        if self._clock() >= q.deadline:
            q.answer = self._nothing()
            self.stats.expired += 1
            log.warning(
                "lookup %s: the node did not answer within %.1f s; no hit",
                qid if isinstance(qid, str) else "(key)",
                self.timeout,
            )
            return q.answer
        return None

    def settle(self, qid: Id, answer: A) -> None:
        """Replace ``qid``'s answer (if asked) with ``answer``: the caller knows better."""
        with self._mutex:
            q = self._questions.get(qid)
            if q is not None:
                q.answer = answer

    def forget(self, qid: Id) -> None:
        """Drop the question and its answer (the one who asked is done with it)."""
        with self._mutex:
            self._questions.pop(qid, None)

    def pending(self) -> int:
        """Questions not answered yet (queued or being asked)."""
        with self._lock:
            return sum(q.answer is None for q in self._questions.values())

    def size(self) -> int:
        """Questions held (answered or not), until forgotten."""
        with self._lock:
            return len(self._questions)

    # -- lookup thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch = [
                    (qid, self._questions[qid]) for qid in self._queued if qid in self._questions
                ]
                self._queued = []
            if not batch:
                continue
            try:
                answers = list(self._answer_batch([q.question for _, q in batch]))
            except RdmakvError as e:  # a bad question or a dead node must not kill the thread
                log.warning("rdmakv lookup of %d question(s) failed, no hits: %s", len(batch), e)
                answers = [self._nothing() for _ in batch]
            with self._lock:
                self.stats.batches += 1
                for (_, q), a in zip(batch, answers, strict=True):
                    if q.answer is None:  # not expired or settled meanwhile
                        q.answer = a
                        self.stats.answered += 1

    def close(self) -> None:
        """Stop the thread (a node call in progress ends within the client timeout),
        then run ``on_close``."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()
        if self._on_close is not None:
            self._on_close()


class LookupService(BatchLookups[str, Prompt, Bitmaps]):
    """The connector's lookups: "which blocks of this prompt are cached", per request.

    ``stores`` are the scheduler side's control-only stores; the service owns
    them from here on (:meth:`close` closes them). A question is answered with
    :meth:`GroupStores.hit_bitmaps` (one batched node call per group) and
    lives until :meth:`forget` (the request was scheduled or finished).
    """

    def __init__(
        self,
        stores: GroupStores,
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stores = stores
        super().__init__(
            stores.hit_bitmaps,
            lambda: [[] for _ in stores.groups],
            timeout,
            on_close=stores.close,
            clock=clock,
        )

    def submit(self, req_id: str, tokens: Sequence[int], extra: bytes | None) -> None:
        """Queue the question for ``req_id`` unless it is already asked (returns at once)."""
        self.ask(req_id, (tuple(tokens), extra))


__all__ = ["BatchLookups", "Bitmaps", "LookupService", "LookupStats", "Prompt"]
