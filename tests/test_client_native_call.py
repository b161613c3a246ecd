"""The client's native lookup call (native/rk_call.c, ``Channel.call_flags``)
against a real node: on an open connection EXISTS and DELETE go out and come
back in one call; keys it leaves to Python get the same answers, and bad ones
the same errors, with the connection kept. Answers that do not fit their
request are covered against a lying node in test_client_hostile_node.py.

Which path answered is read from what the real native call returned (a
list: answered; None: left to Python), recorded by a wrapper around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import NodeProcess

from rdmakv import protocol
from rdmakv.client import KVClient
from rdmakv.errors import ConfigError
from rdmakv.protocol import MAX_KEY_LEN, NATIVE_CALL_FRAME_BYTES
from rdmakv.slab import Slab

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(protocol._native_flags_call is None,
                       reason="rdmakv._native_call not built, or RDMAKV_CALL_NATIVE=0"),
]

BLOCK = 64 * 1024
DIGEST = b"d" * 16


@pytest.fixture
def returned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What each native call returned, in order."""
    real = protocol._native_flags_call
    assert real is not None
    out: list[Any] = []

    def recording(*args: Any) -> Any:
        got = real(*args)
        out.append(got)
        return got

    monkeypatch.setattr(protocol, "_native_flags_call", recording)
    yield out


def _client_with(node: NodeProcess, slab: Slab, keys: list[bytes]) -> KVClient:
    c = KVClient(*node.address, slab)
    src = slab.alloc_many(len(keys))
    assert c.put(keys, src, BLOCK, [DIGEST] * len(keys)) == [True] * len(keys)
    return c


def test_exists_and_delete_on_an_open_connection_are_one_native_call(
    node: NodeProcess, client_slab: Slab, returned: list[Any]
) -> None:
    keys = [b"native-%02d" % i for i in range(3)]
    with _client_with(node, client_slab, keys) as c:
        asked = [keys[0], b"absent-00", keys[1], keys[2]]
        assert c.exists(asked) == [True, False, True, True]
        assert returned == [[True, False, True, True]]
        assert c.delete([keys[1], b"absent-00"]) == [True, False]
        assert c.exists(tuple(asked)) == [True, False, False, True]
        assert returned[1:] == [[True, False], [True, False, False, True]]


def test_keys_the_native_call_leaves_to_python_get_the_same_answers(
    node: NodeProcess, client_slab: Slab, returned: list[Any]
) -> None:
    """Keys of several lengths, a bytearray key, and a request whose frame is
    over NATIVE_CALL_FRAME_BYTES are framed in Python, nothing sent natively."""
    keys = [b"short", b"a-longer-key", b"k" * 32]
    with _client_with(node, client_slab, keys) as c:
        assert c.exists([b"short", b"absent", b"a-longer-key"]) == [True, False, True]
        assert c.exists([bytearray(b"short"), b"nope!"]) == [True, False]
        many = [b"%032d" % i for i in range(NATIVE_CALL_FRAME_BYTES // 34 + 1)] + [b"k" * 32]
        assert c.exists(many) == [False] * (len(many) - 1) + [True]
        assert returned == [None, None, None]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([b"fine", "text"], f"key #1 must be 1..{MAX_KEY_LEN} bytes, got 'text'"),
        ([b""], "key #0 must be 1.."),
        ([b"fine", b"x" * (MAX_KEY_LEN + 1)], "key #1 must be 1.."),
    ],
)
def test_bad_keys_on_an_open_connection_are_named_and_keep_it(
    node: NodeProcess, client_slab: Slab, returned: list[Any], bad: list[Any], error: str
) -> None:
    op: Callable[[list[Any]], list[bool]]
    with _client_with(node, client_slab, [b"fine"]) as c:
        for op in (c.exists, c.delete):
            reconnects = c.reconnects
            with pytest.raises(ConfigError, match=error):
                op(bad)
            assert c.exists([b"fine"]) == [True]
            assert c.reconnects == reconnects
        assert returned == [None, [True], None, [True]]
