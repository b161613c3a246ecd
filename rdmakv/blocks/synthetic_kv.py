"""Synthetic KV: block bytes that are a function of the block's key, so every read is checkable.

The demo and the trace replay stand in for an engine's attention layers with
:func:`fill_kv`, and check every block they get back with :func:`kv_matches`:
a block that came back from the wrong key, or with any byte changed, fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmakv.blocks.keys import KEY_BYTES, BlockKey


def fill_kv(block: np.ndarray[Any, Any], key: BlockKey) -> None:
    """Write the KV of ``key`` into ``block`` (uint8, a multiple of 8 bytes long)."""
    block.view(np.uint64)[:] = int.from_bytes(key[:8], "little")
    block[:KEY_BYTES] = np.frombuffer(key, dtype=np.uint8)


def kv_matches(block: np.ndarray[Any, Any], key: BlockKey) -> bool:
    """Whether ``block`` holds exactly what :func:`fill_kv` writes for ``key``."""
    return bytes(block[:KEY_BYTES]) == key and bool(
        (block[KEY_BYTES:].view(np.uint64)[1:] == int.from_bytes(key[:8], "little")).all()
    )
