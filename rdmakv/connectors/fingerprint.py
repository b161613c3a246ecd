"""Namespace fingerprints: is the KV under this model name ours?

Keys name a namespace (model name + revision, KV dtype, layout), not the
weights. Two engines that serve different weights under one model name (a
fine-tune deployed under the base name, a re-quantized checkpoint) would share
keys and read each other's wrong KV. At start-up each engine writes a small
*fingerprint record* under its namespace on the node (:func:`engine_fingerprint`,
:func:`check_fingerprint`); an engine that finds a record with different
compared fields refuses remote hits for the namespace and says, in one line,
:data:`CONFLICT` and what differs.

What is compared (:data:`COMPARED`): model name and revision, a hash of the
checkpoint's small files and of each weight file's header and first bytes
(where the model path is local), the model dtype, the quantization, the KV
dtype and layout. The rdmakv version is recorded for the operator but not
compared: a change of the stored block format changes the key namespace itself.

Limits: the record is a value like any other on the node and may be evicted;
an engine that starts after that writes its own and the first one never
re-checks. The sampled audit (:mod:`rdmakv.connectors.audit`) catches what
slips through.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv import __version__
from rdmakv.blocks.keys import KeyNamespace
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import RdmakvError
from rdmakv.wire.format import DIGEST_LEN

log = logging.getLogger("rdmakv.connectors.fingerprint")

CONFLICT = "another engine stores different KV under this model name"
"""The one-line message of a fingerprint conflict (followed by what differs)."""
RECORD_KEY_PREFIX = b"rdmakv-fingerprint:"
"""Record keys are this prefix + the namespace seed: never the length of a block key."""
RECORD_FORMAT = 1
COMPARED = ("model", "revision", "weights", "model_dtype", "quantization", "kv_dtype", "kv_layout")
"""Fields of a record that must match for two engines to share a namespace."""
CHECKPOINT_FILE_PATTERNS = ("config.json", "*.index.json", "generation_config.json")
"""Small checkpoint files hashed whole."""
WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
WEIGHT_PREFIX_BYTES = 1 << 20
"""Bytes hashed from the start of each weight file (its header and first tensors)."""
MAX_WEIGHT_FILES = 64
CHECKPOINT_HASH_BYTES = 16
"""Size of :func:`checkpoint_hash` (a BLAKE2b digest, shown as hex in the
record): part of the record format, which engines of other versions compare."""


def checkpoint_hash(model_path: str | Path) -> str | None:
    """A hash of a local checkpoint's small files and its weight files' first bytes.

    None when ``model_path`` is not a local directory (a hub name: the
    revision stands for the weights) or holds none of those files.
    """
    root = Path(model_path)
    if not root.is_dir():
        return None
    h = hashlib.blake2b(digest_size=CHECKPOINT_HASH_BYTES)
    seen = 0
    for pattern in CHECKPOINT_FILE_PATTERNS:
        for p in sorted(root.glob(pattern)):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
            seen += 1
    weights = sorted({p for pat in WEIGHT_FILE_PATTERNS for p in root.glob(pat)})
    for p in weights[:MAX_WEIGHT_FILES]:
        with p.open("rb") as f:
            h.update(p.name.encode() + b"\0" + f.read(WEIGHT_PREFIX_BYTES))
        seen += 1
    return h.hexdigest() if seen else None


def engine_fingerprint(
    *,
    model: str,
    revision: str | None,
    model_path: str | Path | None,
    model_dtype: str | None,
    quantization: str | None,
    namespace: KeyNamespace,
) -> dict[str, Any]:
    """The record this engine writes under ``namespace`` (plain JSON data)."""
    return {
        "format": RECORD_FORMAT,
        "model": model,
        "revision": revision,
        "weights": checkpoint_hash(model_path) if model_path is not None else None,
        "model_dtype": model_dtype,
        "quantization": quantization,
        "kv_dtype": namespace.dtype,
        "kv_layout": namespace.kv_layout,
        "rdmakv": __version__,
    }


def record_key(namespace: KeyNamespace) -> tuple[bytes, bytes]:
    """``(key, digest)`` of the namespace's fingerprint record."""
    key = RECORD_KEY_PREFIX + namespace.seed()
    return key, hashlib.blake2b(key, digest_size=DIGEST_LEN).digest()


def differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """The compared fields that differ, as ``field: ours here, theirs there``."""
    return [
        f"{k}: {ours.get(k)!r} here, {theirs.get(k)!r} there"
        for k in COMPARED
        if ours.get(k) != theirs.get(k)
    ]


def check_fingerprint(
    mgr: KVCacheManager, namespace: KeyNamespace, ours: Mapping[str, Any]
) -> str | None:
    """Read the namespace's record on the node (write ours if there is none).

    Returns the one-line conflict message, or None (no conflict, no node, or
    the node could not be asked: a failure here is logged, never fatal).
    """
    if mgr.client is None:
        return None
    key, digest = record_key(namespace)
    body = json.dumps(dict(ours), sort_keys=True).encode()
    (h,) = mgr.allocate_for(1)
    try:
        view = mgr.block_view(h)
        (size,) = mgr.client.get_sizes([key], [h], [digest])
        if size is not None:
            try:
                theirs = json.loads(view[:size].tobytes())
            except ValueError:
                log.warning("fingerprint record of %s is not JSON; ignored", namespace.model)
                return None
            diff = differences(ours, theirs) if isinstance(theirs, dict) else ["unreadable"]
            if not diff:
                return None
            written_by = theirs.get("rdmakv") if isinstance(theirs, dict) else None
            return f"{CONFLICT} ({'; '.join(diff)}; theirs written by rdmakv {written_by})"
        if len(body) > len(view):
            log.warning("fingerprint record of %d bytes exceeds a block; not written", len(body))
            return None
        view[: len(body)] = np.frombuffer(body, dtype=np.uint8)
        mgr.client.put([key], [h], len(body), [digest])
        return None
    except RdmakvError as e:
        log.warning("fingerprint of %s not checked: %s", namespace.model, e)
        return None
    finally:
        mgr.discard([h])


__all__ = [
    "COMPARED",
    "CONFLICT",
    "check_fingerprint",
    "checkpoint_hash",
    "differences",
    "engine_fingerprint",
    "record_key",
]
