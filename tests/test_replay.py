"""Trace replay: the loader, tokens and keys, the oracle, and model against real stack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rdmakv.blocks.keys import BlockKeyer
from rdmakv.errors import ConfigError
from rdmakv.replay import (
    NodeModel,
    ReplaySetup,
    Trace,
    TraceKeys,
    TraceRequest,
    load_trace,
    replay_model,
)
from rdmakv.replay.stack import replay_stack
from rdmakv.replay.trace import TRACE_BLOCK_TOKENS, block_token_ids

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_slice.jsonl"
BT = 4  # tokens per block in the hand-built traces


def write_trace(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def req(ts: int, ids: list[int], partial: int = 0) -> dict[str, object]:
    """A request whose prompt is ``len(ids)`` blocks, the last one ``partial`` tokens short."""
    return {
        "timestamp": ts,
        "input_length": len(ids) * BT - partial,
        "output_length": 10,
        "hash_ids": ids,
    }


# -- loading -------------------------------------------------------------------------


def test_load_slice_and_window() -> None:
    whole = load_trace(SLICE)
    assert len(whole) == 300 and whole.block_tokens == TRACE_BLOCK_TOKENS
    part = load_trace(SLICE, start=10, limit=5)
    assert part.requests == whole.requests[10:15]
    assert whole.slice(10, 5).requests == part.requests
    r = whole[0]
    assert len(r.hash_ids) == -(-r.input_length // 512)
    assert whole.duration_s == (whole[-1].timestamp_ms - whole[0].timestamp_ms) / 1000


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{not json", r"t\.jsonl:2: not JSON"),
        ("[1, 2]", "a request must be a JSON object, got list"),
        ('{"input_length": 4, "output_length": 1, "hash_ids": [1]}', "'timestamp' must be"),
        (req(5, [1]) | {"input_length": -1}, "'input_length' must be an integer >= 0, got -1"),
        (req(5, [1]) | {"output_length": True}, "'output_length' must be an integer"),
        (req(5, [1]) | {"hash_ids": "12"}, "'hash_ids' must be a list of integers"),
        (req(5, [1]) | {"hash_ids": [1, -2]}, "'hash_ids' must be a list of integers"),
        (
            req(5, [1, 2]) | {"hash_ids": [1]},
            "input_length 8 needs 2 hash ids of 4 tokens, the line has 1",
        ),
        (req(0, [3]), "timestamp 0 is earlier than the line before \\(1\\)"),
    ],
)
def test_bad_lines_are_refused_naming_file_line_and_field(
    tmp_path: Path, line: object, error: str
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [req(1, [1]), line])
    with pytest.raises(ConfigError, match=error):
        load_trace(path, block_tokens=BT)


def test_unreadable_trace_and_bad_window(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read trace .*nope\.jsonl"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="start and limit must be >= 0"):
        load_trace(SLICE, start=-1)
    with pytest.raises(ConfigError, match="block_tokens must be an int >= 2"):
        Trace([], block_tokens=1)


# -- tokens and keys ---------------------------------------------------------------------


def test_block_tokens_are_deterministic_distinct_and_int32() -> None:
    a = block_token_ids(12345, 512)
    assert a.dtype == np.int32 and a.shape == (512,)
    assert np.array_equal(a, block_token_ids(12345, 512))
    firsts = {tuple(block_token_ids(i, 8)[:2]) for i in range(5000)}
    assert len(firsts) == 5000  # no two ids share a block
    big = block_token_ids((1 << 62) - 1, 16)
    assert (big >= 0).all()


def test_keys_match_what_the_manager_computes_from_the_prompt() -> None:
    trace = load_trace(SLICE, limit=40)
    keys = TraceKeys(trace)
    keyer = BlockKeyer(keys.keyer.namespace, trace.block_tokens)
    for r, request in enumerate(trace):
        chain = keyer.chain(trace.prompt_tokens(request))
        assert [k for _, k, _ in chain] == keys.keys[r]
        assert [d for _, _, d in chain] == keys.digests[r]
        assert len(chain) == request.input_length // 512  # the partial tail has no key


def test_partial_tail_is_never_a_block(tmp_path: Path) -> None:
    trace = load_trace(
        write_trace(tmp_path / "t.jsonl", [req(0, [1, 2, 3], partial=1), req(1, [1, 2, 3])]),
        block_tokens=BT,
    )
    keys = TraceKeys(trace)
    assert [len(k) for k in keys.keys] == [2, 3]
    assert keys.keys[1][:2] == keys.keys[0]
    assert keys.unique_blocks == 3 and keys.total_blocks == 5


# -- the oracle and the hint on a trace with a known answer ---------------------------------

# A: 1 2 3      B: 4 5      C: 1 2 6      D: 4 7      E: 1 2 3 8 (A's next turn)
KNOWN = [req(0, [1, 2, 3]), req(1, [4, 5]), req(2, [1, 2, 6]), req(3, [4, 7]),
         req(4, [1, 2, 3, 8])]


@pytest.fixture
def known(tmp_path: Path) -> TraceKeys:
    return TraceKeys(load_trace(write_trace(tmp_path / "k.jsonl", KNOWN), block_tokens=BT))


def test_future_knowledge_of_a_hand_built_trace(known: TraceKeys) -> None:
    k = known.keys
    assert [known.continued(r) for r in range(5)] == [True, False, False, False, False]
    # Brute force: a block of request r is reused later iff a later request has it.
    for r, ks in enumerate(k):
        for x in ks:
            assert known.reused_later(x, r) == any(x in later for later in k[r + 1 :])
    reused_at_insert = {x for r, ks in enumerate(k) for x in ks if known.reused_later(x, r)}
    assert reused_at_insert == {k[0][0], k[0][1], k[0][2], k[1][0]}  # blocks 1, 2, 3, 4


def test_noisy_hints_flip_a_fixed_share_of_requests(known: TraceKeys) -> None:
    perfect = [known.hint(r) for r in range(5)]
    assert perfect == [known.continued(r) for r in range(5)]
    assert [known.hint(r, 1.0) for r in range(5)] == [not h for h in perfect]
    many = TraceKeys(load_trace(SLICE))
    wrong = sum(many.hint(r, 0.25) != many.continued(r) for r in range(len(many.trace)))
    assert 45 <= wrong <= 105  # a quarter of 300, by a fixed hash of the request index
    assert many.hint(7, 0.25) == many.hint(7, 0.25)


def test_oracle_sends_exactly_the_blocks_used_again(known: TraceKeys) -> None:
    # A three-block L1 holds no block until its next use: every hit is the node's.
    oracle = replay_model(known, ReplaySetup(l1_blocks=3, offload="oracle"))
    everything = replay_model(known, ReplaySetup(l1_blocks=3, offload="all"))
    hot = replay_model(known, ReplaySetup(l1_blocks=3, offload="hot"))
    assert everything.sent_blocks == known.unique_blocks == 8
    assert oracle.sent_blocks == 4  # blocks 1, 2, 3 and 4
    # C hits 1 2, D hits 4, E hits 1 2 3: the oracle loses nothing.
    assert (oracle.node_hits, everything.node_hits) == (6, 6)
    assert (hot.node_hits, hot.sent_blocks) == (0, 0)
    assert oracle.l1_hits == everything.l1_hits == 0
    assert oracle.blocks == known.total_blocks == 14


def test_perfect_hint_sends_the_continued_request(known: TraceKeys) -> None:
    hinted = replay_model(known, ReplaySetup(l1_blocks=3, offload="reuse", hints=True))
    # A says keep (E continues it): 1 2 3 go at once; B..E say no. C's reuse of
    # 1 2 hits (A sent them); D's reuse of B's 4 misses, and 4, computed again,
    # is sent then (the ghost saw it leave L1 unsent).
    assert hinted.sent_blocks == 4
    assert hinted.node_hits == 5  # C: 1 2, E: 1 2 3
    assert hinted.extra["offered_hint"] == 3 and hinted.extra["offered_ghost"] == 1


def test_perfect_prefix_hint_names_the_reused_prefix_and_reaches_the_oracle(
    known: TraceKeys,
) -> None:
    assert [known.reused_tokens(r) for r in range(5)] == [3 * BT, 1 * BT, 2 * BT, 0, 0]
    setup = ReplaySetup(l1_blocks=3, offload="reuse", hints=True, hint_form="prefix")
    assert setup.label == "reuse+prefix-hint"
    hinted = replay_model(known, setup)
    oracle = replay_model(known, ReplaySetup(l1_blocks=3, offload="oracle"))
    # B's hint covers its block 4 only, so D hits it: one more than the request hint.
    assert (hinted.node_hits, hinted.sent_blocks) == (oracle.node_hits, oracle.sent_blocks)
    assert hinted.node_hits == 6 and hinted.extra["offered_hint"] == 4
    with pytest.raises(ConfigError, match="hint_form must be one of"):
        replay_model(known, ReplaySetup(l1_blocks=3, hints=True, hint_form="session"))


def test_node_model_follows_the_node_rules() -> None:
    n = NodeModel(2)
    assert n.put([b"a" * 16, b"b" * 16]) == 2
    assert n.put([b"a" * 16]) == 0  # present: EXISTS, nothing moves, no touch
    assert n.touch([b"a" * 16, b"z" * 16]) == [True, False]  # a is now most recent
    assert n.put([b"c" * 16]) == 1  # evicts b, the least recent
    assert b"b" * 16 not in n and b"a" * 16 in n and n.evictions == 1
    with pytest.raises(ConfigError, match="node capacity must be a positive number"):
        NodeModel(0)


def test_bad_setups_are_refused(known: TraceKeys) -> None:
    with pytest.raises(ConfigError, match="l1_blocks must be positive"):
        replay_model(known, ReplaySetup(l1_blocks=0))
    with pytest.raises(ConfigError, match="routing must be one of"):
        replay_model(known, ReplaySetup(l1_blocks=2, engines=2, routing="nearest"))
    with pytest.raises(ConfigError, match="unknown offload mode 'sometimes'"):
        replay_model(known, ReplaySetup(l1_blocks=2, offload="sometimes"))
    with pytest.raises(ConfigError, match="the stack replay runs one engine"):
        replay_stack(known, ReplaySetup(l1_blocks=2, engines=2))


def test_fleet_of_engines_shares_the_node_whatever_the_routing(known: TraceKeys) -> None:
    for routing in ("prefix", "random"):
        setup = ReplaySetup(l1_blocks=8, engines=3, routing=routing)
        r = replay_model(known, setup)
        assert r.hits == 6 and r.sent_blocks == 8  # all: every engine sees every block


# -- model against the real stack -----------------------------------------------------------

AGREE = [
    ReplaySetup(0, None, "all"),
    ReplaySetup(0, None, "hot"),
    ReplaySetup(0, None, "cold"),
    ReplaySetup(0, None, "oracle"),
    ReplaySetup(0, None, "reuse", 0.5),
    ReplaySetup(0, None, "reuse", 0.5, hints=True),
    ReplaySetup(0, 1, "all"),  # node at a third of the unique blocks: it evicts
    ReplaySetup(0, 1, "reuse", 0.5),
]


@pytest.fixture(scope="module")
def slice_keys() -> TraceKeys:
    return TraceKeys(load_trace(SLICE))


@pytest.mark.parametrize("shape", AGREE, ids=lambda s: f"{s.label}-node{s.node_blocks or 'inf'}")
def test_model_and_real_stack_agree_on_a_slice(slice_keys: TraceKeys, shape: ReplaySetup) -> None:
    u = slice_keys.unique_blocks
    setup = ReplaySetup(
        l1_blocks=u // 20,
        node_blocks=None if shape.node_blocks is None else u // 3,
        offload=shape.offload,
        offload_budget=shape.offload_budget,
        hints=shape.hints,
    )
    model = replay_model(slice_keys, setup)
    stack = replay_stack(slice_keys, setup, block_bytes=4096, transport="tcp")
    assert stack.wrong_blocks == 0
    assert stack.dropped_offloads == 0 and stack.extra["flushes_timed_out"] == 0
    assert (stack.l1_hits, stack.node_hits, stack.sent_blocks) == (
        model.l1_hits,
        model.node_hits,
        model.sent_blocks,
    )
    assert stack.blocks == model.blocks == slice_keys.total_blocks
    if shape.offload != "hot":  # hot sends next to nothing in 110 s of trace
        assert model.node_hits > 50
    if shape.node_blocks is not None:
        assert stack.extra["node_evictions"] > 0


def test_real_stack_paced_and_overlapped_returns_no_wrong_block(slice_keys: TraceKeys) -> None:
    """Production-like: timestamps compressed 200x, offloads overlap later requests."""
    setup = ReplaySetup(l1_blocks=slice_keys.unique_blocks // 20, offload="all")
    stack = replay_stack(
        slice_keys, setup, block_bytes=4096, transport="tcp", speedup=200.0, sync=False
    )
    assert stack.wrong_blocks == 0
    assert stack.requests == 300 and stack.node_hits > 0
    assert stack.sent_blocks + stack.dropped_offloads >= slice_keys.unique_blocks // 2


def test_trace_request_full_blocks() -> None:
    assert TraceRequest(0, 1025, 1, (1, 2, 3)).full_blocks(512) == 2
