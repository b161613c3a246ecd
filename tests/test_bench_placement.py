"""Placement of the latency section: real child processes pinned, our own mask restored."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rdmakv.bench.placement import Placement, descendants, placements

CPUS = sorted(os.sched_getaffinity(0))
TWO_CPUS = pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs to place apart")


def _grandparent() -> subprocess.Popen[bytes]:
    """A child that starts a grandchild (a thread-holding Python) and waits."""
    code = (
        "import subprocess, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


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
    proc = _grandparent()
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        found = descendants(os.getpid())
        assert proc.pid in found and grandchild in found
        place = Placement("cross_cpu", CPUS[0], CPUS[1])
        assert place.pin_servers() >= 3  # the child's two threads and the grandchild
        for pid in (proc.pid, grandchild):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {CPUS[1]}, (pid, tid)
        assert os.sched_getaffinity(0) == set(CPUS)  # the bench itself untouched
    finally:
        proc.kill()
        proc.wait()


@TWO_CPUS
def test_client_block_pins_and_restores_the_calling_thread() -> None:
    before = os.sched_getaffinity(0)
    with Placement("same_cpu", CPUS[1], CPUS[1]).client():
        assert os.sched_getaffinity(0) == {CPUS[1]}
        time.sleep(0)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), Placement("cross_cpu", CPUS[0], CPUS[1]).client():
        raise RuntimeError("the mask comes back on errors too")
    assert os.sched_getaffinity(0) == before


def test_unpinned_changes_nothing() -> None:
    proc = _grandparent()
    try:
        before = os.sched_getaffinity(proc.pid)
        place = Placement("unpinned")
        assert place.pin_servers() == 0
        with place.client():
            assert os.sched_getaffinity(0) == set(CPUS)
        assert os.sched_getaffinity(proc.pid) == before
    finally:
        proc.kill()
        proc.wait()
