"""Generated trace shapes: deterministic, in the Mooncake format, and the byte budget on each."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdmakv.errors import ConfigError
from rdmakv.replay import ReplaySetup, TraceKeys, load_trace, replay_model
from rdmakv.replay.shapes import SHAPES, generate_trace, write_trace

SHORT = 500
"""Requests per shape in the budget test: a few seconds of replay each."""
BUDGET_TOLERANCE = 0.05
"""The issue's bar: bytes sent within this share of the budget (relative to ``all``)."""
L1_SHARE = 0.05


@pytest.mark.parametrize("shape", SHAPES)
def test_generator_is_deterministic_for_a_seed(shape: str, tmp_path: Path) -> None:
    a = write_trace(generate_trace(shape, seed=3, requests=200), tmp_path / "a.jsonl")
    b = write_trace(generate_trace(shape, seed=3, requests=200), tmp_path / "b.jsonl")
    c = write_trace(generate_trace(shape, seed=4, requests=200), tmp_path / "c.jsonl")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    # What it writes is a valid Mooncake trace that reads back the same.
    back = load_trace(a)
    assert back.requests == generate_trace(shape, seed=3, requests=200).requests
    assert len(back) == 200


def test_shapes_reuse_where_they_say() -> None:
    reuse = {}
    for shape in SHAPES:
        keys = TraceKeys(generate_trace(shape, seed=0, requests=300))
        reuse[shape] = 1 - keys.unique_blocks / keys.total_blocks
    assert reuse["unique"] < 0.05
    assert min(reuse["shared_prefix"], reuse["shared_docs"], reuse["agent"]) > 0.4
    agent = generate_trace("agent", seed=0, requests=300)
    # An agent turn re-sends the whole context of the turn before it, and more.
    extended = sum(
        any(
            len(later.hash_ids) > len(r.hash_ids)
            and later.hash_ids[: len(r.hash_ids) - 1] == r.hash_ids[:-1]
            for later in agent.requests[i + 1 :]
        )
        for i, r in enumerate(agent.requests[:50])
    )
    assert extended >= 40


def test_bad_generator_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown trace shape 'chat'; expected one of"):
        generate_trace("chat")
    with pytest.raises(ConfigError, match="requests must be a positive int, got 0"):
        generate_trace("agent", requests=0)
    with pytest.raises(ConfigError, match="seed must be an int"):
        generate_trace("agent", seed="1")  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=SHAPES)
def short_keys(request: pytest.FixtureRequest) -> TraceKeys:
    return TraceKeys(generate_trace(request.param, seed=0, requests=SHORT))


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
def test_reuse_budget_holds_on_every_shape(short_keys: TraceKeys, budget: float) -> None:
    l1 = max(1, round(L1_SHARE * short_keys.unique_blocks))
    everything = replay_model(short_keys, ReplaySetup(l1, None, "all"))
    budgeted = replay_model(short_keys, ReplaySetup(l1, None, "reuse", budget))
    share = budgeted.steady_sent_blocks / everything.steady_sent_blocks
    assert abs(share - budget) <= BUDGET_TOLERANCE * budget, share
    assert budgeted.dropped_offloads == 0
