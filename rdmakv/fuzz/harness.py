"""The fuzz harness: a real ``rdmakv serve``, a victim with data on it, and the frames.

:class:`Target` starts a node (``--port 0``, a token required, tcp, a pool
large enough that the fuzzer never makes it evict), stores the victim's
values through a real :class:`~rdmakv.client.node_client.KVClient` and learns their
extents. Each Hypothesis example (:meth:`Target.run_example`) then opens
connections and sends about ``frames_per_example`` frames through them:
single requests and pipelined batches on authenticated connections (among
them a correct client's leased LOOKUP and GET of the victim's values, and its
put: PUT, COMMIT and GET of fresh keys pipelined), handshakes of every kind
on fresh ones (the unauthenticated path), and mutated frames after which the
connection is half-closed. Every answer is checked by
:class:`~rdmakv.fuzz.reference_node.Model`.

After each example every fuzzer connection is closed (waiting until the node
ended its session), and the node must: be alive; hold exactly the entries,
uncommitted extents (0) and leases (0) the model says; have evicted nothing;
give the victim back every value byte for byte through the ordinary client;
have logged no traceback. The fuzzer's own committed keys are deleted so the
next example starts from the victim's data alone.

A failure raises :class:`~rdmakv.fuzz.wire.FuzzFailure` whose message ends
with the example's transcript (frames sent, answers got), and the example is
written to ``<workdir>/failure-<n>.txt``: the error and transcript as ``#``
lines, the token, then ``send <cid> <hex>`` / ``shut <cid>`` / ``close <cid>``
lines, which :func:`replay` sends to a fresh node without Hypothesis.
Hypothesis replays a failing example once more (on a fresh node: a failure
leaves the target dirty), so there are usually two files; the later one
started from a clean node.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmakvError
from rdmakv.fuzz import strategies as S
from rdmakv.fuzz.reference_node import Content, Ext, Model, lookup_extra
from rdmakv.fuzz.wire import Conn, Exchange, FuzzFailure, Req, Resp, raw_keys
from rdmakv.node.process import LocalNodeProcess
from rdmakv.wire.batches import decode_flags, decode_json, decode_lookup_results
from rdmakv.wire.format import (
    DIGEST_LEN,
    HELLO_FIXED,
    MAGIC,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    Op,
    Status,
    decode_node_info,
)

ENV_FRAMES = "RDMAKV_FUZZ_FRAMES"
DEFAULT_FRAMES = 3000
FRAMES_PER_EXAMPLE = 25
EXAMPLES_PER_ROUND = 500
"""Hypothesis runs this many examples per seed, then the next seed: memory stays
bounded on long runs and each round is reproducible on its own."""
MAX_CONNS = 4
SETTLE_TIMEOUT_S = 10.0
TRANSCRIPT_TAIL = 40
VICTIM_KEYS = 16
LEASE_TIMEOUT_S = 3600.0  # leases never expire mid-example: the model has no clock
ROOMY_LIMITS = """\
node:
  handshake_timeout_s: 3600
  idle_timeout_s: 3600
  max_sessions: 100000
  max_sessions_per_source: 100000
  max_unauthenticated: 100000
  max_unauthenticated_per_source: 100000
"""
CONTROL_CID = 0

ACTIONS = (
    ("frame", 10),
    ("pipeline", 3),
    ("open", 1),
    ("close", 1),
    ("handshake", 2),
    ("mutate", 1),
    ("victim_get", 1),
    ("clean_put", 1),
)
ACTION_STRATEGY = st.sampled_from([a for a, w in ACTIONS for _ in range(w)])
CONN_INDEX = st.integers(0, MAX_CONNS - 1)


@dataclass
class FuzzConfig:
    """One fuzz run. ``seed``: the first round's Hypothesis seed (round r uses seed + r)."""

    frames: int = DEFAULT_FRAMES
    frames_per_example: int = FRAMES_PER_EXAMPLE
    seed: int = 0
    known_bugs: frozenset[str] = frozenset(S.KNOWN_BUGS)  # strategies.KNOWN_BUGS classes sent
    pool_size: str = "32MiB"
    block_size: str = "16KiB"
    victim_keys: int = VICTIM_KEYS
    progress_s: float = 0.0  # > 0: a progress line on ``progress`` this often
    progress: TextIO | None = None  # default: sys.stderr
    workdir: Path | None = None  # node stderr, token, failure transcripts (default: a temp dir)


@dataclass
class FuzzReport:
    """Totals of a run (``frames`` counts every frame sent, handshakes included)."""

    frames: int = 0
    examples: int = 0
    connections: int = 0
    handshakes: int = 0
    mutated: int = 0
    fatal: int = 0
    pipelined: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)  # "OPCODE STATUS" of checked answers
    seconds: float = 0.0
    node_rss_kib: int = 0
    bytes_verified: int = 0  # bytes GET returned that the model knew and checked

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["statuses"] = dict(sorted(self.statuses.items()))
        out["answers"] = dict(sorted(self.answers.items()))
        out["frames_per_s"] = round(self.frames / self.seconds, 1) if self.seconds else 0.0
        out["seconds"] = round(self.seconds, 2)
        return out


def frames_from_env(default: int = DEFAULT_FRAMES) -> int:
    raw = os.environ.get(ENV_FRAMES, "")
    try:
        return max(1, int(raw)) if raw else default
    except ValueError:
        raise RdmakvError(f"{ENV_FRAMES}={raw!r} is not an integer") from None


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 when unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Example:
    """The connections and transcript of one Hypothesis example."""

    def __init__(self) -> None:
        self.conns: list[Conn] = []
        self.frames = 0
        self.lines: list[str] = []
        self.sent: list[str] = []  # replayable: "send <cid> <hex>", "shut <cid>", "close <cid>"
        self.mutated = False

    def send(self, cid: int, raw: bytes) -> None:
        self.sent.append(f"send {cid} {raw.hex()}")

    def log(self, line: str) -> None:
        self.lines.append(line)

    def transcript(self) -> str:
        tail = self.lines[-TRANSCRIPT_TAIL:]
        skipped = len(self.lines) - len(tail)
        head = [f"  ... {skipped} earlier lines"] if skipped else []
        return "\n".join(head + ["  " + ln for ln in tail])


class Target:
    """A node under fuzz, its victim client and the model. Use as a context manager."""

    def __init__(self, cfg: FuzzConfig) -> None:
        self.cfg = cfg
        self.report = FuzzReport()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if cfg.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rdmakv-fuzz-")
            self.workdir = Path(self._tmp.name)
        else:
            self.workdir = cfg.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = b"fuzz-token-" + os.urandom(8).hex().encode()
        self.node: LocalNodeProcess | None = None
        self.victim: KVClient | None = None
        self.slab: Slab | None = None
        self.control: Conn | None = None
        self.model: Model | None = None
        self._next_cid = CONTROL_CID + 1
        self._stderr_pos = 0
        self._failures = 0
        self._t0 = time.monotonic()
        self._last_progress = self._t0
        self._evictions0 = 0
        self.victim_digests: dict[bytes, bytes] = {}
        self._dirty = False

    # -- node and victim ------------------------------------------------------------------------
    def start(self) -> None:
        token_file = self.workdir / "token"
        token_file.write_bytes(self.token)
        # The connection limits close idle and unauthenticated connections on their
        # own schedule (tests/test_node_limits.py checks that); the model checks
        # answers to frames, so its node gives them room.
        limits = self.workdir / "limits.yaml"
        limits.write_text(ROOMY_LIMITS)
        self.node = LocalNodeProcess(
            {
                "pool-size": self.cfg.pool_size,
                "block-size": self.cfg.block_size,
                "transport": "tcp",
                "lease-timeout": str(LEASE_TIMEOUT_S),
                "token-file": str(token_file),
                "config": str(limits),
            },
            stderr_path=self.workdir / "node.stderr",
            extra_args=["--no-lock"],
        )
        self._stderr_pos = (self.workdir / "node.stderr").stat().st_size
        self.control = Conn(self.node.address, CONTROL_CID)
        info = decode_node_info(self._control(self._hello_req()).payload)
        self.control.authenticated = True
        self.model = Model(info)
        self._store_victim()
        stats = self._victim().stats()
        self._evictions0 = int(stats.get("evictions", 0))
        quota = stats.get("lease_quota_bytes")
        self.model.lease_quota = int(quota) if quota is not None else None

    def _hello_req(self) -> Req:
        payload = HELLO_FIXED.pack(MAGIC, PROTOCOL_VERSION, len(self.token)) + self.token
        return Req(Op.HELLO, payload, "hello", req_id=1)

    def _victim(self) -> KVClient:
        assert self.victim is not None
        return self.victim

    def _store_victim(self) -> None:
        """Put the victim's values through KVClient and learn their extents (no lease)."""
        assert self.node is not None and self.model is not None
        bs = self.model.bs
        n = self.cfg.victim_keys
        self.slab = Slab(2 * n * bs, bs, lock=False)
        self.victim = KVClient(*self.node.address, self.slab, token=self.token, transport="tcp")
        rng = random.Random(1234)
        keys = [b"victim/" + rng.randbytes(16) for _ in range(n)]
        values = [rng.randbytes(rng.choice([1, bs, rng.randint(1, bs)])) for _ in range(n)]
        digests = [hashlib.blake2b(v, digest_size=DIGEST_LEN).digest() for v in values]
        handles = self.slab.alloc_many(n)
        for h, v in zip(handles, values, strict=True):
            self.slab.view(h)[: len(v)] = v
        stored = self.victim.put(keys, handles, [len(v) for v in values], digests)
        for h in handles:
            self.slab.decref(h)
        if not all(stored):
            raise FuzzFailure(f"the victim could not store its values: {stored}")
        payload = raw_keys(keys)
        found = decode_lookup_results(self._control(Req(Op.LOOKUP, payload)).payload, n)
        for key, value, digest, res in zip(keys, values, digests, found, strict=True):
            if res is None or res.digest != digest or res.extent.length != len(value):
                raise FuzzFailure(f"victim key {key!r} not stored as put: {res}")
            self.model.victim[key] = value
            self.model.committed[key] = Ext(res.extent.addr, len(value), digest,
                                            lookup_extra(res))
            self.model.content[res.extent.addr] = Content.of(value)
        self.victim_digests = dict(zip(keys, digests, strict=True))

    def check_victim(self) -> None:
        """Every victim value comes back byte for byte through the ordinary client."""
        assert self.model is not None and self.slab is not None
        keys = list(self.model.victim)
        handles = self.slab.alloc_many(len(keys))
        try:
            for h in handles:
                self.slab.view(h)[:] = b"\x00" * self.slab.block_size
            sizes = self._victim().get_sizes(keys, handles, [self.victim_digests[k] for k in keys])
            for key, h, size in zip(keys, handles, sizes, strict=True):
                value = self.model.victim[key]
                if size is None:
                    raise FuzzFailure(f"victim key {key!r} lost (get missed)")
                if size != len(value) or bytes(self.slab.view(h)[:size]) != value:
                    raise FuzzFailure(f"victim key {key!r} corrupted: wrong bytes read back")
        finally:
            for h in handles:
                self.slab.decref(h)

    def stop(self) -> None:
        for close in (
            self.victim.close if self.victim else None,
            self.control.close if self.control else None,
            self.slab.close if self.slab else None,
            self.node.close if self.node else None,
        ):
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        self.victim = self.control = self.slab = None
        self.node = None

    def __enter__(self) -> Target:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _ensure_up(self) -> None:
        """A node a previous example killed is replaced (so Hypothesis can replay)."""
        if self._dirty or self.node is None or not self.node.alive() or self.control is None:
            self.stop()
            self.start()
            self._dirty = False

    # -- control connection -------------------------------------------------------------------
    def _control(self, req: Req) -> Resp:
        assert self.control is not None
        req.req_id = req.req_id or 7
        ex = self.control.exchange(req.to_bytes(), 1)
        if not ex.frames:
            raise FuzzFailure(f"the control connection got no answer to opcode {req.opcode}")
        resp = ex.frames[0]
        if resp.status != Status.OK:
            raise FuzzFailure(f"control opcode {req.opcode} refused: {resp.payload[:200]!r}")
        return resp

    def control_stats(self) -> dict[str, Any]:
        return decode_json(self._control(Req(Op.STATS)).payload, "STATS")

    # -- views for the strategies ------------------------------------------------------------------
    def view(self, conn: Conn | None, *, destructive_ok: bool = True) -> S.View:
        m = self.model
        assert m is not None
        cid = -1 if conn is None else conn.cid
        own_keys = tuple(p.key for p in m.pending.values() if p.cid == cid)
        committed_keys = tuple(k for k in m.committed if k not in m.victim)
        own_ids = tuple(i for i, le in m.leases.items() if le.cid == cid)
        others = tuple(i for i in m.lease_owner if i not in own_ids)
        return S.View(
            block_size=m.bs,
            pool_base=m.base,
            pool_len=m.info.pool_len,
            token=self.token,
            victim_keys=tuple(m.victim) if destructive_ok else (),
            own_keys=own_keys,
            committed_keys=committed_keys,
            victim_committed=tuple(
                k for k in m.committed if k in m.victim
            ) if destructive_ok else (),
            key_digests=tuple(
                (k, e.digest, e.length)
                for k, e in (*m.committed.items(), *((p.key, p.ext) for p in m.pending.values()))
                if destructive_ok or k not in m.victim
            ),
            own_leases=own_ids,
            other_leases=others,
            destructive_ok=destructive_ok,
            known_bugs=self.cfg.known_bugs,
        )

    # -- one example ---------------------------------------------------------------------
    def run_example(self, data: st.DataObject) -> None:
        self._ensure_up()
        ex = Example()
        finished = False
        try:
            while ex.frames < self.cfg.frames_per_example:
                action = data.draw(ACTION_STRATEGY, label="action")
                self._step(data, ex, action)
            self._finish(ex)
            finished = True
        except FuzzFailure as e:
            self._dirty = True  # the next example starts on a fresh node
            self._failures += 1
            path = self.workdir / f"failure-{self._failures}.txt"
            path.write_text(
                f"# {e}\n" + "".join(f"# {ln}\n" for ln in ex.lines)
                + f"token {self.token.hex()}\n"
                + "".join(f"{ln}\n" for ln in ex.sent)
            )
            raise FuzzFailure(
                f"{e}\n  node stderr: {self.workdir / 'node.stderr'}\n  bytes sent per "
                f"connection: {path}\n  transcript:\n{ex.transcript()}"
            ) from None
        finally:
            try:
                if not finished and not self._dirty:
                    # Hypothesis abandoned the example mid-way (its choice budget ran
                    # out): end its sessions and clean up as _finish would. A node
                    # that fails at that is a failure like any other.
                    self._dirty = True
                    self._recover(ex)
                    self._dirty = False
            except (RdmakvError, OSError) as e:
                raise FuzzFailure(f"cleaning up after an abandoned example: {e}\n"
                                  f"  transcript:\n{ex.transcript()}") from None
            finally:
                for c in ex.conns:
                    c.close()
        self.report.examples += 1
        self._progress()

    def _new_conn(self, ex: Example) -> Conn:
        assert self.node is not None
        conn = Conn(self.node.address, self._next_cid)
        self._next_cid += 1
        ex.conns.append(conn)
        self.report.connections += 1
        return conn

    def _authed(self, data: st.DataObject, ex: Example, *, fresh: bool = False) -> Conn:
        """A live authenticated connection of the example, or a new one (``fresh``,
        or when there is none). Both draws happen either way: choice shapes must not
        depend on state (see the strategies module)."""
        index = data.draw(CONN_INDEX, label="conn")
        req_id = data.draw(st.integers(0, 2**64 - 1), label="hello req_id")
        live = [c for c in ex.conns if c.authenticated and not c.closed]
        if live and not fresh:
            return live[index % len(live)]
        conn = self._new_conn(ex)
        hello = self._hello_req()
        hello.req_id = req_id
        self._send(ex, conn, [hello])
        conn.authenticated = True
        return conn

    def _step(self, data: st.DataObject, ex: Example, action: str) -> None:
        live = [c for c in ex.conns if c.authenticated and not c.closed]
        if action == "frame":
            conn = self._authed(data, ex)
            req = data.draw(S.frames_any(self.view(conn)), label="frame")
            self._send(ex, conn, [req])
        elif action == "pipeline":
            conn = self._authed(data, ex)
            view = self.view(conn)
            n = data.draw(st.integers(2, 5), label="pipelined")
            reqs = [data.draw(S.frames(view), label="frame") for _ in range(n)]
            if data.draw(st.integers(0, 9), label="fatal last") == 0:
                reqs.append(data.draw(S.oversize_frame(), label="fatal frame"))
            self.report.pipelined += len(reqs)
            self._send(ex, conn, reqs)
        elif action == "open":
            self._authed(data, ex, fresh=len(live) < MAX_CONNS)
        elif action == "close":
            index = data.draw(CONN_INDEX, label="close conn")
            if live:
                self._close(ex, live[index % len(live)])
        elif action == "handshake":
            self._handshake(data, ex)
        elif action == "mutate":
            self._mutate(data, ex)
        elif action == "victim_get":
            conn = self._authed(data, ex)
            reqs = data.draw(S.victim_get(self.view(conn)), label="victim get")
            if reqs:
                self._send(ex, conn, reqs)
        elif action == "clean_put":
            conn = self._authed(data, ex)
            self._send(ex, conn, data.draw(S.clean_put(self.view(conn)), label="clean put"))

    def _send(self, ex: Example, conn: Conn, reqs: list[Req]) -> None:
        """Send ``reqs`` at once and check each answer in order (see the module doc)."""
        m = self.model
        assert m is not None
        raw = b"".join(r.to_bytes() for r in reqs)
        ex.send(conn.cid, raw)
        for r in reqs:
            ex.log(f"c{conn.cid} >> {r.describe()}")
        ex.frames += len(reqs)
        self.report.frames += len(reqs)
        fatal_at = next((i for i, r in enumerate(reqs) if r.fatal), None)
        want = len(reqs) if fatal_at is None else fatal_at + 1
        got = conn.exchange(raw, want)
        self._log_answers(ex, conn, got)
        for i, req in enumerate(reqs[:want]):
            if i >= len(got.frames):
                if fatal_at is not None and got.reset:
                    break  # the node reset after its fatal answer; the RST may eat it
                raise FuzzFailure(
                    f"node closed connection {conn.cid} without answering well-formed "
                    f"request #{i} ({'reset' if got.reset else 'FIN'})"
                )
            resp = got.frames[i]
            self.report.statuses[_name(resp.status)] += 1
            self.report.answers[f"{_op_name(req.opcode)} {_name(resp.status)}"] += 1
            m.check(conn.cid, req, resp)
        if fatal_at is None:
            if len(got.frames) > want:
                raise FuzzFailure(
                    f"node sent {len(got.frames)} answers to {want} requests on connection "
                    f"{conn.cid}: the stream is out of sync"
                )
            if got.eof or got.reset:
                raise FuzzFailure(
                    f"node ended connection {conn.cid} after well-formed requests "
                    f"({'reset' if got.reset else 'FIN'})"
                )
            return
        self.report.fatal += 1
        ex.sent.append(f"close {conn.cid}")
        rest = conn.close_and_wait()  # the node must close without another word
        if len(got.frames) > want or rest.frames:
            raise FuzzFailure(f"node answered after a fatal error on connection {conn.cid}")
        m.closed(conn.cid)

    def _log_answers(self, ex: Example, conn: Conn, got: Exchange) -> None:
        for f in got.frames:
            h = f.header
            ex.log(
                f"c{conn.cid} << op={h.opcode} status={_name(h.status)} req_id={h.req_id} "
                f"payload={len(f.payload)} bulk={len(f.bulk)}"
                + (f": {f.payload[:80]!r}" if h.status else "")
            )
        if got.eof or got.reset:
            ex.log(f"c{conn.cid} << {'reset' if got.reset else 'closed'}")

    def _close(self, ex: Example, conn: Conn) -> None:
        ex.log(f"c{conn.cid} close")
        ex.sent.append(f"close {conn.cid}")
        rest = conn.close_and_wait()
        self._log_answers(ex, conn, rest)
        if rest.frames:
            raise FuzzFailure(f"node sent {len(rest.frames)} unrequested frames on close")
        assert self.model is not None
        self.model.closed(conn.cid)

    def _handshake(self, data: st.DataObject, ex: Example) -> None:
        """A fresh connection's first frame, maybe with more frames right behind it."""
        self.report.handshakes += 1
        conn = self._new_conn(ex)
        first = data.draw(S.hello_frame(self.view(None, destructive_ok=False)), label="first")
        follow: list[Req] = []
        if data.draw(st.integers(0, 2), label="followers") == 0:
            follow = [data.draw(S.frames(self.view(conn)), label="follower") for _ in range(2)]
        if first.fatal:
            # nothing behind a refused first frame may be served: the followers
            # must go unanswered (the node closes right after its refusal)
            raw = first.to_bytes() + b"".join(r.to_bytes() for r in follow)
            ex.send(conn.cid, raw)
            ex.log(f"c{conn.cid} >> {first.describe()} (+{len(follow)} unauthenticated)")
            ex.frames += 1 + len(follow)
            self.report.frames += 1 + len(follow)
            got = conn.exchange(raw, 1)
            self._log_answers(ex, conn, got)
            if got.frames:
                self.report.statuses[_name(got.frames[0].status)] += 1
                assert self.model is not None
                self.model.check(conn.cid, first, got.frames[0])
            elif not got.reset:
                raise FuzzFailure("node closed an unauthenticated connection without a word")
            ex.sent.append(f"close {conn.cid}")
            rest = conn.close_and_wait()
            if len(got.frames) > 1 or rest.frames:
                raise FuzzFailure("node answered requests sent after a refused first frame")
            self.report.fatal += 1
            return
        self._send(ex, conn, [first, *follow])
        conn.authenticated = True

    def _mutate(self, data: st.DataObject, ex: Example) -> None:
        """A broken frame, then a half-close: whatever the node answers must be
        well-formed frames, and it must close. Fresh or existing connection."""
        self.report.mutated += 1
        ex.mutated = True
        live = [c for c in ex.conns if c.authenticated and not c.closed]
        existing = data.draw(st.booleans(), label="mutate existing")
        index = data.draw(CONN_INDEX, label="conn")
        if live and existing:
            conn = live[index % len(live)]
            base = S.frames(self.view(conn, destructive_ok=False))
            authed = True
        else:
            conn = self._new_conn(ex)
            base = S.hello_frame(self.view(None, destructive_ok=False))
            authed = False
        raw, what = data.draw(S.mutated(base), label="mutation")
        ex.send(conn.cid, raw)
        ex.sent.append(f"shut {conn.cid}")
        ex.log(f"c{conn.cid} >> MUTATED {what} -> {raw[:64].hex()} ({len(raw)} bytes)")
        ex.frames += 1
        self.report.frames += 1
        got = conn.exchange(raw, 0, half_close=True)
        self._log_answers(ex, conn, got)
        for f in got.frames:
            self.report.statuses[_name(f.status)] += 1
            if f.status == Status.INTERNAL:
                raise FuzzFailure(f"node reported an internal error: {f.payload[:300]!r}")
        if not authed and got.frames:
            first = got.frames[0].header
            if first.status == Status.OK and first.opcode != Op.HELLO | RESPONSE_BIT:
                raise FuzzFailure(
                    f"node served opcode {first.opcode & 0x7F} before a valid HELLO"
                )
        conn.close()
        assert self.model is not None
        self.model.forget_content(conn.cid)
        self.model.closed(conn.cid)

    # -- end of an example ---------------------------------------------------------------
    def _finish(self, ex: Example) -> None:
        m = self.model
        assert m is not None and self.node is not None
        for c in ex.conns:
            if not c.closed:
                self._close(ex, c)
        if ex.mutated:
            self._resync()
        m.check_stats(self.control_stats(), where="after the example")
        self._cleanup()
        self.check_victim()
        self._settle()
        if not self.node.alive():
            raise FuzzFailure(f"node died (exit code {self.node.proc and self.node.proc.poll()})")
        self._check_stderr()

    def _recover(self, ex: Example) -> None:
        m = self.model
        assert m is not None
        for c in ex.conns:
            if not c.closed:
                c.close_and_wait()
                m.closed(c.cid)
        self._resync()
        self._cleanup()

    def _cleanup(self) -> None:
        """Delete the fuzzer's committed keys: the next example starts from the victim's."""
        m = self.model
        assert m is not None
        fuzz_keys = [k for k in m.committed if k not in m.victim]
        if fuzz_keys:
            got = decode_flags(
                self._control(Req(Op.DELETE, raw_keys(fuzz_keys))).payload,
                len(fuzz_keys), "DELETE",
            )
            if not all(got):
                raise FuzzFailure(f"cleanup DELETE of the fuzzer's committed keys gave {got}")
            for k in fuzz_keys:
                del m.committed[k]
        m.keys_seen.clear()
        m.forget_unplaced()
        # Views may only depend on this example's history: Hypothesis replays a
        # choice sequence and requires the same strategies to come out of it.
        m.lease_owner.clear()

    def _resync(self) -> None:
        """After mutated frames: learn which of the fuzzer's keys are committed now."""
        m = self.model
        assert m is not None
        keys = sorted((m.keys_seen | set(m.committed)) - set(m.victim))
        if not keys:
            return
        found = decode_lookup_results(self._control(Req(Op.LOOKUP, raw_keys(keys))).payload,
                                      len(keys))
        for key, res in zip(keys, found, strict=True):
            if res is None:
                m.committed.pop(key, None)
                continue
            ext = Ext(res.extent.addr, res.extent.length, res.digest, lookup_extra(res))
            old = m.committed.get(key)
            if old is not None and old.addr < 0 and replace(old, addr=ext.addr) == ext:
                m.place(key, ext.addr, check=False)  # a PUT's value, where it is now known
            elif old != ext:
                m.committed[key] = ext
                m.content[ext.addr] = Content.unknown(ext.length)

    def _settle(self) -> None:
        """The node's counts once every fuzzer session has ended: no pending extent,
        no lease, the victim's entries only, nothing evicted, two sessions (victim
        and control) left."""
        assert self.model is not None
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            stats = self._victim().stats()  # also reads the victim's RELEASE answers
            bad = {
                "pending": stats.get("pending"),
                "leases_active": stats.get("leases_active"),
                "entries": stats.get("entries"),
                "evictions": int(stats.get("evictions", 0)) - self._evictions0,
                "sessions_active": stats.get("sessions_active"),
            }
            want = {"pending": 0, "leases_active": 0, "entries": len(self.model.victim),
                    "evictions": 0, "sessions_active": 2}
            if bad == want:
                return
            if time.monotonic() > deadline:
                raise FuzzFailure(f"after the example the node counts {bad}, expected {want}")
            time.sleep(0.005)

    def _check_stderr(self) -> None:
        path = self.workdir / "node.stderr"
        with path.open("rb") as f:
            f.seek(self._stderr_pos)
            new = f.read()
        self._stderr_pos += len(new)
        if b"Traceback" in new or b"Exception in thread" in new:
            text = new.decode(errors="replace")
            raise FuzzFailure(f"node logged a traceback:\n{text[-3000:]}")

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        due = now - self._last_progress >= self.cfg.progress_s
        if self.cfg.progress_s <= 0 or not (force or due):
            return
        self._last_progress = now
        r = self.report
        dt = now - self._t0
        rss = rss_kib(self.node.proc.pid) if self.node and self.node.proc else 0
        print(
            f"fuzz: {r.frames}/{self.cfg.frames} frames, {r.examples} examples, "
            f"{r.frames / dt:.0f} frames/s, {r.connections} connections, {r.mutated} mutated, "
            f"node RSS {rss / 1024:.1f} MiB, {dt:.0f}s",
            file=self.cfg.progress or sys.stderr, flush=True,
        )

    def finish_report(self) -> FuzzReport:
        self.report.seconds = time.monotonic() - self._t0
        if self.node is not None and self.node.proc is not None:
            self.report.node_rss_kib = rss_kib(self.node.proc.pid)
        if self.model is not None:
            self.report.bytes_verified = self.model.bytes_verified
        return self.report


def _op_name(opcode: int) -> str:
    try:
        return Op(opcode).name
    except ValueError:
        return "unknown"


def _name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return str(status)


def _first(group: BaseExceptionGroup[FuzzFailure]) -> FuzzFailure:
    e = group.exceptions[0]
    return e if isinstance(e, FuzzFailure) else _first(e)


def _rounds(cfg: FuzzConfig, target: Target) -> Iterator[Callable[[], None]]:
    """Hypothesis runs, one seed each, until ``cfg.frames`` frames were sent."""
    r = 0
    while target.report.frames < cfg.frames:
        left = cfg.frames - target.report.frames
        examples = min(EXAMPLES_PER_ROUND, max(1, math.ceil(left / cfg.frames_per_example)))

        @seed(cfg.seed + r)
        @settings(
            max_examples=examples,
            database=None,
            deadline=None,
            derandomize=False,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
        )
        @given(st.data())
        def one_round(data: st.DataObject) -> None:
            target.run_example(data)

        yield one_round
        r += 1


def run_fuzz(cfg: FuzzConfig) -> FuzzReport:
    """Fuzz a fresh node with ``cfg.frames`` frames; raise FuzzFailure at the first bug."""
    with Target(cfg) as target:
        before = -1
        for one_round in _rounds(cfg, target):
            if target.report.frames == before:
                raise RdmakvError("Hypothesis ran no example in a round")  # would loop forever
            before = target.report.frames
            try:
                one_round()
            except BaseExceptionGroup as group:  # Hypothesis' FlakyFailure: ours inside
                found = group.subgroup(FuzzFailure)
                if found is None:
                    raise
                raise _first(found) from None
        target._progress(force=True)
        return target.finish_report()


REPLAY_QUIET_S = 0.3


def replay(path: Path, out: TextIO | None = None) -> int:
    """Send a failure file's bytes to a fresh node (same token, no victim) and print
    every answer; returns the node's exit status (None while alive: -1 printed as alive).

    Lines: ``token <hex>``, ``send <cid> <hex>`` (answers are read until the
    node is quiet for REPLAY_QUIET_S), ``shut <cid>`` (half-close, read to the
    end), ``close <cid>``; ``#`` lines are comments.
    """
    out = out or sys.stdout
    lines = [ln.split() for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    token = next((bytes.fromhex(p[1]) for p in lines if p[0] == "token"), b"")
    with tempfile.TemporaryDirectory(prefix="rdmakv-replay-") as tmp:
        opts = {"pool-size": FuzzConfig.pool_size, "block-size": FuzzConfig.block_size,
                "transport": "tcp", "lease-timeout": str(LEASE_TIMEOUT_S)}
        if token:
            (Path(tmp) / "token").write_bytes(token)
            opts["token-file"] = str(Path(tmp) / "token")
        node = LocalNodeProcess(opts, stderr_path=Path(tmp) / "node.stderr",
                                extra_args=["--no-lock"])
        conns: dict[int, Conn] = {}
        try:
            for parts in lines:
                if parts[0] == "token":
                    continue
                cid = int(parts[1])
                if cid not in conns:
                    conns[cid] = Conn(node.address, cid)
                conn = conns[cid]
                if parts[0] == "send":
                    got = conn.exchange_quiet(bytes.fromhex(parts[2]), REPLAY_QUIET_S)
                elif parts[0] == "shut":
                    got = conn.exchange(b"", 0, half_close=True)
                else:
                    got = conn.close_and_wait()
                print(f"{parts[0]} c{cid}: " + "; ".join(
                    f"op={f.header.opcode} {_name(f.status)} req_id={f.header.req_id} "
                    f"payload={f.payload[:60]!r} bulk={len(f.bulk)}" for f in got.frames
                ) + (" [closed]" if got.eof else "") + (" [reset]" if got.reset else ""),
                      file=out)
            alive = node.alive()
            print(f"node {'alive' if alive else 'DEAD'}", file=out)
            print((Path(tmp) / "node.stderr").read_text(errors="replace")[-3000:], file=out)
            return 0 if alive else 1
        finally:
            for c in conns.values():
                c.close()
            node.close()
