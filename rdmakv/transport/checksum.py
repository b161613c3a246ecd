"""Value checksums of slab ranges in native code.

The protocol's value checksum is XXH3-64 of a value's bytes
(:func:`~rdmakv.protocol.value_checksum`). The writer computes it, the node
stores it, and the reader checks the bytes it got against it: never wrong KV.
Per value in Python that is a call, a slice and a list entry each, with the
GIL held: 1000 values of 16 KiB took 1.03 ms that way on the bench host (data
in cache; 2.5 ms in a run from memory) against 0.32 ms in one native call,
where a 100 Gb/s NIC moves those 16 MiB in about 1.3 ms.

So the native core hashes instead, with the xxhash module's own C functions
(the code :func:`value_checksum` runs):

* :data:`HASHER`, the ``rk_hasher`` the native TCP loop (``rdmakv._native_tcp``,
  plain libc, built on every host) hashes ranges with as it moves them;
* :func:`checksum_ranges`, a whole batch of slab ranges hashed in one call
  with the GIL released, for bytes that loop does not move (an RDMA
  transport's writes and reads of the slab).

Either is None / returns None where the native core or the xxhash C API is
missing, and the caller then hashes each value in Python.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from rdmakv import native_core
from rdmakv.protocol import value_checksum
from rdmakv.transport.base import iov_at

_ffi, _lib, _ = native_core.load("_native_tcp", "native TCP core")

_XXH3 = {  # rk_hasher field -> the xxhash C API names for it, fastest first
    "oneshot": ("XXH3_64bits_dispatch", "XXH3_64bits"),  # _dispatch: AVX2 when the CPU has it
    "create_state": ("XXH3_createState",),
    "free_state": ("XXH3_freeState",),
    "reset": ("XXH3_64bits_reset",),
    "update": ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"),
    "digest": ("XXH3_64bits_digest",),
}


def _find_hasher() -> Any:
    """An ``rk_hasher`` of XXH3-64 for the native core, or None.

    Its functions are taken from the ``xxhash`` module that
    :func:`value_checksum` itself calls (its extension exports the C API), so
    both hash with the same code; one-shot and streamed hashes are checked
    against :func:`value_checksum` before they are trusted.
    """
    if _lib is None:
        return None
    try:
        so = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        hasher = _ffi.new("rk_hasher *")
        for field, names in _XXH3.items():
            name = next((n for n in names if hasattr(so, n)), None)
            if name is None:
                return None
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
        return hasher if hasher.oneshot(buf, len(probe)) == want == streamed else None
    except (AttributeError, ImportError, OSError, TypeError):
        return None


HASHER: Any = _find_hasher()
"""The ``rk_hasher *`` the native core hashes with (None: no native checksums)."""


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
