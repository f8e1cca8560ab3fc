"""The scapy MMH layer builds the encoder's bytes and dissects them."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.packet import Padding, Raw

from mmmesh.abi import DType, Flag, Modality
from mmmesh.wire import Header, TensorSpec, decode_header, encode_header, traceparent_from_text
from mmmesh.wire.scapy_layer import (
    MMH,
    MMHTLV,
    bind_mmh_port,
    header_from_mmh,
    mmh_from_header,
    unbind_mmh_port,
)

TRACE_TEXT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PORT = 7000


@pytest.fixture(scope="module", autouse=True)
def _bound() -> Iterator[None]:
    bind_mmh_port(PORT)
    yield
    unbind_mmh_port(PORT)


def test_minimal_build_equals_encoder() -> None:
    assert bytes(MMH(modality="audio", sla_class=3)) == encode_header(Header(Modality.AUDIO, 3))


def test_brief_example_builds_and_dissects() -> None:
    pkt = (
        IP()
        / UDP(dport=PORT)
        / MMH(modality="audio", tlvs=[MMHTLV(type="stream_id", value=struct.pack("!I", 7))])
        / Raw(b"pcm-bytes")
    )
    expected = encode_header(Header(Modality.AUDIO, stream_id=7, payload_len=9)) + b"pcm-bytes"
    assert bytes(pkt[MMH]) == expected
    back = IP(bytes(pkt))
    assert MMH in back and back[MMH].modality == Modality.AUDIO
    assert back[MMH].tlvs[0].value == b"\x00\x00\x00\x07"
    assert back[Raw].load == b"pcm-bytes"


def test_all_fields_build_equals_encoder() -> None:
    trace = traceparent_from_text(TRACE_TEXT)
    h = Header(
        Modality.POINT_CLOUD,
        sla_class=2,
        flags=int(Flag.END_OF_STREAM),
        payload_len=5,
        stream_id=9,
        sequence=10,
        timestamp_ns=11,
        deadline_ns=12,
        fps=13,
        bitrate=14,
        density=120_000,
        tensor=TensorSpec(DType.FP32, (120_000, 4)),
        traceparent=trace,
        error=(7, "oops"),
        extra=((0x99, b"xy"),),
    )
    pkt = MMH(
        modality="lidar",
        sla_class=2,
        flags="END_OF_STREAM",
        tlvs=[
            MMHTLV(type="stream_id", value=9),
            MMHTLV(type="sequence", value=10),
            MMHTLV(type="timestamp_ns", value=11),
            MMHTLV(type="deadline_ns", value=12),
            MMHTLV(type="fps", value=13),
            MMHTLV(type="audio_bitrate", value=14),
            MMHTLV(type="point_density", value=struct.pack("!I", 120_000)),
            MMHTLV(type="tensor", value=TensorSpec(DType.FP32, (120_000, 4))),
            MMHTLV(type="traceparent", value=TRACE_TEXT),
            MMHTLV(type="error", value=(7, "oops")),
            MMHTLV(type=0x99, value=b"xy"),
        ],
    ) / Raw(b"12345")
    assert bytes(pkt) == encode_header(h) + b"12345"
    assert header_from_mmh(pkt) == h


@pytest.mark.parametrize("modality", list(Modality))
def test_dissects_encoder_output(modality: Modality) -> None:
    h = Header(modality, sla_class=4, stream_id=1, fps=25, payload_len=3)
    pkt = MMH(encode_header(h) + b"abc" + b"tail")
    assert pkt.magic == b"MMH" and pkt.version == 1
    assert pkt.hdr_len == len(encode_header(h))
    assert pkt.modality == modality and pkt.sla_class == 4 and pkt.payload_len == 3
    assert [t.type for t in pkt.tlvs] == [0x01, 0x10]
    assert pkt.tlvs[0].len == 4 and pkt.tlvs[1].value == b"\x00\x19"
    assert pkt[Raw].load == b"abc"
    assert pkt[Padding].load == b"tail"


def test_show_uses_names_and_decoded_values() -> None:
    h = Header(Modality.VIDEO, stream_id=42, tensor=TensorSpec(DType.FP16, (3, 2)))
    text = mmh_from_header(h.with_traceparent(TRACE_TEXT)).show(dump=True)
    assert "modality  = video" in text
    assert "stream_id" in text and "42" in text
    assert "FP16[3, 2]" in text and TRACE_TEXT in text


def test_mmh_from_header_and_payload_len_auto() -> None:
    h = Header(Modality.AUDIO, bitrate=64000)
    pkt = mmh_from_header(h, payload=b"x" * 10)
    data = bytes(pkt)
    assert decode_header(data).payload_len == 10 and data.endswith(b"x" * 10)
    assert bytes(mmh_from_header(h)) == encode_header(h)


def test_hdr_len_recomputed_after_editing_tlvs() -> None:
    pkt = mmh_from_header(Header(Modality.TEXT))
    pkt.tlvs = [MMHTLV(type="sequence", value=1)]
    assert decode_header(bytes(pkt)).sequence == 1


def test_tcp_binding_and_continuation_is_raw() -> None:
    pkt = IP() / TCP(sport=PORT, dport=40000) / MMH(modality="video") / b"data"
    assert MMH in IP(bytes(pkt))
    cont = IP() / TCP(sport=PORT, dport=40000) / b"not a header"
    assert MMH not in IP(bytes(cont))


def test_udp_build_sets_dport() -> None:
    pkt = IP(bytes(IP() / UDP() / MMH(modality="control")))
    assert pkt[UDP].dport == PORT and MMH in pkt


def test_unbind_restores_dissection() -> None:
    data = bytes(IP() / UDP(sport=1234, dport=PORT) / MMH(modality="audio"))
    unbind_mmh_port(PORT)
    try:
        assert MMH not in IP(data)
    finally:
        bind_mmh_port(PORT)
    assert MMH in IP(data)


def test_reserved_flag_bits_survive_scapy_both_ways() -> None:
    """docs/wire-format.md 2.3: reserved bits are kept, in the layer as in the codec."""
    pkt = MMH(modality="audio", flags=0x81)
    assert decode_header(bytes(pkt)).flags == 0x81
    h = Header(Modality.AUDIO, flags=0xFC, stream_id=1)
    assert bytes(mmh_from_header(h)) == encode_header(h)
    assert MMH(encode_header(h)).flags == 0xFC and header_from_mmh(MMH(encode_header(h))) == h
