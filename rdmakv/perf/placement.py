"""Where the latency section's client and servers run: the same for every system.

A round trip on one machine costs very different amounts depending on whether
the two ends share a core: with each on its own core every wake-up becomes an
inter-processor interrupt (figures: bench/README.md, "Measurements moved from
code comments (issue 58)"). Left to the scheduler, the short-lived ping-pong
child tends to land beside its parent while a node with several threads does
not, so a lookup would be compared with a round trip made under other
conditions. Each
:class:`Placement` pins the bench (the client) and every process it started
(the servers: the echo child, the node, redis-server, the Mooncake target, and
all their threads) the same way for every system measured under it.

``cross_cpu`` (client and servers on different cores) is what a remote node
looks like: it never runs on the engine's core. ``same_cpu`` shows what the
software on both ends costs once wake-ups are cheap. A machine with one usable
CPU gets ``unpinned``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Placement:
    """Pin the calling thread to ``client_cpu`` and this process's descendants to
    ``server_cpu`` (both None: leave the scheduler alone)."""

    name: str
    client_cpu: int | None = None
    server_cpu: int | None = None

    def describe(self) -> str:
        if self.client_cpu is None or self.server_cpu is None:
            return "unpinned (one usable CPU or no affinity control)"
        if self.client_cpu == self.server_cpu:
            return f"client and servers on cpu {self.client_cpu}"
        return f"client on cpu {self.client_cpu}, servers on cpu {self.server_cpu}"

    def pin_servers(self) -> int:
        """Pin every thread of every descendant process now alive; returns how many.

        Threads a server starts later inherit the mask of the thread that starts
        them, which is pinned by then."""
        if self.server_cpu is None:
            return 0
        pinned = 0
        for pid in descendants(os.getpid()):
            for tid in _tasks(pid):
                # A thread or process that ended meanwhile has nothing left to place.
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, {self.server_cpu})
                    pinned += 1
        return pinned

    @contextlib.contextmanager
    def client(self) -> Iterator[None]:
        """The calling thread on ``client_cpu`` for the block; its mask restored after."""
        if self.client_cpu is None:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.client_cpu})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


def placements() -> list[Placement]:
    """``cross_cpu`` then ``same_cpu`` on the first usable CPUs; ``unpinned`` alone
    where fewer than two can be used."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = []
    if len(cpus) < 2:
        return [Placement("unpinned")]
    return [Placement("cross_cpu", cpus[0], cpus[1]), Placement("same_cpu", cpus[0], cpus[0])]


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return []
