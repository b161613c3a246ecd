"""What one replay is asked to do, and what it measured (shared by the model and the stack)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ROUTINGS = ("prefix", "random")
HINT_FORMS = ("request", "prefix")
"""What the replayed ``keep`` hint says: ``request``, one bool per request
(whether a later request continues it); ``prefix``, a token count (how many
of its first tokens a later request asks for again; see
:data:`rdmakv.engine.l1.KeepHint`)."""
AFFINITY_BLOCK = 1
"""``prefix`` routing sends a request to the engine chosen by its block at this index
(or its last full block if shorter): requests that share their first blocks --
turns of one conversation behind a shared system prompt -- land on one engine,
as a prefix-aware router does."""


@dataclass(frozen=True)
class ReplaySetup:
    """The knobs of one replay.

    ``l1_blocks`` is each engine's L1 capacity in blocks, ``node_blocks`` the
    node's (None: unbounded). ``offload`` is an offload mode name or
    ``"oracle"``; ``hints`` passes each request's ``keep`` hint to the manager:
    whether the trace continues it (:meth:`~rdmakv.replay.trace.TraceKeys.hint`),
    wrong for a ``hint_noise`` share of the requests; or, with ``hint_form``
    ``"prefix"``, how many of its first tokens are asked for again
    (:meth:`~rdmakv.replay.trace.TraceKeys.reused_tokens`).
    ``engines`` > 1 replays a fleet sharing one node, each request routed by
    ``routing`` (:data:`ROUTINGS`).
    """

    l1_blocks: int
    node_blocks: int | None = None
    offload: str = "all"
    offload_budget: float | None = None
    hints: bool = False
    hint_noise: float = 0.0
    hint_form: str = "request"
    policy: str = "lru"
    engines: int = 1
    routing: str = "prefix"
    timeline_s: float = 60.0

    @property
    def label(self) -> str:
        """Short name: ``all``, ``reuse@0.5``, ``reuse+hint``, ``reuse+hint~0.2`` (noisy),
        ``reuse+prefix-hint`` (the token-count form)."""
        name = self.offload
        if self.offload_budget is not None:
            name += f"@{self.offload_budget:g}"
        if self.hints:
            name += "+prefix-hint" if self.hint_form == "prefix" else "+hint"
            name += f"~{self.hint_noise:g}" if self.hint_noise else ""
        return name


@dataclass
class ReplayResult:
    """Counts of one replay. Blocks are full blocks; a hit is a block not recomputed."""

    setup: ReplaySetup
    requests: int = 0
    blocks: int = 0
    l1_hits: int = 0
    node_hits: int = 0
    sent_blocks: int = 0
    """Blocks written to the node during the replay."""
    drained_blocks: int = 0
    """Blocks written when every L1 is emptied through eviction at the end: what a
    policy that sends at eviction still owes. ``sent + drained`` is the steady-state cost."""
    dropped_offloads: int = 0
    wrong_blocks: int = 0
    timeline: list[list[float]] = field(default_factory=list)
    """``[trace second, blocks, hits]`` per ``timeline_s`` of trace time."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hits(self) -> int:
        return self.l1_hits + self.node_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def steady_sent_blocks(self) -> int:
        return self.sent_blocks + self.drained_blocks

    def count_request(self, t_ms: int, blocks: int, l1_hits: int, node_hits: int) -> None:
        self.requests += 1
        self.blocks += blocks
        self.l1_hits += l1_hits
        self.node_hits += node_hits
        t = int(t_ms / 1000.0 // self.setup.timeline_s * self.setup.timeline_s)
        if not self.timeline or self.timeline[-1][0] != t:
            self.timeline.append([t, 0, 0])
        self.timeline[-1][1] += blocks
        self.timeline[-1][2] += l1_hits + node_hits

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(hit_rate=self.hit_rate, steady_sent_blocks=self.steady_sent_blocks)
        return out
