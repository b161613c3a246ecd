"""Op tables: the batch form the client hands a transport, checked like IoOp lists."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.errors import ConfigError
from rdmakv.transport.base import (
    IoOp,
    check_local_ops,
    check_remote_ops,
    io_ops,
    make_op_table,
)
from rdmakv.transport.rdma import verbs

U64 = 2**64 - 1
op_rows = st.lists(
    st.tuples(st.integers(0, U64), st.integers(0, U64), st.integers(0, U64),
              st.integers(0, U64)),
    max_size=20,
)


def _table(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    columns = [np.array(c, dtype=np.uint64) for c in zip(*rows, strict=True)] or [[]] * 4
    return make_op_table(*columns)


@given(rows=op_rows)
def test_a_table_is_the_native_loops_layout_of_the_same_ops(
    rows: list[tuple[int, int, int, int]],
) -> None:
    ops = [IoOp(*r) for r in rows]
    table = _table(rows)
    assert table.dtype == np.uint64 and table.shape == (len(rows), 4)
    assert table.flags.c_contiguous
    assert np.array_equal(table, verbs.op_table(ops).reshape(len(rows), 4))
    if rows:
        assert verbs.op_table(table) is table  # handed to the native loop as it is
    assert list(io_ops(table)) == ops


def _inside(start: int, length: int, lo: int, hi: int) -> bool:
    return lo <= start and start + length <= hi


@given(rows=op_rows, nbytes=st.sampled_from([4096, 1 << 20]))
def test_table_checks_refuse_exactly_what_the_op_by_op_checks_refuse(
    rows: list[tuple[int, int, int, int]], nbytes: int,
) -> None:
    # small values too, so most batches hold ops on both sides of the bounds
    rows = [(a % (2 * nbytes) if i % 2 else a, b, c % (2 * nbytes) if i % 3 else c, d)
            for i, (a, b, c, d) in enumerate(rows)]
    table = _table(rows)
    with Slab(nbytes, 4096, lock=False) as slab:
        local_ok = all(_inside(r[0], r[2], 0, nbytes) for r in rows)
        if local_ok:
            check_local_ops(table, slab)
            check_local_ops([IoOp(*r) for r in rows], slab)
        else:
            first = next(IoOp(*r) for r in rows if not _inside(r[0], r[2], 0, nbytes))
            with pytest.raises(ConfigError, match="outside the registered") as err:
                check_local_ops(table, slab)
            assert str(first) in str(err.value)  # names the first bad op
    base, size = 1 << 40, 1 << 30
    remote_ok = all(_inside(r[1], r[2], base, base + size) for r in rows)
    if remote_ok:
        check_remote_ops(table, base, size)
    else:
        with pytest.raises(ConfigError, match="outside the node pool"):
            check_remote_ops(table, base, size)


def test_remote_check_edges() -> None:
    base, size = 1 << 40, 8192
    check_remote_ops(make_op_table([0, 0], [base, base + 4096], [4096, 4096], [0, 0]), base, size)
    check_remote_ops(make_op_table([0], [base + size], [0], [0]), base, size)  # empty at the end
    for addr, length in ((base - 1, 1), (base + 4096, 4097), (base + size + 1, 0), (base, U64)):
        with pytest.raises(ConfigError, match="outside the node pool"):
            check_remote_ops(make_op_table([0], [addr], [length], [0]), base, size)


def test_ops_that_cannot_be_a_table_are_config_errors() -> None:
    for bad in ([IoOp(0, -5, 10)], [(1, 2), (1, 2, 3)], [(1, 2, 3, 4, 5)]):
        with pytest.raises(ConfigError, match="I/O ops"):
            verbs.op_table(bad)
