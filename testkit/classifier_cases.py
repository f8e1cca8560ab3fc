"""The classifier's packet table: {description, frame, expected reason, class,
modality, ...} rows, shared by tests/system/dataplane/test_classifier.py
(egress mode htb, two builds) and tests/system/dataplane/test_egress_fq.py
(the same rows in egress mode fq).  TCP rows depend on the rows before them:
run them in order through one classifier (one flow table)."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import (
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
)
from scapy.layers.l2 import ARP, Dot1AD, Dot1Q, Ether
from scapy.packet import Raw

from mmmesh import abi as _abi
from mmmesh.policy import load_policy
from mmmesh.wire import Header, encode_header

__all__ = [
    "BATCH",
    "DST",
    "EXAMPLE",
    "ROWS",
    "SRC",
    "VOICE",
    "M",
    "Row",
    "hdr",
    "raw_hdr",
    "tcp",
    "tlv",
    "udp",
    "udp6",
    "udp_len",
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = load_policy(ROOT / "examples" / "policy.yaml")
M = _abi.Modality
SRC = "10.0.1.2"  # unrestricted pod
BATCH = "10.0.99.7"  # in the example's 10.0.99.0/24 source rule (max_class: video)
DST = "10.0.2.2"


def hdr(modality: int, **kw: object) -> bytes:
    return encode_header(Header(modality=modality, **kw))  # type: ignore[arg-type]


def raw_hdr(modality: int, tlvs: bytes = b"", *, hdr_len: int | None = None, version: int = 1,
            sla_class: int = 0, payload_len: int = 0, magic: bytes = b"MMH") -> bytes:
    """A header built by hand, so that it can be wrong on purpose."""
    hl = 12 + len(tlvs) if hdr_len is None else hdr_len
    return magic + struct.pack("!BBBBBI", version, hl, modality, sla_class, 0, payload_len) + tlvs


def tlv(t: int, value: bytes, length: int | None = None) -> bytes:
    return struct.pack("!BB", t, len(value) if length is None else length) + value


def udp(payload: bytes, src: str = SRC, dst: str = DST) -> bytes:
    return bytes(Ether() / IP(src=src, dst=dst) / UDP(sport=40000, dport=7000) / Raw(payload))


def udp_len(data: bytes, ulen: int, *, mf: bool = False, trailer: bytes = b"") -> bytes:
    """IPv4/UDP whose UDP length field is ``ulen`` whatever ``data`` holds; ``mf``
    makes it a first fragment, ``trailer`` is Ethernet padding after the IP packet."""
    ip = IP(src=SRC, dst=DST, proto=17, flags="MF" if mf else 0)
    return bytes(Ether() / ip / Raw(struct.pack("!HHHH", 40000, 7000, ulen, 0) + data)) + trailer


def udp6(payload: bytes, *ext: object, src: str = "fd00::1") -> bytes:
    pkt = IPv6(src=src, dst="fd00::2")
    for e in ext:
        pkt = pkt / e
    return bytes(Ether() / pkt / UDP(sport=40000, dport=7000) / Raw(payload))


def tcp(payload: bytes, sport: int = 41000, src: str = SRC, options: object = None) -> bytes:
    t = TCP(sport=sport, dport=7001, flags="PA", seq=1000)
    if options is not None:
        t.options = options
    return bytes(Ether() / IP(src=src, dst=DST) / t / Raw(payload))


@dataclass
class Row:
    desc: str
    frame: bytes
    reason: str
    cls: str | None
    modality: str | int | None = None
    clamped: bool = False
    direction: str = "egress"
    ref: dict[str, object] | None = field(default=None)  # reference classifier inputs


VOICE = hdr(M.AUDIO, stream_id=7, sequence=1, bitrate=1_200_000, payload_len=0)


def rows() -> Iterator[Row]:
    # --- every modality, IPv4 UDP --------------------------------------
    expect = {
        M.TEXT: "best-effort", M.IMAGE: "video", M.VIDEO: "video", M.AUDIO: "voice",
        M.POINT_CLOUD: "lidar", M.CONTROL: "control", M.TENSOR: "best-effort",
        M.UNSPEC: "best-effort",
    }
    for m, cls in expect.items():
        yield Row(f"udp {m.name.lower()}", udp(hdr(m, stream_id=1)), "parsed", cls,
                  m.name.lower(), ref={"modality": int(m), "src_ip": SRC})
    yield Row("udp unknown modality 99 (reported as a number)", udp(raw_hdr(99)), "parsed",
              "best-effort", 99, ref={"modality": 99})
    yield Row("udp modality 255 (cb's no-modality marker) is still 255 when parsed",
              udp(raw_hdr(255)), "parsed", "best-effort", 255, ref={"modality": 255})
    yield Row("udp with payload", udp(hdr(M.AUDIO, payload_len=100) + b"\0" * 100), "parsed",
              "voice", "audio")
    # --- L2/L3 variants -----------------------------------------------
    yield Row("ipv6 udp audio", udp6(VOICE), "parsed", "voice", "audio")
    yield Row("802.1Q vlan audio", bytes(Ether() / Dot1Q(vlan=10) / IP(src=SRC, dst=DST)
              / UDP(sport=1, dport=2) / Raw(VOICE)), "parsed", "voice", "audio")
    yield Row("QinQ 802.1ad+802.1Q audio", bytes(Ether() / Dot1AD(vlan=5) / Dot1Q(vlan=10)
              / IP(src=SRC, dst=DST) / UDP(sport=1, dport=2) / Raw(VOICE)), "parsed", "voice",
              "audio")
    yield Row("ipv4 options audio", bytes(Ether() / IP(src=SRC, dst=DST, options=b"\x01" * 8)
              / UDP(sport=1, dport=2) / Raw(VOICE)), "parsed", "voice", "audio")
    yield Row("ipv6 hop-by-hop + dstopts + routing", udp6(
        VOICE, IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt(), IPv6ExtHdrRouting()),
        "parsed", "voice", "audio")
    yield Row("ipv6 first fragment", udp6(VOICE, IPv6ExtHdrFragment(offset=0, m=1, id=5)),
              "parsed", "voice", "audio")
    yield Row("ipv6 non-first fragment", udp6(VOICE, IPv6ExtHdrFragment(offset=8, id=5)),
              "not_mesh", "best-effort")
    yield Row("ipv4 non-first fragment", bytes(Ether() / IP(src=SRC, dst=DST, frag=4, proto=17)
              / Raw(VOICE)), "not_mesh", "best-effort")
    # --- IP fragments and the UDP length (docs/wire-format.md 6 and 7) ---
    big = hdr(M.AUDIO, payload_len=1000)
    yield Row("ipv4 first fragment: frame fits the UDP length, not the fragment",
              udp_len(big + bytes(88), 8 + 12 + 1000, mf=True), "parsed", "voice", "audio")
    yield Row("ipv4 first fragment: header cut by the fragment end",
              udp_len(big[:8], 8 + 12 + 1000, mf=True), "malformed", "best-effort")
    yield Row("ipv6 first fragment: frame fits the UDP length, not the fragment", bytes(
        Ether() / IPv6(src="fd00::1", dst="fd00::2") / IPv6ExtHdrFragment(offset=0, m=1, id=6, nh=17)
        / Raw(struct.pack("!HHHH", 1, 2, 8 + 12 + 1000, 0) + big + bytes(50))),
        "parsed", "voice", "audio")
    yield Row("UDP length shorter than the IP payload bounds the frame",
              udp_len(hdr(M.AUDIO, payload_len=20) + bytes(20), 8 + 12 + 10), "malformed",
              "best-effort")
    yield Row("bytes after the UDP length are not read", udp_len(VOICE + b"MMH\x02" * 10,
              8 + len(VOICE)), "parsed", "voice", "audio")
    yield Row("frame shorter than the datagram: trailing bytes ignored",
              udp(VOICE + b"\0" * 30), "parsed", "voice", "audio")
    yield Row("payload only in the L2 padding does not count", udp_len(
        hdr(M.AUDIO, payload_len=10), 8 + 12, trailer=bytes(10)), "malformed", "best-effort")
    yield Row("UDP length below 8: an empty datagram", udp_len(VOICE, 4), "not_mesh",
              "best-effort")
    # --- TCP flows ------------------------------------------------------
    opts = [("MSS", 1460), ("NOP", None), ("WScale", 7), ("SAckOK", b""), ("Timestamp", (1, 2))]
    yield Row("tcp first segment (options) video", tcp(hdr(M.VIDEO, fps=60, payload_len=5000)
              + b"v" * 500, options=opts), "parsed", "video", "video")
    yield Row("tcp later segment, no header", tcp(b"v" * 1000, options=opts), "flow_hit",
              "video", "video")
    yield Row("tcp pure ack on the flow", bytes(Ether() / IP(src=SRC, dst=DST)
              / TCP(sport=41000, dport=7001, flags="A")), "flow_hit", "video", "video")
    yield Row("tcp next message, other modality", tcp(hdr(M.CONTROL, payload_len=10)
              + b"c" * 10), "parsed", "control", "control")
    yield Row("tcp later segment follows the update", tcp(b"c" * 100), "flow_hit", "control",
              "control")
    yield Row("tcp a third header re-classifies the flow again", tcp(hdr(M.VIDEO, payload_len=9)
              + b"v" * 9), "parsed", "video", "video")
    yield Row("tcp continuation after it: video", tcp(b"v" * 10), "flow_hit", "video", "video")
    yield Row("tcp back to control", tcp(hdr(M.CONTROL, payload_len=9) + b"c" * 9), "parsed",
              "control", "control")
    yield Row("ipv4 later fragment between the flow's hosts is not matched to the flow", bytes(
        Ether() / IP(src=SRC, dst=DST, proto=6, frag=100) / Raw(b"c" * 100)), "not_mesh",
        "best-effort")
    yield Row("tcp other flow without header", tcp(b"x" * 100, sport=42000), "not_mesh",
              "best-effort")
    yield Row("tcp mid-flow bytes like a broken header keep the flow's class",
              tcp(b"MMH\x02" + b"c" * 60), "malformed", "control", "control")
    yield Row("ingress header on the same 5-tuple learns an ingress flow only", tcp(
        hdr(M.AUDIO, payload_len=10) + b"a" * 10), "parsed", "voice", "audio",
        direction="ingress")
    yield Row("egress flow unaffected by the ingress claim", tcp(b"c" * 100), "flow_hit",
              "control", "control")
    yield Row("FIN segment still has the flow's class", bytes(
        Ether() / IP(src=SRC, dst=DST) / TCP(sport=41000, dport=7001, flags="FA")),
        "flow_hit", "control", "control")
    yield Row("after FIN the flow is gone", tcp(b"c" * 100), "not_mesh", "best-effort")
    fin_hdr = bytes(Ether() / IP(src=SRC, dst=DST) / TCP(sport=47000, dport=7001, flags="FPA")
                    / Raw(hdr(M.AUDIO, payload_len=5) + b"a" * 5))
    yield Row("FIN segment with a header: classified by its header", fin_hdr, "parsed", "voice",
              "audio")
    yield Row("...and its flow is removed after it", tcp(b"a" * 10, sport=47000), "not_mesh",
              "best-effort")
    yield Row("RST: a flow learnt", tcp(hdr(M.VIDEO, payload_len=5) + b"v" * 5, sport=48000),
              "parsed", "video", "video")
    yield Row("RST segment still has the flow's class", bytes(Ether() / IP(src=SRC, dst=DST)
              / TCP(sport=48000, dport=7001, flags="R")), "flow_hit", "video", "video")
    yield Row("after RST the flow is gone", tcp(b"v" * 10, sport=48000), "not_mesh",
              "best-effort")
    # --- not mesh -----------------------------------------------------
    yield Row("udp random payload", udp(b"hello, world" * 3), "not_mesh", "best-effort")
    yield Row("udp empty payload", udp(b""), "not_mesh", "best-effort")
    yield Row("udp 3-byte payload MMH (truncated)", udp(b"MMH"), "malformed", "best-effort")
    yield Row("udp 3-byte payload not magic", udp(b"MMX"), "not_mesh", "best-effort")
    yield Row("wrong magic", udp(b"MMX" + VOICE[3:]), "not_mesh", "best-effort")
    yield Row("icmp", bytes(Ether() / IP(src=SRC, dst=DST) / ICMP()), "not_mesh", "best-effort")
    yield Row("arp", bytes(Ether() / ARP()), "not_mesh", "best-effort")
    yield Row("bare ethernet header", b"\x00" * 14, "not_mesh", "best-effort")
    yield Row("ipv4 header cut short", bytes(Ether() / IP(src=SRC, dst=DST, ihl=15) / UDP())[:40], "not_mesh",
              "best-effort")
    # --- malformed ------------------------------------------------------
    yield Row("unsupported version", udp(raw_hdr(M.AUDIO, version=2)), "malformed",
              "best-effort")
    yield Row("truncated preamble", udp(b"MMH\x01\x0c\x04"), "malformed", "best-effort")
    yield Row("hdr_len below preamble", udp(raw_hdr(M.AUDIO, hdr_len=8)), "malformed",
              "best-effort")
    yield Row("hdr_len past the packet", udp(raw_hdr(M.AUDIO, hdr_len=200)), "malformed",
              "best-effort")
    yield Row("TLV value past the header", udp(raw_hdr(
        M.AUDIO, tlv(_abi.Tlv.STREAM_ID, b"\0\0\0\1", length=9), hdr_len=18) + b"\0" * 16),
        "malformed", "best-effort")
    yield Row("TLV header past the header", udp(raw_hdr(M.AUDIO, b"\x01", hdr_len=13)),
              "malformed", "best-effort")
    yield Row("zero-length known TLV", udp(raw_hdr(M.AUDIO, tlv(_abi.Tlv.STREAM_ID, b""))),
              "malformed", "best-effort")
    yield Row("wrong-length fps TLV", udp(raw_hdr(M.VIDEO, tlv(_abi.Tlv.VIDEO_FPS, b"\0\0\0"))),
              "malformed", "best-effort")
    yield Row("duplicate TLV", udp(raw_hdr(M.AUDIO, tlv(1, b"\0\0\0\1") * 2)), "malformed",
              "best-effort")
    yield Row("17 TLVs", udp(raw_hdr(M.AUDIO, tlv(0x7F, b"") * 17)), "malformed", "best-effort")
    yield Row("tensor ndim/len mismatch", udp(raw_hdr(
        M.TEXT, tlv(_abi.Tlv.TENSOR, bytes([11, 2]) + b"\0" * 4))), "malformed", "best-effort")
    yield Row("payload_len past the datagram", udp(raw_hdr(M.AUDIO, payload_len=1000)),
              "malformed", "best-effort")
    yield Row("payload_len above 1 GiB", bytes(Ether() / IP(src=SRC, dst=DST)
              / TCP(sport=43000, dport=1, flags="PA") / Raw(raw_hdr(M.AUDIO, payload_len=(1 << 30) + 1))),
              "malformed", "best-effort")
    # --- legal oddities -------------------------------------------------
    yield Row("zero-length unknown TLV skipped", udp(raw_hdr(M.AUDIO, tlv(0x7F, b""))),
              "parsed", "voice", "audio")
    yield Row("PAD TLVs skipped", udp(raw_hdr(M.AUDIO, tlv(0, b"") + tlv(0, b"\0" * 5))),
              "parsed", "voice", "audio")
    yield Row("16 TLVs is the limit", udp(raw_hdr(M.AUDIO, tlv(0x7F, b"") * 16)), "parsed",
              "voice", "audio")
    yield Row("max-size header (255 bytes)", udp(raw_hdr(M.AUDIO, tlv(0, b"\0" * 241))),
              "parsed", "voice", "audio")
    # --- claims and escalation ------------------------------------------
    yield Row("request class by id (voice) for video", udp(hdr(M.VIDEO, sla_class=11)),
              "parsed", "voice", "video", ref={"modality": int(M.VIDEO), "sla_class": 11})
    yield Row("unknown class id falls back to modality", udp(hdr(M.VIDEO, sla_class=40)),
              "parsed", "video", "video", ref={"modality": int(M.VIDEO), "sla_class": 40})
    yield Row("restricted source claims voice -> video", udp(VOICE, src=BATCH), "parsed",
              "video", "audio", clamped=True, ref={"modality": int(M.AUDIO), "src_ip": BATCH})
    yield Row("restricted source requests control id -> video", udp(
        hdr(M.VIDEO, sla_class=10), src=BATCH), "parsed", "video", "video", clamped=True,
        ref={"modality": int(M.VIDEO), "sla_class": 10, "src_ip": BATCH})
    yield Row("restricted source may have lidar (lower rank)", udp(
        hdr(M.POINT_CLOUD, density=100000), src=BATCH), "parsed", "lidar", "point_cloud",
        ref={"modality": int(M.POINT_CLOUD), "src_ip": BATCH})
    yield Row("restricted source, tcp flow learnt clamped", tcp(
        hdr(M.CONTROL, payload_len=100) + b"c" * 100, sport=44000, src=BATCH), "parsed",
        "video", "control", clamped=True)
    yield Row("restricted flow keeps the clamped class", tcp(b"c" * 10, sport=44000, src=BATCH),
              "flow_hit", "video", "control")
    # --- ingress ----------------------------------------------------------
    yield Row("ingress audio", udp(VOICE), "parsed", "voice", "audio", direction="ingress")
    yield Row("ingress not mesh", udp(b"x" * 20), "not_mesh", "best-effort",
              direction="ingress")


ROWS = list(rows())
