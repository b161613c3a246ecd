"""Placement of the latency section: real child processes pinned, our own mask restored."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rdmakv.perf.placement import Placement, descendants, placements

CPUS = sorted(os.sched_getaffinity(0))
TWO_CPUS = pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs to place apart")


@contextlib.contextmanager
def _family() -> Iterator[tuple[int, int]]:
    """(child, grandchild): a child holding a second thread that starts a grandchild;
    both killed on exit (the grandchild would outlive a killed child otherwise)."""
    code = (
        "import subprocess, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    grandchild = None
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        yield proc.pid, grandchild
    finally:
        if grandchild is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_placements_cover_both_arrangements_or_say_unpinned() -> None:
    got = placements()
    if len(CPUS) < 2:
        assert [p.name for p in got] == ["unpinned"]
        assert "unpinned" in got[0].describe()
        return
    cross, same = got
    assert (cross.name, same.name) == ("cross_cpu", "same_cpu")
    assert cross.client_cpu != cross.server_cpu
    assert same.client_cpu == same.server_cpu == cross.client_cpu
    assert cross.describe() == f"client on cpu {CPUS[0]}, servers on cpu {CPUS[1]}"


@TWO_CPUS
def test_pin_servers_places_every_thread_of_every_descendant() -> None:
    with _family() as (child, grandchild):
        found = descendants(os.getpid())
        assert child in found and grandchild in found
        place = Placement("cross_cpu", CPUS[0], CPUS[1])
        assert place.pin_servers() >= 3  # the child's two threads and the grandchild
        for pid in (child, grandchild):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {CPUS[1]}, (pid, tid)
        assert os.sched_getaffinity(0) == set(CPUS)  # the bench itself untouched


@TWO_CPUS
def test_client_block_pins_and_restores_the_calling_thread() -> None:
    before = os.sched_getaffinity(0)
    with Placement("same_cpu", CPUS[1], CPUS[1]).client():
        assert os.sched_getaffinity(0) == {CPUS[1]}
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), Placement("cross_cpu", CPUS[0], CPUS[1]).client():
        raise RuntimeError("the mask comes back on errors too")
    assert os.sched_getaffinity(0) == before


def test_unpinned_changes_nothing() -> None:
    with _family() as (child, grandchild):
        before = {pid: os.sched_getaffinity(pid) for pid in (child, grandchild)}
        place = Placement("unpinned")
        assert place.pin_servers() == 0
        with place.client():
            assert os.sched_getaffinity(0) == set(CPUS)
        assert {pid: os.sched_getaffinity(pid) for pid in (child, grandchild)} == before
