"""The batch argument scans of the native client call (native/rk_call.c's
``join_uniform`` and ``live_handles``): a client checks a batch's keys,
digests and block handles with them before anything is sent. Each must take
exactly the batches the Python checks call plain (their Python twins,
tests/oracles/scans.py, say which), and leave every other one to Python,
which names the bad item: on any batch, a client with the scans and one with
their twins (or, for handles, one whose scan takes nothing) encode the same
bytes and raise the same errors."""

from __future__ import annotations

from collections import UserList
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import scans

from rdmakv import native_core
from rdmakv.blocks import slab as slab_module
from rdmakv.blocks.slab import Slab
from rdmakv.errors import InvalidHandle
from rdmakv.wire import batches
from rdmakv.wire.batches import BatchEncoder
from rdmakv.wire.format import DIGEST_LEN, MAX_KEY_LEN


class _Bytes(bytes):
    """A bytes subclass: not ``bytes`` exactly, so never the plain case."""


def _item(n: int) -> st.SearchStrategy[Any]:
    """Mostly bytes of length n; now and then another length or another type."""
    plain = st.binary(min_size=n, max_size=n)
    return st.one_of(
        plain, plain, plain, plain,
        st.binary(max_size=70),
        plain.map(bytearray), plain.map(_Bytes), plain.map(memoryview),
        st.text(min_size=n, max_size=n), st.integers(), st.none(),
    )


@st.composite
def _items(draw: st.DrawFn) -> Any:
    n = draw(st.integers(0, 70))
    items = draw(st.lists(_item(n), max_size=30))
    return draw(st.sampled_from((list, tuple, iter)))(items)


@given(_items(), st.integers(0, 70), st.integers(0, 70))
def test_join_uniform_takes_only_a_list_or_tuple_of_bytes_of_one_length_in_range(
    items: Any, lo: int, hi: int,
) -> None:
    if not isinstance(items, list | tuple):  # anything else: not taken at all
        assert native_core.CALL.join_uniform(items, lo, hi) is None
        return
    assert native_core.CALL.join_uniform(items, lo, hi) == scans.join_uniform(items, lo, hi)


@given(_items(), st.integers(0, 70), st.integers(0, 70))
def test_join_uniform_answers_the_same_for_a_list_and_for_another_sequence(
    items: Any, lo: int, hi: int,
) -> None:
    """A list or tuple is the native scan's; another sequence takes Python's
    C-level passes: the same answer."""
    items = list(items) if not isinstance(items, list | tuple) else items
    python = batches._join_uniform(UserList(items), lo, hi)
    assert python == scans.join_uniform(list(items), lo, hi)
    assert batches._join_uniform(items, lo, hi) == python


@st.composite
def _encoder_args(draw: st.DrawFn) -> tuple[list[Any], list[Any], list[int]]:
    """A put's keys, digests and sizes: mostly an engine's (one key length,
    bytes throughout), now and then with one odd item."""
    n = draw(st.integers(1, 20))
    klen = draw(st.integers(1, MAX_KEY_LEN))
    keys: list[Any] = [draw(st.binary(min_size=klen, max_size=klen)) for _ in range(n)]
    digests: list[Any] = [draw(st.binary(min_size=DIGEST_LEN, max_size=DIGEST_LEN))
                          for _ in range(n)]
    odd = draw(st.sampled_from(("none", "key", "digest")))
    if odd != "none":
        seq = keys if odd == "key" else digests
        i = draw(st.integers(0, n - 1))
        seq[i] = draw(st.one_of(
            st.binary(min_size=1, max_size=MAX_KEY_LEN), st.binary(max_size=0),
            st.just(bytearray(seq[i])), st.just(_Bytes(seq[i])),
        ))
    return keys, digests, [draw(st.integers(1, 2**20))] * n


def _encoded(keys: list[Any], digests: list[Any], sizes: list[int]) -> tuple[Any, ...]:
    """What a put's and a get's encoders make of these arguments: the payloads,
    or the error each raises."""
    out: list[Any] = []
    for args, kinds in (((keys, digests, sizes), ("alloc", "keys")), ((keys, digests), ("get",))):
        encoder = BatchEncoder(*args)
        out.append(encoder.uniform)
        for kind in kinds:
            try:
                out.append(getattr(encoder, kind)(0, len(keys)))
            except Exception as e:  # the per-key path names what is wrong
                out.append((type(e), str(e)))
    return tuple(out)


@settings(max_examples=200)
@given(_encoder_args())
def test_an_encoder_with_the_native_scans_encodes_and_refuses_as_one_with_their_twins(
    args: tuple[list[Any], list[Any], list[int]],
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches, "_native_join_uniform", scans.join_uniform)
        python = _encoded(*args)
    assert _encoded(*args) == python


BLOCKS = 16


@st.composite
def _handles(draw: st.DrawFn) -> Any:
    """Handles of a slab of BLOCKS blocks: mostly allocated ones, now and then
    a freed one, one out of range, or one of another type."""
    ok = st.integers(0, BLOCKS // 2 - 1)  # the test allocates these
    handle = st.one_of(
        ok, ok, ok, ok,
        st.integers(BLOCKS // 2, BLOCKS - 1),  # freed
        st.integers(-3, -1), st.integers(BLOCKS, 2**70), st.integers(-(2**70), -(2**64)),
        st.booleans(), ok.map(np.int64), ok.map(float), st.none(),
    )
    handles = draw(st.lists(handle, max_size=12))
    return draw(st.sampled_from((list, tuple, np.array)))(handles) if handles else handles


def _checked(slab: Slab, handles: Any) -> tuple[type[Exception], str] | None:
    try:
        slab.check_handles(handles)
    except (InvalidHandle, TypeError, ValueError) as e:
        return type(e), str(e)
    return None


@settings(max_examples=300)
@given(_handles())
def test_check_handles_refuses_the_same_handles_with_and_without_the_native_scan(
    handles: Any,
) -> None:
    """Without: a scan that takes no batch, so Python's checks decide each."""
    with Slab(BLOCKS * 4096, 4096) as slab:
        for h in slab.alloc_many(BLOCKS)[BLOCKS // 2 :]:
            slab.free(h)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(slab_module, "_native_live_handles", lambda handles, refs: False)
            python = _checked(slab, handles)
        assert _checked(slab, handles) == python
        live = native_core.CALL.live_handles(handles, slab._refs)
        assert live == scans.live_handles(handles, slab._refs)
        plain = isinstance(handles, list | tuple) and all(type(h) is int for h in handles)
        if plain:  # the scan takes exactly the lists of live ints
            assert live == (python is None)


@settings(max_examples=300)
@given(st.integers(-3, BLOCKS + 3), st.integers(-3, BLOCKS + 3), st.sampled_from((1, 1, 2, -1)))
def test_a_range_of_handles_is_checked_as_the_list_of_them_is(
    start: int, stop: int, step: int
) -> None:
    """A run of blocks handed over as a ``range`` (which the native scan
    does not take): refused exactly when the list of its handles is, with
    the same error."""
    with Slab(BLOCKS * 4096, 4096) as slab:
        for h in slab.alloc_many(BLOCKS)[BLOCKS // 2 :]:
            slab.free(h)
        handles = range(start, stop, step)
        assert _checked(slab, handles) == _checked(slab, list(handles))
