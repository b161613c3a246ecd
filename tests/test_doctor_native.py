"""``rdmakv doctor`` names the native core's pieces and the file a process here
loads them from (the core is required: every piece is always there), and
how long a native TCP receive spins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rdmakv import cli, doctor, native_core
from rdmakv.config import CONFIG_ENV, env_var, load_config
from rdmakv.defaults import DEFAULT_TCP_SEND_PLAN
from rdmakv.transport.tcp import loop as tcp

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


@pytest.mark.skipif(not tcp.native_checksums(), reason="sends do not hash as they go here")
def test_doctor_names_the_tcp_send_plan_in_use() -> None:
    before = tcp.send_plan_name()
    assert before is not None
    tcp.set_send_plan("128k-ahead")
    try:
        report = doctor.diagnose()
    finally:
        tcp.set_send_plan(before)
    line = ("tcp send plan: 128k-ahead (tcp.send_plan sets it; `rdmakv doctor --tune` times "
            "the plans here)")
    assert line in doctor.render(report)
    assert report.to_dict()["tcp_send_plan"] == line.removeprefix("tcp send plan: ")


@pytest.mark.skipif(not tcp.native_checksums(), reason="sends do not hash as they go here")
def test_doctor_tune_times_every_plan_once_and_prints_a_config_the_loader_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (CONFIG_ENV, env_var("tcp", "send_plan")):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["doctor", "--tune"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("  ") and "GB/s" in line]
    assert sorted(row[0] for row in rows) == sorted(tcp.SEND_PLANS)
    assert all(float(row[1]) > 0 for row in rows)
    assert [row[0] for row in rows if row[-1] == "use)"] == [DEFAULT_TCP_SEND_PLAN]
    # the last lines are the config to copy: the loader takes them as they are
    config = tmp_path / "rdmakv.yaml"
    config.write_text("\n".join(lines[-2:]) + "\n")
    best = load_config(config, {}).tcp.send_plan
    assert best == rows[0][0]  # the rows go fastest first
    assert f"fastest: {best}." in lines[-4]
    assert tcp.send_plan_name() == DEFAULT_TCP_SEND_PLAN  # timing put the plan back
    # --json: the same, for a script
    assert cli.main(["doctor", "--tune", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["send_plans_bytes_per_cpu_s"]) == set(tcp.SEND_PLANS)
    assert out["config"] == {"tcp": {"send_plan": out["fastest"]}}
    assert out["in_use"] == DEFAULT_TCP_SEND_PLAN


def test_doctor_tune_says_why_there_is_nothing_to_tune(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tcp, "native_checksums", lambda: False)
    assert doctor.tune_main() == 1
    assert capsys.readouterr().out.startswith("rdmakv doctor --tune: no hashed sends to tune here")
