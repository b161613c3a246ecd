"""Rendezvous (highest-random-weight) placement of 128-bit block keys on nodes.

Each key ranks every member node by a weight ``w(node, key)`` and lives on the
``R`` nodes of highest weight. Weights depend on the node and the key only, so:

* every process computes the same placement (no ``hash()``, no random seed,
  nodes are ordered by id; ties, probability ~2**-64, go to the smaller id);
* adding a node moves exactly the keys for which the newcomer outranks all
  current owners (about ``1/N`` of them, all *to* the newcomer), and removing
  one moves only its own keys (each to its next-ranked node). Nothing else moves.

The weight, in 64-bit modular arithmetic::

    seed(node) = u64le(blake2b-64(node_id, person=b"rdmakv.hrw.v1"))
    fold(key)  = mix64(lo ^ mix64(hi))      # lo, hi: little-endian u64 halves
    w          = mix64(fold(key) ^ seed(node))

where ``mix64`` is the splitmix64 finalizer (a bijection with full avalanche).
A key that is not :data:`~rdmakv.blocks.keys.KEY_BYTES` long is first replaced by its
128-bit BLAKE2b digest. :func:`weight` is the scalar reference; the
:class:`Rendezvous` methods compute the same numbers with numpy, vectorised
over a whole batch (one pass per node: O(N) per key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from rdmakv.blocks.keys import KEY_BYTES
from rdmakv.errors import ConfigError

SEED_PERSON = b"rdmakv.hrw.v1"
"""BLAKE2b personalisation for node seeds (domain separation from key hashes)."""
LONG_KEY_PERSON = b"rdmakv.hrw.key"
"""BLAKE2b personalisation for keys that are not KEY_BYTES long."""

_MASK64 = (1 << 64) - 1
_MIX_MUL1 = 0xBF58476D1CE4E5B9
_MIX_MUL2 = 0x94D049BB133111EB
_U64 = np.uint64
_SHIFT_30, _SHIFT_27, _SHIFT_31 = _U64(30), _U64(27), _U64(31)
_MUL1, _MUL2 = _U64(_MIX_MUL1), _U64(_MIX_MUL2)

U64Array = npt.NDArray[np.uint64]
IndexArray = npt.NDArray[np.intp]


def mix64(z: int) -> int:
    """splitmix64 finalizer on a Python int (scalar reference of :func:`_mix_array`)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix_array(z: U64Array) -> U64Array:
    """splitmix64 finalizer over a uint64 array (wraps mod 2**64, like :func:`mix64`)."""
    z = z ^ (z >> _SHIFT_30)
    z *= _MUL1
    z ^= z >> _SHIFT_27
    z *= _MUL2
    z ^= z >> _SHIFT_31
    return z


def node_seed(node_id: str) -> int:
    """The 64-bit seed of a node, from its id (``"host:port"``)."""
    digest = hashlib.blake2b(node_id.encode(), digest_size=8, person=SEED_PERSON).digest()
    return int.from_bytes(digest, "little")


def key128(key: bytes) -> bytes:
    """The 16 bytes a key is placed by: itself if KEY_BYTES long, else its BLAKE2b-128."""
    if len(key) == KEY_BYTES:
        return bytes(key)
    return hashlib.blake2b(key, digest_size=KEY_BYTES, person=LONG_KEY_PERSON).digest()


def fold_key(key: bytes) -> int:
    """The key's 64-bit fold (scalar reference)."""
    k = key128(key)
    lo = int.from_bytes(k[:8], "little")
    hi = int.from_bytes(k[8:], "little")
    return mix64(lo ^ mix64(hi))


def weight(node_id: str, key: bytes) -> int:
    """Rendezvous weight of ``key`` on ``node_id`` (scalar reference, slow)."""
    return mix64(fold_key(key) ^ node_seed(node_id))


def fold_keys(keys: Sequence[bytes]) -> U64Array:
    """:func:`fold_key` of every key, as one uint64 array (vectorised)."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    if set(map(len, keys)) != {KEY_BYTES}:
        keys = [key128(k) for k in keys]
    halves = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2).astype(np.uint64)
    return _mix_array(halves[:, 0] ^ _mix_array(halves[:, 1]))


class Rendezvous:
    """Placement over a fixed set of nodes; build a new one when membership changes.

    ``nodes`` is sorted and duplicate-free; every index this class returns
    points into it. Immutable, so safe to share between threads.
    """

    def __init__(self, node_ids: Sequence[str]) -> None:
        if not node_ids:
            raise ConfigError("rendezvous placement needs at least one node")
        self.nodes: tuple[str, ...] = tuple(sorted(set(node_ids)))
        self._seeds: U64Array = np.array([node_seed(n) for n in self.nodes], dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.nodes)

    def weights(self, keys: Sequence[bytes]) -> U64Array:
        """``(len(keys), len(nodes))`` uint64 weights: ``[i, j]`` is
        ``weight(nodes[j], keys[i])``."""
        folded = fold_keys(keys)
        out = np.empty((len(folded), len(self.nodes)), dtype=np.uint64)
        for j, seed in enumerate(self._seeds):
            out[:, j] = _mix_array(folded ^ seed)
        return out

    def rank(self, keys: Sequence[bytes], replicas: int = 1) -> IndexArray:
        """``(len(keys), min(replicas, len(nodes)))`` node indexes, best first per key.

        Row ``i`` holds the top-``replicas`` nodes of ``keys[i]`` by weight;
        equal weights rank the node with the smaller id first.
        """
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        w = self.weights(keys)
        if replicas == 1 or len(self.nodes) == 1:
            best: IndexArray = np.argmax(w, axis=1).reshape(-1, 1)  # first maximum wins ties
            return best
        r = min(replicas, len(self.nodes))
        # ~w ascending == w descending; a stable sort keeps the smaller index first on ties
        return np.argsort(~w, axis=1, kind="stable")[:, :r]

    def owners(self, keys: Sequence[bytes], replicas: int = 1) -> list[tuple[str, ...]]:
        """Node ids holding each key, best first (a readable form of :meth:`rank`)."""
        nodes = self.nodes
        return [tuple(nodes[j] for j in row) for row in self.rank(keys, replicas).tolist()]
