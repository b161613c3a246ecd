"""RequestBook: scheduler-side bookkeeping of the engine connectors (pure logic).

The hit lookup is given as data (a table of cached blocks per group): the
book's job is what it does with the answer, and the store answering it is
tested against a real node in test_connector_store.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rdmakv.connectors.plan import GroupBlocks, RequestBook, request_keep_hint
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from rdmakv.errors import ConfigError

B = 16
FULL = KVCacheGroup(0, FullAttentionSpec(B))
SWA = KVCacheGroup(1, SlidingWindowSpec(B, window=2 * B + 1))  # needs the last 2 blocks
PROMPT = list(range(1000, 1070))  # 70 tokens: 4 full blocks + 6


class Cached:
    """What the store holds: per group, the cached block indices."""

    def __init__(self, *per_group: set[int]) -> None:
        self.per_group = list(per_group)
        self.calls = 0

    def __call__(
        self, req_id: str, tokens: Sequence[int], extra: bytes | None
    ) -> list[list[bool]] | None:
        self.calls += 1
        n = len(tokens) // B
        return [[i in blocks for i in range(n)] for blocks in self.per_group]


def test_hit_is_capped_below_the_last_token_and_counted_beyond_local_hits() -> None:
    book = RequestBook([FULL], Cached({0, 1, 2, 3}), async_loads=False)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (64, False)
    assert book.num_new_matched_tokens("r", PROMPT, 16, None) == (48, False)
    exact = PROMPT[:64]  # every block cached, but one token must be computed
    assert book.num_new_matched_tokens("r", exact, 0, None) == (48, False)
    assert book.num_new_matched_tokens("r", PROMPT, 64, None) == (0, False)


def test_a_hole_stops_a_full_attention_hit() -> None:
    book = RequestBook([FULL], Cached({0, 1, 3}), async_loads=False)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (32, False)


def test_load_plan_covers_the_external_blocks_only_and_saves_follow() -> None:
    book = RequestBook([FULL], Cached({0, 1, 2}), async_loads=False)
    assert book.num_new_matched_tokens("r", PROMPT, 16, None) == (32, False)
    block_ids = [[11, 12, 13, 14, 15]]
    book.after_alloc("r", PROMPT, len(PROMPT), b"x", block_ids, 32)
    book.scheduled("r", 48, block_ids=block_ids)
    plan = book.build({"r": len(PROMPT) - 48})
    assert not plan.async_loads
    (load,) = plan.loads
    assert load.groups == (GroupBlocks(1, (12, 13)),)
    assert load.tokens == tuple(PROMPT[:48]) and load.extra == b"x"
    # Saves start at the hit end and stop at the last full prompt block.
    (save,) = plan.saves
    assert save.groups == (GroupBlocks(3, (14,)),)
    assert len(save.tokens) == 64
    # Nothing is planned twice.
    book.scheduled("r", 70)
    again = book.build({"r": 1})
    assert not again.loads and not again.saves


def test_chunked_prefill_saves_each_block_once_as_it_completes() -> None:
    book = RequestBook([FULL], Cached(set()), async_loads=False)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)
    book.after_alloc("r", PROMPT, len(PROMPT), None, [[1, 2]], 0)
    book.scheduled("r", 0, block_ids=[[1, 2]])
    first = book.build({"r": 40})  # tokens [0, 40): blocks 0 and 1 complete
    assert [s.groups for s in first.saves] == [(GroupBlocks(0, (1, 2)),)]
    book.scheduled("r", 40, new_block_ids=[[3, 4, 5]])
    second = book.build({"r": 30})  # tokens [40, 70): blocks 2 and 3 complete
    assert [s.groups for s in second.saves] == [(GroupBlocks(2, (3, 4)),)]


@pytest.mark.parametrize("keep", [True, False, None])
def test_the_request_hint_rides_on_every_save(keep: bool | None) -> None:
    book = RequestBook([FULL], Cached(set()), async_loads=False)
    book.num_new_matched_tokens("r", PROMPT, 0, None)
    book.after_alloc("r", PROMPT, len(PROMPT), None, [[1, 2]], 0, keep=keep)
    book.scheduled("r", 0, block_ids=[[1, 2]])
    first = book.build({"r": 40})
    book.scheduled("r", 40, new_block_ids=[[3, 4, 5]])
    second = book.build({"r": 30})
    assert [s.keep for s in (*first.saves, *second.saves)] == [keep, keep]


def test_failed_sync_load_is_never_offered_again_and_gets_saved_when_recomputed() -> None:
    book = RequestBook([FULL], Cached({0, 1, 2, 3}), async_loads=False)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (64, False)
    ids = [[5, 6, 7, 8, 9]]
    book.after_alloc("r", PROMPT, len(PROMPT), None, ids, 64)
    book.scheduled("r", 64, block_ids=ids)
    book.build({"r": 6})
    assert book.load_results(bad_blocks={7}) == {"r"}
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)
    book.scheduled("r", 0, block_ids=ids)  # the engine recomputes from scratch
    plan = book.build({"r": 70})
    assert [s.groups for s in plan.saves] == [(GroupBlocks(0, (5, 6, 7, 8)),)]


def test_unrelated_bad_blocks_do_not_fail_a_request() -> None:
    book = RequestBook([FULL], Cached({0, 1}), async_loads=False)
    book.num_new_matched_tokens("r", PROMPT, 0, None)
    book.after_alloc("r", PROMPT, len(PROMPT), None, [[5, 6, 7, 8, 9]], 32)
    book.build({})
    assert book.load_results(bad_blocks={42}) == set()
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (32, False)


def test_hybrid_hit_uses_each_groups_rule_and_loads_async() -> None:
    # The window group lacks blocks 0-1: fine for a hit at 64 (needs blocks 2-3 only).
    book = RequestBook([FULL, SWA], Cached({0, 1, 2, 3}, {2, 3}))
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (64, True)
    # Only block 2 in the window group: a hit at 64 needs window blocks 2-3, at 48
    # blocks 1-2, at 32 blocks 0-1, at 16 block 0: no common hit at all.
    book2 = RequestBook([FULL, SWA], Cached({0, 1, 2, 3}, {2}))
    assert book2.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)


def test_hybrid_failure_is_per_request_and_the_null_block_is_not_a_load() -> None:
    book = RequestBook([FULL, SWA], Cached({0, 1, 2, 3}, {2, 3}), null_block=0)
    book.num_new_matched_tokens("r", PROMPT, 0, None)
    ids = [[1, 2, 3, 4, 5], [0, 0, 8, 9, 10]]
    book.after_alloc("r", PROMPT, len(PROMPT), None, ids, 64)
    plan = book.build({})
    assert plan.async_loads
    (load,) = plan.loads
    assert load.engine_block_ids(null_block=0) == {1, 2, 3, 4, 8, 9}
    assert book.load_results(finished={"r"}, failed={"r"}) == {"r"}
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)
    book.finished("r")
    assert "r" not in book


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        RequestBook([], Cached())
    book = RequestBook([FULL, SWA], Cached(set(), set()))
    with pytest.raises(ConfigError, match="the connector has 2"):
        book.after_alloc("r", PROMPT, 70, None, [[1, 2]], 0)
    with pytest.raises(ConfigError, match="num_computed"):
        book.num_new_matched_tokens("r", PROMPT, -1, None)
    book.num_new_matched_tokens("r", PROMPT, 0, None)
    with pytest.raises(ConfigError, match="needs 4"):
        book.after_alloc("r", PROMPT, 70, None, [[1], [2]], 64)


class NotYet(Cached):
    """A lookup that has not answered until ``ready`` is set."""

    ready = False

    def __call__(
        self, req_id: str, tokens: Sequence[int], extra: bytes | None
    ) -> list[list[bool]] | None:
        return super().__call__(req_id, tokens, extra) if self.ready else None


def test_a_lookup_not_answered_yet_says_ask_again_then_loads_async() -> None:
    lookup = NotYet({0, 1, 2, 3})
    book = RequestBook([FULL], lookup)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (None, False)
    lookup.ready = True
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (64, True)
    ids = [[5, 6, 7, 8, 9]]
    book.after_alloc("r", PROMPT, len(PROMPT), None, ids, 64)
    plan = book.build({})
    assert plan.async_loads and len(plan.loads) == 1
    # The load is reported finished with one bad block in the same pass: a failure.
    assert book.load_results(finished={"r"}, bad_blocks={7}) == {"r"}
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)


def test_async_load_finished_without_errors_is_not_a_failure() -> None:
    book = RequestBook([FULL], Cached({0, 1, 2, 3}))
    book.num_new_matched_tokens("r", PROMPT, 0, None)
    book.after_alloc("r", PROMPT, len(PROMPT), None, [[5, 6, 7, 8, 9]], 64)
    book.build({})
    assert book.load_results() == set()  # still in flight
    assert book.load_results(finished={"r"}, bad_blocks={42}) == set()
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (64, True)


def test_a_request_with_a_planned_save_is_held_when_it_finishes() -> None:
    book = RequestBook([FULL], Cached(set()))
    book.num_new_matched_tokens("saved", PROMPT, 0, None)
    book.after_alloc("saved", PROMPT, len(PROMPT), None, [[1, 2, 3, 4, 5]], 0)
    book.scheduled("saved", 0, block_ids=[[1, 2, 3, 4, 5]])
    book.num_new_matched_tokens("short", PROMPT[:10], 0, None)
    book.after_alloc("short", PROMPT[:10], 10, None, [[6]], 0)
    book.scheduled("short", 0, block_ids=[[6]])
    plan = book.build({"saved": 70, "short": 10}, preempted=["gone"])
    assert [s.req_id for s in plan.saves] == ["saved"]
    assert plan.preempted == ("gone",)
    assert book.finished("saved") is True  # the engine keeps its blocks until reported
    assert book.finished("short") is False  # no save: freed at once


# -- the reuse hint a request's fields carry ---------------------------------------------------


@pytest.mark.parametrize(
    ("params", "hint"),
    [
        (None, None),
        ({}, None),
        ({"rdmakv_keep": True}, True),
        ({"rdmakv_keep": False, "session_id": "s1"}, False),  # the explicit hint wins
        ({"rdmakv_keep": 4096}, 4096),  # the first 4096 tokens will be reused
        ({"rdmakv_keep": 0}, 0),
        ({"prompt_cache_key": "support-bot-v3"}, True),
        ({"session_id": "s1"}, True),
        ({"conversation_id": "c-9"}, True),
        ({"other": 1}, None),
    ],
)
def test_request_keep_hint_maps_the_fields(params: dict[str, object] | None, hint: object) -> None:
    assert request_keep_hint(params, "r1") == hint
    assert type(request_keep_hint(params, "r1")) is type(hint)


@pytest.mark.parametrize(
    ("params", "hint", "warning"),
    [
        ({"rdmakv_keep": "yes"}, None, "'rdmakv_keep' must be true, false or a token count"),
        ({"rdmakv_keep": -5, "session_id": "s"}, True, "'rdmakv_keep' must be true"),
        ({"rdmakv_keep": 1.5}, None, "got 1.5; ignored"),
        ({"session_id": ""}, None, "'session_id' must be a non-empty string"),
        ({"prompt_cache_key": 7, "conversation_id": "c"}, True, "'prompt_cache_key' must be"),
        (["rdmakv_keep"], None, "must be a mapping, got list"),
    ],
)
def test_request_keep_hint_warns_about_bad_values_and_goes_on(
    params: object, hint: object, warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="rdmakv.connectors"):
        assert request_keep_hint(params, "req-7") == hint  # type: ignore[arg-type]
    assert warning in caplog.text and "request req-7" in caplog.text
