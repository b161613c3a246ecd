"""Verbs-level tests on a real device: registration, SGL batching, windows,
error completions and QP recovery (two QPs in one process, slab a -> slab b)."""

from __future__ import annotations

import os

import pytest

from rdmakv.errors import ConfigError, RdmaError, RdmaUnavailable
from rdmakv.transport.rdma import verbs

from .conftest import BLOCK, BLOCKS, Pair

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 20.0  # generous: soft-RoCE under emulation is slow


def fill(p: Pair) -> None:
    p.a.array[:] = memoryview(bytearray(os.urandom(p.a.nbytes)))
    p.b.array[:] = 0


def scattered_ops(p: Pair, n: int, length: int = BLOCK) -> list[tuple[int, int, int]]:
    """Local blocks in reverse order (never locally contiguous), remote contiguous."""
    return [((BLOCKS - 1 - i) * BLOCK, p.b.base_addr + i * length, length) for i in range(n)]


def assert_moved(p: Pair, ops: list[tuple[int, int, int]], which: list[int] | None = None) -> None:
    for i in which if which is not None else range(len(ops)):
        lo, ra, ln = ops[i]
        ro = ra - p.b.base_addr
        assert bytes(p.b.array[ro : ro + ln]) == bytes(p.a.array[lo : lo + ln]), f"op {i}"


def test_selection_prefers_roce_v2(device: verbs.Device) -> None:
    info = verbs.port_info(device.sel.device, device.sel.port)
    assert info.active
    if any(g.is_roce_v2 for g in info.gids):
        assert device.sel.gid_type.lower() == "roce v2"
    assert device.attrs.max_sge >= 1 and device.attrs.max_qp_wr >= 1


def test_explicit_gid_index_override(device: verbs.Device) -> None:
    sel = verbs.select(device.sel.device, device.sel.port, device.sel.gid_index)
    assert sel.gid_index == device.sel.gid_index
    with pytest.raises(RdmaUnavailable, match="no GID at index"):
        verbs.select(device.sel.device, device.sel.port, 1023)
    with pytest.raises(RdmaUnavailable, match="not found"):
        verbs.select("no-such-dev0")


def test_slab_registered_once(device: verbs.Device, pair: Pair) -> None:
    before = device.registrations
    again = device.register(pair.a.base_addr, pair.a.nbytes)
    assert again is pair.ma
    qp = device.create_qp()  # another peer: same slab MR, no new registration
    qp.close()
    assert device.registrations == before


def test_register_rejects_nonsense(device: verbs.Device) -> None:
    with pytest.raises(ConfigError):
        device.register(0, 4096)


def test_write_then_read_sgl_at_max_sge(pair: Pair) -> None:
    fill(pair)
    max_sge = pair.qa.max_sge
    n = min(BLOCKS, 2 * max_sge + 3)
    ops = scattered_ops(pair, n)
    status, stats = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * n
    assert stats.sges == n  # one SGE per (locally scattered) block
    assert stats.wrs == -(-n // max_sge)  # gathered up to max_sge per WR
    assert_moved(pair, ops)
    pair.a.array[:] = 0
    status, stats = pair.qa.run(verbs.OP_READ, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * n and stats.wrs == -(-n // max_sge)
    assert_moved(pair, ops)


def test_contiguous_both_sides_merge_into_one_sge(pair: Pair) -> None:
    fill(pair)
    ops = [(i * BLOCK, pair.b.base_addr + i * BLOCK, BLOCK) for i in range(8)]
    status, stats = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * 8 and stats.wrs == 1 and stats.sges == 1
    assert_moved(pair, ops)


def test_many_outstanding_wrs_bounded_by_window(pair: Pair) -> None:
    fill(pair)
    small = 512
    n = 3 * pair.qa.max_wr + 7  # more WRs than the send queue holds
    ops = [
        ((i % BLOCKS) * BLOCK + (i // BLOCKS) * small, pair.b.base_addr + i * small, small)
        for i in range(n)
        if (i // BLOCKS) * small + small <= BLOCK
    ]
    assert len(ops) == n
    status, stats = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, 60.0, sge_limit=1)
    assert stats.failed_ops == 0 and status == [0] * n
    assert stats.wrs == n
    assert stats.max_outstanding == pair.qa.max_wr
    assert stats.post_calls > 1 and stats.signaled < n  # chained, selectively signalled
    assert_moved(pair, ops)
    status, stats = pair.qa.run(verbs.OP_READ, pair.ma, pair.mb.rkey, ops, 60.0, sge_limit=1)
    assert stats.failed_ops == 0
    assert stats.max_outstanding <= pair.qa.max_rd_atom


def test_bad_rkey_is_an_error_completion_then_recovery(pair: Pair) -> None:
    fill(pair)
    ops = scattered_ops(pair, 4)
    status, stats = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey ^ 0x5A5A, ops, TIMEOUT)
    assert stats.failed_ops == 4 and status[0] == verbs.ST_REMOTE_ACCESS
    assert bytes(pair.b.array[: 4 * BLOCK]) == bytes(4 * BLOCK)  # nothing written
    pair.reconnect()
    status, _ = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * 4
    assert_moved(pair, ops)


def test_bad_address_fails_only_that_op_and_what_follows(pair: Pair) -> None:
    fill(pair)
    good = scattered_ops(pair, 6)
    beyond = (0, pair.b.base_addr + pair.b.nbytes, BLOCK)  # outside the remote MR
    ops = [*good[:3], beyond, *good[3:]]
    status, _ = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status[:3] == [0, 0, 0]
    assert status[3] == verbs.ST_REMOTE_ACCESS
    assert all(s in verbs.RETRYABLE for s in status[4:])
    assert_moved(pair, ops, [0, 1, 2])
    pair.reconnect()
    status, _ = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, good[3:], TIMEOUT)
    assert status == [0, 0, 0]
    assert_moved(pair, good)


def test_qp_error_flushes_then_reset_recovers(pair: Pair) -> None:
    fill(pair)
    ops = scattered_ops(pair, 10)
    pair.qa.force_error()
    assert pair.qa.state() == verbs.QPS_ERR
    status, stats = pair.qa.run(verbs.OP_READ, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert stats.failed_ops == 10 and all(s in verbs.RETRYABLE for s in status)
    pair.reconnect()
    assert pair.qa.state() == verbs.QPS_RTS
    status, _ = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * 10
    assert_moved(pair, ops)


def test_dead_peer_gives_retry_exceeded_not_a_hang(device: verbs.Device, pair: Pair) -> None:
    fill(pair)
    pair.qb.close()  # the peer's QP is gone: packets are dropped, never acked
    ops = scattered_ops(pair, 3)
    status, stats = pair.qa.run(verbs.OP_WRITE, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert stats.failed_ops == 3
    # RETRY_EXCEEDED after ~0.55 s; the others where the emulated device is slower
    assert status[0] in (verbs.ST_RETRY_EXCEEDED, verbs.ST_STALLED, verbs.ST_TIMEOUT)
    pair.qb = device.create_qp()  # for the fixture's close()


def test_a_qp_without_completions_is_given_up_as_stalled(device: verbs.Device, pair: Pair) -> None:
    fill(pair)
    pair.qb.close()  # nothing answers: no completion, not even an error, for ~0.55 s
    ops = scattered_ops(pair, 3)
    status, stats = pair.qa.run(
        verbs.OP_READ, pair.ma, pair.mb.rkey, ops, 60.0, sge_limit=1, stall_s=0.05
    )
    # given up long before the device's own retries run out (and the 60 s deadline)
    assert stats.failed_ops == 3 and stats.first_error == verbs.ST_STALLED
    assert status[0] == verbs.ST_STALLED
    assert all(s in (verbs.ST_STALLED, verbs.ST_NOT_POSTED) for s in status)
    assert all(s in verbs.RETRYABLE for s in status)
    assert pair.qa.state() == verbs.QPS_ERR  # forced there: the device lets go of the WRs
    pair.qb = device.create_qp()
    pair.reconnect()
    status, _ = pair.qa.run(verbs.OP_READ, pair.ma, pair.mb.rkey, ops, TIMEOUT)
    assert status == [0] * 3  # a reset QP moves them
    assert_moved(pair, ops)


def test_conn_info_round_trip_and_validation(pair: Pair) -> None:
    info = pair.qa.local_info(pair.ma)
    assert verbs.ConnInfo.from_dict(info.to_dict()) == info
    bad = info.to_dict() | {"qpn": -1}
    with pytest.raises(RdmaError, match="qpn"):
        verbs.ConnInfo.from_dict(bad)
    with pytest.raises(RdmaError, match="gid"):
        verbs.ConnInfo.from_dict(info.to_dict() | {"gid": "zz"})
