"""Value checksums of slab ranges in native code.

The protocol's value checksum is XXH3-64 of a value's bytes
(:func:`~rdmakv.wire.format.value_checksum`). The writer computes it, the node
stores it, and the reader checks the bytes it got against it: never wrong KV.
Per value in Python that is a call, a slice and a list entry each, with the
GIL held: several times one native call's cost for a batch, and of the order
of the time a 100 Gb/s NIC takes to move it.

So the native core hashes instead, with the xxhash module's own C functions
(the code :func:`value_checksum` runs):

* :data:`HASHER`, the ``rk_hasher`` the native TCP loop (native/rk_tcp.c, in
  ``rdmakv._native``) hashes ranges with as it moves them;
* :func:`checksum_ranges`, a whole batch of slab ranges hashed in one call
  with the GIL released, for bytes that loop does not move (an RDMA
  transport's writes and reads of the slab).

Either is None / returns None where the xxhash C API is missing, and the
caller then hashes each value in Python.

How fast XXH3 runs is the xxhash build's: from xxhash 4.1 its x86 wheels
pick SSE2, AVX2 or AVX-512 at run time (``XXH3_64bits_dispatch``); earlier
wheels are built for baseline x86-64 (SSE2), which hashed at a third to a half
of that speed and slowed the native loop's hashed sends with it. Hence the
``xxhash>=4.1`` requirement, and :func:`describe`, which ``rdmakv doctor``
prints. The figures behind both paragraphs: bench/README.md, section
"Measurements moved from code comments (issue 58)".
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from rdmakv import native_core
from rdmakv.transport.base import iov_at
from rdmakv.wire.format import value_checksum

_ffi, _lib = native_core.ffi, native_core.lib

X86 = frozenset({"x86_64", "amd64", "i386", "i686"})
"""Machines where an xxhash build without run-time dispatch hashes with SSE2
only (elsewhere the baseline build has the vector unit: NEON on arm64)."""
_DISPATCH = "XXH3_64bits_dispatch"
_XXH3 = {  # rk_hasher field -> the xxhash C API names for it, fastest first
    "oneshot": (_DISPATCH, "XXH3_64bits"),  # _dispatch: AVX2 / AVX-512 when the CPU has it
    "create_state": ("XXH3_createState",),
    "free_state": ("XXH3_freeState",),
    "reset": ("XXH3_64bits_reset",),
    "update": ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"),
    "digest": ("XXH3_64bits_digest",),
}


def _find_hasher() -> tuple[Any, bool]:
    """An ``rk_hasher`` of XXH3-64 for the native core, or None; and whether
    its one-shot hash is xxhash's run-time dispatching one.

    Its functions are taken from the ``xxhash`` module that
    :func:`value_checksum` itself calls (its extension exports the C API), so
    both hash with the same code; one-shot and streamed hashes are checked
    against :func:`value_checksum` before they are trusted.
    """
    try:
        so = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        hasher = _ffi.new("rk_hasher *")
        for field, names in _XXH3.items():
            name = next((n for n in names if hasattr(so, n)), None)
            if name is None:
                return None, False
            addr = ctypes.cast(so[name], ctypes.c_void_p).value
            setattr(hasher, field, _ffi.cast(_ffi.typeof(getattr(hasher, field)), addr))
        probe = os.urandom(4099)
        buf = _ffi.from_buffer(probe)
        state = hasher.create_state()
        try:
            hasher.reset(state)
            hasher.update(state, buf, 1000)
            hasher.update(state, buf + 1000, len(probe) - 1000)
            streamed = hasher.digest(state)
        finally:
            hasher.free_state(state)
        want = value_checksum(probe)
        if hasher.oneshot(buf, len(probe)) == want == streamed:
            return hasher, hasattr(so, _DISPATCH)
        return None, False
    except (AttributeError, ImportError, OSError, TypeError):
        return None, False


HASHER: Any
DISPATCHED: bool
HASHER, DISPATCHED = _find_hasher()
"""HASHER: the ``rk_hasher *`` the native core hashes with (None: no native
checksums); DISPATCHED: whether it picks SSE2 / AVX2 / AVX-512 at run time."""


def describe() -> str:
    """How values are hashed here, and the fix where that is slow (speed only)."""
    version = getattr(xxhash, "VERSION", "?")
    if HASHER is None:
        return (f"XXH3 (xxhash {version}) in Python, one call per value: the xxhash C API "
                "was not found")
    if DISPATCHED or platform.machine().lower() not in X86:
        return f"XXH3 (xxhash {version}), native, vector unit picked at run time"
    return (f"XXH3 (xxhash {version}), native, a baseline x86-64 build (SSE2 only: a third "
            "to a half of AVX2's speed where measured): pip install -U 'xxhash>=4.1'")


def checksum_ranges(
    base: int, offsets: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
) -> list[int] | None:
    """:func:`value_checksum` of the bytes at ``base + offsets[i]``, ``lengths[i]``
    long, for every i, in one native call with the GIL released; None without
    the native hasher (the caller hashes in Python then).

    The caller has bounds-checked every range against memory that stays
    mapped, and unchanged, while this runs.
    """
    if HASHER is None:
        return None
    n = len(lengths)
    iov = iov_at(base, offsets, lengths)
    out = np.empty(n, dtype=np.uint64)
    if n:
        _lib.rk_tcp_hash_ranges(
            HASHER, _ffi.cast("const uint64_t *", _ffi.from_buffer(iov)), n,
            _ffi.cast("uint64_t *", _ffi.from_buffer(out, require_writable=True)),
        )
    return out.tolist()
