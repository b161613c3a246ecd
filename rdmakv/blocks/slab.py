"""Slab: the L1 memory arena, carved into fixed-size blocks.

One anonymous, page-aligned ``mmap`` per slab, locked in RAM when the memlock
limit allows. It is registered with an RDMA device exactly once (by the
transport, using :attr:`Slab.base_addr` / :attr:`Slab.nbytes`), so every block
is addressable as ``(addr, lkey/rkey)`` for zero-copy one-sided I/O.

Invariants:

* A block handle is an ``int`` in ``[0, num_blocks)``. A handle is *live*
  while its refcount is > 0; :meth:`alloc` returns it with refcount 1.
* Each owner (cache entry, in-flight I/O, reader holding a view) takes one
  reference with :meth:`incref` and gives it back with :meth:`decref`; the
  block returns to the free list when the count reaches 0. A block on the free
  list is never handed out twice and never overlaps another block.
* Views (memoryview / numpy / torch) alias the arena; they do not keep a block
  alive by themselves -- hold a reference while you use one.

A slab can also be laid over memory someone else allocated
(:meth:`Slab.over_buffer`, e.g. an inference engine's host KV pool), so the
KV client moves bytes straight into and out of that memory. Such a slab never
maps, locks or frees the memory: see :meth:`Slab.over_buffer` for who owns
its blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import resource
import sys
import warnings
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rdmakv import native_core
from rdmakv.errors import (
    ConfigError,
    InvalidHandle,
    MemoryLockWarning,
    MissingExtra,
    SlabExhausted,
)

if TYPE_CHECKING:
    import torch

PAGE_SIZE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_native_live_handles: Callable[[Sequence[int], list[int] | array[int]], bool] = (
    native_core.CALL.live_handles
)


def memlock_limit() -> int | None:
    """Soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _refcounts(n: int, start: int, shared: bool) -> list[int] | array[int]:
    """Per block its reference count. A list unless ``shared``: Python's
    specialised list indexing makes a list's ``+= 1`` about twice as fast as
    an array's, and the L1 takes a reference per block. ``shared``: a C
    ``int32`` array that native code can update in place (:attr:`Slab.refcounts`)."""
    return array("i", [start]) * n if shared else [start] * n


def _mlock(addr: int, length: int) -> int:
    """mlock(2); returns 0 or the errno."""
    rc = _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length))
    return 0 if rc == 0 else ctypes.get_errno()


class Slab:
    """A pinned arena of ``num_blocks`` blocks of ``block_size`` bytes.

    ``capacity`` is rounded down to a whole number of blocks; the mapping itself
    is rounded up to whole pages. Not thread-safe: the owner (L1Cache, KV node)
    serialises alloc/free. ``shared_refcounts`` keeps the refcounts where
    native code can take references too (:attr:`refcounts`: the KV node's
    pool, whose GETs pin their hits in C).
    """

    def __init__(
        self, capacity: int, block_size: int, *, lock: bool = True, shared_refcounts: bool = False
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"slab capacity must be a positive int, got {capacity!r}")
        if block_size > capacity:
            raise ConfigError(
                f"block_size {block_size} is larger than the slab capacity {capacity}"
            )
        self.block_size = block_size
        self.num_blocks = capacity // block_size
        self.nbytes = self.num_blocks * block_size
        map_len = -(-self.nbytes // PAGE_SIZE) * PAGE_SIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, map_len, flags=flags)
        self._array: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(
            self._mmap, dtype=np.uint8, count=self.nbytes
        )
        self._view = memoryview(self._mmap)[: self.nbytes]
        self.base_addr: int = int(self._array.ctypes.data)
        self.locked = False
        if lock:
            self.locked = self._try_lock(map_len)
        # Free list as a stack: O(1) alloc/free, most recently freed reused first
        # (warm in cache and TLB).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._refs = _refcounts(self.num_blocks, 0, shared_refcounts)
        self.external = False
        """True for a slab laid over foreign memory (:meth:`over_buffer`)."""
        self._owner: object | None = None

    @classmethod
    def over_buffer(cls, buffer: object, block_size: int, *, borrowed: bool = True) -> Slab:
        """A slab whose blocks are consecutive ``block_size``-byte pieces of ``buffer``.

        ``buffer`` is memory someone else allocated: any writable, C-contiguous
        object with the buffer protocol (``bytearray``, ``mmap``, ``memoryview``,
        numpy array) or a contiguous CPU ``torch.Tensor`` of any dtype. Its size
        must be a whole number of blocks. Block ``h`` is bytes
        ``[h * block_size, (h + 1) * block_size)`` of it and :attr:`base_addr` is
        its address, so a transport registers exactly that memory and one-sided
        I/O on a block reads or writes the owner's bytes in place (zero copy).

        Memory: the slab never maps, locks (mlock) or frees the buffer; it keeps
        a reference to ``buffer`` so the memory outlives the slab, and
        :meth:`close` only drops the slab's views and that reference. Keeping
        the memory resident (pinned) for RDMA is the owner's business;
        :attr:`locked` is False.

        Block ownership (the invariant callers rely on):

        * ``borrowed=True`` (default): every block starts *live* with refcount 1,
          a reference that belongs to the buffer's owner (its pages are in use by
          it), so all handles are valid at once and :meth:`alloc` has nothing to
          hand out (:class:`SlabExhausted`). Callers may still incref/decref
          around their I/O; dropping the owner's own reference puts the block on
          the free list like any other.
        * ``borrowed=False``: every block starts free and :meth:`alloc` /
          :meth:`decref` work exactly as on an mmap slab (an arena carved out of
          foreign memory).

        Bad input (not a buffer, read-only, non-contiguous, not on the CPU,
        empty, or a size that is not a multiple of ``block_size``) raises
        :class:`ConfigError` naming the problem.
        """
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        flat = _writable_bytes(buffer)
        nbytes = flat.nbytes
        if nbytes == 0:
            raise ConfigError("cannot lay a slab over an empty buffer (0 bytes)")
        if nbytes % block_size:
            raise ConfigError(
                f"buffer of {nbytes} bytes is not a whole number of {block_size}-byte blocks "
                f"({nbytes % block_size} bytes left over)"
            )
        slab = cls.__new__(cls)
        slab.block_size = block_size
        slab.num_blocks = nbytes // block_size
        slab.nbytes = nbytes
        slab._mmap = None
        slab._array = np.frombuffer(flat, dtype=np.uint8)
        slab._view = flat
        slab.base_addr = int(slab._array.ctypes.data)
        slab.locked = False
        if borrowed:
            slab._free = []
            slab._refs = _refcounts(slab.num_blocks, 1, False)
        else:
            slab._free = list(range(slab.num_blocks - 1, -1, -1))
            slab._refs = _refcounts(slab.num_blocks, 0, False)
        slab.external = True
        slab._owner = buffer
        return slab

    def _try_lock(self, length: int) -> bool:
        err = _mlock(self.base_addr, length)
        if err == 0:
            return True
        limit = memlock_limit()
        shown = "unlimited" if limit is None else f"{limit} bytes"
        warnings.warn(
            f"rdmakv: could not lock the {length}-byte slab in RAM "
            f"(mlock: {os.strerror(err)}; "
            f"RLIMIT_MEMLOCK is {shown}). RDMA registration of this slab may fail. "
            "Raise the limit with `ulimit -l unlimited` (or LimitMEMLOCK=infinity in a "
            "systemd unit, `--ulimit memlock=-1` in docker).",
            MemoryLockWarning,
            stacklevel=3,
        )
        # Touch every page so registration and first I/O don't fault.
        self._array[::PAGE_SIZE] = 0
        return False

    # -- allocation ---------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self) -> int:
        """Take one free block; it starts with refcount 1."""
        if not self._free:
            raise SlabExhausted(
                f"slab exhausted: all {self.num_blocks} blocks of {self.block_size} bytes in use"
            )
        h = self._free.pop()
        self._refs[h] = 1
        return h

    def try_alloc(self) -> int | None:
        """Take one free block (refcount 1), or None when none is free."""
        if not self._free:
            return None
        h = self._free.pop()
        self._refs[h] = 1
        return h

    def alloc_many(self, n: int) -> list[int]:
        """Take ``n`` blocks at once, or none (raises) if fewer are free."""
        if n < 0:
            raise ConfigError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise SlabExhausted(
                f"slab exhausted: asked for {n} blocks, {len(self._free)} of "
                f"{self.num_blocks} free"
            )
        if not n:
            return []
        # the order pop() would give, in C-level slices: the last freed first
        free, refs = self._free, self._refs
        out = free[-n:]
        del free[-n:]
        out.reverse()
        for h in out:
            refs[h] = 1
        return out

    def _check(self, h: int) -> None:
        if not (0 <= h < self.num_blocks):
            raise InvalidHandle(f"block handle {h!r} out of range [0, {self.num_blocks})")
        if self._refs[h] == 0:
            raise InvalidHandle(f"block handle {h} is not allocated (freed or never handed out)")

    def incref(self, h: int) -> None:
        self._check(h)
        self._refs[h] += 1

    def incref_many(self, handles: Sequence[int]) -> None:
        """:meth:`incref` of each handle (a repeated one once per time it is
        named); nothing changes unless every handle is live."""
        self.check_handles(handles)
        refs = self._refs
        for h in handles:
            refs[h] += 1

    def decref_many(self, handles: Sequence[int]) -> None:
        """:meth:`decref` of each handle in order (a repeated one once per time
        it is named), freeing each block whose last reference goes."""
        self.check_handles(handles)
        refs, free = self._refs, self._free
        for h in handles:
            if not refs[h]:  # named more often than it had references
                self._check(h)  # raises: not allocated
            refs[h] -= 1
            if not refs[h]:
                free.append(h)

    def decref(self, h: int) -> None:
        """Drop one reference; the block is freed when the last one goes."""
        self._check(h)
        self._refs[h] -= 1
        if self._refs[h] == 0:
            self._free.append(h)

    free = decref

    def refcount(self, h: int) -> int:
        if not (0 <= h < self.num_blocks):
            raise InvalidHandle(f"block handle {h!r} out of range [0, {self.num_blocks})")
        return self._refs[h]

    @property
    def refcounts(self) -> array[int] | None:
        """Every block's reference count, the ``int32`` array the slab itself
        keeps, on a slab made with ``shared_refcounts`` (else None). For native
        code that takes references in bulk on the owner's behalf, under the
        owner's serialisation: it may only add references to live blocks (a
        block at 0 is on the free list, and only :meth:`alloc` takes it off),
        and they are given back through :meth:`decref_many`."""
        refs = self._refs
        return refs if isinstance(refs, array) else None

    def is_live(self, h: int) -> bool:
        return 0 <= h < self.num_blocks and self._refs[h] > 0

    def check_handles(self, handles: Sequence[int]) -> None:
        """Raise :class:`InvalidHandle` for the first handle that is out of
        range or not allocated. One native pass (rk_call.c's
        ``live_handles``: a list or tuple of ints, on a slab whose refcounts
        are a list), else two C-level ones, in the common (valid) case:
        batches check thousands of handles before anything is sent."""
        if _native_live_handles(handles, self._refs):
            return
        try:
            if len(handles) == 0 or (
                min(handles) >= 0 and all(map(self._refs.__getitem__, handles))
            ):
                return
        except (IndexError, TypeError, ValueError):
            pass  # the per-handle check below names the bad one
        for h in handles:
            if not isinstance(h, int | np.integer):
                raise InvalidHandle(f"block handle {h!r} is not an integer")
            self._check(h)

    # -- addressing and views -------------------------------------------------
    def offset(self, h: int) -> int:
        self._check(h)
        return h * self.block_size

    def addr(self, h: int) -> int:
        """Virtual address of block ``h`` (for SGEs against the slab's MR)."""
        return self.base_addr + self.offset(h)

    def handle_at(self, offset: int) -> int:
        """The block containing arena offset ``offset`` (bounds-checked)."""
        if not (0 <= offset < self.nbytes):
            raise InvalidHandle(f"offset {offset} outside the {self.nbytes}-byte slab")
        return offset // self.block_size

    def view(self, h: int, length: int | None = None) -> memoryview:
        """Writable zero-copy memoryview of block ``h`` (first ``length`` bytes)."""
        off = self.offset(h)
        n = self.block_size if length is None else self._check_len(length)
        return self._view[off : off + n]

    def _check_len(self, length: int) -> int:
        if not (0 <= length <= self.block_size):
            raise ConfigError(f"length {length} outside [0, block_size={self.block_size}]")
        return length

    def numpy(self, h: int, dtype: Any = np.uint8) -> np.ndarray[Any, Any]:
        """Zero-copy numpy view of block ``h`` reinterpreted as ``dtype``."""
        off = self.offset(h)
        return self._array[off : off + self.block_size].view(dtype)

    def torch(self, h: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Zero-copy CPU tensor aliasing block ``h`` (uint8 unless ``dtype``)."""
        try:
            import torch  # heavy import: only when a tensor view is asked for
        except ModuleNotFoundError as e:
            if e.name != "torch":  # torch is there but broken: its own error says more
                raise
            raise MissingExtra(
                "Slab.torch needs torch, which is not installed: pip install 'rdmakv[torch]'",
                name="torch",
            ) from None

        t = torch.from_numpy(self.numpy(h))
        return t if dtype is None else t.view(dtype)

    @property
    def buffer(self) -> memoryview:
        """The whole arena as one writable memoryview."""
        return self._view

    @property
    def array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The whole arena as a flat uint8 numpy array."""
        return self._array

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Unmap the arena. Views handed out earlier must not be used after.

        A slab over foreign memory (:meth:`over_buffer`) only drops its own
        views and its reference to the buffer; the memory stays with its owner.
        """
        if self.external:
            if self._owner is None:
                return
            del self._array  # first: the array is an export of the view
            with contextlib.suppress(BufferError):  # a caller still holds a slice
                self._view.release()
            self._owner = None
            return
        if self._mmap is None:
            return
        self._view.release()
        del self._array
        mm, self._mmap = self._mmap, None
        # A caller may still hold a view (BufferError): the mapping then lives
        # until that view is dropped.
        with contextlib.suppress(BufferError):
            mm.close()

    @property
    def closed(self) -> bool:
        if self.external:
            return self._owner is None
        return self._mmap is None

    def __enter__(self) -> Slab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = ", external" if self.external else ""
        return (
            f"Slab(blocks={self.num_blocks}x{self.block_size}, used={self.used_blocks}, "
            f"locked={self.locked}, base=0x{self.base_addr:x}{where})"
        )


def _writable_bytes(buffer: object) -> memoryview:
    """``buffer``'s memory as a flat writable byte memoryview aliasing it (no copy)."""
    torch_mod = sys.modules.get("torch")  # a tensor implies torch is already imported
    if torch_mod is not None and isinstance(buffer, torch_mod.Tensor):
        t = buffer
        if t.device.type != "cpu":
            raise ConfigError(f"a slab needs CPU memory; the tensor is on {t.device}")
        if not t.is_contiguous():
            raise ConfigError(
                f"a slab needs contiguous memory; the tensor (shape {tuple(t.shape)}, "
                f"strides {t.stride()}) is not contiguous"
            )
        if t.is_sparse or t.is_quantized or t.is_conj() or t.is_neg():
            raise ConfigError("a slab needs a plain dense tensor (not sparse/quantized/conj/neg)")
        # A byte view of the tensor's own storage: works for every dtype (bf16 too).
        arr = t.detach().reshape(-1).view(torch_mod.uint8).numpy()
        if arr.ctypes.data != t.data_ptr():
            raise ConfigError("the tensor's byte view does not alias its memory")
        return memoryview(arr)
    try:
        mv = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as e:
        raise ConfigError(
            f"a slab needs a writable buffer (buffer protocol or CPU tensor), "
            f"got {type(buffer).__name__}"
        ) from e
    if mv.readonly:
        raise ConfigError(f"the {type(buffer).__name__} buffer is read-only; a slab must write it")
    if not mv.c_contiguous:
        raise ConfigError(
            f"a slab needs C-contiguous memory; the {type(buffer).__name__} buffer "
            f"(shape {mv.shape}, strides {mv.strides}) is not"
        )
    return mv if (mv.ndim == 1 and mv.format == "B") else mv.cast("B")
