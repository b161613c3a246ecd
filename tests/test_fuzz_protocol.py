"""The protocol fuzzer (rdmakv.fuzz): a bounded run against a real node, and its parts.

``test_fuzz_real_node`` is the CI run: ``RDMAKV_FUZZ_FRAMES`` frames (default
3000) from fixed Hypothesis seeds and no example database, so every run sends
the same frames; it prints the frame count and time. The other tests check
the fuzzer itself without a node: that what the strategies say about a frame
(well-formed, or the status it must get) agrees with rdmakv.wire's
decoders, that the model rejects wrong answers, and that the reply parser
rejects broken response streams. The ``test_bug_*`` test reproduces a node
bug the fuzzer found and that is fixed (rdmakv.fuzz.strategies.KNOWN_BUGS,
whose input classes the default fuzz keeps sending).
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import NodeProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmakv.errors import ProtocolError
from rdmakv.fuzz import FuzzConfig, FuzzFailure, frames_from_env, run_fuzz
from rdmakv.fuzz import strategies as S
from rdmakv.fuzz.harness import replay
from rdmakv.fuzz.reference_node import Content, Ext, Model, Pending
from rdmakv.fuzz.wire import (
    ALLOC_EXTRA,
    LOOKUP_EXTRA,
    Req,
    Resp,
    parse_frames,
    raw_alloc,
    raw_commit,
    raw_get,
)
from rdmakv.wire.batches import (
    decode_alloc,
    decode_commit,
    decode_extents,
    decode_get,
    decode_keys,
    decode_u64_list,
    encode_flags,
    encode_get_answer,
    encode_keys,
    encode_put_answer,
)
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    COMMIT_FLAG_REQUIRE_WRITTEN,
    HEADER,
    LOOKUP_ENTRY,
    LOOKUP_FLAG_LEASE,
    MAX_BULK_BYTES,
    RESPONSE_BIT,
    U32,
    AllocStatus,
    Header,
    LimitExceeded,
    NodeInfo,
    Op,
    Status,
    encode_hello,
)

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16 * 1024
BASE = 0x7F00_0000_0000
POOL = 2048 * BLOCK

VIEW = S.View(
    block_size=BLOCK,
    pool_base=BASE,
    pool_len=POOL,
    token=b"t0ken",
    victim_keys=(b"victim/a", b"victim/b"),
    own_keys=(b"fz-1", b"fz-2"),
    committed_keys=(b"fz-9",),
    own_leases=(3, 4),
    other_leases=(9,),
    key_digests=((b"victim/a", b"A" * 16, 100), (b"fz-1", b"1" * 16, 100),
                 (b"fz-9", b"9" * 16, 1)),
)


def test_fuzz_real_node(tmp_path: Path) -> None:
    frames = frames_from_env()
    report = run_fuzz(FuzzConfig(frames=frames, workdir=tmp_path))
    print(
        f"\nfuzz: {report.frames} frames ({report.examples} examples, {report.connections} "
        f"connections, {report.mutated} mutated) in {report.seconds:.1f}s; "
        f"{report.bytes_verified} bytes read back verified; answers {dict(report.answers)}"
    )
    assert report.frames >= frames
    if frames >= 1000:  # a run that long must have exercised every kind of answer
        answers = set(report.answers)
        for op in ("ALLOC", "COMMIT", "ABORT", "LOOKUP", "RELEASE", "DELETE", "EXISTS",
                   "STATS", "GET", "PUT", "HELLO"):
            assert f"{op} OK" in answers, op
        for refusal in ("ALLOC BAD_REQUEST", "GET BAD_REQUEST", "PUT BAD_REQUEST",
                        "unknown UNKNOWN_OPCODE"):
            assert refusal in answers, refusal
        assert {"AUTH_FAILED", "NOT_AUTHENTICATED", "FRAME_TOO_LARGE", "LIMIT_EXCEEDED"} <= set(
            report.statuses
        )
        assert report.mutated > 0 and report.bytes_verified > 0


def test_cli_runs_and_prints_totals(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "rdmakv.fuzz", "--frames", "60", "--progress", "0",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["frames"] >= 60 and out["examples"] >= 1 and out["seconds"] > 0


# -- the strategies agree with rdmakv.wire -----------------------------------------------


def _decode(req: Req) -> object:
    if req.kind == "keys":
        return decode_keys(req.payload, "keys")
    if req.kind == "commit":
        return decode_commit(req.payload)
    if req.kind == "alloc":
        return decode_alloc(req.payload)
    if req.kind == "put":
        return decode_alloc(req.payload, "PUT")
    if req.kind == "get":
        return decode_get(req.payload)
    assert req.kind == "ids"
    return decode_u64_list(req.payload, "ids")


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_strategy_tags_match_the_protocol_decoders(data: st.DataObject) -> None:
    """A frame tagged well-formed decodes to exactly its items; one tagged
    LIMIT_EXCEEDED makes the decoder raise LimitExceeded; one tagged BAD_REQUEST
    another ProtocolError, or it is a PUT whose bulk disagrees with its sizes
    (the node answers those statuses for exactly these errors). A well-formed
    PUT's bulk is its items' values: the sizes' sum."""
    req = data.draw(S.frames(VIEW))
    kinds = ("keys", "commit", "alloc", "put", "get", "ids")
    if req.kind not in kinds or req.fatal:
        return
    if req.expect is None:
        items = [(k, n, d, *extra) for k, n, d, extra in req.items or []]
        want = {"keys": req.keys, "ids": req.ids, "alloc": items,
                "put": items, "commit": (req.keys, req.sums),
                "get": (req.keys, req.digests)}[req.kind]
        assert _decode(req) == want
        if req.kind == "put":
            assert len(req.bulk) == sum(n for _, n, _, _ in req.items or [])
    elif req.expect == Status.LIMIT_EXCEEDED:
        with pytest.raises(LimitExceeded):
            _decode(req)
    else:
        assert req.expect == Status.BAD_REQUEST
        try:
            ops = _decode(req)
        except LimitExceeded:
            pytest.fail("tagged BAD_REQUEST but the count is over the limit")
        except ProtocolError:
            return
        assert isinstance(ops, list)
        assert req.opcode == Op.PUT
        assert sum(n for _, n, _ in ops) != len(req.bulk)


@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_destructive_and_mutation_frames_never_name_the_victim(data: st.DataObject) -> None:
    req = data.draw(S.keys_frame(VIEW, Op.DELETE))
    safe = S.View(**{**VIEW.__dict__, "victim_keys": (), "destructive_ok": False})
    raw, _ = data.draw(S.mutated(S.frames(safe)))
    for key in VIEW.victim_keys:
        assert key not in (req.keys or []) and key not in req.payload
        assert key not in raw


# -- the model rejects wrong answers -------------------------------------------------------------


def _model() -> Model:
    info = NodeInfo(1, 0, BLOCK, BASE, POOL, b"n" * 16, 1, 1, 1, 1, ("tcp",))
    m = Model(info)
    m.victim[b"victim/a"] = b"v"
    m.committed[b"victim/a"] = Ext(BASE, 1, b"d" * 16, (0,) * LOOKUP_EXTRA)
    return m


def _resp(req: Req, payload: bytes, status: int = Status.OK, **kw: int) -> Resp:
    hdr = Header(kw.get("opcode", req.opcode | RESPONSE_BIT), 0, status, len(payload), 0,
                 kw.get("req_id", req.req_id))
    return Resp(hdr, payload)


def test_model_accepts_right_answers_and_rejects_wrong_ones() -> None:
    m = _model()
    exists = Req(Op.EXISTS, encode_keys([b"victim/a", b"nope"]), "keys",
                 keys=[b"victim/a", b"nope"], req_id=5)
    m.check(1, exists, _resp(exists, encode_flags([True, False])))
    with pytest.raises(FuzzFailure, match="EXISTS"):
        m.check(1, exists, _resp(exists, encode_flags([True, True])))
    with pytest.raises(FuzzFailure, match="out of sync"):
        m.check(1, exists, _resp(exists, encode_flags([True, False]), req_id=6))
    with pytest.raises(FuzzFailure, match="does not decode"):
        m.check(1, exists, _resp(exists, encode_flags([True])))
    with pytest.raises(FuzzFailure, match="internal error"):
        m.check(1, exists, _resp(exists, b"boom", Status.INTERNAL))
    # ALLOC must never hand out a block someone holds (here: the victim's)
    items = [(b"k", 10, b"x" * 16, (5,) * ALLOC_EXTRA)]
    alloc = Req(Op.ALLOC, raw_alloc(items), "alloc", items=items)
    held = U32.pack(1) + bytes([0]) + BASE.to_bytes(8, "little") + (10).to_bytes(4, "little")
    with pytest.raises(FuzzFailure, match="still held"):
        m.check(1, alloc, _resp(alloc, held + bytes(4)))
    free = U32.pack(1) + bytes([0]) + (BASE + BLOCK).to_bytes(8, "little")
    m.check(1, alloc, _resp(alloc, free + (10).to_bytes(4, "little") + bytes(4)))
    assert decode_extents(free + (10).to_bytes(4, "little") + bytes(4), 1)[0].extent
    # RELEASE counts only the connection's own live leases, each once
    look = Req(Op.LOOKUP, encode_keys([b"victim/a"]), "keys", keys=[b"victim/a"],
               flags=LOOKUP_FLAG_LEASE)
    entry = LOOKUP_ENTRY.pack(1, BASE, 1, 0, 77, b"d" * 16, *(0,) * LOOKUP_EXTRA)
    m.check(1, look, _resp(look, U32.pack(1) + entry))
    rel = Req(Op.RELEASE, U32.pack(3) + bytes(24), "ids", ids=[77, 77, 5])
    with pytest.raises(FuzzFailure, match="released 2"):
        m.check(1, rel, _resp(rel, U32.pack(2)))
    m.check(1, rel, _resp(rel, U32.pack(1)))


def _get_resp(req: Req, lengths: list[int], sums: list[int], bulk: bytes,
              status: int = Status.OK) -> Resp:
    payload = encode_get_answer(lengths, sums) if status == Status.OK else b"refused"
    hdr = Header(req.opcode | RESPONSE_BIT, 0, status, len(payload), len(bulk), req.req_id)
    return Resp(hdr, payload, bulk)


def test_model_checks_get_answers() -> None:
    """GET hits exactly the committed keys asked with their digest; lengths,
    checksums and bulk must say so; the bytes are checked; bulk on a GET
    request is refused; hits over MAX_BULK_BYTES are refused."""
    m = _model()
    m.content[BASE] = Content.of(b"v")
    m.committed[b"victim/a"] = Ext(BASE, 1, b"d" * 16, (7,))
    m.pending[b"p"] = Pending(b"p", 1, Ext(BASE + BLOCK, 5, b"p" * 16), written=True)
    keys = [b"victim/a", b"nope", b"victim/a", b"victim/a", b"p"]
    digests = [b"d" * 16, b"d" * 16, b"d" * 16, b"e" * 16, b"p" * 16]
    get = Req(Op.GET, raw_get(keys, digests), "get", keys=keys, digests=digests, req_id=3)
    m.check(1, get, _get_resp(get, [1, 0, 1, 0, 0], [7, 0, 7, 0, 0], b"vv"))
    assert m.bytes_verified == 2
    for lengths, sums, bulk, match in (
        ([1, 0, 1, 1, 0], [7, 0, 7, 7, 0], b"vvv", "model says miss"),  # digest mismatch
        ([1, 0, 1, 0, 5], [7, 0, 7, 0, 0], b"vv12345", "uncommitted"),  # pending key
        ([1, 1, 1, 0, 0], [7, 7, 7, 0, 0], b"vvv", "unknown"),  # unknown key
        ([1, 0, 1, 0, 0], [7, 0, 8, 0, 0], b"vv", "checksum"),  # not what COMMIT stored
        ([1, 0, 1, 0, 0], [7, 0, 7, 0, 0], b"v", "bulk"),  # bulk short of the hits
        ([1, 0, 1, 0, 0], [7, 0, 7, 0, 0], b"vx", "wrong value"),  # bytes not the value's
    ):
        with pytest.raises(FuzzFailure, match=match):
            m.check(1, get, _get_resp(get, lengths, sums, bulk))
    with pytest.raises(FuzzFailure, match="does not decode"):
        m.check(1, get, _get_resp(get, [1, 0, 1, 0], [7, 0, 7, 0], b"vv"))
    # a GET request carries no bulk: refused, whatever it asks
    with_bulk = Req(Op.GET, get.payload, "get", keys=keys, digests=digests, bulk=b"x")
    with pytest.raises(FuzzFailure, match="with bulk"):
        m.check(1, with_bulk, _get_resp(with_bulk, [1, 0, 1, 0, 0], [7, 0, 7, 0, 0], b"vv"))
    m.check(1, with_bulk, _get_resp(with_bulk, [], [], b"", Status.BAD_REQUEST))
    # hits over MAX_BULK_BYTES: LIMIT_EXCEEDED, not an answer over the frame limit
    m.committed[b"big"] = Ext(BASE + 2 * BLOCK, 2 * BLOCK, b"b" * 16, (0,))
    n = MAX_BULK_BYTES // (2 * BLOCK) + 1
    big = Req(Op.GET, raw_get([b"big"], [b"b" * 16], repeat=n), "get", keys=[b"big"] * n,
              digests=[b"b" * 16] * n)
    m.check(1, big, _get_resp(big, [], [], b"", Status.LIMIT_EXCEEDED))
    with pytest.raises(FuzzFailure, match="LIMIT_EXCEEDED"):
        m.check(1, big, _get_resp(big, [], [], b"", Status.BAD_REQUEST))


def _put_resp(req: Req, statuses: list[AllocStatus], status: int = Status.OK,
              bulk: bytes = b"") -> Resp:
    payload = encode_put_answer(statuses) if status == Status.OK else b"refused"
    hdr = Header(req.opcode | RESPONSE_BIT, 0, status, len(payload), len(bulk), req.req_id)
    return Resp(hdr, payload, bulk)


def _put_model() -> Model:
    """The victim's key at BASE, another connection's (2) uncommitted key at the next block."""
    m = _model()
    m.content[BASE] = Content.of(b"v")
    m.pending[b"p"] = Pending(b"p", 2, Ext(BASE + BLOCK, 5, b"p" * 16))
    return m


def test_model_checks_put_answers() -> None:
    """PUT's statuses are ALLOC's item by item (an earlier item of the same PUT
    makes a key BUSY; NO_SPACE tolerated); each OK item is a written extent of
    the connection holding the bytes sent: COMMIT require_written commits it,
    GET gives those bytes back, before and after a leased LOOKUP places it; a bulk
    that is not the sizes' sum is BAD_REQUEST; no bulk comes back; PUT's bulk
    is not 'bulk on a request that takes none'."""
    E, K, B, T = AllocStatus.EXISTS, AllocStatus.OK, AllocStatus.BUSY, AllocStatus.TOO_LARGE
    items = [(b"new", 3, b"n" * 16, ()), (b"victim/a", 2, b"d" * 16, ()),
             (b"p", 1, b"p" * 16, ()), (b"big", BLOCK + 1, b"b" * 16, ()),
             (b"new", 2, b"n" * 16, ()), (b"zero", 0, b"z" * 16, ())]
    bulk = b"abc" + b"xy" + b"z" + bytes(BLOCK + 1) + b"qq"
    put = Req(Op.PUT, raw_alloc(items), "put", items=items, bulk=bulk, req_id=4)
    right = [K, E, B, T, B, T]
    for statuses, status, answer_bulk, match in (
        ([E, E, B, T, B, T], Status.OK, b"", "node said EXISTS, expected OK"),
        ([K, K, B, T, B, T], Status.OK, b"", "node said OK, expected EXISTS"),  # victim's key
        ([K, E, K, T, B, T], Status.OK, b"", "node said OK, expected BUSY"),  # another's key
        ([K, E, B, K, B, T], Status.OK, b"", "expected TOO_LARGE"),  # over the block size
        ([K, E, B, T, K, T], Status.OK, b"", "expected BUSY"),  # allocated by item 0
        ([K, E, B, T, B], Status.OK, b"", "does not decode"),  # one status short
        ([*right, K], Status.OK, b"", "does not decode"),  # one too many
        (right, Status.OK, b"x", "bulk"),  # answers carry no bulk
        ([], Status.BAD_REQUEST, b"", "expected OK"),  # a well-formed PUT
    ):
        with pytest.raises(FuzzFailure, match=match):
            _put_model().check(1, put, _put_resp(put, statuses, status, answer_bulk))
    m = _put_model()
    full = AllocStatus.NO_SPACE  # tolerated where OK is due (then the key is not BUSY)
    m.check(1, put, _put_resp(put, [full, E, B, T, full, T]))
    assert b"new" not in m.pending
    m = _put_model()
    m.check(1, put, _put_resp(put, right))
    p = m.pending[b"new"]
    assert p.cid == 1 and p.written and p.ext.length == 3 and p.ext.addr < 0
    assert bytes(m.content[p.ext.addr].data) == b"abc" and b"new" in m.keys_seen
    # its bulk is not bulk on a request that takes none; one the sizes disagree with is
    for lie in (bulk[:-1], bulk + b"!"):
        short = Req(Op.PUT, put.payload, "put", items=items, bulk=lie)
        _put_model().check(1, short, _put_resp(short, [], Status.BAD_REQUEST))
        with pytest.raises(FuzzFailure, match="BAD_REQUEST"):
            _put_model().check(1, short, _put_resp(short, right))
    over = Req(Op.PUT, put.payload, "put", bulk=bulk, expect=Status.LIMIT_EXCEEDED)
    with pytest.raises(FuzzFailure, match="expected status LIMIT_EXCEEDED"):
        _put_model().check(1, over, _put_resp(over, [], Status.BAD_REQUEST))
    # COMMIT require_written commits it (only on its own connection) ...
    commit = Req(Op.COMMIT, raw_commit([b"new"], [9]), "commit", keys=[b"new"], sums=[9],
                 flags=COMMIT_FLAG_REQUIRE_WRITTEN)
    with pytest.raises(FuzzFailure, match="COMMIT"):
        m.check(1, commit, _resp(commit, encode_flags([False])))
    with pytest.raises(FuzzFailure, match="COMMIT"):
        m.check(2, commit, _resp(commit, encode_flags([True])))
    m.check(1, commit, _resp(commit, encode_flags([True])))
    assert m.committed[b"new"].extra == (9,) and b"new" not in m.pending
    # ... then GET gives the PUT's bytes back, with COMMIT's checksum
    get = Req(Op.GET, raw_get([b"new"], [b"n" * 16]), "get", keys=[b"new"], digests=[b"n" * 16])
    verified = m.bytes_verified
    m.check(1, get, _get_resp(get, [3], [9], b"abc"))
    assert m.bytes_verified == verified + 3
    with pytest.raises(FuzzFailure, match="wrong value"):
        m.check(1, get, _get_resp(get, [3], [9], b"abd"))
    # a leased LOOKUP says where it is (never a block someone holds); its bytes move along
    look = Req(Op.LOOKUP, encode_keys([b"new"]), "keys", keys=[b"new"], flags=LOOKUP_FLAG_LEASE)
    for addr, lease in ((BASE, 40), (BASE + 3 * BLOCK, 41)):
        entry = LOOKUP_ENTRY.pack(1, addr, 3, 0, lease, b"n" * 16, *(9,) * LOOKUP_EXTRA)
        if addr == BASE:  # the victim's block
            with pytest.raises(FuzzFailure, match="not a free block"):
                copy.deepcopy(m).check(1, look, _resp(look, U32.pack(1) + entry))
            continue
        m.check(1, look, _resp(look, U32.pack(1) + entry))
    assert m.committed[b"new"].addr == BASE + 3 * BLOCK
    verified = m.bytes_verified
    m.check(1, get, _get_resp(get, [3], [9], b"abc"))
    assert m.bytes_verified == verified + 3
    with pytest.raises(FuzzFailure, match="wrong value"):
        m.check(1, get, _get_resp(get, [3], [9], b"xbc"))


def test_put_frames_carry_their_values() -> None:
    """PUT frames are mostly well-formed with the values as bulk (some sizes over
    the block size, drained), sometimes with a bulk the sizes disagree with
    (BAD_REQUEST); no bulk is ever big. A clean put is PUT, COMMIT
    (require_written) and GET of the same keys, each well-formed."""
    seen = {"ok": 0, "over_block": 0, "bad_bulk": 0}
    biggest = 0

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(S.put_frame(VIEW))
    def count(req: Req) -> None:
        nonlocal biggest
        biggest = max(biggest, len(req.bulk))
        if req.expect is None:
            assert req.items is not None
            assert len(req.bulk) == sum(n for _, n, _, _ in req.items)
            seen["ok"] += 1
            seen["over_block"] += any(n > BLOCK for _, n, _, _ in req.items)
        elif req.expect == Status.BAD_REQUEST and not req.fatal:
            try:
                items = decode_alloc(req.payload, "PUT")
            except ProtocolError:
                return
            assert sum(n for _, n, _ in items) != len(req.bulk)
            seen["bad_bulk"] += 1

    count()
    assert seen["ok"] > 150 and seen["over_block"] > 0 and seen["bad_bulk"] > 0, seen
    assert biggest <= 2 * 1024 * 1024

    @settings(max_examples=50, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(S.clean_put(VIEW))
    def clean(reqs: list[Req]) -> None:
        put, commit, get = reqs
        assert [r.opcode for r in reqs] == [Op.PUT, Op.COMMIT, Op.GET]
        assert put.expect is None and put.items is not None
        keys = [k for k, _, _ in decode_alloc(put.payload, "PUT")]
        assert len(put.bulk) == sum(n for _, n, _, _ in put.items)
        assert decode_commit(commit.payload) == (keys, commit.sums) == (commit.keys, commit.sums)
        assert commit.flags == COMMIT_FLAG_REQUIRE_WRITTEN
        assert decode_get(get.payload) == (keys, get.digests)

    clean()


def test_get_frames_mostly_ask_for_the_stored_digest() -> None:
    """GET frames name the keys the view knows with their stored digest (hits
    when committed) most of the time, and with another digest sometimes."""
    stored = {k: d for k, d, _ in VIEW.key_digests}
    right = wrong = 0

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(S.get_frame(VIEW))
    def count(req: Req) -> None:
        nonlocal right, wrong
        for key, digest in zip(req.keys or [], req.digests or [], strict=True):
            if key in stored:
                if digest == stored[key]:
                    right += 1
                else:
                    wrong += 1

    count()
    assert right > 2 * wrong > 0


def test_reply_parser_rejects_broken_streams() -> None:
    out: list[Resp] = []
    buf = bytearray(HEADER.pack(Op.EXISTS | RESPONSE_BIT, 0, 0, 5, 0, 1) + encode_flags([True]))
    buf += HEADER.pack(Op.EXISTS | RESPONSE_BIT, 0, 0, 5, 0, 2) + b"\x01"  # partial
    parse_frames(buf, out)
    assert len(out) == 1 and len(buf) == HEADER.size + 1
    for bad in (
        HEADER.pack(Op.EXISTS, 0, 0, 0, 0, 1),  # no response bit
        HEADER.pack(Op.GET | RESPONSE_BIT, 0, 0, 0, MAX_BULK_BYTES + 1, 1),
        HEADER.pack(Op.GET | RESPONSE_BIT, 0, 999, 0, 0, 1),  # unknown status
        HEADER.pack(Op.GET | RESPONSE_BIT, 0, Status.BAD_REQUEST, 0, 10, 1),  # error + bulk
    ):
        with pytest.raises(FuzzFailure):
            parse_frames(bytearray(bad), [])


def test_replay_sends_a_failure_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hello = encode_hello(b"tok")
    exists = encode_keys([b"a"])
    lines = [
        "# a comment",
        f"token {b'tok'.hex()}",
        f"send 1 {(HEADER.pack(Op.HELLO, 0, 0, len(hello), 0, 1) + hello).hex()}",
        f"send 1 {(HEADER.pack(Op.EXISTS, 0, 0, len(exists), 0, 2) + exists).hex()}",
        f"send 2 {HEADER.pack(Op.EXISTS, 0, 0, 0, 0, 3).hex()}",  # before HELLO: refused
        "close 1",
    ]
    path = tmp_path / "failure.txt"
    path.write_text("\n".join(lines) + "\n")
    assert replay(path) == 0
    out = capsys.readouterr().out
    assert "send c1: op=136 OK req_id=2" in out
    assert "NOT_AUTHENTICATED" in out and "node alive" in out


# -- node bugs the fuzzer found, fixed (their reproducers stay as regression tests) --------


def _hello(node: NodeProcess) -> Channel:
    sock = socket.create_connection(node.address, timeout=10)
    ch = Channel(sock)
    payload = encode_hello(None)
    sock.sendall(HEADER.pack(Op.HELLO, 0, 0, len(payload), 0, 1) + payload)
    hdr = ch.recv_header()
    ch.recv_payload(hdr)
    assert hdr.status == Status.OK
    return ch


@pytest.mark.timeout(60)
def test_bug_control_request_bulk_is_parsed_as_a_frame(
    node_factory: Callable[..., NodeProcess],
) -> None:
    ch = _hello(node_factory(block_size="16KiB"))
    payload = encode_keys([b"a"])
    smuggled = HEADER.pack(Op.STATS, 0, 0, 0, 0, 777)  # 24 bulk bytes that look like a frame
    ch.sock.sendall(HEADER.pack(Op.EXISTS, 0, 0, len(payload), len(smuggled), 2)
                    + payload + smuggled)
    hdr = ch.recv_header()
    ch.recv_payload(hdr)
    assert hdr.req_id == 2
    ch.sock.settimeout(1.0)
    with pytest.raises(TimeoutError):  # nothing else may come: the bulk is not a request
        extra = ch.recv_header()
        pytest.fail(f"the node answered the bulk as a request: {extra}")
