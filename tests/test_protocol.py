"""Wire-format codecs: round trips, and every limit enforced before allocation."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmakv.errors import AuthError, ConfigError, ProtocolError, RdmakvError, RemoteError
from rdmakv.wire.batches import (
    BatchEncoder,
    decode_alloc,
    decode_commit,
    decode_extent_table,
    decode_extents,
    decode_flags,
    decode_get,
    decode_get_answer,
    decode_get_answer_arrays,
    decode_keys,
    decode_keys_request,
    decode_lookup_results,
    decode_lookup_table,
    decode_put_answer,
    decode_u64_list,
    encode_alloc,
    encode_commit,
    encode_extent_table,
    encode_extents,
    encode_flags,
    encode_get,
    encode_get_answer,
    encode_keys,
    encode_lookup_results,
    encode_put_answer,
    encode_u64_list,
)
from rdmakv.wire.channel import SMALL_FRAME_BYTES, Channel, recv_views, send_frame, send_views
from rdmakv.wire.format import (
    ALLOC_ITEM,
    DIGEST_LEN,
    EXTENT,
    EXTENT_DTYPE,
    FATAL_STATUSES,
    HEADER,
    LOOKUP_ENTRY,
    LOOKUP_ENTRY_DTYPE,
    MAX_KEY_LEN,
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    U16,
    U32,
    AllocResult,
    AllocStatus,
    Extent,
    FrameTooLarge,
    Header,
    LimitExceeded,
    LookupResult,
    NodeInfo,
    Status,
    check_digest,
    check_digests,
    check_key,
    check_keys,
    decode_hello,
    decode_node_info,
    encode_hello,
    encode_node_info,
    raise_for_status,
)

keys_st = st.lists(st.binary(min_size=1, max_size=MAX_KEY_LEN), max_size=50)
digest_st = st.binary(min_size=DIGEST_LEN, max_size=DIGEST_LEN)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)


@given(keys_st)
def test_keys_roundtrip(keys: list[bytes]) -> None:
    assert decode_keys(encode_keys(keys), "t") == keys
    request = decode_keys_request(encode_keys(keys), "t")
    assert request.count == len(keys) and request.keys == keys
    one_len = {len(k) for k in keys}
    assert request.key_len == (one_len.pop() if len(one_len) == 1 else None)
    if request.key_len is not None:  # the records C reads: each key behind its u16 length
        assert bytes(request.records) == b"".join(U16.pack(len(k)) + k for k in keys)


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=64), u32, digest_st), max_size=40))
def test_alloc_roundtrip(items: list[tuple[bytes, int, bytes]]) -> None:
    keys, sizes, digests = ([x[i] for x in items] for i in range(3))
    assert decode_alloc(encode_alloc(keys, sizes, digests)) == items


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=64), u64), max_size=40))
def test_commit_roundtrip(items: list[tuple[bytes, int]]) -> None:
    keys, sums = [k for k, _ in items], [c for _, c in items]
    assert decode_commit(encode_commit(keys, sums)) == (keys, sums)


def test_commit_payload_that_does_not_split_into_keys_and_checksums_is_refused() -> None:
    good = encode_commit([b"ab", b"c"], [1, 2])
    for bad in (good[:-1], good + b"x", U32.pack(3) + good[4:], U32.pack(1) + good[4:]):
        with pytest.raises(ProtocolError):
            decode_commit(bad)
    with pytest.raises(ProtocolError, match="2 keys with 1 checksums"):
        encode_commit([b"a", b"b"], [1])


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=64), digest_st), max_size=40))
def test_get_roundtrip(items: list[tuple[bytes, bytes]]) -> None:
    keys, digests = [k for k, _ in items], [d for _, d in items]
    assert decode_get(encode_get(keys, digests)) == (keys, digests)


@given(st.lists(st.tuples(u32, u64), max_size=40))
def test_get_answer_roundtrip(rows: list[tuple[int, int]]) -> None:
    lengths, sums = [n for n, _ in rows], [c for _, c in rows]
    payload = encode_get_answer(lengths, sums)
    assert decode_get_answer(payload, len(rows)) == (lengths, sums)
    arrays = decode_get_answer_arrays(payload, len(rows))
    assert (arrays[0].tolist(), arrays[1].tolist()) == (lengths, sums)


@given(klen=st.integers(1, 64), n=st.integers(1, 40), data=st.data())
def test_get_of_uniform_keys_encodes_the_bytes_of_the_per_key_encoder(
    klen: int, n: int, data: st.DataObject
) -> None:
    keys = [data.draw(st.binary(min_size=klen, max_size=klen)) for _ in range(n)]
    digests = [data.draw(digest_st) for _ in range(n)]
    fast = encode_get(keys, digests)
    assert fast == U32.pack(n) + b"".join(
        U16.pack(klen) + k + d for k, d in zip(keys, digests, strict=True))
    # a bytearray digest leaves the fast path; the bytes are the same
    assert encode_get(keys, [*digests[:-1], bytearray(digests[-1])]) == fast


def test_malformed_get_and_get_answers_are_refused() -> None:
    good = encode_get([b"ab", b"c"], [bytes(16), bytes(range(16))])
    for bad in (good[:-1], good + b"x", U32.pack(3) + good[4:], U32.pack(1) + good[4:]):
        with pytest.raises(ProtocolError):
            decode_get(bad)
    with pytest.raises(ConfigError, match="digest must be 16 bytes, got 5 bytes"):
        encode_get([b"a"], [b"short"])
    answer = encode_get_answer([5, 0], [9, 0])
    for decode in (decode_get_answer, decode_get_answer_arrays):
        with pytest.raises(ProtocolError, match="2 entries for 3 keys"):
            decode(answer, 3)
        for bad in (answer[:-1], answer + b"x"):
            with pytest.raises(ProtocolError):
                decode(bad, 2)
    for digests in ([bytes(16), b"short"], [bytes(16)]):  # a short one; counts differ
        with pytest.raises((ProtocolError, ValueError)):
            encode_get([b"ab", b"cd"], digests)
    with pytest.raises(ProtocolError, match="2 lengths with 1 checksums"):
        encode_get_answer([1, 2], [3])


@given(st.lists(st.tuples(st.sampled_from(list(AllocStatus)), u64, u32, u32), max_size=40))
def test_extents_roundtrip(rows: list[tuple[AllocStatus, int, int, int]]) -> None:
    results = [
        AllocResult(s, Extent(a, n, k) if s == AllocStatus.OK else None) for s, a, n, k in rows
    ]
    payload = encode_extents(results)
    assert decode_extents(payload, len(results)) == results
    table = np.zeros(len(rows), dtype=EXTENT_DTYPE)
    for i, r in enumerate(results):
        table[i] = (r.status, *(r.extent or (0, 0, 0)))
    assert encode_extent_table(table) == payload


def test_extent_table_of_another_shape_is_refused() -> None:
    for bad in (np.zeros(2, dtype=LOOKUP_ENTRY_DTYPE), np.zeros((2, 2), dtype=EXTENT_DTYPE)):
        with pytest.raises(ProtocolError, match="1-d array of EXTENT_DTYPE"):
            encode_extent_table(bad)


@given(st.lists(st.none() | st.tuples(u64, u32, u32, u64, digest_st, u64), max_size=40))
def test_lookup_roundtrip(rows: list[tuple[int, int, int, int, bytes, int] | None]) -> None:
    results = [
        None if r is None else LookupResult(Extent(r[0], r[1], r[2]), r[3], r[4], r[5])
        for r in rows
    ]
    assert decode_lookup_results(encode_lookup_results(results), len(results)) == results


@given(st.lists(st.booleans(), max_size=100), st.lists(u64, max_size=100))
def test_flags_and_ids_roundtrip(flags: list[bool], ids: list[int]) -> None:
    assert decode_flags(encode_flags(flags), len(flags), "t") == flags
    assert decode_u64_list(encode_u64_list(ids), "t") == ids


def test_hello_and_node_info_roundtrip() -> None:
    assert decode_hello(encode_hello(b"tok")) == (PROTOCOL_VERSION, b"tok")
    info = NodeInfo(1, 7, 4096, 2**40, 2**30, b"n" * 16, 9, 10, 11, 13, ("tcp", "rdma"))
    assert decode_node_info(encode_node_info(info)) == info


def test_counts_over_limits_are_refused_before_allocating() -> None:
    with pytest.raises(LimitExceeded, match=str(MAX_KEYS_PER_REQUEST)):
        decode_keys(U32.pack(MAX_KEYS_PER_REQUEST + 1), "t")
    with pytest.raises(ProtocolError, match="cannot fit"):
        decode_u64_list(U32.pack(1000), "t")


@given(st.binary(max_size=200))
def test_decoders_never_raise_anything_but_protocol_errors(junk: bytes) -> None:
    for decode in (
        lambda b: decode_keys(b, "t"),
        decode_alloc,
        decode_commit,
        decode_get,
        lambda b: decode_get_answer(b, 1),
        lambda b: decode_extents(b, 1),
        lambda b: decode_lookup_results(b, 1),
        lambda b: decode_flags(b, 1, "t"),
        lambda b: decode_u64_list(b, "t"),
        decode_hello,
        decode_node_info,
    ):
        with contextlib.suppress(ProtocolError):
            decode(junk)


def test_response_count_mismatch_is_detected() -> None:
    with pytest.raises(ProtocolError, match="2 entries for 3 keys"):
        decode_flags(encode_flags([True, False]), 3, "EXISTS")


def test_one_key_check_and_one_digest_check_name_what_was_wrong() -> None:
    """The wire's rules, for every caller (encoders, clients, L1, key chain),
    each naming its own argument."""

    def error(check: Callable[..., object], *args: object, **kw: object) -> str:
        with pytest.raises(ConfigError) as e:
            check(*args, **kw)
        return str(e.value)

    assert check_key(b"k") == b"k" and check_key(b"x" * MAX_KEY_LEN) == b"x" * MAX_KEY_LEN
    assert type(check_key(bytearray(b"k"))) is bytes and check_key(bytearray(b"k")) == b"k"
    for bad, got in ((b"", "0 bytes"), (b"x" * (MAX_KEY_LEN + 1), f"{MAX_KEY_LEN + 1} bytes"),
                     ("k", "str 'k'"), (None, "NoneType None")):
        assert error(check_key, bad, "parent") == (
            f"parent must be 1..{MAX_KEY_LEN} bytes, got {got}"
        )
    assert check_key(bytes(16), length=16) == bytes(16)
    for bad in (b"abc", b"x" * MAX_KEY_LEN):  # valid on the wire, not of the caller's one size
        assert error(check_key, bad, "block key", length=16) == (
            f"block key must be 16 bytes, got {len(bad)} bytes"
        )
    assert check_digest(bytearray(DIGEST_LEN)) == bytes(DIGEST_LEN)
    assert error(check_digest, bytes(15)) == "digest must be 16 bytes, got 15 bytes"
    assert error(check_digest, "d" * 16, "value digest") == (
        "value digest must be 16 bytes, got str 'dddddddddddddddd'"
    )
    check_keys([b"a", bytearray(b"bc")])  # type: ignore[list-item]
    check_digests([bytes(DIGEST_LEN), bytearray(DIGEST_LEN)])  # type: ignore[list-item]
    assert error(check_keys, [b"a", b"b", b""]).startswith("key #2 must be")
    assert error(check_digests, [bytes(DIGEST_LEN), b"x"]).startswith("digest #1 must be")


def test_bad_keys_and_digests_refused_on_encode() -> None:
    with pytest.raises(ConfigError, match=f"^key must be .* got {MAX_KEY_LEN + 1} bytes"):
        encode_keys([b"x" * (MAX_KEY_LEN + 1)])
    with pytest.raises(ConfigError, match="digest must be 16 bytes"):
        encode_alloc([b"k"], [1], [b"short"])


def test_status_maps_to_exceptions() -> None:
    def hdr(status: Status) -> Header:
        return Header(0x82, 0, status, 0, 0, 1)

    with pytest.raises(AuthError):
        raise_for_status(hdr(Status.AUTH_FAILED), b"no", "HELLO")
    with pytest.raises(ProtocolError, match="BAD_VERSION"):
        raise_for_status(hdr(Status.BAD_VERSION), b"v9", "HELLO")
    with pytest.raises(RemoteError, match="BAD_ADDRESS: outside"):
        raise_for_status(hdr(Status.BAD_ADDRESS), b"outside", "WRITE")
    raise_for_status(hdr(Status.OK), b"", "x")
    # a status after which the node closes the connection reads as the stream's
    # end (ProtocolError, AuthError); any other as the node's refusal
    for status in set(Status) - {Status.OK}:
        with pytest.raises(RdmakvError) as e:
            raise_for_status(hdr(status), b"why", "x")
        if status == Status.AUTH_FAILED:
            assert isinstance(e.value, AuthError)
        elif status in FATAL_STATUSES:
            assert isinstance(e.value, ProtocolError)
        else:
            assert isinstance(e.value, RemoteError) and not isinstance(e.value, ProtocolError)


def test_scatter_gather_moves_bytes_between_many_buffers() -> None:
    a, b = socket.socketpair()
    src = [bytes([i % 256]) * (1000 + 37 * i) for i in range(1100)]
    dst = [memoryview(bytearray(len(s))) for s in src]
    t = threading.Thread(target=send_views, args=(a, src))
    t.start()
    recv_views(b, dst)
    t.join()
    assert [bytes(d) for d in dst] == src
    a.close()
    b.close()


def test_send_frame_sends_every_byte_when_the_socket_buffer_fills() -> None:
    """Frames without bulk, joined (up to SMALL_FRAME_BYTES) or gathered
    (above), and frames with bulk (gathered), through a socket buffer too
    small for them: a short write sends its rest, a full buffer waits under
    the socket's timeout."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(10)
    sizes = [0, 1, 100, SMALL_FRAME_BYTES, SMALL_FRAME_BYTES + 1, 3 * SMALL_FRAME_BYTES] * 20
    frames = [(HEADER.pack(1, 0, 0, n, 0, i), bytes([i % 251]) * n, [bytes([i % 7]) * (i % 3)])
              for i, n in enumerate(sizes)]
    frames[1] = (frames[1][0], memoryview(bytearray(frames[1][1])), [])  # any buffer
    t = threading.Thread(target=lambda: [send_frame(a, h, p, bk) for h, p, bk in frames])
    t.start()
    want = b"".join(h + bytes(p) + b"".join(bk) for h, p, bk in frames)
    got = bytearray(len(want))
    recv_views(b, [memoryview(got)])
    t.join()
    assert bytes(got) == want
    a.close()
    b.close()


def test_channel_rejects_oversized_header_fields() -> None:
    a, b = socket.socketpair()
    a.sendall(HEADER.pack(2, 0, 0, 2**32 - 1, 0, 1))
    with pytest.raises(FrameTooLarge, match="payload"):
        Channel(b).recv_header()
    a.sendall(HEADER.pack(16, 0, 0, 0, 2**62, 1))
    with pytest.raises(FrameTooLarge, match="bulk"):
        Channel(b).recv_header()
    a.close()
    b.close()


# -- the table decoders (what the rdma client builds op tables from) ----------------


@given(
    entries=st.lists(
        st.tuples(
            st.sampled_from([int(s) for s in AllocStatus]),
            st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
        ),
        max_size=40,
    )
)
def test_extent_table_decodes_what_decode_extents_does(
    entries: list[tuple[int, int, int, int]],
) -> None:
    payload = U32.pack(len(entries)) + b"".join(EXTENT.pack(*e) for e in entries)
    table = decode_extent_table(payload, len(entries))
    objects = decode_extents(payload, len(entries))
    assert [int(x) for x in table["status"]] == [int(r.status) for r in objects]
    for row, res in zip(table, objects, strict=True):
        if res.extent is not None:
            assert (int(row["addr"]), int(row["length"]), int(row["rkey"])) == tuple(res.extent)


def test_extent_table_refuses_unknown_statuses_and_wrong_counts() -> None:
    good = EXTENT.pack(0, 4096, 100, 7)
    with pytest.raises(ProtocolError, match="unknown status 200"):
        decode_extent_table(U32.pack(2) + good + EXTENT.pack(200, 0, 0, 0), 2)
    with pytest.raises(ProtocolError, match="1 entries for 2 keys"):
        decode_extent_table(U32.pack(1) + good, 2)
    with pytest.raises(ProtocolError):
        decode_extent_table(U32.pack(1) + good + b"x", 1)  # trailing bytes


@given(
    entries=st.lists(
        st.tuples(
            st.integers(0, 255), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.binary(min_size=16,
                                                                             max_size=16),
            st.integers(0, 2**64 - 1),
        ),
        max_size=40,
    )
)
def test_lookup_table_decodes_what_decode_lookup_results_does(
    entries: list[tuple[int, int, int, int, int, bytes, int]],
) -> None:
    payload = U32.pack(len(entries)) + b"".join(LOOKUP_ENTRY.pack(*e) for e in entries)
    table = decode_lookup_table(payload, len(entries))
    objects = decode_lookup_results(payload, len(entries))
    for row, res in zip(table, objects, strict=True):
        assert (row["found"] != 0) == (res is not None)
        if res is not None:
            assert (int(row["addr"]), int(row["length"]), int(row["rkey"])) == tuple(res.extent)
            assert int(row["lease"]) == res.lease_id and int(row["checksum"]) == res.checksum
            assert bytes(row["digest"]) == res.digest


@given(
    klen=st.integers(1, 64),
    n=st.integers(1, 40),
    sizes=st.one_of(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**32 - 1),
                                                          min_size=40, max_size=40)),
    data=st.data(),
)
def test_alloc_of_uniform_keys_encodes_the_bytes_of_the_per_key_encoder(
    klen: int, n: int, sizes: int | list[int], data: st.DataObject,
) -> None:
    keys = [data.draw(st.binary(min_size=klen, max_size=klen)) for _ in range(n)]
    digests = [data.draw(st.binary(min_size=DIGEST_LEN, max_size=DIGEST_LEN)) for _ in range(n)]
    per_key = [sizes] * n if isinstance(sizes, int) else sizes[:n]
    fast = encode_alloc(keys, per_key, digests)
    assert fast == U32.pack(n) + b"".join(
        U16.pack(klen) + k + ALLOC_ITEM.pack(s, d) for k, s, d in zip(keys, per_key, digests,
                                                                      strict=True))
    assert decode_alloc(fast) == list(zip(keys, per_key, digests, strict=True))


@st.composite
def _batch_st(draw: st.DrawFn) -> tuple[list[bytes], list[bytes], list[int], list[int]]:
    """One call's keys, digests and sizes, as an engine (one key length, one
    size) or odder callers (several lengths, a bytearray, several sizes) pass
    them, and the sub-batch cut points."""
    n = draw(st.integers(1, 40))
    klen = draw(st.integers(1, 64))
    key = st.one_of(st.just(klen), st.integers(1, 64)) if draw(st.booleans()) else st.just(klen)
    keys: list[bytes] = [draw(st.binary(min_size=m, max_size=m)) for m in
                         (draw(key) for _ in range(n))]
    if draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        keys[i] = bytearray(keys[i])  # type: ignore[call-overload]
    digests = [draw(digest_st) for _ in range(n)]
    one = draw(st.integers(0, 2**32 - 1))
    sizes = draw(st.one_of(st.just([one] * n),
                           st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)))
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
    return keys, digests, sizes, cuts


@given(_batch_st())
def test_batch_encoder_encodes_each_sub_batch_as_the_per_request_encoders_do(
    batch: tuple[list[bytes], list[bytes], list[int], list[int]],
) -> None:
    keys, digests, sizes, cuts = batch
    put = BatchEncoder(keys, digests, sizes)
    get = BatchEncoder(keys, digests)
    bare = BatchEncoder(keys)
    for s, e in pairwise(cuts):
        assert put.alloc(s, e) == encode_alloc(keys[s:e], sizes[s:e], digests[s:e])
        assert put.keys(s, e) == bare.keys(s, e) == encode_keys(keys[s:e])
        assert get.get(s, e) == encode_get(keys[s:e], digests[s:e])
        assert decode_alloc(put.alloc(s, e)) == list(
            zip(map(bytes, keys[s:e]), sizes[s:e], digests[s:e], strict=True))


@given(_batch_st())
def test_a_part_of_a_batch_encoder_encodes_as_an_encoder_of_its_keys_does(
    batch: tuple[list[bytes], list[bytes], list[int], list[int]],
) -> None:
    keys, digests, sizes, cuts = batch
    whole = BatchEncoder(keys, digests, sizes)
    whole.keys(0, len(keys))  # one kind laid out before the parts, the others by them
    for s, e in pairwise(cuts):
        part, own = whole.part(s, e), BatchEncoder(keys[s:e], digests[s:e], sizes[s:e])
        assert part.uniform == whole.uniform  # a part's keys took the whole's path
        m = (e - s) // 2
        for a, b in ((0, e - s), (0, m), (m, e - s)):
            assert part.alloc(a, b) == own.alloc(a, b)
            assert part.get(a, b) == own.get(a, b)
            assert part.keys(a, b) == own.keys(a, b)
        # a part of a part starts where its parent does
        assert part.part(m, e - s).alloc(0, e - s - m) == own.alloc(m, e - s)
        with pytest.raises(ProtocolError, match="part"):
            part.part(0, e - s + 1)
    with pytest.raises(ProtocolError, match="part"):
        whole.part(1, 0)


def test_batch_encoder_refuses_what_the_per_request_encoders_refuse() -> None:
    digests = [bytes(DIGEST_LEN)] * 2
    with pytest.raises(ConfigError, match=r"^key must be .* got 0 bytes"):
        BatchEncoder([b"k1", b""], digests, [1, 1]).alloc(0, 2)
    with pytest.raises(ConfigError, match="digest must be 16 bytes, got 5 bytes"):
        BatchEncoder([b"k1", b"k2"], [bytes(DIGEST_LEN), b"short"]).get(0, 2)
    for sizes in ([2**32, 1], [-1, 1], [1.5, 1]):
        with pytest.raises((struct.error, TypeError)):
            BatchEncoder([b"k1", b"k2"], digests, sizes).alloc(0, 2)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="needs the keys' digests and sizes"):
        BatchEncoder([b"k1"], digests[:1]).alloc(0, 1)
    with pytest.raises(ProtocolError, match="needs the keys' digests"):
        BatchEncoder([b"k1"]).get(0, 1)
    # a key that is no bytes at all: the per-key path names it
    with pytest.raises(ConfigError, match="got str 'k2'"):
        BatchEncoder([b"k1", "k2"]).keys(0, 2)  # type: ignore[list-item]
    assert BatchEncoder([]).keys(0, 0) == encode_keys([])


def test_batch_encoder_is_uniform_only_when_every_item_is_valid() -> None:
    keys, digests, sizes = [b"k1", b"k2"], [bytes(DIGEST_LEN)] * 2, [1, 2]
    assert BatchEncoder(keys, digests, sizes).uniform
    assert BatchEncoder(keys, digests).uniform and BatchEncoder(keys).uniform
    # each breaks what a client's checks would otherwise have to check again
    off_path: list[tuple[list[Any], list[Any] | None, list[Any] | None]] = [
        ([b"k1", b"k22"], digests, sizes),  # two key lengths (valid, but no records)
        ([b"k1", bytearray(b"k2")], digests, sizes),  # a bytearray key (valid)
        ([b"k1", b""], digests, sizes),
        ([b"k1", b"x" * (MAX_KEY_LEN + 1)], None, None),
        ([b"k1", "k2"], None, None),
        (keys, [bytes(DIGEST_LEN), b"short"], None),
        (keys, [bytes(DIGEST_LEN), "x" * DIGEST_LEN], None),
        (keys, digests[:1], None),
        (keys, digests, [1, -1]),
        (keys, digests, [1, 2**32]),
        (keys, digests, [1, 1.5]),
        (keys, digests, [1, [1]]),  # unhashable: no TypeError here, the per-key path names it
        ([], None, None),
    ]
    for k, d, n in off_path:
        assert not BatchEncoder(k, d, n).uniform, (k, d, n)


@given(st.one_of(
    st.lists(st.sampled_from(AllocStatus), max_size=40),
    st.builds(lambda st_, n: [st_] * n, st.sampled_from(AllocStatus), st.integers(1, 40)),
))
def test_put_answer_roundtrip(statuses: list[AllocStatus]) -> None:
    """Mixed statuses and one status for all (the decoder's shortcut) alike."""
    payload = encode_put_answer(statuses)
    assert decode_put_answer(payload, len(statuses)) == statuses
    if statuses:
        with pytest.raises(ProtocolError, match="unknown status 238"):
            decode_put_answer(U32.pack(len(statuses)) + b"\xee" * len(statuses), len(statuses))


@given(klen=st.integers(1, 64), n=st.integers(0, 40), data=st.data())
def test_key_bytes_of_a_decoded_keys_request_are_its_keys_joined(
    klen: int, n: int, data: st.DataObject
) -> None:
    keys = [data.draw(st.binary(min_size=klen, max_size=klen)) for _ in range(n)]
    request = decode_keys_request(encode_keys(keys), "COMMIT")
    if n:
        assert request.key_bytes() == b"".join(keys)
    several = decode_keys_request(encode_keys([b"a", b"bc"]), "COMMIT")
    with pytest.raises(ProtocolError, match="several lengths"):
        several.key_bytes()


def test_alloc_refuses_what_does_not_fit_its_fields_on_every_path() -> None:
    keys, digests = [b"k1", b"k2"], [bytes(DIGEST_LEN)] * 2
    for sizes in ([2**32, 1], [-1, 1], [1.5, 1]):
        with pytest.raises((struct.error, TypeError)):
            encode_alloc(keys, sizes, digests)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_alloc(keys, [1], digests)  # counts differ
    with pytest.raises(ConfigError, match="digest must be 16 bytes"):
        encode_alloc(keys, [1, 1], [bytes(DIGEST_LEN), b"short"])
