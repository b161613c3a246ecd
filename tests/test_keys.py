"""Block keys: chaining, namespaces, extras, digests, determinism across processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmakv.blocks.keys import (
    KEY_BYTES,
    BlockKeyer,
    KeyNamespace,
    extra_bytes,
)
from rdmakv.errors import ConfigError
from rdmakv.wire.format import DIGEST_LEN

NS = KeyNamespace(model="llama-3-8b@abc123", dtype="bfloat16", kv_layout="NHD")
BS = 4
TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


def keyer(bs: int = BS, ns: KeyNamespace = NS) -> BlockKeyer:
    return BlockKeyer(ns, bs)


def test_one_key_per_full_block_partial_tail_ignored() -> None:
    k = keyer()
    assert k.keys([]) == []
    assert k.keys([1, 2, 3]) == []
    ks = k.keys(list(range(11)))
    assert len(ks) == 2
    assert all(isinstance(x, bytes) and len(x) == KEY_BYTES for x in ks)
    assert k.keys(list(range(8))) == ks


@settings(max_examples=100, deadline=None)
@given(tokens=TOKENS, cut=st.integers(0, 10))
def test_chain_continues_from_a_parent(tokens: list[int], cut: int) -> None:
    """Keys computed incrementally (from the last key) equal keys computed at once."""
    k = keyer()
    full = k.keys(tokens)
    cut_blocks = min(cut, len(full))
    head = k.keys(tokens[: cut_blocks * BS])
    parent = head[-1] if head else None
    tail = k.keys(tokens[cut_blocks * BS :], parent=parent)
    assert head + tail == full


@settings(max_examples=100, deadline=None)
@given(tokens=TOKENS)
def test_key_names_the_whole_prefix(tokens: list[int]) -> None:
    """Changing any token changes the key of its block and of every later block."""
    k = keyer()
    ks = k.keys(tokens)
    for i in range(len(ks) * BS):
        changed = list(tokens)
        changed[i] = (changed[i] + 1) % 2**31
        ks2 = k.keys(changed)
        b = i // BS
        assert ks2[:b] == ks[:b]
        assert all(x != y for x, y in zip(ks2[b:], ks[b:], strict=True))


def test_input_types_give_identical_keys() -> None:
    toks = [5, 0, 2**31 - 1, 17, 3, 3, 3, 3]
    k = keyer()
    want = k.keys(toks)
    for arr in (
        np.array(toks, dtype=np.int64),
        np.array(toks, dtype=np.int32),
        np.array(toks, dtype=np.uint32),
        np.array(toks, dtype=">i8"),  # big-endian input must still hash as little-endian
        tuple(toks),
    ):
        assert k.keys(arr) == want  # type: ignore[arg-type]
    assert k.keys(np.array([1, 2, 3, 4], dtype=np.uint16)) == k.keys([1, 2, 3, 4])


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, 3, 2**31],
        [1, 2, 3, -(2**31) - 1],
        np.array([1, 2, 3, 2**40]),
        np.array([1.0, 2.0, 3.0, 4.0]),
        ["a", "b", "c", "d"],
        np.zeros((2, 4), dtype=np.int32),
    ],
)
def test_bad_tokens_are_rejected(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"token|integers|1-D"):
        keyer().keys(bad)  # type: ignore[arg-type]


def test_extra_changes_every_key_and_none_equals_no_extra() -> None:
    k = keyer()
    toks = list(range(12))
    plain = k.keys(toks)
    assert k.keys(toks, extra=extra_bytes()) == plain
    lora = k.keys(toks, extra=extra_bytes(lora_name="sql-adapter"))
    salt = k.keys(toks, extra=extra_bytes(cache_salt="tenant-7"))
    mm = k.keys(toks, extra=extra_bytes(mm_hashes=["img0"]))
    for other in (lora, salt, mm):
        assert len(other) == len(plain)
        assert all(a != b for a, b in zip(other, plain, strict=True))
    assert len({lora[0], salt[0], mm[0]}) == 3


def test_extra_bytes_is_unambiguous() -> None:
    e = extra_bytes
    assert e() is None
    variants = [
        e(lora_name="ab"),
        e(lora_name="a", cache_salt="b"),
        e(cache_salt="ab"),
        e(mm_hashes=["ab"]),
        e(mm_hashes=["a", "b"]),
        e(lora_name=""),
        e(cache_salt=""),
        e(lora_name="a", mm_hashes=["b"]),
    ]
    assert len(set(variants)) == len(variants)
    with pytest.raises(ConfigError, match="mm_hashes must be a sequence of str"):
        e(mm_hashes="img0")  # type: ignore[arg-type]


def test_namespace_fields_all_matter() -> None:
    base = KeyNamespace("m", "bf16", "NHD", 0, 2)
    others = [
        KeyNamespace("m2", "bf16", "NHD", 0, 2),
        KeyNamespace("m", "fp8", "NHD", 0, 2),
        KeyNamespace("m", "bf16", "HND", 0, 2),
        KeyNamespace("m", "bf16", "NHD", 1, 2),
        KeyNamespace("m", "bf16", "NHD", 0, 4),
        KeyNamespace("m", "bf16", "NHD"),
    ]
    seeds = {ns.seed() for ns in [base, *others]}
    assert len(seeds) == len(others) + 1
    assert all(len(s) == KEY_BYTES for s in seeds)
    toks = list(range(8))
    assert BlockKeyer(base, 4).keys(toks)[0] != BlockKeyer(others[0], 4).keys(toks)[0]
    # Unambiguous encoding: moving characters between fields changes the seed.
    assert KeyNamespace("ab", "c").seed() != KeyNamespace("a", "bc").seed()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "", "dtype": "bf16"}, "model must be a non-empty str"),
        ({"model": "m", "dtype": ""}, "dtype must be a non-empty str"),
        ({"model": "m", "dtype": "bf16", "tp_rank": 0}, "given together"),
        ({"model": "m", "dtype": "bf16", "tp_rank": 2, "tp_size": 2}, r"tp_rank must be in \[0, "),
        ({"model": "m", "dtype": "bf16", "tp_rank": 0, "tp_size": 0}, "tp_size must be a positive"),
    ],
)
def test_bad_namespace_is_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KeyNamespace(**kwargs)  # type: ignore[arg-type]


def test_bad_keyer_arguments_are_rejected() -> None:
    with pytest.raises(ConfigError, match="block_size must be a positive int"):
        BlockKeyer(NS, 0)
    with pytest.raises(ConfigError, match="namespace must be a KeyNamespace"):
        BlockKeyer("llama", 16)  # type: ignore[arg-type]
    k = keyer()
    with pytest.raises(ConfigError, match="parent key must be 16 bytes, got 3 bytes"):
        k.keys(list(range(8)), parent=b"abc")
    with pytest.raises(ConfigError, match="extra must be bytes"):
        k.keys(list(range(8)), extra="lora")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a block has 4 tokens, digest"):
        k.digest(k.root, [1, 2, 3])
    with pytest.raises(ConfigError, match="block index 2 out of range"):
        k.block_tokens(list(range(8)), 2)
    bad = BlockKeyer(NS, 4, key_hash=lambda b: b[:8])
    with pytest.raises(ConfigError, match="key hash output must be 16 bytes"):
        bad.keys(list(range(8)))


def test_chain_matches_keys_and_digest() -> None:
    k = keyer()
    toks = list(range(100, 114))
    ex = extra_bytes(lora_name="x")
    ch = k.chain(toks, extra=ex)
    ks = k.keys(toks, extra=ex)
    assert [c[1] for c in ch] == ks
    assert [c[0] for c in ch] == [k.root, *ks[:-1]]
    for i, (parent, _key, dig) in enumerate(ch):
        assert len(dig) == DIGEST_LEN
        assert dig == k.digest(parent, k.block_tokens(toks, i), extra=ex)
    # The digest depends on parent, tokens and extra, and is not the key.
    p, key, d = ch[1]
    assert d != key
    assert k.digest(ks[1], k.block_tokens(toks, 1), extra=ex) != d
    assert k.digest(p, k.block_tokens(toks, 2), extra=ex) != d
    assert k.digest(p, k.block_tokens(toks, 1)) != d


def test_weak_key_hash_still_yields_distinct_digests() -> None:
    """An injected constant key hash makes every key collide; digests still tell blocks apart."""
    weak = BlockKeyer(NS, BS, key_hash=lambda _b: b"\0" * KEY_BYTES)
    a = weak.chain([1, 2, 3, 4])
    b = weak.chain([1, 2, 3, 5])
    assert a[0][1] == b[0][1]
    assert a[0][2] != b[0][2]
    # The digest does not depend on the key hash in use.
    assert a[0][2] == keyer().chain([1, 2, 3, 4])[0][2]


_CHILD = r"""
import json, sys
from rdmakv.blocks.keys import BlockKeyer, KeyNamespace, extra_bytes
ns = KeyNamespace("llama-3-8b@abc123", "bfloat16", "NHD", 1, 4)
k = BlockKeyer(ns, 16)
toks = [(i * 7919) % 128256 for i in range(1000)]
ex = extra_bytes(lora_name="sql", mm_hashes=["img0", "img1"], cache_salt="s")
out = {
    "seed": ns.seed().hex(),
    "keys": [x.hex() for x in k.keys(toks)],
    "chain": [[p.hex(), key.hex(), d.hex()] for p, key, d in k.chain(toks, extra=ex)],
}
json.dump(out, sys.stdout)
"""


def _child_keys(hashseed: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    out: dict[str, object] = json.loads(res.stdout)
    return out


@pytest.mark.timeout(240)
def test_keys_identical_across_processes() -> None:
    """Two separate interpreters (different hash seeds) and this one agree on every key."""
    first = _child_keys("1")
    second = _child_keys("12345")
    assert first == second
    ns = KeyNamespace("llama-3-8b@abc123", "bfloat16", "NHD", 1, 4)
    k = BlockKeyer(ns, 16)
    toks = [(i * 7919) % 128256 for i in range(1000)]
    assert first["seed"] == ns.seed().hex()
    assert first["keys"] == [x.hex() for x in k.keys(toks)]
    assert len(first["keys"]) == 62  # type: ignore[arg-type]


def _decode_key_message(msg: bytes) -> tuple[bytes, bytes, bytes | None]:
    """Inverse of the key message encoding: (parent, token bytes, extra)."""
    parent, rest = msg[:KEY_BYTES], msg[KEY_BYTES:]
    if len(msg) % 4 == 0:
        return parent, rest, None
    assert len(msg) % 4 == 1 and rest[-1:] == b"\x01"
    e = int.from_bytes(rest[-5:-1], "little")
    padded = e + (-e % 4)
    body = rest[: -5 - padded]
    return parent, body, rest[len(body) : len(body) + e]


@settings(max_examples=200, deadline=None)
@given(
    bs=st.integers(1, 6),
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12),
    extra=st.one_of(st.none(), st.binary(max_size=9)),
)
def test_key_messages_decode_uniquely_across_block_sizes(
    bs: int, tokens: list[int], extra: bytes | None
) -> None:
    """Whatever the block size, a key message decodes back to exactly its inputs."""
    seen: list[bytes] = []

    def record(msg: bytes) -> bytes:
        seen.append(msg)
        return hashlib.md5(msg).digest()

    k = BlockKeyer(NS, bs, key_hash=record)
    k.keys(tokens, extra=extra)
    want_extra = extra or None  # b"" is no extra
    for i, msg in enumerate(seen):
        parent, body, ex = _decode_key_message(msg)
        assert parent == (NS.seed() if i == 0 else hashlib.md5(seen[i - 1]).digest())
        assert body == np.array(tokens[i * bs : (i + 1) * bs], dtype="<i4").tobytes()
        assert ex == want_extra


def test_empty_extra_is_no_extra() -> None:
    k = keyer()
    toks = list(range(8))
    assert k.keys(toks, extra=b"") == k.keys(toks)
    assert k.chain(toks, extra=b"") == k.chain(toks)
