"""What one ``rdmakv bench`` run measures: :class:`BenchConfig` and its sizes.

Block sizes, blocks per size, repeats, latency samples and the concurrency
section's shape, with the quick run's smaller ones beside them. Units: KiB
and MiB of bytes; GB is 1e9 bytes (figures are GB/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdmakv.perf.drivers import default_systems

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
DEFAULT_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
QUICK_SIZES = (16 * KiB, 256 * KiB)
MAX_BLOCKS = 1000
MAX_BYTES = 256 * MiB
QUICK_BLOCKS = 64
DEFAULT_REPEATS = 3
LATENCY_BLOCK = 64 * KiB
LATENCY_KEYS = (1, 16, 64)
LATENCY_SAMPLES = 1000
"""Samples per latency figure. The p99 of 1000 samples lies between the tenth- and
eleventh-largest, so one or two stray wake-ups do not set it (of 200, between the
second- and third-largest, they did: bench/README.md, "Measurements moved from code
comments (issue 58)")."""
QUICK_LATENCY_SAMPLES = 20
CONC_BLOCK = 256 * KiB
CONC_BATCH = 16
"""Blocks per put/get call of a concurrency client (4 MiB)."""
CONC_ROUNDS = 16
QUICK_CONC_ROUNDS = 4
CONC_PROCS = (1, 2, 4)
QUICK_CONC_PROCS = (1, 2)
CONC_SYSTEMS = ("rdmakv", "redis", "mooncake_te")


@dataclass
class BenchConfig:
    """One run's choices (the CLI's flags); None: the default for the transport / quick."""

    transport: str = "tcp"
    quick: bool = False
    systems: Sequence[str] | None = None
    sizes: Sequence[int] | None = None
    repeats: int | None = None
    blocks: int | None = None
    """Blocks per size (default: min(1000, 256 MiB / size); quick: 64)."""
    name: str | None = None
    out: Path | None = None
    progress: bool = True
    latency: bool = True
    concurrency: bool = True
    warm_up: bool = True
    """Untimed puts and gets of the whole batch before each timed one
    (:func:`rdmakv.perf.measure.warm_up_rounds`)."""
    conc_procs: Sequence[int] | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)

    def resolved_systems(self) -> list[str]:
        return list(self.systems or default_systems(self.transport))

    def resolved_sizes(self) -> list[int]:
        return list(self.sizes or (QUICK_SIZES if self.quick else DEFAULT_SIZES))

    def resolved_repeats(self) -> int:
        return self.repeats or (1 if self.quick else DEFAULT_REPEATS)

    def blocks_for(self, size: int) -> int:
        if self.blocks:
            return self.blocks
        return QUICK_BLOCKS if self.quick else max(1, min(MAX_BLOCKS, MAX_BYTES // size))

    def output_name(self) -> str:
        """``peers_<transport>`` for the full comparison; a run narrowed by --systems,
        --sizes, --blocks or --repeats gets ``_partial`` so it never replaces that."""
        if self.name:
            return self.name
        narrowed = self.systems or self.sizes or self.blocks or self.repeats
        return f"peers_{self.transport}" + ("_partial" if narrowed else "")

    def output_dir(self) -> Path | None:
        """Where files go; None for --quick without --out (nothing written)."""
        if self.out is not None:
            return self.out
        return None if self.quick else Path("bench/results")
