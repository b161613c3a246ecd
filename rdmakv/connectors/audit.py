"""Sampled recompute audits: proof that the KV rdmakv hands an engine is the right KV.

Checksums prove that the bytes read are the bytes written; they cannot prove
the bytes written were the right KV for those tokens (another engine with other
weights under the same model name, a paged-copy layout bug, a wrong TP head
slice, a kernel change). An audit proves it for a sample of requests:

1. The scheduler side picks a request with a remote hit (:func:`audit_sampled`,
   deterministic per request id, so every process agrees) and offers the engine
   **no** external tokens: the engine computes the whole prompt, its output is
   unaffected.
2. The worker fetches the blocks the request would have loaded (L1, then the
   node) into slab blocks it holds (:class:`PendingAudit`), off the engine's
   thread.
3. The save that copies the same positions, which the engine has just computed,
   compares them with the fetched bytes (:func:`block_diff`): exactly, or
   within ``audit_tolerance`` (max abs difference relative to the block's
   largest magnitude, per layer).

Outcomes go to an :class:`AuditLedger`: counters and a diff histogram for the
metrics, one log line per namespace for the first mismatching block (key,
layer, diff), and, with ``audit_quarantine``, the :class:`NamespaceGuard`
switches the namespace's remote hits and stores off in this process until an
operator clears it or the engine restarts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rdmakv.connectors.audit")

SAMPLE_HASH_BYTES = 8
"""Bytes of the request id's hash that pick a request for an audit."""
SAMPLE_SPACE = 1 << (8 * SAMPLE_HASH_BYTES)
MIN_MAGNITUDE = 1e-30
"""A block whose largest magnitude is below this is compared in absolute terms."""
AUDIT_BACKOFF_S = 30.0
"""After an audit fetch hit a node failure, audits pause this long (saves never wait)."""


def audit_sampled(req_id: str, rate: float) -> bool:
    """Whether request ``req_id`` is audited at ``rate`` (deterministic: a hash of the id)."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    h = hashlib.blake2b(req_id.encode(), digest_size=SAMPLE_HASH_BYTES).digest()
    return int.from_bytes(h, "little") < rate * SAMPLE_SPACE


def check_audit_options(rate: object, tolerance: object, quarantine: object) -> None:
    """ConfigError naming the key of a bad audit option."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"audit_rate must be a number in [0, 1], got {rate!r}")
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not tolerance >= 0.0  # also refuses NaN
    ):
        raise ConfigError(
            f"audit_tolerance must be a number >= 0 (0 = exact), got {tolerance!r}"
        )
    if not isinstance(quarantine, bool):
        raise ConfigError(f"audit_quarantine must be true or false, got {quarantine!r}")


def namespace_label(ns: KeyNamespace) -> str:
    """A one-line, human-readable name of a key namespace (logs, metrics, node reports)."""
    tp = "" if ns.tp_rank is None else f" tp{ns.tp_rank}/{ns.tp_size}"
    return f"{ns.model} {ns.dtype} {ns.kv_layout}{tp}"


@dataclass(frozen=True)
class BlockDiff:
    """How far a fetched block is from the computed one."""

    max_rel: float
    """Max over layers of ``max|computed - fetched| / max|computed|`` (inf for NaN)."""
    layer: int
    """The layer where ``max_rel`` is reached."""
    identical: bool
    """The bytes are equal."""

    def mismatch(self, tolerance: float) -> bool:
        """Exact (``tolerance`` 0): any byte differs; else the relative diff exceeds it."""
        return not self.identical if tolerance == 0.0 else self.max_rel > tolerance


def block_diff(computed: torch.Tensor, fetched: torch.Tensor) -> BlockDiff:
    """Compare two blocks shaped ``[layers, ...]`` of one dtype (see :class:`BlockDiff`)."""
    import torch

    if computed.shape != fetched.shape or computed.dtype != fetched.dtype:
        raise ConfigError(
            f"audit compares blocks of one shape and dtype: {tuple(computed.shape)} "
            f"{computed.dtype} vs {tuple(fetched.shape)} {fetched.dtype}"
        )
    identical = torch.equal(
        computed.contiguous().view(torch.uint8), fetched.contiguous().view(torch.uint8)
    )
    if identical:
        return BlockDiff(0.0, 0, True)
    worst, worst_layer = 0.0, 0
    for layer in range(computed.shape[0]):
        a = computed[layer].float()
        b = fetched[layer].float()
        diff = float((a - b).abs().max())
        scale = max(float(a.abs().max()), MIN_MAGNITUDE)
        rel = diff / scale
        if rel != rel:  # NaN somewhere: as far apart as can be
            rel = float("inf")
        if rel > worst:
            worst, worst_layer = rel, layer
    return BlockDiff(worst, worst_layer, False)


@dataclass
class PendingAudit:
    """One audited request on a worker: fetched slab blocks awaiting their computed twins.

    ``fetched[k]`` maps request block index -> a slab handle of group ``k``'s
    manager the audit holds one reference on, until the save of that block
    compares it (or the request ends: :meth:`GroupStores.end_audit`).
    """

    req_id: str
    fetched: list[dict[int, int]]
    compared: int = 0
    mismatched: int = 0
    max_rel: float = 0.0

    @property
    def waiting(self) -> int:
        return sum(len(f) for f in self.fetched)


@dataclass
class AuditStats:
    """Audit counts of one process (read by the metrics collector at scrape time)."""

    checks: int = 0
    """Audited requests with at least one block compared."""
    mismatches: int = 0
    """Audited requests with at least one block outside the tolerance."""
    blocks_compared: int = 0
    blocks_mismatched: int = 0
    fetches_skipped: int = 0
    """Audit fetches not run (queued too long, node failing, namespace quarantined)."""


@dataclass
class GuardReport:
    """What changed in a :class:`NamespaceGuard` since it was last asked."""

    quarantined: dict[str, str] = field(default_factory=dict)
    cleared: set[str] = field(default_factory=set)


class NamespaceGuard:
    """Whether this process may use (load, store) its namespace's remote KV.

    Two reasons switch it off: a fingerprint conflict found at start-up
    (:attr:`refused`, until restart) and an audit quarantine
    (:meth:`quarantine`, until :meth:`clear` or restart). Thread-safe: the
    transfer thread sets it, the engine thread reads it and takes the changes
    for the scheduler side, an operator's HTTP request clears it.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self.refused: str | None = None
        self._quarantine: str | None = None
        self._report = GuardReport()

    @property
    def reason(self) -> str | None:
        """Why remote KV is off here, or None when it is on."""
        with self._lock:
            return self.refused or self._quarantine

    @property
    def quarantined(self) -> str | None:
        with self._lock:
            return self._quarantine

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refused = reason
            self._report.quarantined[self.label] = reason
            self._report.cleared.discard(self.label)

    def quarantine(self, reason: str) -> bool:
        """Switch remote KV off for an audit mismatch; False if it already was."""
        with self._lock:
            if self._quarantine is not None:
                return False
            self._quarantine = reason
            self._report.quarantined[self.label] = reason
            self._report.cleared.discard(self.label)
            return True

    def clear(self) -> bool:
        """An operator lifted the audit quarantine; False if there was none. A
        fingerprint refusal stays (the other engine's KV is still there)."""
        with self._lock:
            if self._quarantine is None:
                return False
            self._quarantine = None
            if self.refused is None:
                self._report.quarantined.pop(self.label, None)
                self._report.cleared.add(self.label)
            return True

    def take_report(self) -> GuardReport | None:
        """The changes since the last call (None: nothing changed)."""
        with self._lock:
            if not (self._report.quarantined or self._report.cleared):
                return None
            out, self._report = self._report, GuardReport()
            return out


class AuditLedger:
    """Where audit outcomes go: :class:`AuditStats`, the diff hook, the log, the guard.

    ``quarantine`` is the ``audit_quarantine`` option. ``on_result`` (a
    metrics hook, None = off) gets each finished audit's max relative diff.
    Written by the transfer thread only.
    """

    def __init__(self, guard: NamespaceGuard, *, tolerance: float, quarantine: bool) -> None:
        self.guard = guard
        self.tolerance = tolerance
        self.quarantine = quarantine
        self.stats = AuditStats()
        self.on_result: Callable[[float], None] | None = None
        self._logged = False

    def compared(
        self, audit: PendingAudit, diff: BlockDiff, *, key: bytes, group: int, block: int
    ) -> None:
        """One fetched block met its computed twin."""
        self.stats.blocks_compared += 1
        audit.compared += 1
        audit.max_rel = max(audit.max_rel, diff.max_rel)
        if not diff.mismatch(self.tolerance):
            return
        self.stats.blocks_mismatched += 1
        audit.mismatched += 1
        reason = (
            f"audit of request {audit.req_id}: block {block} of group {group} "
            f"(key {key.hex()}) layer {diff.layer} differs from the computed KV by "
            f"{diff.max_rel:.3g} (relative; tolerance {self.tolerance:g})"
        )
        if not self._logged:
            self._logged = True
            log.error(
                "rdmakv KV audit mismatch under namespace %s: %s; %s",
                self.guard.label,
                reason,
                "remote hits and stores of this namespace are off in this process "
                "(quarantine) until cleared or restarted"
                if self.quarantine
                else "audit_quarantine is off: remote hits continue",
            )
        if self.quarantine:
            self.guard.quarantine(reason)

    def finished(self, audit: PendingAudit) -> None:
        """The audit ended (all its blocks compared, or its request is gone)."""
        if not audit.compared:
            return
        self.stats.checks += 1
        if audit.mismatched:
            self.stats.mismatches += 1
        if self.on_result is not None:
            self.on_result(audit.max_rel)


__all__ = [
    "AUDIT_BACKOFF_S",
    "AuditLedger",
    "AuditStats",
    "BlockDiff",
    "GuardReport",
    "NamespaceGuard",
    "PendingAudit",
    "audit_sampled",
    "block_diff",
    "check_audit_options",
    "namespace_label",
]
