"""The native TCP scatter/gather loop (native/rk_tcp.c) on real sockets.

``send_iov``/``recv_iov`` move a list of (address, length) ranges with the GIL
released; they must keep the Python loop's semantics: every byte in order
across any split of the ranges, a timeout when no byte moves for the socket's
timeout, ConnectionLost when the peer goes away, signals handled.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest
from oracles import tcp_loop

from rdmakv import doctor
from rdmakv.defaults import DEFAULT_TCP_SEND_PLAN
from rdmakv.errors import ConfigError, ConnectionLost
from rdmakv.transport import checksum
from rdmakv.transport.checksum import checksum_ranges
from rdmakv.transport.tcp import loop as tcp
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import HEADER, Op, value_checksum

pytestmark = pytest.mark.timeout(60)


def table(arrays: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint64]:
    return np.array([[a.ctypes.data, a.nbytes] for a in arrays], dtype=np.uint64).reshape(-1, 2)


@contextlib.contextmanager
def alarms_every(seconds: float) -> Iterator[list[int]]:
    """SIGALRM every ``seconds`` while the block runs; yields the count of
    alarms so far (``[n]``), and puts the handler and timer back after."""
    hits = [0]
    old = signal.signal(signal.SIGALRM, lambda *_: hits.__setitem__(0, hits[0] + 1))
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, seconds)
        yield hits
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("timeout", [5.0, None])
def test_many_odd_ranges_arrive_in_order_across_a_different_split(
    pair: tuple[socket.socket, socket.socket], timeout: float | None
) -> None:
    a, b = pair
    a.settimeout(timeout)
    b.settimeout(timeout)
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 70_000, 3000)  # more ranges than one sendmsg takes
    sizes[::97] = 0
    src = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
    left, rsizes = int(sizes.sum()), []
    while left:
        n = int(min(left, rng.integers(1, 200_000)))
        rsizes.append(n)
        left -= n
    dst = [np.zeros(n, np.uint8) for n in rsizes]
    sender = threading.Thread(target=tcp.send_iov, args=(a, table(src)))
    sender.start()
    tcp.recv_iov(b, table(dst))
    sender.join()
    assert np.array_equal(np.concatenate(src), np.concatenate(dst))


@pytest.mark.parametrize("hashed", [False, True], ids=["plain", "hashed"])
def test_the_native_loop_moves_and_hashes_what_its_python_twin_does(
    pair: tuple[socket.socket, socket.socket], hashed: bool
) -> None:
    """Each direction against the other's Python twin (tests/oracles/tcp_loop.py),
    over the same odd ranges (empty ones, one over two windows): the native
    send into the twin's receive, then the twin's send into the native
    receive. The same bytes arrive each way, and the native loop's checksums
    (``hashed``) are the twin's."""
    if hashed and not tcp.native_checksums():
        pytest.skip("the xxhash module exports no XXH3_64bits to call")
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    rng = np.random.default_rng(5)
    sizes = [int(n) for n in rng.integers(0, 70_000, 400)]
    sizes[::37] = [0] * len(sizes[::37])
    sizes[9] = 2 * tcp._lib.RK_TCP_WINDOW + 3
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    mid = [np.zeros(n, np.uint8) for n in sizes]
    dst = [np.zeros(n, np.uint8) for n in sizes]
    native_sent = np.zeros(len(sizes), np.uint64) if hashed else None
    sender = threading.Thread(target=tcp.send_iov, args=(a, table(src), native_sent))
    sender.start()
    twin_got = tcp_loop.recv_iov(b, table(mid))
    sender.join()
    assert all(np.array_equal(s, m) for s, m in zip(src, mid, strict=True))
    twin_sent: list[list[int]] = []
    sender = threading.Thread(target=lambda: twin_sent.append(tcp_loop.send_iov(b, table(mid))))
    sender.start()
    native_got = np.zeros(len(sizes), np.uint64) if hashed else None
    tcp.recv_iov(a, table(dst), checksums=native_got)
    sender.join()
    assert all(np.array_equal(m, d) for m, d in zip(mid, dst, strict=True))
    assert twin_sent == [twin_got]
    if native_sent is not None and native_got is not None:
        assert native_sent.tolist() == twin_got
        assert native_got.tolist() == twin_got


def test_a_silent_peer_times_out_while_other_threads_run(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    _, b = pair
    b.settimeout(0.5)
    ticks, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        with pytest.raises(TimeoutError):
            tcp.recv_iov(b, table([np.zeros(1000, np.uint8)]))
    finally:
        stop.set()
        spinner.join()
    assert ticks[0] > 0  # the wait released the GIL


def test_progress_keeps_a_slow_transfer_alive(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.settimeout(2.0)

    def dribble() -> None:
        for _ in range(4):
            threading.Event().wait(0.2)
            a.sendall(b"x" * 10)

    t = threading.Thread(target=dribble)
    t.start()
    buf = np.zeros(40, np.uint8)
    tcp.recv_iov(b, table([buf]))
    t.join()
    assert bytes(buf) == b"x" * 40


def test_a_peer_that_closes_mid_transfer_is_connection_lost(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.settimeout(2)
    a.sendall(b"y" * 100)
    a.close()
    with pytest.raises(ConnectionLost):
        tcp.recv_iov(b, table([np.zeros(1000, np.uint8)]))


def test_sending_to_a_closed_peer_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.settimeout(2)
    b.close()
    with pytest.raises(OSError):
        tcp.send_iov(a, table([np.zeros(1 << 20, np.uint8)]))


def test_signals_interrupt_and_resume_the_wait(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.settimeout(5)
    hits = [0]
    old = signal.signal(signal.SIGALRM, lambda *_: hits.__setitem__(0, hits[0] + 1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        late = threading.Timer(0.5, lambda: a.sendall(b"z" * 5000))
        late.start()
        buf = np.zeros(5000, np.uint8)
        tcp.recv_iov(b, table([buf]))
        late.join()
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert bytes(buf) == b"z" * 5000 and hits[0] > 0

        class Boom(Exception):
            pass

        def boom(*_: object) -> None:
            raise Boom

        signal.signal(signal.SIGALRM, boom)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Boom):
            tcp.recv_iov(b, table([np.zeros(10, np.uint8)]))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_shutdown_from_another_thread_wakes_a_blocked_receive(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    _, b = pair
    b.settimeout(30)
    threading.Timer(0.3, lambda: b.shutdown(socket.SHUT_RDWR)).start()
    with pytest.raises(ConnectionLost):
        tcp.recv_iov(b, table([np.zeros(10, np.uint8)]))


@pytest.mark.parametrize("native", [True, False])
def test_bulk_read_ahead_with_its_header_lands_in_place_and_the_next_frame_stays_whole(
    pair: tuple[socket.socket, socket.socket], native: bool
) -> None:
    """A Channel reads ahead past a header: the first bulk bytes (and the start
    of the next, pipelined frame) sit in its buffer, not in the socket. Both
    bulk receivers must take them from there, in order, and leave exactly the
    next frame behind."""
    a, b = pair
    a.settimeout(5)
    b.settimeout(5)
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3, 5000, 1, 20_000, 700)]
    total = sum(x.nbytes for x in src)
    # one write: header, bulk and a whole second frame arrive together
    a.sendall(
        HEADER.pack(Op.PUT, 0, 0, 0, total, 1)
        + b"".join(x.tobytes() for x in src)
        + HEADER.pack(Op.STATS, 0, 0, 2, 0, 2)
        + b"{}"
    )
    ch = Channel(b)
    hdr = ch.recv_header()
    assert hdr.bulk_len == total and ch.buffered > 0  # bulk bytes were read ahead
    dst = [np.zeros(x.nbytes, np.uint8) for x in src]
    if native:
        tcp.recv_iov_from(ch, table(dst), total)
    else:
        ch.recv_bulk([memoryview(d) for d in dst])
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    nxt = ch.recv_header()
    assert (nxt.opcode, nxt.req_id) == (Op.STATS, 2)
    assert ch.recv_payload(nxt) == b"{}"
    assert ch.buffered == 0


needs_checksums = pytest.mark.skipif(
    not tcp.native_checksums(), reason="the xxhash module exports no XXH3_64bits to call"
)


@needs_checksums
def test_checksum_ranges_gives_each_range_value_checksum_in_one_call() -> None:
    """The native hash of ranges the loop does not move (an RDMA transport's
    writes and reads): each range's value_checksum, for empty, unaligned,
    repeated and overlapping ranges and ones past a megabyte."""
    data = np.frombuffer(bytearray(os.urandom(3 << 20)), dtype=np.uint8)
    base = data.ctypes.data
    offsets = [0, 1, 4093, 16384, 16384, 777, 2 << 20, 0, 5]
    lengths = [16384, 0, 65536, 16384, 16384, 1 << 20, (1 << 20) - 3, 3 << 20, 1]
    got = checksum_ranges(base, np.array(offsets, dtype=np.uint64),
                          np.array(lengths, dtype=np.uint64))
    assert got == [value_checksum(data[o : o + n]) for o, n in zip(offsets, lengths, strict=True)]
    assert got[3] == got[4] and got[0] != got[3]  # the same bytes twice; other bytes
    empty = np.zeros(0, dtype=np.uint64)
    assert checksum_ranges(base, empty, empty) == []


@pytest.fixture(params=list(tcp.SEND_PLANS))
def hashed_window(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each hashed-send plan (window, hashed after or ahead of its sendmsg),
    set for the test; the plan before is put back after it."""
    before = tcp.send_plan_name()
    assert before is not None
    tcp.set_send_plan(request.param)
    try:
        yield tcp.SEND_PLANS[request.param].window
    finally:
        tcp.set_send_plan(before)


@needs_checksums
def test_each_range_is_hashed_on_the_way_out_and_in_as_value_checksum_would(
    pair: tuple[socket.socket, socket.socket], hashed_window: int
) -> None:
    """Hashed send and receive give every range's value_checksum, for ranges
    smaller and larger than the hashing windows (either send window), empty
    ones, and a receive whose first bytes were already placed (``skip``, as
    after a read-ahead)."""
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(0, 40_000, 200)]
    sizes[5] = sizes[-1] = 0
    sizes[17] = 3 * tcp._lib.RK_TCP_WINDOW + 5
    sizes[40] = hashed_window + 1  # a send window and one byte
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dst = [np.zeros(n, np.uint8) for n in sizes]
    want = [value_checksum(x.tobytes()) for x in src]
    sent = np.zeros(len(src), np.uint64)
    got = np.zeros(len(src), np.uint64)
    sender = threading.Thread(target=tcp.send_iov, args=(a, table(src), sent))
    sender.start()
    first = np.zeros(sizes[0] + 7, np.uint8)  # the first range and a bit of the next
    tcp.recv_iov(b, table([first]))
    dst[0][:] = first[: sizes[0]]
    dst[1][:7] = first[sizes[0] :]
    tcp.recv_iov(b, table(dst), skip=first.nbytes, checksums=got)
    sender.join()
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    assert [int(x) for x in sent] == want
    assert [int(x) for x in got] == want


@needs_checksums
def test_hashing_resumes_where_a_signal_interrupted_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.settimeout(5)
    rng = np.random.default_rng(5)
    # the second range is streamed through the hash in pieces (longer than a window)
    sizes = [3000, 3 * tcp._lib.RK_TCP_WINDOW + 5, 3000, 3000]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    wire = b"".join(x.tobytes() for x in src)
    early = sizes[0] + tcp._lib.RK_TCP_WINDOW + 1000  # stops inside the long range
    with alarms_every(0.05) as hits:
        # a range and a half now, the rest after several interruptions
        sender = threading.Thread(target=a.sendall, args=(wire[:early],))
        sender.start()
        late = threading.Timer(0.5, lambda: (sender.join(), a.sendall(wire[early:])))
        late.start()
        dst = [np.zeros(n, np.uint8) for n in sizes]
        got = np.zeros(4, np.uint64)
        tcp.recv_iov(b, table(dst), checksums=got)
        late.join()
        sender.join()
    assert hits[0] > 0
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    assert [int(x) for x in got] == [value_checksum(x.tobytes()) for x in src]


@needs_checksums
def test_a_hashed_send_resumes_where_a_signal_interrupted_it(
    pair: tuple[socket.socket, socket.socket], hashed_window: int,
) -> None:
    """A send that hashes its ranges as they go out, interrupted while it
    waits for room (the peer reads late): resumed, it sends every byte once,
    hashes every range whole (one longer than a window, streamed in pieces,
    included; hashed ahead, a window's hash may have run past the bytes that
    went out) and a checksum row at the end still goes out holding them."""
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    rng = np.random.default_rng(11)
    sizes = [3000, 3 * tcp._lib.RK_TCP_WINDOW + 5, 3000, 3000]
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    hashes = np.zeros(len(sizes) + 1, np.uint64)
    iov = np.vstack([table(src), [[hashes.ctypes.data, 8 * len(sizes)]]]).astype(np.uint64)
    into = np.zeros(sum(sizes) + 8 * len(sizes), np.uint8)
    late = threading.Timer(0.5, tcp.recv_iov, args=(b, table([into])))
    with alarms_every(0.05) as hits:
        late.start()
        tcp.send_iov(a, iov, hashes)  # the main thread: it is the one signals interrupt
        late.join()
    assert hits[0] > 0
    want = [value_checksum(x.tobytes()) for x in src]
    assert hashes[: len(sizes)].tolist() == want
    got = into.tobytes()
    assert got[: sum(sizes)] == b"".join(x.tobytes() for x in src)
    assert np.frombuffer(got[sum(sizes) :], dtype="<u8").tolist() == want


@needs_checksums
def test_a_range_that_is_the_hashes_of_earlier_ranges_goes_out_holding_them(
    pair: tuple[socket.socket, socket.socket], hashed_window: int
) -> None:
    """What the tcp transport's PUT relies on: ranges are hashed as they go
    out, and a COMMIT's checksum row (pointing into the call's own hashes)
    goes out only once the values before it are hashed, holding their
    hashes, whether they went out in earlier calls or go with it in one
    window; here three groups, values both side of window edges."""
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    rng = np.random.default_rng(7)
    groups = [[int(n) for n in rng.integers(1, 90_000, k)] for k in (5, 40, 9)]
    groups[1][3] = tcp._lib.RK_TCP_WINDOW + 17  # longer than a window: hashed in pieces
    values = [[rng.integers(0, 256, n, dtype=np.uint8) for n in g] for g in groups]
    rows = sum(len(g) + 1 for g in groups)
    hashes = np.zeros(rows, np.uint64)
    at, out, r = hashes.ctypes.data, [], 0
    for vs in values:
        out += [[v.ctypes.data, v.nbytes] for v in vs]
        out.append([at + 8 * r, 8 * len(vs)])  # the hashes of the rows just above
        r += len(vs) + 1
    iov = np.array(out, dtype=np.uint64)
    wire = b"".join(b"".join(v.tobytes() for v in vs) + bytes(8 * len(vs)) for vs in values)
    into = np.zeros(len(wire), np.uint8)
    receiver = threading.Thread(target=tcp.recv_iov, args=(b, table([into])))
    receiver.start()
    tcp.send_iov(a, iov, hashes)
    receiver.join()
    got = into.tobytes()
    pos = 0
    for vs in values:
        for v in vs:
            assert got[pos : pos + v.nbytes] == v.tobytes()
            pos += v.nbytes
        trailer = np.frombuffer(bytes(got[pos : pos + 8 * len(vs)]), dtype="<u8")
        assert trailer.tolist() == [value_checksum(v.tobytes()) for v in vs]
        pos += 8 * len(vs)
    assert pos == len(wire)


@pytest.fixture
def records_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A SOCK_SEQPACKET pair: each sendmsg arrives as one record."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    yield a, b
    a.close()
    b.close()


@needs_checksums
@pytest.mark.parametrize(("sizes", "calls"), [
    (lambda w: [16384], 1),
    (lambda w: [3000, 16384, 5], 1),
    (lambda w: [w // 2, w // 2 + 1], 2),  # the second value and the row: one call
])
def test_a_checksum_row_goes_out_with_its_values_when_they_fit_one_window(
    records_pair: tuple[socket.socket, socket.socket], hashed_window: int,
    sizes: Callable[[int], list[int]], calls: int,
) -> None:
    """A small put's frames leave in one system call: values and the checksum
    row behind them that fit one window are hashed first and sent together
    (the records of a SOCK_SEQPACKET socket show the calls). Values that do
    not fit one window with it go out first. Either way the row holds their
    checksums."""
    a, b = records_pair
    lengths = sizes(hashed_window)
    rng = np.random.default_rng(11)
    values = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    hashes = np.zeros(len(values) + 1, np.uint64)
    iov = np.vstack([table(values), [[hashes.ctypes.data, 8 * len(values)]]]).astype(np.uint64)
    total = sum(lengths) + 8 * len(values)
    records: list[bytes] = []

    def receive() -> None:
        while sum(map(len, records)) < total:
            records.append(b.recv(1 << 20))

    receiver = threading.Thread(target=receive)
    receiver.start()
    tcp.send_iov(a, iov, hashes)
    receiver.join(10)
    assert len(records) == calls, [len(r) for r in records]
    wire = b"".join(records)
    assert wire[: sum(lengths)] == b"".join(v.tobytes() for v in values)
    trailer = np.frombuffer(wire[sum(lengths) :], dtype="<u8").tolist()
    assert trailer == [value_checksum(v.tobytes()) for v in values]


def _hashed_send(sock: socket.socket, peer: socket.socket, nbytes: int) -> None:
    """``nbytes`` (a multiple of 128 KiB) in 16 KiB ranges through a hashed
    send, drained by a thread; the bytes and the hashes are checked."""
    src = np.random.default_rng(13).integers(0, 256, 16384 * 8, dtype=np.uint8)
    ranges = [src[i * 16384 : (i + 1) * 16384] for i in range(8)] * (nbytes // (8 * 16384))
    hashes = np.zeros(len(ranges), np.uint64)
    got = bytearray()

    def drain() -> None:
        while len(got) < len(ranges) * 16384:
            got.extend(peer.recv(min(1 << 20, len(ranges) * 16384 - len(got))))

    receiver = threading.Thread(target=drain)
    receiver.start()
    tcp.send_iov(sock, table(ranges), hashes)
    receiver.join()
    assert bytes(got) == src.tobytes() * (len(ranges) // 8)
    want = [value_checksum(r.tobytes()) for r in ranges[:8]]
    assert hashes.tolist() == want * (len(ranges) // 8)


@needs_checksums
def test_a_new_process_sends_with_the_default_plan() -> None:
    """The plan is set as the module loads, before any send: the default of
    rdmakv.defaults, which names one of the four plans."""
    out = subprocess.run(
        [sys.executable, "-c",
         "from rdmakv.transport.tcp import loop as tcp; "
         "print(tcp.send_plan_name(), *tcp.hashed_send_plan())"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()
    plan = tcp.SEND_PLANS[DEFAULT_TCP_SEND_PLAN]
    assert out == [DEFAULT_TCP_SEND_PLAN, str(plan.window), str(plan.ahead)]


@needs_checksums
def test_a_plan_set_stays_the_plan_however_much_is_sent(
    pair: tuple[socket.socket, socket.socket], hashed_window: int
) -> None:
    """Nothing in the data path measures or changes the plan: after many
    windows of hashed sends on a non-blocking socket (where the loop once
    timed its windows) and on a blocking one, the plan is the one set."""
    a, b = pair
    name = tcp.send_plan_name()
    assert name is not None and tcp.SEND_PLANS[name].window == hashed_window
    _hashed_send(a, b, 8 << 20)  # blocking
    a.settimeout(10)  # non-blocking underneath, as every rdmakv connection
    b.settimeout(10)
    _hashed_send(a, b, 32 << 20)
    assert tcp.send_plan_name() == name
    assert tcp.hashed_send_plan() == tcp.SEND_PLANS[name]


@pytest.mark.parametrize("name", ["", "512k", "512K-ahead", "256k-ahead", "auto"])
def test_a_send_plan_that_is_not_one_of_the_four_is_refused(name: str) -> None:
    before = tcp.hashed_send_plan()
    with pytest.raises(ConfigError, match=r"^tcp\.send_plan: .* is not one of 512k-ahead, "):
        tcp.set_send_plan(name)
    assert tcp.hashed_send_plan() == before


@pytest.mark.parametrize(("window", "ahead"), [
    (0, 0), (tcp._lib.RK_TCP_WINDOW + 1, 0), (4096, 2), (4096, -1),
])
def test_the_native_loop_refuses_a_plan_out_of_range(window: int, ahead: int) -> None:
    before = tcp.hashed_send_plan()
    assert tcp._lib.rk_tcp_set_hashed_send_plan(window, ahead) == -1
    assert tcp.hashed_send_plan() == before


def test_the_native_hasher_picks_its_vector_unit_at_run_time() -> None:
    """pyproject asks for xxhash >= 4.1, whose x86 builds dispatch XXH3 to
    SSE2 / AVX2 / AVX-512 at run time; an older one hashed at a third to a half
    of that speed (bench/README.md), and doctor names the fix."""
    if platform.machine().lower() in checksum.X86:
        assert checksum.DISPATCHED
    text = checksum.describe()
    assert "native" in text and "pip install" not in text
    assert f"value checksums: {text}" in doctor.render(doctor.diagnose())


def test_describe_names_the_fix_for_a_baseline_xxhash_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an xxhash < 4.1 cannot be installed beside the real one: its one fact,
    # no dispatching symbol, is set here
    monkeypatch.setattr(checksum, "HASHER", object())
    monkeypatch.setattr(checksum, "DISPATCHED", False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert "pip install -U 'xxhash>=4.1'" in checksum.describe()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # NEON is its baseline
    assert "pip install" not in checksum.describe()
    monkeypatch.setattr(checksum, "HASHER", None)
    assert "in Python" in checksum.describe()


# Receive spinning (rk_tcp.h): a receive that runs dry mid-list polls for the
# rest before it sleeps, while its process has fewer receives in flight than
# CPUs.

TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


@pytest.fixture
def spin_us() -> Iterator[Callable[[int], None]]:
    """Set the process's receive spin for one test; the default comes back after."""
    before = tcp.recv_spin_us()
    yield tcp.set_recv_spin_us
    tcp.set_recv_spin_us(before)


def receive_in_gaps(
    a: socket.socket, b: socket.socket, pieces: int = 5, pin_to_one_cpu: bool = False
) -> tuple[bytes, bytes, tcp.RecvWaitCounts]:
    """Receive ``pieces`` x 64 KiB that a thread sends with a ~1 ms pause before
    each piece, so the receive runs dry mid-list each time: the bytes sent, the
    bytes received and the change in the process's wait counts.
    ``pin_to_one_cpu``: the receiving thread runs on one CPU only."""
    b.settimeout(10)
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, 65536, dtype=np.uint8) for _ in range(pieces)]
    dst = [np.zeros(65536, np.uint8) for _ in range(pieces)]

    def send() -> None:
        for piece in src:
            threading.Event().wait(0.001)
            a.sendall(piece.tobytes())

    def receive() -> None:
        if pin_to_one_cpu:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        tcp.recv_iov(b, table(dst))

    before = tcp.recv_wait_counts()
    sender, receiver = threading.Thread(target=send), threading.Thread(target=receive)
    receiver.start()
    sender.start()
    sender.join()
    receiver.join()
    after = tcp.recv_wait_counts()
    sent, got = (b"".join(p.tobytes() for p in arrays) for arrays in (src, dst))
    return sent, got, tcp.RecvWaitCounts(
        after.spun - before.spun, after.slept - before.slept
    )


@pytest.mark.skipif(not TWO_CPUS, reason="a receive spins only with a CPU to spare")
def test_a_receive_that_runs_dry_mid_list_spins_for_the_rest(
    pair: tuple[socket.socket, socket.socket], spin_us: Callable[[int], None]
) -> None:
    a, b = pair
    spin_us(tcp._lib.RK_TCP_RECV_SPIN_MAX_US)  # 10 ms: far longer than each pause
    sent, got, waits = receive_in_gaps(a, b)
    assert got == sent
    assert waits.spun >= 1


def test_a_receive_sleeps_at_once_with_spinning_off_or_one_cpu(
    pair: tuple[socket.socket, socket.socket], spin_us: Callable[[int], None]
) -> None:
    a, b = pair
    spin_us(0)
    sent, got, waits = receive_in_gaps(a, b)
    assert got == sent
    assert waits.spun == 0 and waits.slept >= 1
    # with a budget, but no CPU to spare: the one receive in flight is as
    # many as the receiving thread's CPUs
    spin_us(tcp._lib.RK_TCP_RECV_SPIN_MAX_US)
    sent, got, waits = receive_in_gaps(a, b, pin_to_one_cpu=True)
    assert got == sent
    assert waits.spun == 0 and waits.slept >= 1


def test_receives_in_flight_count_each_running_receive_and_drop_on_every_exit(
    pair: tuple[socket.socket, socket.socket], spin_us: Callable[[int], None]
) -> None:
    a, b = pair
    spin_us(tcp._lib.RK_TCP_RECV_SPIN_MAX_US)
    b.settimeout(10)
    assert tcp.receives_in_flight() == 0
    buf = np.zeros(1000, np.uint8)
    receiver = threading.Thread(target=tcp.recv_iov, args=(b, table([buf])))
    receiver.start()
    while tcp.receives_in_flight() != 1:  # waits in the native loop
        assert receiver.is_alive()
        threading.Event().wait(0.001)
    a.sendall(b"z" * 1000)
    receiver.join()
    assert bytes(buf) == b"z" * 1000 and tcp.receives_in_flight() == 0
    b.settimeout(0.05)  # a receive that spins, then sleeps until its deadline
    with pytest.raises(TimeoutError):
        tcp.recv_iov(b, table([buf]))
    assert tcp.receives_in_flight() == 0
    a.close()  # and a peer gone mid-transfer
    b.settimeout(5)
    with pytest.raises(ConnectionLost):
        tcp.recv_iov(b, table([buf]))
    assert tcp.receives_in_flight() == 0


def test_a_receive_spin_out_of_range_is_refused_by_name(spin_us: Callable[[int], None]) -> None:
    for bad in (-1, tcp._lib.RK_TCP_RECV_SPIN_MAX_US + 1, 1 << 70, 1.5, True, "100"):
        with pytest.raises(ConfigError, match="receive spin must be an integer"):
            tcp.set_recv_spin_us(bad)  # type: ignore[arg-type]
    assert tcp.recv_spin_us() == tcp._lib.RK_TCP_RECV_SPIN_US  # unchanged
    spin_us(0)
    assert tcp.recv_spin_us() == 0


@pytest.mark.parametrize(("value", "ok"), [("250", True), ("0", True), ("fast", False),
                                           ("-5", False), ("10001", False)])
def test_the_environment_sets_the_receive_spin_and_start_up_refuses_a_bad_one(
    value: str, ok: bool
) -> None:
    """A bad value is not applied (importing rdmakv must not fail: ``rdmakv
    doctor`` runs on it), and loading the configuration, which every command
    and connector does at start-up, refuses it by name."""
    env = {**os.environ, tcp.ENV_RECV_SPIN: value}
    script = ("from rdmakv.transport.tcp import loop; print(loop.recv_spin_us(), flush=True); "
              "from rdmakv.config import load_config; load_config()")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == value
    else:
        assert proc.stdout.strip() == str(tcp._lib.RK_TCP_RECV_SPIN_US)  # the default stays
        assert proc.returncode != 0
        assert (f"ConfigError: environment variable {tcp.ENV_RECV_SPIN}: {value!r} is not an "
                f"integer of 0 to {tcp._lib.RK_TCP_RECV_SPIN_MAX_US} microseconds") in proc.stderr
