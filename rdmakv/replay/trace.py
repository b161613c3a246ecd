"""Request traces in the Mooncake format, turned into real tokens, keys and digests.

A trace is JSON lines, one request each, in arrival order::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` is milliseconds from the start, ``input_length`` and
``output_length`` token counts, and ``hash_ids`` one id per ``block_tokens``
block of the input (the last one may be partial). Equal ids at equal chain
positions are the same KV block. This is the format of the Mooncake FAST'25
traces (``../shared/traces/``) and of the traces Mooncake's and LMCache's
tools write.

To replay a trace through the real stack, every hash id becomes one block of
deterministic tokens (:func:`block_token_ids`, a function of the id only), and
a request's prompt is its blocks' tokens cut to ``input_length``. The real
:class:`~rdmakv.blocks.keys.BlockKeyer` then gives real chained keys and digests.
Only *full* blocks are cached, as in the manager: a prompt's partial last block
is recomputed by every request (in this trace it is never reused anyway, since
the next turn fills it with the answer's tokens, which gives it a new id).

:class:`TraceKeys` also knows the future, for the two things a replay compares
online policies against: when each block is used last (the *oracle* offloads
exactly the blocks used again) and which requests are continued by a later
one (the *hint* an application could give: "this conversation goes on").
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.blocks.keys import BlockKey, BlockKeyer, KeyNamespace
from rdmakv.engine.l1.offload_policies import NoOffload
from rdmakv.errors import ConfigError

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""
TRACE_NAMESPACE = KeyNamespace(model="rdmakv-trace-replay", dtype="synthetic", kv_layout="trace")
_MAX_HASH_ID = (1 << 62) - 1  # token ids 0 and 1 of a block encode the id (31 bits each)
_TOKEN_BITS = 31
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_tokens: int) -> int:
        """Blocks of the prompt that are full (the only ones a cache stores)."""
        return self.input_length // block_tokens


class Trace:
    """The requests of a trace, in arrival order, with ``block_tokens`` tokens per hash id."""

    def __init__(
        self, requests: Sequence[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS
    ) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 2:
            raise ConfigError(f"block_tokens must be an int >= 2, got {block_tokens!r}")
        self.requests = list(requests)
        self.block_tokens = block_tokens

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    def slice(self, start: int = 0, count: int | None = None) -> Trace:
        """Requests ``[start, start + count)`` as a trace of their own."""
        stop = None if count is None else start + count
        return Trace(self.requests[start:stop], self.block_tokens)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    def prompt_tokens(self, request: TraceRequest) -> np.ndarray[Any, np.dtype[np.int32]]:
        """The request's prompt: its blocks' tokens, cut to ``input_length``."""
        bt = self.block_tokens
        out = np.empty(len(request.hash_ids) * bt, dtype=np.int32)
        for i, h in enumerate(request.hash_ids):
            out[i * bt : (i + 1) * bt] = block_token_ids(h, bt)
        return out[: request.input_length]


def block_token_ids(hash_id: int, block_tokens: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    """The tokens of hash id ``hash_id``: deterministic, and different for different ids.

    Tokens 0 and 1 hold the id (31 bits each), so no two ids share a block;
    the rest are a splitmix64 stream of the id, in ``[0, 2**31)``.
    """
    seed = (hash_id * _GOLDEN_GAMMA) & _MASK64  # in Python ints: numpy scalars warn on wrap
    x = np.arange(block_tokens, dtype=np.uint64) + np.uint64(seed)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    out = (x >> np.uint64(64 - _TOKEN_BITS)).astype(np.int32)
    out[0] = hash_id & ((1 << _TOKEN_BITS) - 1)
    out[1] = hash_id >> _TOKEN_BITS
    return out


def load_trace(
    path: str | Path,
    *,
    start: int = 0,
    limit: int | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> Trace:
    """Read requests ``[start, start + limit)`` of a JSON-lines trace, checking every field.

    A malformed line is a :class:`ConfigError` naming the file, the line and
    what is wrong with it; blank lines are skipped.
    """
    if start < 0 or (limit is not None and limit < 0):
        raise ConfigError(f"start and limit must be >= 0, got start={start}, limit={limit}")
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read trace {str(p)!r}: {e.strerror}") from None
    requests: list[TraceRequest] = []
    index = 0
    last_ts = -1
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            req = _parse_request(line, where, block_tokens)
            if req.timestamp_ms < last_ts:
                raise ConfigError(
                    f"{where}: timestamp {req.timestamp_ms} is earlier than the line before "
                    f"({last_ts}); a trace must be in arrival order"
                )
            last_ts = req.timestamp_ms
            if index >= start:
                requests.append(req)
                if limit is not None and len(requests) >= limit:
                    break
            index += 1
    return Trace(requests, block_tokens)


def _parse_request(line: str, where: str, block_tokens: int) -> TraceRequest:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a request must be a JSON object, got {type(raw).__name__}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length"):
        v = raw.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{where}: {name!r} must be an integer >= 0, got {v!r}")
        fields[name] = v
    ids = raw.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_HASH_ID for h in ids
    ):
        raise ConfigError(
            f"{where}: 'hash_ids' must be a list of integers in [0, 2**62), got {_short(ids)}"
        )
    want = math.ceil(fields["input_length"] / block_tokens)
    if len(ids) != want:
        raise ConfigError(
            f"{where}: input_length {fields['input_length']} needs {want} hash ids of "
            f"{block_tokens} tokens, the line has {len(ids)} (is --block-tokens right?)"
        )
    return TraceRequest(
        fields["timestamp"], fields["input_length"], fields["output_length"], tuple(ids)
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class TraceKeys:
    """Real keys and digests of every request's full blocks, and what the future holds.

    Keys come from the real :class:`BlockKeyer` over the tokens of
    :func:`block_token_ids`, chained along each request's ``hash_ids``; a
    block shared by many requests is hashed once.
    """

    def __init__(self, trace: Trace, namespace: KeyNamespace = TRACE_NAMESPACE) -> None:
        self.trace = trace
        self.keyer = BlockKeyer(namespace, trace.block_tokens)
        bt = trace.block_tokens
        memo: dict[tuple[BlockKey, int], tuple[BlockKey, bytes]] = {}
        self.keys: list[list[BlockKey]] = []
        self.digests: list[list[bytes]] = []
        last_use: dict[BlockKey, int] = {}
        for r, req in enumerate(trace):
            parent = self.keyer.root
            ks: list[BlockKey] = []
            ds: list[bytes] = []
            for h in req.hash_ids[: req.full_blocks(bt)]:
                kd = memo.get((parent, h))
                if kd is None:
                    ((_, k, d),) = self.keyer.chain(block_token_ids(h, bt), parent=parent)
                    kd = memo[(parent, h)] = (k, d)
                ks.append(kd[0])
                ds.append(kd[1])
                last_use[kd[0]] = r
                parent = kd[0]
            self.keys.append(ks)
            self.digests.append(ds)
        self.last_use = last_use
        """Key -> index of the last request that asks for it."""
        self.unique_blocks = len(last_use)
        """Distinct full blocks in the trace: what an unbounded cache would hold."""
        self.total_blocks = sum(len(k) for k in self.keys)
        """Full blocks asked for, repeats included: the hit rate's denominator."""

    def continued(self, r: int) -> bool:
        """Whether a later request asks for request ``r``'s last full block.

        That is what an application knows when it says "this conversation goes
        on" (the next turn's prompt extends this one): the perfect request hint.
        """
        ks = self.keys[r]
        return bool(ks) and self.last_use[ks[-1]] > r

    def hint(self, r: int, noise: float = 0.0) -> bool:
        """Request ``r``'s ``keep`` hint: :meth:`continued`, wrong for a ``noise`` share.

        Which requests get the wrong answer is a fixed function of ``r`` (the
        same in every replay), so replays with the same noise compare.
        """
        wrong = noise > 0.0 and zlib.crc32(r.to_bytes(8, "little")) < noise * 2**32
        return self.continued(r) != wrong

    def reused_tokens(self, r: int) -> int:
        """Tokens of request ``r``'s first blocks that a later request asks for again.

        The perfect prefix-length hint (:data:`rdmakv.engine.l1.KeepHint`): a later
        request that asks for block ``d`` of the chain asks for every block
        before it, so the reused blocks are a prefix.
        """
        n = 0
        for k in self.keys[r]:
            if self.last_use[k] <= r:
                break
            n += 1
        return n * self.trace.block_tokens

    def reused_later(self, key: BlockKey, r: int) -> bool:
        """Whether a request after ``r`` asks for ``key``: the oracle's knowledge."""
        return self.last_use.get(key, -1) > r


class OracleOffload(NoOffload):
    """Offloads, at insert, exactly the blocks a later request asks for. Not online.

    The replay tells it which request is running (:attr:`now`) before each
    request. It is the bound the online policies are measured against.
    """

    name = "oracle"
    needs_queue = True

    def __init__(self, keys: TraceKeys) -> None:
        self._keys = keys
        self.now = 0

    def on_insert(self, key: BlockKey, depth: int, keep: bool | None) -> bool:
        return self._keys.reused_later(key, self.now)
