"""Block keys: fixed-size, chained names for KV blocks, plus value digests.

A *block key* names a whole token prefix in 16 bytes::

    key_i = H(key_{i-1} || tokens of block i)                       (no extra)
    key_i = H(key_{i-1} || tokens of block i || extra || pad || u32le(len(extra)) || 0x01)

with ``key_{-1}`` = the namespace seed (model fingerprint, dtype, KV layout and,
where the layout differs per rank, TP rank/size), so different models never share
keys. ``H`` is XXH3-128 (chosen by measurement, see ``bench/l1.py``): the chain is
a sequential Python loop, so the per-call cost of the hash dominates and XXH3 beats
BLAKE2b and SHA-256 there. Tokens are hashed as their little-endian int32 bytes
(one vectorised conversion per sequence), never via pickle.

Every encoding is unambiguous, even across block sizes: the parent is
fixed-size; token bytes come in multiples of 4, so a message without extra has a
length of 0 mod 4, while the extra is zero-padded to a multiple of 4 and followed
by its length and a marker byte, giving 1 mod 4; its length is read from the end
and the token bytes are whatever lies between. Different inputs can only share a
key through a genuine hash collision. (The no-extra form carries no suffix at all
because per-block concatenations are a measurable share of the hashing time.)

Because XXH3 is fast but not collision resistant, every stored value also carries
a *digest* of ``(parent key, block tokens, extra)`` made with a different
algorithm (BLAKE2b-128 with a fixed personalisation string). A get compares the
digest the caller computed with the stored one, so a key collision -- accidental
or crafted -- becomes a miss, never wrong KV. Checking costs O(block), not
O(prefix): the parent key already stands for everything before the block, and a
prefix lookup verifies block by block from the first, so the first block whose
inputs differ stops the hit.

Everything here is deterministic across processes and machines: no random seed,
no ``hash()``, no pickle.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from rdmakv.errors import ConfigError
from rdmakv.wire.format import DIGEST_LEN, check_key

BlockKey = bytes
"""A block key: exactly :data:`KEY_BYTES` bytes."""

KEY_BYTES = 16

TOKEN_DTYPE = np.dtype("<i4")
"""Tokens are hashed as little-endian int32: every real vocabulary fits."""
_TOKEN_MIN = int(np.iinfo(TOKEN_DTYPE).min)
_TOKEN_MAX = int(np.iinfo(TOKEN_DTYPE).max)

# Domain-separation strings: the namespace seed and the value digest must never be
# computable from each other or from a key, even for equal inputs.
_NAMESPACE_PERSON = b"rdmakv.ns.v1"
_DIGEST_PERSON = b"rdmakv.digest.v1"
# Copying a personalised BLAKE2b state is ~40% cheaper per block than
# constructing one with keyword arguments. Copy is safe across threads.
_DIGEST_BASE = hashlib.blake2b(digest_size=DIGEST_LEN, person=_DIGEST_PERSON)
_PERSON_BYTES = 16  # BLAKE2b's personalisation field

_LEN = struct.Struct("<I")
_NO_EXTRA_DIGEST_TAIL = _LEN.pack(0)
_EXTRA_MARKER = b"\x01"
_TOKEN_ALIGN = 4  # token bytes are int32: messages without extra are 0 mod 4

KeyHash = Callable[[bytes], bytes]
"""A key hash: message bytes -> :data:`KEY_BYTES` bytes."""


# The default key hash, XXH3-128 (canonical big-endian digest, seed 0). Bound to
# the C function itself, not wrapped: a Python-level wrapper would cost more per
# block than the hash.
xxh3_key_hash: KeyHash = xxhash.xxh3_128_digest


def _blake2b_16(data: bytes | memoryview, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_LEN, person=person).digest()


def _lp(data: bytes) -> bytes:
    """Length-prefixed field, so concatenated fields stay unambiguous."""
    return _LEN.pack(len(data)) + data


def _lp_opt_int(value: int | None) -> bytes:
    # None and 0 must encode differently: "no TP split" is not "rank 0".
    return b"\x00" if value is None else b"\x01" + struct.pack("<q", value)


@dataclass(frozen=True)
class KeyNamespace:
    """What must match for two engines to share KV blocks.

    ``model`` should be a fingerprint of the weights (name plus revision or a
    hash), ``dtype`` the KV dtype, ``kv_layout`` anything that changes the bytes
    of a block (e.g. ``"NHD"``, ``"HND"``, head count/size). ``tp_rank`` and
    ``tp_size`` belong here only when a rank's block holds a different slice of
    the KV; leave both ``None`` when all ranks store identical layouts so that
    different TP sizes can share.
    """

    model: str
    dtype: str
    kv_layout: str = ""
    tp_rank: int | None = None
    tp_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"KeyNamespace.model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ConfigError(f"KeyNamespace.dtype must be a non-empty str, got {self.dtype!r}")
        if not isinstance(self.kv_layout, str):
            raise ConfigError(f"KeyNamespace.kv_layout must be a str, got {self.kv_layout!r}")
        if (self.tp_rank is None) != (self.tp_size is None):
            raise ConfigError(
                "KeyNamespace.tp_rank and tp_size must be given together "
                f"(got tp_rank={self.tp_rank!r}, tp_size={self.tp_size!r})"
            )
        if self.tp_size is not None and self.tp_rank is not None:
            if not isinstance(self.tp_size, int) or self.tp_size <= 0:
                raise ConfigError(
                    f"KeyNamespace.tp_size must be a positive int, got {self.tp_size!r}"
                )
            if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
                raise ConfigError(
                    f"KeyNamespace.tp_rank must be in [0, tp_size={self.tp_size}), "
                    f"got {self.tp_rank!r}"
                )

    def seed(self) -> bytes:
        """The 16-byte root "parent" of the first block, derived from all fields."""
        msg = b"".join(
            (
                _lp(self.model.encode()),
                _lp(self.dtype.encode()),
                _lp(self.kv_layout.encode()),
                _lp_opt_int(self.tp_rank),
                _lp_opt_int(self.tp_size),
            )
        )
        return _blake2b_16(msg, _NAMESPACE_PERSON)


def extra_bytes(
    lora_name: str | None = None,
    mm_hashes: Sequence[str] = (),
    cache_salt: str | None = None,
) -> bytes | None:
    """Canonical bytes for the per-request inputs that change KV besides tokens.

    Returns ``None`` when there is nothing extra, so plain requests share keys.
    Each field is tagged and length-prefixed: a LoRA called ``"a"`` with salt
    ``"b"`` never collides with a LoRA called ``"ab"``.
    """
    if isinstance(mm_hashes, str):
        # A bare str is a Sequence[str] of characters: almost certainly a mistake.
        raise ConfigError("mm_hashes must be a sequence of str, not a single str")
    parts: list[bytes] = []
    if lora_name is not None:
        parts.append(b"L" + _lp(lora_name.encode()))
    if mm_hashes:
        parts.append(b"M" + _LEN.pack(len(mm_hashes)))
        parts.extend(_lp(h.encode()) for h in mm_hashes)
    if cache_salt is not None:
        parts.append(b"S" + _lp(cache_salt.encode()))
    return b"".join(parts) if parts else None


def _normalize_extra(extra: bytes | None) -> bytes | None:
    if extra is None:
        return None
    if not isinstance(extra, bytes | bytearray):
        raise ConfigError(f"extra must be bytes or None, got {type(extra).__name__}")
    return bytes(extra) if extra else None  # b"" means no extra: same keys as None


def _key_tail(extra: bytes | None) -> bytes:
    """Suffix of every key message for ``extra`` (see the module docstring)."""
    e = _normalize_extra(extra)
    if e is None:
        return b""
    pad = b"\x00" * (-len(e) % _TOKEN_ALIGN)
    return e + pad + _LEN.pack(len(e)) + _EXTRA_MARKER


def _digest_tail(extra: bytes | None) -> bytes:
    """Suffix of every digest message: the digest is length-prefixed, so simpler."""
    e = _normalize_extra(extra)
    return _NO_EXTRA_DIGEST_TAIL if e is None else e + _LEN.pack(len(e))


def _check_parent(parent: object) -> BlockKey:
    return check_key(parent, "parent key", length=KEY_BYTES)


def _checked_hash(key_hash: KeyHash) -> KeyHash:
    """``key_hash`` whose every output is checked to be a :data:`BlockKey`: a
    chain's parents must be of one size for its messages to stay unambiguous."""

    def checked(message: bytes) -> BlockKey:
        return check_key(key_hash(message), "key hash output", length=KEY_BYTES)

    return checked


def as_token_array(tokens: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``tokens`` as a 1-D little-endian int32 array (no copy when already one).

    Raises :class:`ConfigError` for non-integer tokens or values outside int32.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ConfigError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.dtype != TOKEN_DTYPE:
            if arr.size and arr.dtype.itemsize >= TOKEN_DTYPE.itemsize:
                # astype would wrap silently; out-of-range ids must fail loudly.
                lo, hi = int(arr.min()), int(arr.max())
                if lo < _TOKEN_MIN or hi > _TOKEN_MAX:
                    bad = lo if lo < _TOKEN_MIN else hi
                    raise ConfigError(f"token id {bad} does not fit in int32")
            arr = arr.astype(TOKEN_DTYPE)
        return arr
    try:
        return np.fromiter(tokens, dtype=TOKEN_DTYPE, count=len(tokens))
    except (OverflowError, TypeError, ValueError) as e:
        raise ConfigError(f"tokens must be int32-range integers: {e}") from e


class BlockKeyer:
    """Computes chained block keys and value digests for one namespace and block size.

    ``block_size`` is in tokens. Only *full* blocks get keys; a partial tail is
    ignored (it cannot be shared until it fills). ``key_hash`` replaces XXH3-128
    for the keys only -- tests inject a deliberately weak one to force
    collisions; the digest always uses BLAKE2b, so such collisions are still
    caught. Stateless apart from configuration, so safe to share across threads.
    """

    def __init__(
        self,
        namespace: KeyNamespace,
        block_size: int,
        *,
        key_hash: KeyHash | None = None,
    ) -> None:
        if not isinstance(namespace, KeyNamespace):
            raise ConfigError(f"namespace must be a KeyNamespace, got {type(namespace).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int (tokens), got {block_size!r}")
        self.namespace = namespace
        self.block_size = block_size
        self._root = namespace.seed()
        # XXH3 always gives KEY_BYTES, and its hot loops pay for no check.
        self._hash: KeyHash = xxh3_key_hash if key_hash is None else _checked_hash(key_hash)
        self._step = block_size * TOKEN_DTYPE.itemsize
        self._splitter = struct.Struct(f"{self._step}s")

    @property
    def root(self) -> BlockKey:
        """The parent of block 0 when none is given: the namespace seed."""
        return self._root

    def num_blocks(self, tokens: Sequence[int] | np.ndarray[Any, Any]) -> int:
        """How many full blocks ``tokens`` holds."""
        return len(tokens) // self.block_size

    def keys(
        self,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        extra: bytes | None = None,
        parent: BlockKey | None = None,
    ) -> list[BlockKey]:
        """One key per full block of ``tokens``, chained from ``parent``.

        ``parent=None`` starts at the namespace seed; pass the last key of an
        earlier call to continue a chain incrementally (keys of the new blocks
        only -- identical to recomputing from the start).
        """
        p = self._root if parent is None else _check_parent(parent)
        tail = _key_tail(extra)
        blocks = self._block_bytes(tokens)
        h = self._hash
        # The hot loop, as a comprehension over a C-level block splitter: one or
        # two concatenations and one C hash call per block (measured ~25% faster
        # than slicing in a for loop; the list conversion is the other half).
        if tail:
            out = [(p := h(p + c + tail)) for (c,) in blocks]
        else:
            out = [(p := h(p + c)) for (c,) in blocks]
        return out

    def _block_bytes(self, tokens: Sequence[int] | np.ndarray[Any, Any]) -> Iterator[tuple[bytes]]:
        """Little-endian int32 bytes of each full block of ``tokens``, as 1-tuples."""
        n = len(tokens) // self.block_size * self.block_size
        # Slicing a list copies it: skip when there is no partial tail.
        arr = as_token_array(tokens if n == len(tokens) else tokens[:n])
        buf: memoryview = np.ascontiguousarray(arr).data
        return self._splitter.iter_unpack(buf)

    def block_tokens(
        self, tokens: Sequence[int] | np.ndarray[Any, Any], i: int
    ) -> np.ndarray[Any, Any]:
        """Tokens of full block ``i`` as an int32 array."""
        n = self.num_blocks(tokens)
        if not 0 <= i < n:
            raise ConfigError(
                f"block index {i} out of range: {len(tokens)} tokens hold {n} full blocks"
            )
        bs = self.block_size
        return as_token_array(tokens[i * bs : (i + 1) * bs])

    def digest(
        self,
        parent: BlockKey,
        block_tokens: Sequence[int] | np.ndarray[Any, Any],
        extra: bytes | None = None,
    ) -> bytes:
        """Value digest: BLAKE2b-128 of ``(parent, block tokens, extra)``. O(block).

        Independent of the key hash (different algorithm, own personalisation),
        so a key collision does not imply a digest collision. Pass the same
        ``extra`` that produced the key (``chain`` does).
        """
        parent = _check_parent(parent)
        arr = as_token_array(block_tokens)
        if len(arr) != self.block_size:
            raise ConfigError(f"a block has {self.block_size} tokens, digest() got {len(arr)}")
        return self._digest_bytes(parent, arr.tobytes(), _digest_tail(extra))

    @staticmethod
    def _digest_bytes(parent: bytes, tb: bytes, tail: bytes) -> bytes:
        h = _DIGEST_BASE.copy()
        h.update(parent + _LEN.pack(len(tb)) + tb + tail)
        return h.digest()

    def chain(
        self,
        tokens: Sequence[int] | np.ndarray[Any, Any],
        extra: bytes | None = None,
        parent: BlockKey | None = None,
    ) -> list[tuple[BlockKey, BlockKey, bytes]]:
        """``(parent, key, digest)`` for every full block: what a put or a verified get needs."""
        p = self._root if parent is None else _check_parent(parent)
        ktail = _key_tail(extra)
        dtail = _digest_tail(extra)
        h = self._hash
        length = _LEN.pack(self._step)
        new_digest = _DIGEST_BASE.copy
        out: list[tuple[BlockKey, BlockKey, bytes]] = []
        for (chunk,) in self._block_bytes(tokens):
            k = h(p + chunk + ktail)
            # Same bytes as digest(): keep the two in step.
            hd = new_digest()
            hd.update(p + length + chunk + dtail)
            d = hd.digest()
            out.append((p, k, d))
            p = k
        return out


class NamedKeys:
    """Keys and digests for values an engine names with its own hash (no tokens here).

    Some engines hand a storage tier a name per value that already stands for
    the whole prefix (vLLM's offload key: a chained block hash plus the KV
    cache group). Under a namespace ``seed`` (:meth:`KeyNamespace.seed`) a name
    becomes::

        key    = XXH3-128(seed || name)
        digest = BLAKE2b-128(seed || name, person=person)

    so two namespaces never share a value, and a key collision (XXH3 is not
    collision resistant) is a digest mismatch, i.e. a miss, never wrong KV.
    ``person`` versions the value format. Stateless: safe across threads.
    """

    def __init__(self, namespace: KeyNamespace, person: bytes) -> None:
        if not isinstance(person, bytes) or not 0 < len(person) <= _PERSON_BYTES:
            raise ConfigError(f"person must be 1..{_PERSON_BYTES} bytes, got {person!r}")
        self.seed = namespace.seed()
        self._digest_base = hashlib.blake2b(digest_size=DIGEST_LEN, person=person)

    def keys(self, names: Sequence[bytes]) -> list[BlockKey]:
        """One key per name, in order."""
        seed, h = self.seed, xxh3_key_hash
        return [h(seed + n) for n in names]

    def digests(self, names: Sequence[bytes]) -> list[bytes]:
        """One value digest per name, in order."""
        out = []
        for n in names:
            d = self._digest_base.copy()
            d.update(self.seed + n)
            out.append(d.digest())
        return out

