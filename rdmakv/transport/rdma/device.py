"""What both sides of the ``rdma`` transport share: the device, its usability, its counters.

One device context and protection domain per process (:class:`SharedDevice`,
reference counted, closed at exit after every user), the answer to "can RDMA
run here" (:func:`rdma_usable`), the data path's counters and the error that
names the ops a device failed.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from typing import Any

from rdmakv.errors import (
    ConfigError,
    OpsFailed,
    RdmaError,
    RdmaUnavailable,
)
from rdmakv.transport.rdma import verbs

log = logging.getLogger("rdmakv.rdma")


@dataclass
class DataPathTotals:
    """Running totals of what the native loop did on one transport (bench)."""

    batches: int = 0
    wrs: int = 0
    sges: int = 0
    busy_s: float = 0.0

    def add(self, stats: verbs.JobStats, seconds: float) -> None:
        self.batches += 1
        self.wrs += stats.wrs
        self.sges += stats.sges
        self.busy_s += seconds

    def snapshot(self) -> DataPathTotals:
        return DataPathTotals(self.batches, self.wrs, self.sges, self.busy_s)


class RdmaOpsFailed(RdmaError, OpsFailed):
    """Some ops of a batch failed on the device; ``failed`` are their indexes
    in the batch (the other ops' bytes moved, the QP was already reset and
    reconnected or will be before the next batch). ``statuses`` maps index ->
    completion code."""

    def __init__(self, msg: str, failed: list[int], statuses: dict[int, int]) -> None:
        OpsFailed.__init__(self, msg, failed)
        self.statuses = statuses


# -- one shared device per process -------------------------------------------------
class SharedDevice:
    """The process-wide :class:`verbs.Device`: every transport and data path in
    a process shares one PD, so a slab registered for one peer is registered
    for all, exactly once, and stays registered across reconnects. The device
    lives until the process exits (like a GPU context); registrations of
    closed slabs are replaced when the range is registered again."""

    _lock = threading.Lock()
    _dev: verbs.Device | None = None

    @classmethod
    def acquire(cls) -> verbs.Device:
        with cls._lock:
            if cls._dev is None:
                cls._dev = verbs.Device(verbs.select())
                atexit.register(cls._close)
                log.info("rdmakv rdma: using %s", cls._dev.sel.describe())
            return cls._dev

    @classmethod
    def _close(cls) -> None:
        with cls._lock:
            if cls._dev is not None:
                cls._dev.close()
                cls._dev = None


def rdma_usable() -> tuple[bool, str]:
    """(True, description) when a usable device/port/GID and the native core
    exist, else (False, why)."""
    if not verbs.native_available():
        return False, verbs.NATIVE_ERROR or "native RDMA core missing"
    try:
        return True, verbs.select().describe()
    except (RdmaUnavailable, ConfigError) as e:
        return False, str(e)


class NoRegion:
    """Stands in for a region before the client slab is registered."""

    addr = 0
    length = 0
    rkey = 0


NO_REGION: Any = NoRegion()
