"""``rdmakv bench``: the runner, its registry and the two systems that never skip.

Real processes throughout (a real ``rdmakv serve``, the socket loop's child);
the only fake is a driver that injects "this peer cannot run here". No timing
assertions: benchmarks are not tests (DESIGN.md section 5).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from rdmakv.client.streams import default_streams
from rdmakv.errors import RdmakvError
from rdmakv.perf import command, latency, measure, settings
from rdmakv.perf.driver import Arena, PeerUnavailable, Workload
from rdmakv.perf.drivers import (
    OURS_VARIANTS,
    default_systems,
    make_driver,
    register,
    socket_loop,
    unregister,
)
from rdmakv.perf.drivers.rdmakv_node import RdmakvDriver
from rdmakv.perf.drivers.socket_loop import IOV_MAX, WINDOW_BYTES, SocketLoopDriver
from rdmakv.perf.placement import placements
from rdmakv.transport.tcp import loop as tcp

QUICK_SIZES = ("16384", "262144")


def _arenas(work: Workload, seed: int) -> tuple[Arena, Arena]:
    """A source arena of ``work`` filled with random bytes, and a destination one."""
    n = work.block_bytes * work.blocks
    src, dst = measure.arena(n), measure.arena(n)
    measure.fill_random(src, seed)
    return src, dst


def test_cli_quick_rdmakv_and_socket_loop(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, "-m", "rdmakv.cli", "bench", "--quick", "--json", "--no-progress",
         "--systems", "rdmakv,socket_loop", "--out", str(out), "--name", "q"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert set(res) == {"tcp", "latency", "concurrency", "ratios", "meta"}
    assert tuple(res["tcp"]) == QUICK_SIZES
    for size, per in res["tcp"].items():
        assert set(per) == {"rdmakv", "socket_loop"}
        for name in ("rdmakv", "socket_loop"):
            fig = per[name]
            assert set(fig) == {
                "put_gbps", "get_gbps", "put_gbps_median", "get_gbps_median", "repeats",
                "fresh_connections", "warm_up", "warm_up_rounds", "bytes_verified",
            }, (size, name, fig)
            assert fig["fresh_connections"] is True  # both reconnect between repeats
            assert fig["warm_up"] is True  # the default: timed transfers on warm connections
            assert fig["warm_up_rounds"] == 1  # quick: one round, the drivers checked
            assert fig["bytes_verified"] == settings.QUICK_BLOCKS * int(size)
            assert fig["put_gbps"] > 0 and fig["get_gbps"] > 0
            # best of the repeats, the median beside it
            assert 0 < fig["put_gbps_median"] <= fig["put_gbps"]
            assert 0 < fig["get_gbps_median"] <= fig["get_gbps"]
        # --quick asks for 1 repeat; the ceiling's minimum applies to every system
        assert per["rdmakv"]["repeats"] == per["socket_loop"]["repeats"] == (
            SocketLoopDriver.min_repeats
        )
        r = res["ratios"][size]
        assert r["put_vs_socket_loop"] > 0 and r["get_vs_socket_loop"] > 0
        assert r["put_vs_socket_loop_median"] > 0 and r["get_vs_socket_loop_median"] > 0
        assert r["put_vs_best_peer"] is None  # no peer in this run
    lat = res["latency"]
    assert lat["round_trip"]["p50_ms"] > 0
    ours = lat["systems"]["rdmakv"]
    for op in ("exists_1", "exists_16", "exists_64", "get_1"):
        assert 0 < ours[op]["p50_ms"] <= ours[op]["p99_ms"], op
        # a round trip beside every sample, under the same load
        trip = ours[op]["paired_round_trip"]
        assert 0 < trip["p50_ms"] <= trip["p99_ms"], op
    assert "get_1" in lat["systems"]["socket_loop"]
    assert "exists_1" not in lat["systems"]["socket_loop"]  # no lookup there
    # Every placement measures the round trip and every system the same way.
    names = [p.name for p in placements()]
    assert lat["placement"] == names[0] and lat["cpus"]
    lat_ratios = res["ratios"]["latency"]
    assert lat_ratios["exists_64_p99_vs_paired_round_trip_p99"] == round(
        ours["exists_64"]["p99_ms"] / ours["exists_64"]["paired_round_trip"]["p99_ms"], 3
    )
    assert "exists_64_p99_vs_round_trip_p99" in lat_ratios
    for name in names[1:]:
        part = lat[name]
        assert part["cpus"] and part["round_trip"]["p50_ms"] > 0
        assert part["systems"]["rdmakv"]["exists_64"]["p50_ms"] > 0
        assert "get_1" in part["systems"]["socket_loop"]
        assert "exists_64_p99_vs_round_trip_p99" in res["ratios"]["latency"][name]
        assert "exists_64_p99_vs_paired_round_trip_p99" in res["ratios"]["latency"][name]
    # each client's connections warmed first (one round in a quick run)
    assert res["concurrency"]["warm_up_rounds_per_client"] == 1
    conc = res["concurrency"]["systems"]
    assert set(conc) == {"rdmakv"}  # the socket loop is not a server clients share
    for n in ("1", "2"):
        assert conc["rdmakv"][n]["aggregate_gbps"] > 0
        assert conc["rdmakv"][n]["bytes_verified"] == (
            int(n) * settings.QUICK_CONC_ROUNDS * settings.CONC_BATCH * settings.CONC_BLOCK
        )
    meta = res["meta"]
    assert meta["quick"] is True and meta["date"] and meta["machine"] and meta["commit"]
    # the plan the bench's puts followed
    if tcp.native_checksums():
        plan = tcp.hashed_send_plan()
        assert plan is not None
        assert (meta["tcp_hashed_send_window"], meta["tcp_hashed_send_ahead"]) == plan
    else:
        assert meta["tcp_hashed_send_window"] is None
        assert meta["tcp_hashed_send_ahead"] is None
    assert meta["tcp_recv_spin_us"] == tcp.recv_spin_us()
    assert json.loads((out / "q.json").read_text()) == res
    for what in ("throughput", "latency", "concurrency"):
        assert (out / f"q_{what}.png").stat().st_size > 0
    assert meta["warm_up"] is True


def test_cli_no_warm_up_times_first_transfers() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rdmakv.cli", "bench", "--quick", "--json", "--no-progress",
         "--systems", "socket_loop", "--sizes", "16KiB", "--blocks", "8", "--no-latency",
         "--no-concurrency", "--no-warm-up"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["meta"]["warm_up"] is False
    fig = res["tcp"]["16384"]["socket_loop"]
    assert fig["warm_up"] is False and fig["bytes_verified"] == 8 * 16384


class _Unavailable:
    """The one fake: a peer that cannot run here (as a missing wheel or device would)."""

    name = "unavailable_peer"

    def __init__(self, transport: str, server: str | None = None) -> None:
        pass

    def open(self, work: object, src: object, dst: object) -> None:
        raise PeerUnavailable("unavailable_peer: needs hardware this machine lacks")

    def put(self, keys: object) -> None:
        raise AssertionError("never opened")

    get = put

    def exists(self, keys: object) -> list[bool]:
        raise AssertionError("never opened")

    def close(self) -> None:
        pass


def test_rdmakv_with_two_streams_moves_every_byte_split() -> None:
    """The ``rdmakv_streams2`` variant: a 16 MiB batch of 256 KiB blocks goes over two
    connections (MultiStreamClient splits it), every byte read back verified; its
    ratios nest under rdmakv's and it is never taken for a peer; no latency rows."""
    cfg = settings.BenchConfig(
        quick=True, systems=["rdmakv", "rdmakv_streams2", "socket_loop"], sizes=[262144],
        progress=False, concurrency=False,
    )
    res, rc = command.run(cfg)
    assert rc == 0, res["meta"].get("failures")
    per = res["tcp"]["262144"]
    for name in ("rdmakv", "rdmakv_streams2"):
        assert per[name]["bytes_verified"] == settings.QUICK_BLOCKS * 262144, name
    r = res["ratios"]["262144"]
    assert r["put_vs_best_peer"] is None  # the variant is rdmakv, not a peer of it
    assert r["rdmakv_streams2"]["put_vs_socket_loop"] > 0
    assert r["rdmakv_streams2"]["get_vs_socket_loop"] > 0
    assert "rdmakv_streams2" not in res["latency"]["systems"]


def test_rdmakv_driver_passes_digest_sized_keys_as_their_digests_and_pads_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The workload's keys are DIGEST_LEN bytes and go to the client as they are
    (no copy, no check of its own in the timed call); keys of other lengths,
    which the client refuses as digests before sending anything, go again
    padded or cut to DIGEST_LEN, and read back whole."""
    work = Workload(4096, 4, 4)
    src, dst = _arenas(work, 2)
    drv = RdmakvDriver("tcp")
    drv.open(work, src, dst)
    try:
        client = drv._put_c
        assert client is not None
        seen: list[Sequence[bytes]] = []
        real_put = client.put

        def put(keys: Sequence[bytes], handles: Sequence[int], nbytes: int,
                digests: Sequence[bytes]) -> list[bool]:
            seen.append(digests)
            return real_put(keys, handles, nbytes, digests)

        monkeypatch.setattr(client, "put", put)  # records, then the real put
        keys = work.keys("t")
        drv.put(keys)
        assert len(seen) == 1 and seen[0] is keys
        odd: list[bytes] = [b"ab", b"x" * 20, b"y" * 16, b"z" * 3]
        drv.put(odd)
        assert seen[1] is odd
        assert seen[2] == [b"ab".ljust(16, b"\0"), b"x" * 16, b"y" * 16, b"zzz".ljust(16, b"\0")]
        drv.get(odd)
        assert measure.wrong_bytes(src, dst) == 0
    finally:
        drv.close()


def test_rdmakv_driver_reconnects_to_the_same_node_and_moves_every_byte() -> None:
    """``reconnect()`` (between repeats): the node sees new sessions, the old
    clients are closed, and a put and get on the new ones read back whole."""
    work = Workload(16384, 8, 8)
    src, dst = _arenas(work, 5)
    drv = RdmakvDriver("tcp")
    drv.open(work, src, dst)
    try:
        old_put, old_get = drv._put_c, drv._get_c
        assert old_put is not None and old_get is not None
        before = old_put.stats()["sessions_total"]
        server = drv.server
        drv.reconnect()
        assert drv.server == server  # the same node
        assert drv._put_c is not old_put and drv._get_c is not old_get
        assert drv._put_c is not None
        assert drv._put_c.stats()["sessions_total"] > before
        with pytest.raises(RdmakvError):
            old_put.exists([b"k" * 16])  # closed
        keys = work.keys("r")
        drv.put(keys)
        drv.get(keys)
        assert measure.wrong_bytes(src, dst) == 0
    finally:
        drv.close()


def test_an_rdmakv_get_that_misses_names_the_shortfall_and_what_the_node_logged() -> None:
    """A short get fails the run (rdmakv never skips); its error says how many
    blocks it got and what the node logged, since the node's log is deleted
    when the driver closes."""
    work = Workload(16384, 8, 8)
    src, dst = _arenas(work, 6)
    drv = RdmakvDriver("tcp")
    drv.open(work, src, dst)
    try:
        keys = work.keys("m")
        drv.put(keys)
        drv.discard(keys[:3])  # really gone from the node: those gets miss
        with pytest.raises(RuntimeError, match=r"get hit 5 of 8 blocks; the node logged no warn"):
            drv.get(keys)
    finally:
        drv.close()


def test_socket_loop_reconnects_through_a_new_peer_and_moves_every_byte() -> None:
    work = Workload(block_bytes=8192, blocks=6, batch=6)
    src, dst = _arenas(work, 4)
    drv = SocketLoopDriver()
    drv.open(work, src, dst)
    try:
        drv.put(work.keys("a"))
        old = drv._proc
        assert old is not None
        drv.reconnect()
        assert drv._proc is not None and drv._proc.pid != old.pid
        assert old.poll() is not None  # the first peer left
        keys = work.keys("b")
        drv.put(keys)
        drv.get(keys)
        assert measure.wrong_bytes(src, dst) == 0
    finally:
        drv.close()


class _RecordingSocketLoop(SocketLoopDriver):
    """The real socket loop, recording the keys of every put and get it moves."""

    name = "recording_loop"
    calls: ClassVar[list[tuple[str, bytes, int]]] = []

    def put(self, keys: Sequence[bytes]) -> None:
        self.calls.append(("put", keys[0], len(keys)))
        super().put(keys)

    def get(self, keys: Sequence[bytes]) -> None:
        self.calls.append(("get", keys[0], len(keys)))
        super().get(keys)


@pytest.mark.parametrize("warm_up", [True, False])
def test_each_timed_repeat_follows_a_warm_up_of_the_whole_batch_under_other_keys(
    warm_up: bool,
) -> None:
    register("recording_loop", lambda transport, server=None: _RecordingSocketLoop(transport))
    _RecordingSocketLoop.calls = []
    try:
        cfg = settings.BenchConfig(
            systems=["recording_loop"], sizes=[16384], blocks=8, repeats=2,
            progress=False, latency=False, concurrency=False, warm_up=warm_up,
        )
        res, rc = command.run(cfg)
    finally:
        unregister("recording_loop")
    assert rc == 0, res["meta"].get("failures")
    fig = res["tcp"]["16384"]["recording_loop"]
    assert fig["bytes_verified"] == 8 * 16384 and fig["warm_up"] is warm_up
    assert res["meta"]["warm_up"] is warm_up
    calls = _RecordingSocketLoop.calls
    repeats = fig["repeats"]  # the loop's minimum applies
    assert all(n == 8 for _, _, n in calls)  # every transfer moves the whole batch
    ops = [op for op, _, _ in calls]
    rounds = measure.warm_up_rounds(8 * 16384, quick=False) if warm_up else 0
    assert fig["warm_up_rounds"] == rounds == (measure.WARM_UP_MAX_ROUNDS if warm_up else 0)
    assert ops == ["put", "get"] * (rounds + 1) * repeats
    step = len(calls) // repeats
    per_repeat = [calls[i : i + step] for i in range(0, len(calls), step)]
    timed = [(r[-2][1], r[-1][1]) for r in per_repeat]
    assert all(p == g for p, g in timed)  # a get reads back what its put stored
    assert len({p for p, _ in timed}) == repeats  # each repeat its own keys
    if warm_up:
        warm = [(r[i][1], r[i + 1][1]) for r in per_repeat for i in range(0, 2 * rounds, 2)]
        assert all(p == g for p, g in warm)
        assert not {p for p, _ in warm} & {p for p, _ in timed}  # never the timed keys


def test_tcp_warm_up_rounds_move_a_gibibyte_each_way_in_one_to_sixteen_rounds() -> None:
    mib = 1 << 20
    assert measure.warm_up_rounds(16 * mib, quick=False) == 16  # 64 rounds of 16 MiB: capped
    assert measure.warm_up_rounds(256 * mib, quick=False) == 4
    assert measure.warm_up_rounds(300 * mib, quick=False) == 4  # rounded up: 1.17 GiB
    assert measure.warm_up_rounds(2048 * mib, quick=False) == 1
    assert measure.warm_up_rounds(256 * mib, quick=True) == 1  # a quick run checks drivers
    assert measure.warm_up_rounds(16 * mib, quick=False, transport="rdma") == 1  # no window


def test_unavailable_peer_is_recorded_not_fatal() -> None:
    register("unavailable_peer", _Unavailable)
    try:
        cfg = settings.BenchConfig(
            quick=True, systems=["socket_loop", "unavailable_peer"], sizes=[16384],
            blocks=8, progress=False, concurrency=False,
        )
        res, rc = command.run(cfg)
    finally:
        unregister("unavailable_peer")
    assert rc == 0, res["meta"].get("failures")
    per = res["tcp"]["16384"]
    assert per["unavailable_peer"] == {
        "error": "unavailable_peer: needs hardware this machine lacks"
    }
    assert per["socket_loop"]["bytes_verified"] == 8 * 16384
    assert "error" in res["latency"]["systems"]["unavailable_peer"]
    assert "failures" not in res["meta"]


def test_fatal_system_failure_fails_the_run() -> None:
    """rdmakv never skips: its error fails the run (the socket loop only in TCP runs)."""
    import os

    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has an RDMA device: rdmakv over rdma would run")
    cfg = settings.BenchConfig(
        transport="rdma", quick=True, systems=["rdmakv", "socket_loop"], sizes=[16384],
        blocks=4, progress=False, latency=False, concurrency=False,
    )
    res, rc = command.run(cfg)
    assert rc == 1
    assert "no RDMA device" in res["rdma"]["16384"]["rdmakv"]["error"]
    assert "TCP only" in res["rdma"]["16384"]["socket_loop"]["error"]
    assert len(res["meta"]["failures"]) == 1 and "rdmakv" in res["meta"]["failures"][0]


def test_cli_and_measuring_code_import_no_matplotlib() -> None:
    """matplotlib is loaded by the plot module only, when it writes plots: the CLI
    and every measuring module start without it."""
    code = (
        "import sys, rdmakv.cli, rdmakv.perf.command, rdmakv.perf.measure, "
        "rdmakv.perf.latency, rdmakv.perf.concurrency, rdmakv.perf.report, rdmakv.perf.plot; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registry_is_lazy_and_names_what_is_missing() -> None:
    # Importing the command (what `rdmakv bench` does first) imports no peer module.
    code = (
        "import sys, rdmakv.perf.command; "
        "print([m for m in sys.modules if m.startswith('rdmakv.perf.drivers.')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    with pytest.raises(PeerUnavailable, match="unknown system"):
        make_driver("no_such_system", "tcp")


@pytest.mark.parametrize(
    ("block", "blocks", "first"),
    [(4096, 1500, 700),  # > IOV_MAX blocks per call
     (WINDOW_BYTES + 4096 + 3, 5, 2)],  # every call cuts a block somewhere
    ids=["many_blocks", "blocks_over_a_window"],
)
def test_socket_loop_moves_bytes_out_and_back(block: int, blocks: int, first: int) -> None:
    work = Workload(block_bytes=block, blocks=blocks, batch=blocks)
    src, dst = _arenas(work, 3)
    drv = make_driver("socket_loop", "tcp")
    try:
        drv.open(work, src, dst)
        keys = work.keys("t")
        drv.put(keys)
        drv.get(keys[first : first + 2])  # a short, non-zero-offset run lands in dst 0..1
        assert bytes(dst[: 2 * block]) == bytes(src[first * block : (first + 2) * block])
        drv.get(keys)
        assert measure.wrong_bytes(src, dst) == 0
    finally:
        drv.close()


def test_socket_loop_answers_a_get_while_a_put_waits_for_its_bytes() -> None:
    """Puts and gets have a connection each, each served by its own peer thread
    (as a node serves each session): a get is answered while the put thread
    still waits for a put's blocks. One thread for both would leave the get
    unanswered until its timeout."""
    block, blocks = 4096, 8
    work = Workload(block_bytes=block, blocks=blocks, batch=blocks)
    src, dst = _arenas(work, 5)
    drv = socket_loop.SocketLoopDriver()
    try:
        drv.open(work, src, dst)
        keys = work.keys("t")
        drv.put(keys)
        put_sock, get_sock = drv._socks
        put_sock.sendall(socket_loop._HDR.pack(b"P", 0, blocks))  # its blocks follow later
        get_sock.settimeout(30)
        drv.get(keys)
        assert measure.wrong_bytes(src, dst) == 0
        socket_loop.send_views(put_sock, socket_loop._blocks(src.data.cast("B"), block, blocks))
        assert socket_loop._recv_exact(put_sock, 1) == socket_loop.ACK  # the put completes
    finally:
        drv.close()


def test_socket_loop_windows_are_capped_in_bytes_and_cover_every_byte() -> None:
    data = bytes(range(256)) * 16384  # 4 MiB
    sizes = [5, WINDOW_BYTES + 7, 4096, 3 * WINDOW_BYTES, 1]
    mv, views, at = memoryview(data), [], 0
    for n in sizes:
        views.append(mv[at : at + n])
        at += n
    i, off, seen = 0, 0, bytearray()
    while i < len(views):
        win = socket_loop._window(views, i, off)
        moved = sum(map(len, win))
        assert 0 < moved <= WINDOW_BYTES and len(win) <= IOV_MAX
        seen += b"".join(win)
        i, off = socket_loop._advance(views, i, off, moved)
    assert bytes(seen) == data[:at]  # in order, nothing skipped or repeated


def test_round_trip_names_its_transport() -> None:
    tcp = latency.round_trip(settings.BenchConfig(transport="tcp"), samples=5)
    assert tcp["kind"].startswith("tcp") and 0 < tcp["p50_ms"] <= tcp["p99_ms"]
    rdma = latency.round_trip(settings.BenchConfig(transport="rdma"), samples=5)
    if "tcp" in rdma:  # a device here: ib_read_lat ran, the TCP one rides along
        assert rdma["kind"].startswith("rdma") and rdma["p50_ms"] > 0
    else:  # no device: the TCP round trip, saying why there is no RDMA one
        assert "no rdma round trip" in rdma["kind"] and rdma["p50_ms"] > 0


def test_echo_peer_times_round_trips_until_closed() -> None:
    from rdmakv.perf.drivers.socket_loop import EchoPeer

    with EchoPeer() as echo:
        trips = [echo.ping_ms() for _ in range(5)]
        proc = echo._proc
    assert all(t > 0 for t in trips)
    assert proc.returncode == 0  # the child saw EOF and left by itself


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_default_systems_hold_rdmakv_and_its_other_stream_count(transport: str) -> None:
    """rdmakv beside the one variant that is not its default on this host (the
    other would measure rdmakv twice), the ceilings and every peer."""
    systems = default_systems(transport)
    variants = [s for s in systems if s in OURS_VARIANTS]
    assert systems[0] == "rdmakv" and len(variants) == 1
    assert variants[0] != f"rdmakv_streams{default_streams(transport)}"
    assert "mooncake_te" in systems
    assert ("socket_loop" in systems) == (transport == "tcp")
    assert ("perftest" in systems) == (transport == "rdma")
    assert settings.BenchConfig(transport=transport).resolved_systems() == list(systems)
