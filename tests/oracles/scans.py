"""The client's batch scans in plain Python: the oracles of native/rk_call.c's
``join_uniform`` and ``live_handles`` (:data:`rdmakv.native_core.CALL`).

Before the native core was required these were the client's own path where
the scans were not built; tests/test_batch_scans.py checks the native scans
against them on random batches.
"""

from __future__ import annotations

from typing import Any


def join_uniform(items: Any, lo: int, hi: int) -> tuple[int, bytes] | None:
    """``(n, b"".join(items))`` when ``items`` is a list or tuple of one or more
    ``bytes`` (exactly) all ``n`` long, ``lo <= n <= hi``; else None."""
    if type(items) not in (list, tuple) or not items:
        return None
    if any(type(x) is not bytes for x in items):
        return None
    if len({len(x) for x in items}) != 1 or not lo <= len(items[0]) <= hi:
        return None
    return len(items[0]), b"".join(items)


def live_handles(handles: Any, refs: Any) -> bool:
    """Whether ``handles`` is a list or tuple of ints (exactly ``int``), each
    ``h`` in ``[0, len(refs))`` with ``refs[h]`` an int other than 0, and
    ``refs`` a list (a slab's reference counts)."""
    if type(handles) not in (list, tuple) or type(refs) is not list:
        return False
    for h in handles:
        if type(h) is not int or not 0 <= h < len(refs):
            return False
        if type(refs[h]) is not int or refs[h] == 0:
            return False
    return True
