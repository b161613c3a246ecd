"""The contract between ``rdmakv bench`` and one system it measures.

A driver moves ``blocks`` blocks of ``block_bytes`` bytes between the bench's
source arena and a store, and back into the bench's destination arena, batched
the way that system is meant to be used. The runner times :meth:`Driver.put`
and :meth:`Driver.get` and then compares every byte of the destination with
the source itself: a driver never reports its own correctness.

Lifetime: ``open()`` starts what the system needs (servers, connections,
registrations) and may raise :class:`PeerUnavailable` with the reason (a wheel
that cannot import, a server that needs a device); the runner records that
text in the JSON instead of a number. ``close()`` stops everything ``open()``
started, and is safe to call after a failed ``open()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from rdmakv.errors import RdmakvError

Arena = npt.NDArray[np.uint8]
"""``blocks * block_bytes`` contiguous bytes (page-aligned, from an mmap or a Slab)."""


class PeerUnavailable(RdmakvError):
    """This system cannot run here; the message says why (recorded in the JSON)."""


@dataclass(frozen=True)
class Workload:
    """What every driver moves in one measurement."""

    block_bytes: int
    blocks: int
    batch: int
    """Blocks per request for systems that batch (all of them, as they are meant to)."""

    def keys(self, tag: str) -> list[bytes]:
        """Distinct 16-byte keys for this workload (``tag`` separates repeats)."""
        return [f"{tag}:{i}".encode().ljust(16, b".")[:16] for i in range(self.blocks)]


class Driver(Protocol):
    """One system under test. ``name`` is its key in the JSON (``rdmakv``, ``redis``...)."""

    name: str

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        """Start and connect; register ``src``/``dst`` if the system registers memory."""
        ...

    def put(self, keys: Sequence[bytes]) -> None:
        """Store block ``i`` of ``src`` under ``keys[i]`` (all of them, batched)."""
        ...

    def get(self, keys: Sequence[bytes]) -> None:
        """Read ``keys[i]`` into block ``i`` of ``dst`` (all of them, batched)."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is stored (one batched lookup); PeerUnavailable if the
        system has no such operation."""
        ...

    def close(self) -> None: ...
