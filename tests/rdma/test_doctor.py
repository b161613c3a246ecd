"""``rdmakv doctor`` and port/GID selection against sysfs trees laid out like
the kernel's (real files in a temp dir), plus the real machine's own view.
These run without an RDMA device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rdmakv import doctor
from rdmakv.transport.rdma import verbs

pytestmark = pytest.mark.anydevice

V4_GID = "0000:0000:0000:0000:0000:ffff:c612:0001"
LINK_LOCAL_GID = "fe80:0000:0000:0000:f80a:eeff:fe40:7706"
EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def make_port(root: Path, dev: str, state: str, gids: dict[int, tuple[str, str]]) -> None:
    port = root / dev / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "gid_attrs" / "ndevs").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "lid").write_text("0x0\n")
    for i in range(4):
        gid, gtype = gids.get(i, (EMPTY_GID, ""))
        (port / "gids" / str(i)).write_text(gid + "\n")
        if gtype:
            (port / "gid_attrs" / "types" / str(i)).write_text(gtype + "\n")
            (port / "gid_attrs" / "ndevs" / str(i)).write_text("rk0\n")


def test_port_info_and_best_gid_prefer_ipv4_roce_v2(tmp_path: Path) -> None:
    make_port(tmp_path, "rxe9", "4: ACTIVE",
              {0: (LINK_LOCAL_GID, "RoCE v2"), 1: (V4_GID, "RoCE v2"), 2: (V4_GID, "IB/RoCE v1")})
    info = verbs.port_info("rxe9", 1, tmp_path)
    assert info.active and [g.index for g in info.gids] == [0, 1, 2]  # empty slot 3 skipped
    best = verbs.best_gid(info)
    assert best is not None and best.index == 1 and best.text == "::ffff:198.18.0.1"


def test_doctor_healthy_tree_has_no_problem_but_memlock(tmp_path: Path) -> None:
    make_port(tmp_path, "rxe9", "4: ACTIVE", {1: (V4_GID, "RoCE v2")})
    report = doctor.diagnose(tmp_path)
    assert [p.device for p in report.ports] == ["rxe9"]
    assert all("memlock" in p.what or "native" in p.what for p in report.problems)
    text = doctor.render(report)
    assert "gid[1] ::ffff:198.18.0.1  RoCE v2  on rk0" in text


def test_doctor_says_port_down_and_how_to_fix(tmp_path: Path) -> None:
    make_port(tmp_path, "rxe9", "1: DOWN", {1: (V4_GID, "RoCE v2")})
    problems = doctor.diagnose(tmp_path).problems
    down = [p for p in problems if "port 1 is DOWN" in p.what]
    assert down and "ip link set rk0 up" in down[0].fix


def test_doctor_says_no_roce_v2_gid(tmp_path: Path) -> None:
    make_port(tmp_path, "rxe9", "4: ACTIVE", {0: (LINK_LOCAL_GID, "IB/RoCE v1")})
    problems = doctor.diagnose(tmp_path).problems
    v2 = [p for p in problems if "no RoCE v2 GID" in p.what]
    assert v2 and "ip addr add" in v2[0].fix and "rk0" in v2[0].fix


def test_doctor_says_no_device(tmp_path: Path) -> None:
    report = doctor.diagnose(tmp_path / "missing")
    assert not report.ok
    nodev = [p for p in report.problems if p.what.startswith("no RDMA device")]
    assert nodev and "rdma link add" in nodev[0].fix and "run-in-vm.sh" in nodev[0].fix


def test_select_explains_why_nothing_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(verbs.ENV_DEVICE, "no-such-dev0")
    with pytest.raises(verbs.RdmaUnavailable):
        verbs.select()
    monkeypatch.setenv(verbs.ENV_GID_INDEX, "one")
    with pytest.raises(verbs.ConfigError, match=verbs.ENV_GID_INDEX):
        verbs.select()


def test_cli_doctor_runs_and_exit_code_matches_report() -> None:
    proc = subprocess.run([sys.executable, "-m", "rdmakv.cli", "doctor"],
                          capture_output=True, text=True, timeout=120)
    report = doctor.diagnose()
    assert proc.returncode == (0 if report.ok else 1)
    assert "memlock limit:" in proc.stdout
    assert ("OK: RDMA is usable" in proc.stdout) == report.ok
