"""Admission's choice of whom to shed, on its own (it touches no sockets).

The node-level behaviour under real floods is in tests/test_node_limits.py;
here each rule of the victim order is pinned down with exact ages, which a
real node under load cannot give.
"""

from __future__ import annotations

from dataclasses import dataclass

from rdmakv.node.admission import (
    MIN_IDLE_TO_SHED_S,
    MIN_UNUSED_TO_SHED_S,
    Admission,
    SessionLimits,
)

NOW = 1000.0


@dataclass(eq=False)
class Conn:
    """A connection as admission sees it (the node's Session has these fields)."""

    name: str
    opened: float
    authenticated: bool = True
    last_active: float = 0.0
    requests: int = 0
    busy: bool = False
    waiting: bool = False
    source: str = "10.0.0.1"
    closing: bool = False
    was_shed: bool = False

    @property
    def peer(self) -> str:
        return f"{self.source}:{self.name}"

    def shed(self) -> None:
        self.was_shed = True

    def has_input(self) -> bool:
        return self.waiting


def full_node(*conns: Conn, cap: int | None = None) -> Admission:
    n = cap if cap is not None else len(conns)
    adm = Admission(SessionLimits(max_sessions=n, max_sessions_per_source=n))
    for c in conns:
        ok, shed = adm.admit(c, c.opened)
        assert ok and not shed
    return adm


def admit_new(adm: Admission) -> tuple[bool, list[str]]:
    ok, shed = adm.admit(Conn("new", opened=NOW, authenticated=False), NOW)
    return ok, [c.name for c in shed]  # type: ignore[attr-defined]


def idle(name: str, seconds: float, requests: int = 1, waiting: bool = False) -> Conn:
    t = NOW - seconds
    return Conn(name, opened=t - 1, last_active=t, requests=requests, waiting=waiting)


def handshake(name: str, age: float) -> Conn:
    return Conn(name, opened=NOW - age, authenticated=False)


def test_a_young_handshake_outlives_an_idle_connection() -> None:
    """A token holder re-opening idle connections must not shed a client mid-HELLO."""
    adm = full_node(handshake("hello", 0.01), idle("idler", MIN_IDLE_TO_SHED_S + 5))
    assert admit_new(adm) == (True, ["idler"])


def test_a_stalled_handshake_goes_before_any_idle_connection() -> None:
    adm = full_node(
        idle("idler", 100.0, requests=0), handshake("stalled", MIN_IDLE_TO_SHED_S + 0.5)
    )
    assert admit_new(adm) == (True, ["stalled"])


def test_never_used_idle_goes_before_the_longest_idle() -> None:
    adm = full_node(idle("old-user", 200.0), idle("flood", 2.0, requests=0))
    assert admit_new(adm) == (True, ["flood"])


def test_an_idle_looking_connection_with_a_request_waiting_is_kept() -> None:
    """Not yet served is not idle: its request sits unread on a loaded node."""
    adm = full_node(idle("queued", 50.0, requests=0, waiting=True), idle("idler", 2.0))
    assert admit_new(adm) == (True, ["idler"])


def test_young_handshakes_go_oldest_first_when_nothing_is_idle() -> None:
    adm = full_node(
        idle("recent", MIN_IDLE_TO_SHED_S / 2), handshake("a", 0.3), handshake("b", 0.1)
    )
    assert admit_new(adm) == (True, ["a"])


def test_refused_only_when_every_connection_is_busy_or_recent() -> None:
    busy = idle("busy", 60.0)
    busy.busy = True
    adm = full_node(busy, idle("recent", MIN_IDLE_TO_SHED_S / 2), idle("queued", 9.0, waiting=True))
    assert admit_new(adm) == (False, [])


def test_a_connection_that_never_sent_a_request_is_sheddable_sooner() -> None:
    """A same-address idle flood keeps every slot younger than 1 s: its never-used
    connections must still make room, while a used one that young is kept."""
    between = (MIN_UNUSED_TO_SHED_S + MIN_IDLE_TO_SHED_S) / 2
    adm = full_node(idle("user", between), idle("flood", between, requests=0))
    assert admit_new(adm) == (True, ["flood"])
    adm = full_node(idle("user", between), idle("fresh", MIN_UNUSED_TO_SHED_S / 2, requests=0))
    assert admit_new(adm) == (False, [])
