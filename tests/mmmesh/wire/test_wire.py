"""MMH v1 encoder/decoder (mmmesh.wire): round trips, malformed input, framing, docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mmmesh import wire
from mmmesh.abi import (
    MMH_MAX_PAYLOAD,
    MMH_MAX_TLVS,
    TLV_FIXED_LEN,
    DType,
    Flag,
    Modality,
    Tlv,
)
from mmmesh.cli.wire import header_to_json
from mmmesh.errors import MeshError, WireError
from mmmesh.wire import (
    Header,
    TensorSpec,
    decode_frame,
    decode_header,
    encode_header,
    frame,
    peek_class_inputs,
)
from mmmesh.wire import _codec as _wire_codec
from mmmesh.wire import _header as _wire_header
from mmmesh.wire import _stream as _wire_stream
from mmmesh.wire import _text as _wire_text
from testkit.mmh_bytes import raw_header, tlv
from testkit.wire_cases import MALFORMED, ORDER

DOC = Path(__file__).resolve().parents[3] / "docs" / "wire-format.md"
TRACE_TEXT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE = bytes.fromhex("004bf92f3577b34da6a3ce929d0e0e473600f067aa0ba902b701")


FULL = Header(
    modality=Modality.POINT_CLOUD,
    sla_class=63,
    flags=int(Flag.END_OF_STREAM),
    payload_len=1234,
    stream_id=0xFFFFFFFF,
    sequence=2**64 - 1,
    timestamp_ns=1_700_000_000_123_456_789,
    deadline_ns=1_700_000_000_223_456_789,
    fps=60,
    bitrate=1_200_000,
    density=120_000,
    tensor=TensorSpec(DType.FP32, (120_000, 4)),
    traceparent=TRACE,
    error=(503, "überlastet"),
    extra=((0x99, b"xyz"), (0xF0, b"")),
)


# --------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------
@pytest.mark.parametrize("modality", [*Modality, 8, 200, 255])
def test_every_modality_round_trips(modality: int) -> None:
    h = Header(modality=modality, sla_class=5, payload_len=10)
    data = encode_header(h)
    assert len(data) == 12 and data[5] == modality
    out = decode_header(data)
    assert out == h and out.hdr_len == 12
    assert out.modality_name == (
        Modality(modality).name.lower() if modality in set(Modality) else str(modality)
    )


@pytest.mark.parametrize(
    ("field", "value", "typ", "length"),
    [
        ("stream_id", 7, Tlv.STREAM_ID, 4),
        ("stream_id", 2**32 - 1, Tlv.STREAM_ID, 4),
        ("sequence", 2**64 - 1, Tlv.SEQUENCE, 8),
        ("timestamp_ns", 1_700_000_000_000_000_000, Tlv.TIMESTAMP_NS, 8),
        ("deadline_ns", 0, Tlv.DEADLINE_NS, 8),
        ("fps", 65535, Tlv.VIDEO_FPS, 2),
        ("bitrate", 1_200_000, Tlv.AUDIO_BITRATE, 4),
        ("density", 120_000, Tlv.POINT_DENSITY, 4),
        ("tensor", TensorSpec(DType.BF16, ()), Tlv.TENSOR, 2),
        ("tensor", TensorSpec(DType.INT8, tuple(range(1, 9))), Tlv.TENSOR, 34),
        ("tensor", TensorSpec(200, (2**32 - 1,)), Tlv.TENSOR, 6),
        ("traceparent", TRACE, Tlv.TRACEPARENT, 26),
        ("error", (0, ""), Tlv.ERROR, 2),
        ("error", (65535, "bad ✓"), Tlv.ERROR, 2 + len("bad ✓".encode())),
    ],
)
def test_each_tlv_round_trips(field: str, value: object, typ: int, length: int) -> None:
    h = Header(modality=Modality.TENSOR, **{field: value})  # type: ignore[arg-type]
    data = encode_header(h)
    assert data[12] == typ and data[13] == length and len(data) == 14 + length
    assert data[4] == len(data)
    out = decode_header(data)
    assert out == h
    assert getattr(out, field) == value


def test_all_fields_round_trip() -> None:
    data = encode_header(FULL)
    out = decode_header(data)
    assert out == FULL and hash(out) == hash(FULL)
    assert out.hdr_len == len(data) and out.frame_len == len(data) + 1234
    assert out.traceparent_text == TRACE_TEXT
    assert out.tensor is not None and out.tensor.dtype_name == "FP32" and out.tensor.ndim == 2


def test_encoder_emits_known_tlvs_in_type_order_then_extra() -> None:
    data = encode_header(FULL)
    types, off = [], 12
    while off < len(data):
        types.append(data[off])
        off += 2 + data[off + 1]
    assert types == [1, 2, 3, 4, 0x10, 0x11, 0x12, 0x20, 0x30, 0x40, 0x99, 0xF0]


def test_decoder_accepts_any_tlv_order_pad_and_unknown() -> None:
    body = (
        tlv(0x10, b"\x00\x1e")
        + tlv(0, b"")
        + tlv(0x77, b"abc")
        + tlv(0, b"\x00\x00\x00")
        + tlv(0x01, b"\x00\x00\x00\x05")
        + tlv(0x77, b"")
    )
    out = decode_header(raw_header(body))
    assert out.fps == 30 and out.stream_id == 5
    assert out.extra == ((0x77, b"abc"), (0x77, b""))
    assert decode_header(encode_header(out)) == out


def test_reserved_flag_bits_are_kept_and_written_back() -> None:
    """docs/wire-format.md 2.3: decode keeps reserved bits, encode writes them as
    given, so re-encoding a decoded header gives back the same bytes."""
    out = decode_header(raw_header(flags=0xFE))
    assert out.flags == 0xFE and out.flags & Flag.END_OF_STREAM
    assert encode_header(Header(4, flags=0x81))[7] == 0x81
    data = raw_header(tlv(1, b"\x00\x00\x00\x07") + tlv(0x99, b"x"), flags=0xFD, plen=3)
    assert encode_header(decode_header(data)) == data
    assert header_to_json(decode_header(data))["flags"] == 0xFD


def test_decoder_accepts_memoryview_and_bytearray_and_trailing_bytes() -> None:
    data = encode_header(FULL) + b"payload..."
    for buf in (bytearray(data), memoryview(data), memoryview(bytearray(data))):
        assert decode_header(buf) == FULL


def test_tensor_spec_shape_becomes_tuple() -> None:
    spec = TensorSpec(DType.FP32, [2, 3])  # type: ignore[arg-type]
    assert spec.shape == (2, 3) and hash(spec)
    assert decode_header(encode_header(Header(7, tensor=spec))).tensor == spec


def test_decoder_table_matches_abi_fixed_lengths() -> None:
    for typ, (_, fixed, _, _) in _wire_codec._DECODERS.items():
        assert TLV_FIXED_LEN[Tlv(typ)] == (None if fixed < 0 else fixed)
    assert set(_wire_codec._DECODERS) == {int(t) for t in Tlv} - {Tlv.PAD}


@pytest.mark.parametrize("align", [1, 2, 4, 8, 16, 64])
def test_align_pads_with_a_pad_tlv(align: int) -> None:
    for h in (Header(4), Header(3, stream_id=1), FULL):
        data = encode_header(h, align=align)
        assert len(data) % align == 0
        assert decode_header(data) == h


def test_align_one_byte_gap_uses_one_more_unit() -> None:
    h = Header(4, fps=1, bitrate=2, density=3, stream_id=4)  # 12 + 4 + 6*3 = 34
    assert len(encode_header(h)) == 34
    assert len(encode_header(h, align=7)) == 42  # 34 -> 35 impossible, so 42


# --------------------------------------------------------------------------
# Encoder validation
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"modality": 256}, "modality 256 does not fit"),
        ({"modality": -1}, "modality"),
        ({"modality": 4, "sla_class": 300}, "sla_class"),
        ({"modality": 4, "flags": 0x100}, "flags 256 does not fit"),
        ({"modality": 4, "payload_len": MMH_MAX_PAYLOAD + 1}, "payload_len"),
        ({"modality": 4, "payload_len": 2**32}, "payload_len"),
        ({"modality": 4, "stream_id": 2**32}, "stream_id"),
        ({"modality": 4, "sequence": -1}, "sequence"),
        ({"modality": 4, "fps": 65536}, "fps"),
        ({"modality": 4, "bitrate": 1.5}, "bitrate must be an int"),
        ({"modality": 4, "density": True}, "density must be an int"),
        ({"modality": 4, "tensor": TensorSpec(1, (1,) * 9)}, "9 dims"),
        ({"modality": 4, "tensor": TensorSpec(256, ())}, "dtype"),
        ({"modality": 4, "tensor": TensorSpec(1, (2**32,))}, r"shape\[0\]"),
        ({"modality": 4, "traceparent": b"short"}, "26 raw bytes"),
        ({"modality": 4, "error": (70000, "x")}, "error code"),
        ({"modality": 4, "error": (1, "x" * 254)}, "max 255"),
        ({"modality": 4, "extra": ((0x01, b"1234"),)}, "known type"),
        ({"modality": 4, "extra": ((0x00, b""),)}, "known type"),
        ({"modality": 4, "extra": ((0x99, b""),) * 17}, "17 TLVs"),
        ({"modality": 4, "extra": ((0x99, b"x" * 200), (0x98, b"y" * 50))}, "at most 255"),
    ],
)
def test_encode_rejects_out_of_range(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(WireError, match=pattern) as ei:
        encode_header(Header(**kwargs))  # type: ignore[arg-type]
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, MeshError)


def test_encode_limits_exactly_reachable() -> None:
    h = Header(4, extra=tuple((0x80 + i, b"") for i in range(MMH_MAX_TLVS)))
    assert decode_header(encode_header(h)) == h
    big = Header(4, extra=((0x99, b"x" * 241),))
    assert len(encode_header(big)) == 255
    assert decode_header(encode_header(big)) == big






@pytest.mark.parametrize(
    ("data", "pattern", "offset"), [pytest.param(d, p, o, id=name) for name, d, p, o in ORDER]
)
def test_reading_order(data: bytes, pattern: str, offset: int) -> None:
    with pytest.raises(WireError) as ei:
        decode_header(data)
    assert re.search(pattern, ei.value.reason), ei.value.reason
    assert ei.value.offset == offset


@pytest.mark.parametrize(
    ("message", "index"),
    [
        (b"ok\xff", 2),  # a byte that never starts a code point
        (b"x\x80", 1),  # a lone continuation byte
        (b"\xe2\x82A", 0),  # wrong continuation: the lead byte
        (b"abc\xc3", 3),  # cut short by the end of the message
        (b"d\xc3\xa9j\xf0\x9f\x98", 4),  # valid code points first
        (b"\xc0\x80", 0),  # overlong (C0, C1 never valid)
        (b"\xe0\x80\x80", 0),  # overlong 3-byte
        (b"\xf0\x80\x80\x80", 0),  # overlong 4-byte
        (b"\xed\xa0\x80", 0),  # surrogate
        (b"\xf4\x90\x80\x80", 0),  # above U+10FFFF
        (b"\xf5\x80\x80\x80", 0),  # F5..FF never valid
    ],
)
def test_error_utf8_offset_is_the_first_ill_formed_sequence(message: bytes, index: int) -> None:
    """Step 7k: the offset is the first byte of the first ill-formed sequence."""
    pad = tlv(0x99, b"ab")  # the ERROR TLV at 16, its message at 20
    with pytest.raises(WireError, match="not valid UTF-8") as ei:
        decode_header(raw_header(pad + tlv(0x40, b"\x00\x07" + message)))
    assert ei.value.offset == 20 + index


@pytest.mark.parametrize(
    ("data", "pattern", "offset"),
    [pytest.param(d, p, o, id=name) for name, d, p, o in MALFORMED],
)
def test_malformed(data: bytes, pattern: str, offset: int) -> None:
    with pytest.raises(WireError) as ei:
        decode_header(data)
    assert re.search(pattern, ei.value.reason), ei.value.reason
    assert ei.value.offset == offset
    assert str(ei.value) == f"malformed MMH at byte {offset}: {ei.value.reason}"


def test_truncated_everywhere() -> None:
    data = encode_header(FULL)
    for n in range(len(data)):
        with pytest.raises(WireError) as ei:
            decode_header(data[:n])
        assert ei.value.reason == "truncated" and ei.value.offset == n


def test_payload_len_max_is_legal() -> None:
    assert decode_header(raw_header(plen=MMH_MAX_PAYLOAD)).payload_len == MMH_MAX_PAYLOAD


def test_pad_and_unknown_may_be_zero_length_and_repeat() -> None:
    out = decode_header(raw_header(tlv(0, b"") * 8 + tlv(0xEE, b"") * 8))
    assert out.extra == ((0xEE, b""),) * 8


# --------------------------------------------------------------------------
# Frames, zero copy
# --------------------------------------------------------------------------
def test_frame_scatter_gather_no_copy() -> None:
    payload = bytearray(b"\x01" * 1000)
    bufs = frame(Header(Modality.AUDIO, stream_id=3), payload)
    assert len(bufs) == 2
    hdr, view = bufs
    assert isinstance(view, memoryview) and view.obj is payload
    assert decode_header(hdr).payload_len == 1000
    payload[0] = 0x42
    assert view[0] == 0x42


def test_frame_accepts_typed_memoryview() -> None:
    import array

    arr = array.array("f", [1.0, 2.0, 3.0])
    hdr, view = frame(Header(Modality.TENSOR), arr)
    assert decode_header(hdr).payload_len == 12 and len(view) == 12


def test_decode_frame_payload_shares_memory() -> None:
    buf = bytearray(b"".join(frame(Header(Modality.VIDEO, fps=30), b"abcdef")) + b"next")
    h, payload = decode_frame(buf)
    assert h.fps == 30 and bytes(payload) == b"abcdef"
    assert payload.obj is buf
    buf[h.hdr_len or 0] = ord("X")
    assert bytes(payload) == b"Xbcdef"


def test_decode_frame_of_memoryview_keeps_underlying_object() -> None:
    data = b"".join(frame(Header(Modality.TEXT), b"hello"))
    _, payload = decode_frame(memoryview(data))
    assert payload.obj is data and payload.readonly


def test_decode_frame_truncated_payload() -> None:
    data = b"".join(frame(Header(Modality.TEXT), b"hello"))
    with pytest.raises(WireError) as ei:
        decode_frame(data[:-1])
    assert ei.value.reason == "truncated payload" and ei.value.offset == len(data) - 1


def test_peek_class_inputs() -> None:
    data = encode_header(Header(Modality.VIDEO, sla_class=7, stream_id=1))
    assert peek_class_inputs(data) == (3, 7)
    assert peek_class_inputs(data[:8]) == (3, 7)
    with pytest.raises(WireError, match="truncated"):
        peek_class_inputs(data[:7])
    with pytest.raises(WireError, match="bad magic"):
        peek_class_inputs(b"GET / HTTP/1.1")
    with pytest.raises(WireError, match="unsupported version 9"):
        peek_class_inputs(b"MMH\x09" + bytes(8))
    with pytest.raises(WireError, match="hdr_len"):
        peek_class_inputs(raw_header(hdr_len=5))


# --------------------------------------------------------------------------
# Names, trace context, public API
# --------------------------------------------------------------------------
def test_parse_modality_names_and_aliases() -> None:
    assert wire.parse_modality("AUDIO") == Modality.AUDIO
    assert wire.parse_modality("voice") == Modality.AUDIO
    for alias in ("lidar", "pointcloud", "point_cloud", "point-cloud"):
        assert wire.parse_modality(alias) == Modality.POINT_CLOUD
    assert wire.parse_modality("42") == 42
    with pytest.raises(ValueError, match="valid: unspec, text"):
        wire.parse_modality("smell")
    with pytest.raises(ValueError):
        wire.parse_modality("256")


def test_traceparent_text_round_trip() -> None:
    raw = wire.traceparent_from_text(TRACE_TEXT)
    assert raw == TRACE and wire.traceparent_to_text(raw) == TRACE_TEXT
    h = Header(Modality.TEXT).with_traceparent(TRACE_TEXT)
    assert decode_header(encode_header(h)).traceparent_text == TRACE_TEXT
    for bad in ("", "00-xyz", TRACE_TEXT.upper(), "ff" + TRACE_TEXT[2:], TRACE_TEXT + "-00"):
        with pytest.raises(ValueError):
            wire.traceparent_from_text(bad)
    with pytest.raises(ValueError):
        wire.traceparent_to_text(b"abc")


def test_public_api() -> None:
    assert set(wire.__all__) == {
        "Buffer",
        "FrameReader",
        "Header",
        "MODALITY_ALIASES",
        "TRACEPARENT_LEN",
        "TensorSpec",
        "decode_frame",
        "decode_header",
        "encode_header",
        "frame",
        "modality_from_name",
        "modality_name",
        "modality_names",
        "parse_modality",
        "peek_class_inputs",
        "traceparent_from_text",
        "traceparent_to_text",
    }
    parts = (_wire_codec, _wire_header, _wire_stream, _wire_text)
    # every public name of the private modules is re-exported as the same object...
    exported = {name: getattr(m, name) for m in parts for name in m.__all__}
    assert set(exported) == set(wire.__all__)
    for name, obj in exported.items():
        assert getattr(wire, name) is obj, name
    # ...and nothing public defined in them is left out of their __all__
    for m in parts:
        defined = {
            name
            for name, obj in vars(m).items()
            if not name.startswith("_") and getattr(obj, "__module__", None) == m.__name__
        }
        assert defined - set(m.__all__) <= {"byte_view", "check_magic", "read_preamble"}, m


def test_header_is_frozen_and_hdr_len_not_compared() -> None:
    import dataclasses

    h = Header(Modality.TEXT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.modality = 2  # type: ignore[misc]
    assert decode_header(encode_header(h)) == h  # hdr_len differs, still equal
    with pytest.raises(ValueError):
        _ = h.frame_len


# --------------------------------------------------------------------------
# docs/wire-format.md examples
# --------------------------------------------------------------------------
def doc_examples() -> list[tuple[bytes, dict[str, object]]]:
    """(header bytes, expected decode JSON) for every ```hex block and the json after it."""
    text = DOC.read_text()
    blocks = re.findall(r"```(hex|json)\n(.*?)```", text, flags=re.DOTALL)
    out = []
    for i, (kind, body) in enumerate(blocks):
        if kind != "hex":
            continue
        assert blocks[i + 1][0] == "json", "every hex example is followed by its json"
        hexdigits = "".join(line.split("#", 1)[0] for line in body.splitlines())
        out.append((bytes.fromhex("".join(hexdigits.split())), json.loads(blocks[i + 1][1])))
    return out


def test_docs_have_at_least_three_examples() -> None:
    examples = doc_examples()
    assert len(examples) >= 3
    modalities = {e[1]["modality"] for e in examples}
    assert {"audio", "video", "point_cloud"} <= modalities


@pytest.mark.parametrize("index", range(3))
def test_docs_example_decodes_as_documented(index: int) -> None:
    data, documented = doc_examples()[index]
    h = decode_header(data)
    expected = {key: None for key in header_to_json(h)}
    expected["extra"] = []
    expected.update(documented)
    assert header_to_json(h) == expected
    assert encode_header(h) == data  # the encoder produces exactly the documented bytes


def test_frame_of_a_zero_size_array() -> None:
    import numpy as np

    bufs = frame(Header(modality=7), np.zeros((0, 3), dtype=np.float32))
    assert b"".join(bytes(b) for b in bufs)[8:12] == b"\0\0\0\0"  # payload_len 0
