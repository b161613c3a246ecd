"""Audits, quarantine reports and fingerprints: the parts below the engine connector.

The connector's whole audit path (real vLLM scheduler, real node) is in
tests/engines/test_vllm_connector.py; here: the sampling and comparison rules,
the audit options, the scheduler book's audit plan, the REPORT opcode against a
real node (and ``rdmakv stats`` showing it), and the fingerprint record.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.connectors.audit import audit_sampled, block_diff
from rdmakv.connectors.fingerprint import CONFLICT, check_fingerprint, engine_fingerprint
from rdmakv.connectors.group_stores import StoreOptions
from rdmakv.connectors.plan import GroupBlocks, RequestBook
from rdmakv.engine.hybrid import FullAttentionSpec, KVCacheGroup
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import ConfigError, ProtocolError, RemoteError, UnknownOpcode
from rdmakv.wire.batches import decode_report, encode_report
from rdmakv.wire.format import Op

B = 16
FULL = KVCacheGroup(0, FullAttentionSpec(B))
PROMPT = list(range(1000, 1070))  # 4 full blocks + 6


def test_sampling_is_a_deterministic_share_of_request_ids() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    picked = [r for r in ids if audit_sampled(r, 0.1)]
    assert 300 < len(picked) < 500  # about 10%
    assert picked == [r for r in ids if audit_sampled(r, 0.1)]  # same answer every time
    assert set(picked) <= {r for r in ids if audit_sampled(r, 0.5)}  # nested rates
    assert not any(audit_sampled(r, 0.0) for r in ids[:50])
    assert all(audit_sampled(r, 1.0) for r in ids[:50])


def test_block_diff_is_exact_or_relative_per_layer() -> None:
    torch = pytest.importorskip("torch")
    a = torch.arange(2 * 16 * 4, dtype=torch.float32).view(2, 16, 4) + 1.0
    same = block_diff(a, a.clone())
    assert same.identical and same.max_rel == 0.0 and not same.mismatch(0.0)
    b = a.clone()
    b[1, 3, 2] += 0.5  # layer 1 off by 0.5 against a magnitude of 128
    d = block_diff(a, b)
    assert not d.identical and d.layer == 1
    assert d.max_rel == pytest.approx(0.5 / 128)
    assert d.mismatch(0.0) and d.mismatch(1e-3) and not d.mismatch(1e-2)
    b[0, 0, 0] = float("nan")
    assert math.isinf(block_diff(a, b).max_rel) and block_diff(a, b).mismatch(10.0)
    with pytest.raises(ConfigError, match="shape"):
        block_diff(a, a[:1])


@pytest.mark.parametrize(
    ("key", "value"),
    [("audit_rate", 2), ("audit_rate", -0.5), ("audit_rate", True), ("audit_rate", "0.1"),
     ("audit_tolerance", -1e-3), ("audit_tolerance", float("nan")),
     ("audit_quarantine", 1)],
)
def test_bad_audit_options_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        StoreOptions.from_mapping({"node": "h:1", key: value})


def test_audit_options_default_off_exact_and_quarantining() -> None:
    o = StoreOptions.from_mapping({"node": "h:1"})
    assert (o.audit_rate, o.audit_tolerance, o.audit_quarantine) == (0.0, 0.0, True)
    o = StoreOptions.from_mapping({"node": "h:1", "audit_rate": 0.01, "audit_tolerance": 0.02})
    assert (o.audit_rate, o.audit_tolerance) == (0.01, 0.02)


def _cached(req_id: str, tokens: Any, extra: bytes | None) -> list[list[bool]]:
    return [[True] * (len(tokens) // B)]


def test_an_audited_request_gets_no_hit_and_its_plan_names_the_blocks_to_compare() -> None:
    book = RequestBook([FULL], _cached, audit_rate=1.0)
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)
    book.after_alloc("r", PROMPT, len(PROMPT), None, [[11, 12, 13, 14, 15]], 0)
    book.scheduled("r", 0, block_ids=[[11, 12, 13, 14, 15]])
    plan = book.build({"r": len(PROMPT)})
    assert plan.loads == ()
    (audit,) = plan.audits
    assert audit.groups == (GroupBlocks(0, (11, 12, 13, 14)),)
    assert audit.tokens == tuple(PROMPT[:64])
    (save,) = plan.saves  # the same blocks are saved (and compared) this step
    assert save.groups == (GroupBlocks(0, (11, 12, 13, 14)),)
    assert book.build({}).audits == ()  # planned once
    plain = RequestBook([FULL], _cached, audit_rate=0.0)
    assert plain.num_new_matched_tokens("r", PROMPT, 0, None) == (64, True)


def test_remote_hits_stop_while_a_namespace_is_reported_and_resume_when_cleared() -> None:
    book = RequestBook([FULL], _cached)
    book.remote_reported({"ns tp0/2": "audit mismatch"}, ())
    assert book.num_new_matched_tokens("r", PROMPT, 0, None) == (0, False)
    assert book.build({}).clear_quarantine is False
    book.remote_reported({}, {"ns tp0/2"})
    assert book.num_new_matched_tokens("r2", PROMPT, 0, None) == (64, True)
    # One rank's clearance is passed to every rank, once.
    assert book.build({}).clear_quarantine is True
    assert book.build({}).clear_quarantine is False


def test_report_codec_refuses_bad_payloads() -> None:
    assert decode_report(encode_report("ns", "why")) == ("ns", "why")
    assert decode_report(encode_report("ns", None)) == ("ns", None)
    for bad in (b"[]", b"{}", json.dumps({"quarantined": "ns"}).encode(),
                json.dumps({"cleared": ""}).encode(), b"\xff"):
        with pytest.raises(ProtocolError):
            decode_report(bad)


@pytest.mark.timeout(60)
def test_a_node_shows_reported_quarantines_in_stats_and_rdmakv_stats(
    node: Any, client_slab: Slab
) -> None:
    with KVClient(*node.address, client_slab) as c:
        assert c.stats()["quarantined_namespaces"] == {}
        assert c.report("m float16 layout", "audit of request r: block 0 differs") is True
        assert c.report("m float16 layout", "again") is True
        shown = c.stats()["quarantined_namespaces"]["m float16 layout"]
        assert shown["reason"] == "again" and shown["reports"] == 2
        out = subprocess.run(
            [sys.executable, "-m", "rdmakv.cli", "stats", f"{node.address[0]}:{node.address[1]}"],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "m float16 layout" in json.loads(out.stdout)["quarantined_namespaces"]
        assert c.report("m float16 layout", None) is True  # an operator cleared it
        assert c.stats()["quarantined_namespaces"] == {}
        with pytest.raises(RemoteError, match="BAD_REQUEST"):
            c._call(Op.REPORT, b'{"quarantined": 5}', "REPORT")
        # What an older node answers for an opcode it lacks (here one this TCP node
        # does not serve): UnknownOpcode, and the connection keeps serving.
        with pytest.raises(UnknownOpcode):
            c._call(Op.RDMA_CONNECT, b"", "RDMA_CONNECT")
        assert "entries" in c.stats()


def _manager(node: Any, model: str = "m") -> KVCacheManager:
    return KVCacheManager(
        namespace=KeyNamespace(model, "float16", "layout"),
        block_tokens=B,
        block_bytes=4096,
        l1_bytes=64 * 4096,
        node=f"{node.address[0]}:{node.address[1]}",
        transport="tcp",
        lock_slab=False,
    )


def test_fingerprint_is_written_once_and_a_different_one_is_refused(
    node: Any, tmp_path: Path
) -> None:
    ns = KeyNamespace("m", "float16", "layout")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"layers": 2}')
    (tmp_path / "b" / "config.json").write_text('{"layers": 3}')

    def fp(path: Path) -> dict[str, Any]:
        return engine_fingerprint(model="m", revision=None, model_path=path,
                                  model_dtype="float16", quantization=None, namespace=ns)

    assert fp(tmp_path / "a")["weights"] != fp(tmp_path / "b")["weights"]
    with _manager(node) as mgr:
        assert check_fingerprint(mgr, ns, fp(tmp_path / "a")) is None  # first: written
        assert check_fingerprint(mgr, ns, fp(tmp_path / "a")) is None  # same: fine
        conflict = check_fingerprint(mgr, ns, fp(tmp_path / "b"))
        assert conflict is not None and conflict.startswith(CONFLICT)
        assert "weights" in conflict and "\n" not in conflict
        other_ns = KeyNamespace("m2", "float16", "layout")
        assert check_fingerprint(mgr, other_ns, fp(tmp_path / "b")) is None  # own record
        assert not mgr.l1.held_handles
