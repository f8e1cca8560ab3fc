"""Property tests for mmmesh.wire: only WireError escapes, encode/decode round-trips."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmmesh.abi import MMH_MAX_PAYLOAD, Flag, Tlv
from mmmesh.errors import WireError
from mmmesh.wire import (
    FrameReader,
    Header,
    TensorSpec,
    decode_frame,
    decode_header,
    encode_header,
    peek_class_inputs,
)

FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KNOWN_TYPES = {int(t) for t in Tlv}
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)


def opt(s: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.none() | s


headers = st.builds(
    Header,
    modality=u8,
    sla_class=u8,
    flags=st.sampled_from([0, int(Flag.ERROR), int(Flag.END_OF_STREAM), 3]) | u8,
    payload_len=st.integers(0, MMH_MAX_PAYLOAD),
    stream_id=opt(u32),
    sequence=opt(u64),
    timestamp_ns=opt(u64),
    deadline_ns=opt(u64),
    fps=opt(u16),
    bitrate=opt(u32),
    density=opt(u32),
    tensor=opt(st.builds(TensorSpec, u8, st.lists(u32, max_size=8).map(tuple))),
    traceparent=opt(st.binary(min_size=26, max_size=26)),
    error=opt(st.tuples(u16, st.text(max_size=20))),
    extra=st.lists(
        st.tuples(u8.filter(lambda t: t not in KNOWN_TYPES), st.binary(max_size=12)), max_size=4
    ).map(tuple),
)


def check_decode(data: bytes) -> None:
    """decode_header/decode_frame/peek on ``data``: a result or a WireError, nothing else."""
    for fn in (decode_header, decode_frame, peek_class_inputs):
        try:
            fn(data)
        except WireError as e:
            assert isinstance(e.reason, str) and 0 <= e.offset <= max(len(data), 12)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_wire_error(data: bytes) -> None:
    check_decode(data)
    check_decode(b"MMH\x01" + data)


@FAST
@given(headers, st.data())
def test_mutated_valid_headers_raise_only_wire_error(h: Header, data: st.DataObject) -> None:
    try:
        raw = bytearray(encode_header(h))
    except WireError:
        return
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw) - 1)) if raw else 0
        if op == "flip" and raw:
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[i] = data.draw(u8)
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    check_decode(bytes(raw))
    check_decode(raw)  # bytearray input too


@FAST
@given(headers)
def test_encode_decode_round_trip(h: Header) -> None:
    try:
        data = encode_header(h)
    except WireError as e:  # only size limits may refuse a generated header
        assert "at most" in e.reason or "max 255" in e.reason, e.reason
        return
    out = decode_header(data)
    assert out == h
    assert out.hdr_len == len(data) == data[4]
    assert encode_header(out) == data


@FAST
@given(st.binary(min_size=12, max_size=300))
def test_whatever_decodes_re_encodes_to_the_same_header(data: bytes) -> None:
    raw = b"MMH\x01" + data[1:]
    try:
        h = decode_header(raw)
    except WireError:
        return
    # reserved flag bits included (docs/wire-format.md 2.3): nothing to mask first
    again = encode_header(h)
    assert decode_header(again) == h and again[7] == raw[7]


@settings(max_examples=100, deadline=None)
@given(st.lists(headers, min_size=1, max_size=5), st.lists(st.integers(1, 64), min_size=1))
def test_frame_reader_any_chunking(hs: list[Header], cuts: list[int]) -> None:
    frames = []
    for i, h in enumerate(hs):
        payload = bytes([i]) * (i * 7)
        h = dataclasses.replace(h, payload_len=len(payload))
        try:
            frames.append((encode_header(h), h, payload))
        except WireError:
            continue
    stream = b"".join(raw + p for raw, _, p in frames)
    reader = FrameReader()
    got = []
    pos, k = 0, 0
    while pos < len(stream):
        n = cuts[k % len(cuts)]
        reader.feed(stream[pos : pos + n])
        pos, k = pos + n, k + 1
        got.extend((h, bytes(p)) for h, p in reader)
    reader.close()
    assert got == [(h, p) for _, h, p in frames]


@FAST
@given(st.binary(max_size=400), st.integers(1, 50))
def test_frame_reader_garbage_raises_only_wire_error(data: bytes, step: int) -> None:
    reader = FrameReader(max_payload=1000)
    try:
        for i in range(0, len(data), step):
            reader.feed(b"MMH\x01" + data[i : i + step] if i == 0 else data[i : i + step])
            for _ in reader:
                pass
        reader.close()
    except WireError:
        pass
