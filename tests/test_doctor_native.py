"""``rdmakv doctor`` names the native core's pieces and the file a process here
loads them from (the core is required: every piece is always there), and
how long a native TCP receive spins."""

from __future__ import annotations

import pytest

from rdmakv import doctor, native_core
from rdmakv.transport import tcp

PIECES = ("tcp loop", "node index", "node request loop", "client calls")


def test_doctor_names_the_native_core_pieces_and_where_they_were_loaded_from() -> None:
    assert doctor.native_core_line() == f"{', '.join(PIECES)} ({native_core.FILE})"
    assert native_core.FILE.endswith(".so")
    report = doctor.diagnose()
    assert report.native_core == doctor.native_core_line()
    assert f"native core: {', '.join(PIECES)} ({native_core.FILE})" in doctor.render(report)
    assert report.to_dict()["native_core"] == report.native_core


@pytest.mark.parametrize(("setting", "line"), [
    (100, "tcp receive spin: up to 100 us per wait, while a CPU is spare "
          "(RDMAKV_TCP_RECV_SPIN_US sets it, 0 turns it off)"),
    (0, "tcp receive spin: off (RDMAKV_TCP_RECV_SPIN_US=0)"),
])
def test_doctor_says_how_long_a_tcp_receive_spins(setting: int, line: str) -> None:
    before = tcp.recv_spin_us()
    tcp.set_recv_spin_us(setting)
    try:
        report = doctor.diagnose()
    finally:
        tcp.set_recv_spin_us(before)
    assert line in doctor.render(report)
    assert report.to_dict()["tcp_recv_spin"] == line.removeprefix("tcp receive spin: ")
