"""The reference model: what a correct node answers, request by request.

The fuzzer drives every connection from one thread and the victim client is
idle meanwhile, so the node's state is a deterministic function of the frames
sent; this module replays them against a small model of the store (committed
keys, uncommitted extents by owner, leases, the bytes known to be in each
block) and checks every answer:

* framing: the response opcode and req_id echo the request (a fatal
  FRAME_TOO_LARGE may answer with opcode 0 or HELLO and req_id 0, the node
  having no header it trusts), the payload decodes with :mod:`rdmakv.wire`;
* refusals: a malformed frame gets exactly the status the strategy predicted;
  INTERNAL is always a failure (an exception escaped a handler);
* semantics: ALLOC statuses (TOO_LARGE, EXISTS, BUSY, OK; NO_SPACE is
  tolerated) and that an extent handed out is never a block someone still
  holds; COMMIT/ABORT/DELETE/EXISTS flags; LOOKUP hits, extents, digests and
  that one leased LOOKUP has one fresh lease id; RELEASE counts only this
  connection's live leases, each once; GET hits exactly the keys committed
  with the digest asked for, each with its committed length and COMMIT's
  checksum, and its bulk is the hits' values (every byte the model knows --
  the victim's values, what this fuzzer PUT -- checked), unless they total
  more than MAX_BULK_BYTES (LIMIT_EXCEEDED); PUT's statuses are ALLOC's
  (BAD_REQUEST when the bulk is not the sizes' sum) and each OK item is an
  uncommitted extent of this connection holding exactly the bytes sent,
  written (COMMIT require_written commits it). Its answer gives no address:
  the model learns where it is from the first LOOKUP that finds it committed;
* STATS: entries, pending and leases_active equal the model's counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rdmakv.errors import ProtocolError
from rdmakv.fuzz.wire import AllocItem, FuzzFailure, Req, Resp
from rdmakv.wire.batches import (
    decode_extents,
    decode_flags,
    decode_get_answer,
    decode_json,
    decode_lookup_results,
    decode_put_answer,
)
from rdmakv.wire.format import (
    BULK_REQUEST_OPCODES,
    COMMIT_FLAG_REQUIRE_WRITTEN,
    LOOKUP_FLAG_LEASE,
    MAX_BULK_BYTES,
    RESPONSE_BIT,
    U32,
    AllocStatus,
    LookupResult,
    NodeInfo,
    Op,
    Status,
    decode_node_info,
)


@dataclass
class Ext:
    """A value's extent as the node handed it out; ``extra``: the fields LOOKUP
    must give back after the digest (the checksum COMMIT stored; the ALLOC
    item's fields after the digest until then, none since protocol v3).
    ``addr`` < 0: a PUT's extent whose address the model has not learnt yet
    (a name of its own, never a pool address; see :meth:`Model.place`)."""

    addr: int
    length: int
    digest: bytes
    extra: tuple[int, ...] = ()


@dataclass
class Pending:
    key: bytes
    cid: int
    ext: Ext
    written: bool = False


@dataclass
class Lease:
    lid: int
    cid: int
    exts: list[Ext]


@dataclass
class Content:
    """The bytes of one block's current value, and which of them the model knows."""

    data: bytearray
    known: bytearray

    @classmethod
    def unknown(cls, length: int) -> Content:
        return cls(bytearray(length), bytearray(length))

    @classmethod
    def of(cls, value: bytes) -> Content:
        return cls(bytearray(value), bytearray(b"\x01" * len(value)))


@dataclass
class Model:
    """The node's state as far as the fuzzer can know it."""

    info: NodeInfo
    victim: dict[bytes, bytes] = field(default_factory=dict)  # key -> value
    committed: dict[bytes, Ext] = field(default_factory=dict)
    pending: dict[bytes, Pending] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)  # live ones
    lease_owner: dict[int, int] = field(default_factory=dict)  # ids granted this example -> cid
    lease_ids: set[int] = field(default_factory=set)  # every id ever granted
    content: dict[int, Content] = field(default_factory=dict)  # block start -> bytes
    keys_seen: set[bytes] = field(default_factory=set)  # every fuzz key ever allocated
    bytes_verified: int = 0
    lease_quota: int | None = None  # the node's per-session lease quota (bytes), if it has one
    unplaced: int = 0  # PUT extents named so far (their Ext.addr: -1, -2, ...)

    @property
    def base(self) -> int:
        return self.info.pool_base

    @property
    def bs(self) -> int:
        return self.info.block_size

    def block_start(self, addr: int) -> int | None:
        """Start of the block holding ``addr``, None outside the pool."""
        off = addr - self.base
        if off < 0 or off >= self.info.pool_len:
            return None
        return self.base + off // self.bs * self.bs

    def new_unplaced(self) -> int:
        """A name for a PUT extent, whose answer does not say where it is."""
        self.unplaced += 1
        return -self.unplaced

    def place(self, key: bytes, addr: int, *, check: bool = True) -> Ext:
        """The model learnt where ``key``'s PUT extent (uncommitted, or committed
        without a LOOKUP since) is: ``addr``, which must be a block start no one
        else holds (``check``). Its bytes move along; returns the extent."""
        p = self.pending.get(key)
        if p is None or p.ext.addr >= 0:
            p = None
            old = self.committed[key]
        else:
            old = p.ext
        assert old.addr < 0
        if check and (self.block_start(addr) != addr or addr in self.held_blocks()):
            raise FuzzFailure(
                f"{key!r:.40}'s PUT extent is at 0x{addr:x}, which is not a free block start"
            )
        ext = replace(old, addr=addr)
        if p is not None:
            p.ext = ext
        else:
            self.committed[key] = ext
        c = self.content.pop(old.addr, None)
        self.content[addr] = Content.unknown(ext.length) if c is None else c
        return ext

    def forget_unplaced(self) -> None:
        """Drop the bytes of PUT extents nobody holds any more (names are never reused)."""
        live = {p.ext.addr for p in self.pending.values()}
        live.update(e.addr for e in self.committed.values())
        for addr in [a for a in self.content if a < 0 and a not in live]:
            del self.content[addr]

    def held_blocks(self) -> set[int]:
        """Blocks someone holds: committed, uncommitted, or under a live lease."""
        held = {e.addr for e in self.committed.values()}
        held.update(p.ext.addr for p in self.pending.values())
        for lease in self.leases.values():
            held.update(e.addr for e in lease.exts)
        return held

    # -- connection lifecycle ------------------------------------------------------------
    def closed(self, cid: int) -> None:
        """The node ended connection ``cid``'s session: its extents and leases are gone."""
        for key in [k for k, p in self.pending.items() if p.cid == cid]:
            del self.pending[key]
        for lid in [i for i, le in self.leases.items() if le.cid == cid]:
            del self.leases[lid]

    def forget_content(self, cid: int) -> None:
        """After a mutated frame on ``cid`` the model no longer knows what it wrote."""
        for p in self.pending.values():
            if p.cid == cid:
                self.content[p.ext.addr] = Content.unknown(p.ext.length)

    # -- checking one answer -----------------------------------------------------------------
    def check(self, cid: int, req: Req, resp: Resp) -> None:
        """Check ``resp`` to ``req`` sent on ``cid`` and apply its effects."""
        hdr = resp.header
        echo = hdr.opcode == (req.opcode | RESPONSE_BIT) and hdr.req_id == req.req_id
        if hdr.status == Status.FRAME_TOO_LARGE and not echo:
            echo = hdr.opcode in (RESPONSE_BIT, Op.HELLO | RESPONSE_BIT) and hdr.req_id == 0
        if not echo:
            raise FuzzFailure(
                f"answer out of sync: got opcode {hdr.opcode} req_id {hdr.req_id} for "
                f"opcode {req.opcode} req_id {req.req_id}"
            )
        if hdr.status == Status.INTERNAL:
            raise FuzzFailure(f"node reported an internal error: {resp.payload[:300]!r}")
        # Bulk on a request that takes none is refused before its payload is looked at.
        bulk_refused = (bool(req.bulk) and req.opcode not in BULK_REQUEST_OPCODES
                        and req.kind != "hello")
        if req.expect is not None and not (bulk_refused and hdr.status == Status.BAD_REQUEST):
            if hdr.status != req.expect:
                raise FuzzFailure(
                    f"expected status {req.expect.name}, got {_status_name(hdr.status)}: "
                    f"{resp.payload[:300]!r}"
                )
            return
        try:
            self._semantics(cid, req, resp)
        except ProtocolError as e:
            raise FuzzFailure(f"answer does not decode: {e}") from None

    def _semantics(self, cid: int, req: Req, resp: Resp) -> None:
        op, st = req.opcode, resp.status
        if req.bulk and op not in BULK_REQUEST_OPCODES:  # refused, bulk skipped
            _want(st, Status.BAD_REQUEST, resp, f"opcode {op} with bulk")
            return
        if op == Op.PUT:  # may be refused for its bulk: before the check for OK
            self._put(cid, req, resp)
            return
        if op == Op.GET:  # its answer carries bulk: before the check that others carry none
            self._get(req, resp)
            return
        if req.kind == "hello":
            _want(st, Status.OK, resp)
            info = decode_node_info(resp.payload)
            for name in ("version", "block_size", "pool_base", "pool_len", "node_id"):
                if getattr(info, name) != getattr(self.info, name):
                    raise FuzzFailure(f"HELLO answer changed {name}: {info}")
            return
        if op == Op.LOOKUP and st == Status.LIMIT_EXCEEDED:
            assert req.keys is not None
            self._lease_refused(cid, req.keys, bool(req.flags & LOOKUP_FLAG_LEASE), resp)
            return
        _want(st, Status.OK, resp)
        if resp.bulk:
            raise FuzzFailure(f"opcode {op} answered with {len(resp.bulk)} bulk bytes")
        if op == Op.ALLOC:
            assert req.items is not None
            self._alloc(cid, req.items, resp)
        elif op == Op.COMMIT:
            assert req.keys is not None and req.sums is not None
            strict = bool(req.flags & COMMIT_FLAG_REQUIRE_WRITTEN)
            got = decode_flags(resp.payload, len(req.keys), "COMMIT")
            for key, checksum, ok in zip(req.keys, req.sums, got, strict=True):
                p = self.pending.get(key)
                want = p is not None and p.cid == cid and (p.written or not strict)
                _same("COMMIT", key, want, ok)
                if ok:
                    assert p is not None
                    del self.pending[key]
                    self.committed[key] = replace(p.ext, extra=(checksum,))
        elif op == Op.ABORT:
            assert req.keys is not None
            got = decode_flags(resp.payload, len(req.keys), "ABORT")
            for key, ok in zip(req.keys, got, strict=True):
                p = self.pending.get(key)
                _same("ABORT", key, p is not None and p.cid == cid, ok)
                if ok:
                    del self.pending[key]
        elif op == Op.DELETE:
            assert req.keys is not None
            got = decode_flags(resp.payload, len(req.keys), "DELETE")
            for key, ok in zip(req.keys, got, strict=True):
                if key in self.victim:
                    raise FuzzFailure("fuzzer bug: DELETE of a victim key")
                _same("DELETE", key, key in self.committed, ok)
                self.committed.pop(key, None)
        elif op == Op.EXISTS:
            assert req.keys is not None
            got = decode_flags(resp.payload, len(req.keys), "EXISTS")
            for key, ok in zip(req.keys, got, strict=True):
                _same("EXISTS", key, key in self.committed, ok)
        elif op == Op.LOOKUP:
            assert req.keys is not None
            self._lookup(cid, req.keys, bool(req.flags & LOOKUP_FLAG_LEASE), resp)
        elif op == Op.RELEASE:
            assert req.ids is not None
            if len(resp.payload) != U32.size:
                raise FuzzFailure(f"RELEASE answer of {len(resp.payload)} bytes")
            (n,) = U32.unpack(resp.payload)
            mine = {i for i in req.ids if i in self.leases and self.leases[i].cid == cid}
            if n != len(mine):
                raise FuzzFailure(
                    f"RELEASE of {req.ids} released {n}; this connection held {len(mine)} "
                    "of those ids live"
                )
            for lid in mine:
                del self.leases[lid]
        elif op == Op.STATS:
            self.check_stats(decode_json(resp.payload, "STATS"), where="STATS")
        else:
            raise FuzzFailure(f"opcode {op} answered OK")

    def check_stats(self, stats: dict[str, object], *, where: str) -> None:
        want = {
            "entries": len(self.committed),
            "pending": len(self.pending),
            "leases_active": len(self.leases),
        }
        got = {k: stats.get(k) for k in want}
        if got != want:
            raise FuzzFailure(f"{where}: node counts {got}, model counts {want}")

    def _allocated(self, what: str, key: bytes, size: int, status: AllocStatus) -> bool:
        """Check one ALLOC (or PUT) item's status against the model, the items
        before it applied: True when the node allocated it (NO_SPACE is allowed
        wherever OK is, the model not knowing what eviction can free)."""
        if not 0 < size <= self.bs:
            want = AllocStatus.TOO_LARGE
        elif key in self.committed:
            want = AllocStatus.EXISTS
        elif key in self.pending:
            want = AllocStatus.BUSY
        else:
            want = AllocStatus.OK
        if status == AllocStatus.NO_SPACE and want == AllocStatus.OK:
            return False
        if status != want:
            raise FuzzFailure(
                f"{what} {key!r:.40} size {size}: node said {status.name}, expected {want.name}"
            )
        return status == AllocStatus.OK

    def _alloc(self, cid: int, items: list[AllocItem], resp: Resp) -> None:
        results = decode_extents(resp.payload, len(items))
        for (key, size, digest, extra), (status, ext) in zip(items, results, strict=True):
            if not self._allocated("ALLOC", key, size, status) or ext is None:
                continue
            if ext.length != size or ext.rkey != self.info.rkey:
                raise FuzzFailure(f"ALLOC {key!r:.40} size {size} got extent {ext}")
            start = self.block_start(ext.addr)
            if start != ext.addr:
                raise FuzzFailure(f"ALLOC handed out {ext}, not a block start in the pool")
            if ext.addr in self.held_blocks():
                raise FuzzFailure(f"ALLOC handed out block 0x{ext.addr:x}, which is still held")
            self.pending[key] = Pending(key, cid, Ext(ext.addr, size, digest, extra))
            self.content[ext.addr] = Content.unknown(size)
            if key not in self.victim:
                self.keys_seen.add(key)

    def _put(self, cid: int, req: Req, resp: Resp) -> None:
        """PUT: BAD_REQUEST unless the bulk is the sizes' sum; then each item's
        status as ALLOC's, and each OK item an extent of this connection holding
        the item's bytes, written. Where it is the answer does not say."""
        assert req.items is not None
        total = sum(size for _, size, _, _ in req.items)
        what = f"PUT of {len(req.items)} items ({total} bytes)"
        if len(req.bulk) != total:  # checked before anything is allocated
            _want(resp.status, Status.BAD_REQUEST, resp, f"{what} with {len(req.bulk)} bulk")
            return
        _want(resp.status, Status.OK, resp, what)
        if resp.bulk:
            raise FuzzFailure(f"{what} answered with {len(resp.bulk)} bulk bytes")
        statuses = decode_put_answer(resp.payload, len(req.items))
        pos = 0
        for (key, size, digest, extra), status in zip(req.items, statuses, strict=True):
            value = req.bulk[pos : pos + size]
            pos += size
            if not self._allocated("PUT", key, size, status):
                continue
            addr = self.new_unplaced()
            self.pending[key] = Pending(key, cid, Ext(addr, size, digest, extra), written=True)
            self.content[addr] = Content.of(value)
            if key not in self.victim:
                self.keys_seen.add(key)

    def _lookup(self, cid: int, keys: list[bytes], lease: bool, resp: Resp) -> None:
        results = decode_lookup_results(resp.payload, len(keys))
        hits: list[Ext] = []
        ids = set()
        for key, res in zip(keys, results, strict=True):
            ext = self.committed.get(key)
            _same("LOOKUP found", key, ext is not None, res is not None)
            if res is None or ext is None:
                continue
            if ext.addr < 0:  # a PUT's value: now the model knows where it is
                ext = self.place(key, res.extent.addr)
            got = (res.extent.addr, res.extent.length, res.digest, res.extent.rkey,
                   lookup_extra(res))
            if got != (ext.addr, ext.length, ext.digest, self.info.rkey, ext.extra):
                raise FuzzFailure(f"LOOKUP {key!r:.40}: node says {res}, model says {ext}")
            hits.append(ext)
            ids.add(res.lease_id)
        if not hits:
            return
        if not lease:
            if ids != {0}:
                raise FuzzFailure(f"LOOKUP without a lease returned lease ids {ids}")
            return
        if len(ids) != 1 or 0 in ids:
            raise FuzzFailure(f"one leased LOOKUP returned lease ids {ids}")
        (lid,) = ids
        if lid in self.lease_ids:
            raise FuzzFailure(f"LOOKUP reused lease id {lid}")
        self.lease_ids.add(lid)
        self.lease_owner[lid] = cid
        self.leases[lid] = Lease(lid, cid, hits)

    def _lease_refused(self, cid: int, keys: list[bytes], lease: bool, resp: Resp) -> None:
        """A leased LOOKUP refused whole for the session's lease limits: fine only if
        it would take the session over its quota of leased bytes, or it names a
        block the session already holds a lease on, or one block more than once
        (the per-block limit counts repeats inside one request)."""
        hits = [self.committed[k] for k in keys if k in self.committed]
        if not lease or not hits:
            raise FuzzFailure(
                f"LOOKUP refused with LIMIT_EXCEEDED but it asks for no lease on anything: "
                f"{resp.payload[:300]!r}"
            )
        mine = [e for le in self.leases.values() if le.cid == cid for e in le.exts]
        held = sum(e.length for e in mine)
        adding = sum(e.length for e in hits)
        over_quota = self.lease_quota is not None and held + adding > self.lease_quota
        pinned = {e.addr for e in mine}
        repeated = len({e.addr for e in hits}) < len(hits)  # one block asked for twice
        if not over_quota and not repeated and not any(e.addr in pinned for e in hits):
            raise FuzzFailure(
                f"LOOKUP lease refused ({resp.payload[:200]!r}) though this connection "
                f"holds {held} leased bytes (+{adding}, quota {self.lease_quota}) and no "
                "lease on any of these blocks"
            )

    def _get(self, req: Req, resp: Resp) -> None:
        """GET: a key is a hit exactly when committed with the digest asked for
        (the node pins its block and sends its bytes). No lease, no change the
        model tracks (hits become most recently used; the pool never evicts)."""
        assert req.keys is not None and req.digests is not None
        hits: list[Ext | None] = []
        for key, digest in zip(req.keys, req.digests, strict=True):
            ext = self.committed.get(key)
            hits.append(ext if ext is not None and ext.digest == digest else None)
        total = sum(e.length for e in hits if e is not None)
        what = f"GET of {len(req.keys)} keys ({total} bytes of hits)"
        if total > MAX_BULK_BYTES:  # no answer may carry that much bulk
            _want(resp.status, Status.LIMIT_EXCEEDED, resp, what)
            return
        _want(resp.status, Status.OK, resp, what)
        lengths, sums = decode_get_answer(resp.payload, len(req.keys))
        for key, ext, length, checksum in zip(req.keys, hits, lengths, sums, strict=True):
            got = (length, checksum)
            want = (0, 0) if ext is None else (ext.length, *ext.extra)
            if got != want:
                state = ("committed" if key in self.committed else
                         "uncommitted" if key in self.pending else "unknown")
                raise FuzzFailure(
                    f"GET {key!r:.40} ({state}): node says length {length} checksum "
                    f"{checksum:#x}, model says {'miss' if ext is None else ext}"
                )
        if len(resp.bulk) != total:
            raise FuzzFailure(f"{what} answered {len(resp.bulk)} bulk bytes")
        pos = 0
        for ext in hits:
            if ext is None:
                continue
            c = self.content.get(ext.addr)
            if c is not None:
                self.bytes_verified += _compare(c, 0, resp.bulk[pos : pos + ext.length],
                                                ext.addr, "GET")
            pos += ext.length


def lookup_extra(res: LookupResult) -> tuple[int, ...]:
    """The fields of a LOOKUP hit after the digest (what ALLOC stored after it)."""
    extra: tuple[object, ...] = tuple(res)[3:]
    return tuple(x for x in extra if isinstance(x, int))


def _compare(c: Content, off: int, got: bytes, addr: int, what: str) -> int:
    """Every byte of ``got`` (read at value offset ``off``) the model knows must
    match; returns how many were checked."""
    n = len(got)
    known = c.known[off : off + n]
    unknown = known.count(0)
    if unknown == n:
        return 0
    want = c.data[off : off + n]
    if unknown == 0 and got == want:
        return n
    for i in range(n):
        if known[i] and got[i] != want[i]:
            where = f"0x{addr:x}" if addr >= 0 else "a PUT's extent (address not known)"
            raise FuzzFailure(
                f"{what} at {where}: byte {off + i} of the value is {got[i]:#x}, "
                f"expected {want[i]:#x} (wrong value)"
            )
    return n - unknown


def _status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return str(status)


def _want(got: int, want: Status, resp: Resp, what: str = "") -> None:
    if got != want:
        raise FuzzFailure(
            f"{what or 'request'}: expected {want.name}, got {_status_name(got)}: "
            f"{resp.payload[:300]!r}"
        )


def _same(what: str, key: bytes, want: bool, got: bool) -> None:
    if want != got:
        raise FuzzFailure(f"{what} {key!r:.40}: node said {got}, model says {want}")
