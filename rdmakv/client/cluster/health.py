"""Per-node health: up, or down with exponential backoff before the next try.

A node is *up* until a call to it fails with a transport error (timeout,
refused, connection lost). It is then *down*: the cluster client does not send
it data; after ``backoff`` seconds a background probe (reconnect + one STATS
round trip) tries it again. Success makes it up; failure doubles the backoff,
up to ``cap_s``. Consecutive failures ``k`` give a backoff of
``min(base_s * 2**(k-1), cap_s)``.

Not thread-safe by itself: the cluster client mutates it under its own lock.
"""

from __future__ import annotations

import dataclasses

from rdmakv.errors import ConfigError

DEFAULT_BACKOFF_BASE_S = 0.5
"""Wait before the first retry of a node that just failed."""
DEFAULT_BACKOFF_CAP_S = 30.0
"""Longest wait between retries of a node that keeps failing."""


@dataclasses.dataclass
class NodeHealth:
    """Failure count, next retry time (monotonic seconds) and last error of one node.

    Invariants: ``failures == 0`` iff the node is up; while down,
    ``retry_at`` is when a probe may start; ``probing`` is True while one runs
    (at most one probe per node at a time).
    """

    base_s: float = DEFAULT_BACKOFF_BASE_S
    cap_s: float = DEFAULT_BACKOFF_CAP_S
    failures: int = 0
    retry_at: float = 0.0
    probing: bool = False
    last_error: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ConfigError(
                f"backoff must satisfy 0 < base ({self.base_s}) <= cap ({self.cap_s})"
            )

    @property
    def up(self) -> bool:
        return self.failures == 0

    def backoff_s(self) -> float:
        """The current wait between tries (0 when up)."""
        if self.failures == 0:
            return 0.0
        # cap the exponent too: 2**k overflows a float long before it matters
        return min(self.base_s * 2.0 ** min(self.failures - 1, 64), self.cap_s)

    def failed(self, now: float, error: str) -> bool:
        """Record a failure at ``now``; True when this took the node from up to down."""
        was_up = self.up
        self.failures += 1
        self.retry_at = now + self.backoff_s()
        self.last_error = error
        return was_up

    def succeeded(self) -> bool:
        """Record a success; True when this took the node from down to up."""
        was_down = not self.up
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = ""
        return was_down

    def probe_due(self, now: float) -> bool:
        """Down, no probe running, and the backoff has passed."""
        return not self.up and not self.probing and now >= self.retry_at
