"""A slice of the real trace through a real node over RDMA: the same counts as the model.

The same replay as tests/test_replay.py, with the client and node moving every
block by one-sided RDMA on the device (soft-RoCE ``rxe0`` in CI), so the offload
policies and the verified reads are checked on the data path users deploy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rdmakv.replay import ReplaySetup, TraceKeys, load_trace, replay_model
from rdmakv.replay.stack import replay_stack

SLICE = Path(__file__).parent.parent / "data" / "mooncake_conversation_slice.jsonl"
REQUESTS = 150  # the VM's emulated CPU is 10-25x slower than the host


@pytest.fixture(scope="module")
def keys() -> TraceKeys:
    return TraceKeys(load_trace(SLICE, limit=REQUESTS))


@pytest.mark.parametrize(("offload", "budget"), [("all", None), ("reuse", 0.5)])
def test_replay_over_rdma_matches_the_model(
    keys: TraceKeys, offload: str, budget: float | None
) -> None:
    setup = ReplaySetup(
        l1_blocks=keys.unique_blocks // 20, offload=offload, offload_budget=budget
    )
    model = replay_model(keys, setup)
    stack = replay_stack(keys, setup, block_bytes=16384, transport="rdma")
    assert stack.extra["transport"] == "rdma"
    assert stack.wrong_blocks == 0 and stack.dropped_offloads == 0
    assert (stack.l1_hits, stack.node_hits, stack.sent_blocks) == (
        model.l1_hits,
        model.node_hits,
        model.sent_blocks,
    )
    assert model.node_hits > 0
