"""Admission: which client connections a node keeps, so slow, idle or hostile ones
can never lock good clients out.

A connection is *unauthenticated* from accept until its HELLO (with the right
token) is answered, then *authenticated*. The rules, checked at every accept
and by a periodic sweep:

* **Whole-handshake deadline.** An unauthenticated connection that has not
  finished HELLO ``handshake_timeout_s`` after it was accepted is closed,
  however many bytes it has dribbled in (a per-read timeout would let one byte
  every few seconds hold it open forever).
* **Idle timeout.** An authenticated connection with no request for
  ``idle_timeout_s`` is closed (clients reconnect on their next call).
* **Unauthenticated ones are shed first.** A new connection is always let in
  while someone can make room for it: over ``max_unauthenticated_per_source``
  (or ``max_unauthenticated`` in all) the *oldest* unauthenticated connection
  goes -- a real client finishes HELLO in a round trip, so it is never the
  oldest for long, while a flood only displaces itself.
* **Over ``max_sessions_per_source`` or ``max_sessions``** the victim is, in
  order: a handshake stalled for ``MIN_IDLE_TO_SHED_S``; an authenticated
  connection idle that long (``MIN_UNUSED_TO_SHED_S`` if it never sent a
  request) with no request waiting unread (never-used ones first, then the
  longest idle); a younger handshake, oldest first. Only when every
  connection is busy, recently active or has a request waiting is the new one
  refused. A young handshake comes after the idle ones because it is most
  likely a real client one round trip from authenticated: a token holder
  re-opening idle connections as fast as they are shed would otherwise shed
  every good client mid-HELLO (bench/flood.py, same address: 195 of 200 rounds).

Nothing here touches sockets: :meth:`Admission.admit` and
:meth:`Admission.expired` say whom to close and why, asking a candidate only
whether input waits (:meth:`Tracked.has_input`); the node closes them.
Not thread-safe: the node's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rdmakv import defaults
from rdmakv.errors import ConfigError

MIN_IDLE_TO_SHED_S = 1.0
"""An authenticated connection idle for less than this is never shed to admit another
(it is in active use between two requests), nor is one in a handshake this young
while an idle one can go. (Measured with bench/flood.py: 0.1 s let a
same-address idle flood that re-opens every shed connection churn through the slots
faster than a good client's round, shedding it mid-put.)"""

MIN_UNUSED_TO_SHED_S = 0.25
"""The same floor for an authenticated connection that has not sent a request since
its HELLO: a real client sends its first one within a round trip of the answer (and
one whose request has arrived but waits unread is never shed, see
:meth:`Tracked.has_input`). A token holder re-opening idle connections as fast as
they are shed keeps every slot younger than 1 s; this shorter floor still finds one.
(bench/flood.py, slow+idle phase: 1 of 200 good connects refused with the 1 s floor
alone.)"""

SHED_TIMEOUT = "timeout"


@dataclass(frozen=True)
class SessionLimits:
    """The node's connection limits (config keys ``node.<field>``)."""

    handshake_timeout_s: float = defaults.HANDSHAKE_TIMEOUT_S
    idle_timeout_s: float = defaults.IDLE_TIMEOUT_S
    max_sessions: int = defaults.MAX_SESSIONS
    max_sessions_per_source: int = defaults.MAX_SESSIONS_PER_SOURCE
    max_unauthenticated: int = defaults.MAX_UNAUTHENTICATED
    max_unauthenticated_per_source: int = defaults.MAX_UNAUTHENTICATED_PER_SOURCE

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in (
            "max_sessions",
            "max_sessions_per_source",
            "max_unauthenticated",
            "max_unauthenticated_per_source",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


class Tracked(Protocol):
    """What admission reads of a connection (the node's ``Session``)."""

    source: str
    peer: str
    opened: float
    last_active: float
    authenticated: bool
    closing: bool
    requests: int  # served since HELLO

    @property
    def busy(self) -> bool:
        """Serving a request now (never idle then)."""

    def shed(self) -> None:
        """Close the connection (from any thread)."""

    def has_input(self) -> bool:
        """Whether a request has arrived and waits unread: the connection only
        looks idle because its turn to be served has not come (a loaded node)."""


class Admission:
    """Live connections by source address, and the rules above."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        self._by_source: dict[str, list[Tracked]] = {}  # in accept order

    def _live(self, conns: Iterable[Tracked]) -> list[Tracked]:
        return [c for c in conns if not c.closing]

    def _all(self) -> list[Tracked]:
        return [c for conns in self._by_source.values() for c in conns if not c.closing]

    def admit(self, new: Tracked, now: float) -> tuple[bool, list[Tracked]]:
        """Whether ``new`` may stay, and the connections to close to make room
        (each one already marked ``closing``)."""
        lim = self.limits
        shed: list[Tracked] = []

        def drop(victim: Tracked | None) -> bool:
            if victim is None:
                return False
            victim.closing = True
            shed.append(victim)
            return True

        mine = self._live(self._by_source.get(new.source, ()))
        if sum(not c.authenticated for c in mine) >= lim.max_unauthenticated_per_source:
            drop(_oldest_unauthenticated(mine))
        everyone = self._all()
        if sum(not c.authenticated for c in everyone) >= lim.max_unauthenticated:
            drop(_oldest_unauthenticated(everyone))
        for per_source in (True, False):
            # listed after the previous victim is marked closing: one victim can
            # make room under both caps, and none is shed twice
            if per_source:
                pool = self._live(self._by_source.get(new.source, ()))
                cap = lim.max_sessions_per_source
            else:
                pool, cap = self._all(), lim.max_sessions
            if len(pool) >= cap:
                victim = (
                    _oldest_unauthenticated(pool, older_than=now - MIN_IDLE_TO_SHED_S)
                    or _longest_idle(pool, now)
                    or _oldest_unauthenticated(pool)
                )
                if not drop(victim):
                    return False, shed
        self._by_source.setdefault(new.source, []).append(new)
        return True, shed

    def remove(self, conn: Tracked) -> None:
        conns = self._by_source.get(conn.source)
        if conns is None:
            return
        try:
            conns.remove(conn)
        except ValueError:
            return
        if not conns:
            del self._by_source[conn.source]

    def expired(self, now: float) -> list[tuple[Tracked, str]]:
        """Connections past the handshake deadline or the idle timeout (marked ``closing``)."""
        lim = self.limits
        out: list[tuple[Tracked, str]] = []
        for c in self._all():
            late = (not c.authenticated and now - c.opened > lim.handshake_timeout_s) or (
                c.authenticated and not c.busy and now - c.last_active > lim.idle_timeout_s
            )
            if late:
                c.closing = True
                out.append((c, SHED_TIMEOUT))
        return out

    def counts(self) -> dict[str, int]:
        everyone = self._all()
        return {
            "sessions_unauthenticated": sum(not c.authenticated for c in everyone),
            "sources": len(self._by_source),
        }


def _oldest_unauthenticated(
    conns: list[Tracked], older_than: float = float("inf")
) -> Tracked | None:
    """The first (oldest) connection still in its handshake, if it was opened before
    ``older_than``."""
    return next((c for c in conns if not c.authenticated and c.opened < older_than), None)


def _longest_idle(conns: list[Tracked], now: float) -> Tracked | None:
    """Connections that never sent a request after HELLO go first (an idle flood holds
    slots that way), then the longest idle; never one with a request waiting."""
    idle = [
        c
        for c in conns
        if c.authenticated
        and not c.busy
        and now - c.last_active
        >= (MIN_IDLE_TO_SHED_S if c.requests else MIN_UNUSED_TO_SHED_S)
    ]
    idle.sort(key=lambda c: (c.requests > 0, c.last_active))
    return next((c for c in idle if not c.has_input()), None)
