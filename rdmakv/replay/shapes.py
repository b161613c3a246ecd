"""Synthetic traces in the Mooncake format, one per workload shape, from a seed.

The conversation trace (``../shared/traces/``) is one workload. Offload
decisions that hold there may not hold on others, so the replay is also run on
generated traces whose reuse comes from a different place:

``shared_prefix``
    Single-turn requests behind a few popular system prompts and few-shot
    blocks (Zipf popularity), each followed by a unique user part: the
    reuse is at the *start* of every chain.
``shared_docs``
    Long documents (16-80 blocks, Zipf popularity) with a short question, and
    some follow-up questions on the same document: long shared chains, each
    asked for again minutes apart.
``agent``
    Agent loops: a tool-set system prompt, a task, then turn after turn of
    tool output appended, the *whole* growing context re-sent every turn.
    Reuse is at every depth, deepest blocks included.
``unique``
    Mostly unique prompts; a small share starts with a short shared prompt.
    Next to nothing is reused: every byte sent is close to wasted.

Each request is ``{"timestamp", "input_length", "output_length",
"hash_ids"}`` with one hash id per ``block_tokens`` block of the prompt (the
last one may be partial), ids equal exactly where prompts share a prefix
block, so :func:`rdmakv.replay.trace.load_trace` reads the files
:func:`write_trace` writes. The same ``(shape, seed, requests)`` always gives
the same trace (only :class:`random.Random` draws from the seed).
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rdmakv.errors import ConfigError
from rdmakv.replay.trace import TRACE_BLOCK_TOKENS, Trace, TraceRequest

SHAPES = ("shared_prefix", "shared_docs", "agent", "unique")
"""The generated shapes, by the name ``bench/trace_shapes.py --shape`` takes."""
DEFAULT_REQUESTS = 4000
"""Requests per generated trace unless asked otherwise (a few minutes of trace)."""
ZIPF_S = 1.1
"""Popularity skew of shared prompts and documents (1 = classic Zipf)."""
MEAN_GAP_MS = 150.0
"""Mean gap between request (or agent session) arrivals: Poisson arrivals."""
ANSWER_TOKENS = (50, 600)
"""Output length range of a request, in tokens."""


@dataclass
class _Ids:
    """Fresh hash ids: every block of new content gets the next one."""

    next_id: int = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out


@dataclass(order=True)
class _Event:
    """One request due at ``t_ms`` (heap order); ``then`` may schedule the next turn."""

    t_ms: float
    seq: int
    ids: list[int] = field(compare=False)
    partial: int = field(compare=False)
    then: Callable[[float], _Event | None] | None = field(compare=False, default=None)


class _Generator:
    def __init__(self, seed: int, block_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.ids = _Ids()
        self.bt = block_tokens
        self._seq = 0
        self._zipf: dict[int, list[float]] = {}

    def zipf_pick(self, n: int) -> int:
        """An index in ``[0, n)``, index i drawn with weight ``1 / (i + 1) ** ZIPF_S``."""
        weights = self._zipf.get(n)
        if weights is None:
            weights = self._zipf[n] = [1.0 / (i + 1) ** ZIPF_S for i in range(n)]
        return self.rng.choices(range(n), weights=weights)[0]

    def partial(self) -> int:
        """Tokens missing from a prompt's last block (0: it ends on a block boundary)."""
        return self.rng.randrange(self.bt)

    def event(
        self, t_ms: float, ids: list[int], then: Callable[[float], _Event | None] | None = None
    ) -> _Event:
        self._seq += 1
        return _Event(t_ms, self._seq, ids, self.partial(), then)

    def arrivals(self, count: int) -> Iterable[float]:
        t = 0.0
        for _ in range(count):
            t += self.rng.expovariate(1.0 / MEAN_GAP_MS)
            yield t

    def run(self, starts: Iterable[_Event], requests: int) -> list[TraceRequest]:
        """Requests in time order, each event's follow-up scheduled, until ``requests``."""
        heap: list[_Event] = []
        pending = iter(starts)
        upcoming = next(pending, None)
        out: list[TraceRequest] = []
        while len(out) < requests:
            if upcoming is not None and (not heap or upcoming.t_ms <= heap[0].t_ms):
                ev = upcoming
                upcoming = next(pending, None)
            elif heap:
                ev = heapq.heappop(heap)
            else:
                break
            ids = ev.ids
            out.append(
                TraceRequest(
                    int(ev.t_ms),
                    max(1, len(ids) * self.bt - ev.partial),
                    self.rng.randint(*ANSWER_TOKENS),
                    tuple(ids),
                )
            )
            if ev.then is not None:
                nxt = ev.then(ev.t_ms)
                if nxt is not None:
                    heapq.heappush(heap, nxt)
        return out


def _shared_prefix(g: _Generator, requests: int) -> Iterable[_Event]:
    rng = g.rng
    prompts = [g.ids.fresh(rng.randint(2, 12)) for _ in range(40)]
    shots = [[g.ids.fresh(rng.randint(4, 16)) for _ in range(rng.randint(0, 3))] for _ in prompts]
    for t in g.arrivals(requests):
        p = g.zipf_pick(len(prompts))
        ids = list(prompts[p])
        if shots[p]:
            ids += rng.choice(shots[p])
        ids += g.ids.fresh(rng.randint(1, 8))
        yield g.event(t, ids)


def _shared_docs(g: _Generator, requests: int) -> Iterable[_Event]:
    rng = g.rng
    docs = [g.ids.fresh(rng.randint(16, 80)) for _ in range(300)]

    def follow_up(ids: list[int]) -> Callable[[float], _Event | None]:
        def then(t: float) -> _Event | None:
            if rng.random() >= 0.3:  # most readers ask one question
                return None
            more = ids + g.ids.fresh(rng.randint(1, 2))  # the answer and the next question
            return g.event(t + rng.uniform(20_000, 300_000), more, follow_up(more))

        return then

    for t in g.arrivals(requests):
        ids = docs[g.zipf_pick(len(docs))] + g.ids.fresh(1)
        yield g.event(t, ids, follow_up(ids))


def _agent(g: _Generator, requests: int) -> Iterable[_Event]:
    rng = g.rng
    toolsets = [g.ids.fresh(rng.randint(4, 10)) for _ in range(5)]

    def next_turn(ids: list[int], left: int) -> Callable[[float], _Event | None]:
        def then(t: float) -> _Event | None:
            if left <= 0:
                return None
            more = ids + g.ids.fresh(rng.randint(1, 6))  # the call and the tool's output
            return g.event(t + rng.uniform(2_000, 30_000), more, next_turn(more, left - 1))

        return then

    # Sessions arrive ~10x more slowly than single requests: each has many turns.
    for t in g.arrivals(requests):
        ids = rng.choice(toolsets) + g.ids.fresh(rng.randint(1, 4))
        yield g.event(10 * t, ids, next_turn(ids, rng.randint(5, 30)))


def _unique(g: _Generator, requests: int) -> Iterable[_Event]:
    rng = g.rng
    prompts = [g.ids.fresh(rng.randint(1, 3)) for _ in range(5)]
    for t in g.arrivals(requests):
        ids = rng.choice(prompts) if rng.random() < 0.05 else []
        yield g.event(t, ids + g.ids.fresh(rng.randint(2, 40)))


_SHAPES: dict[str, Callable[[_Generator, int], Iterable[_Event]]] = {
    "shared_prefix": _shared_prefix,
    "shared_docs": _shared_docs,
    "agent": _agent,
    "unique": _unique,
}


def generate_trace(
    shape: str,
    *,
    seed: int = 0,
    requests: int = DEFAULT_REQUESTS,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> Trace:
    """``requests`` requests of ``shape`` (:data:`SHAPES`), the same for the same seed."""
    make = _SHAPES.get(shape)
    if make is None:
        raise ConfigError(f"unknown trace shape {shape!r}; expected one of: {', '.join(SHAPES)}")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests <= 0:
        raise ConfigError(f"requests must be a positive int, got {requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")
    g = _Generator(seed, block_tokens)
    return Trace(g.run(make(g, requests), requests), block_tokens)


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as Mooncake JSON lines (what :func:`load_trace` reads)."""
    p = Path(path)
    with p.open("w", encoding="utf-8") as f:
        for r in trace:
            f.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp_ms,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )
    return p
