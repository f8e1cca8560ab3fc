"""Frames for the BPF fuzz run (tests/system/dataplane/test_bpf_fuzz.py): the fuzz policy, the
addresses, MMH payloads valid and mutated, Ethernet frames built by hand with
``struct`` (scapy would need minutes for 100k packets), structural damage, and
what the BPF parser sees of a frame (its L3 and source address).

Every generator takes the ``random.Random`` it draws from, so a seed
reproduces a run."""

from __future__ import annotations

import ipaddress
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mmmesh import abi
from mmmesh.policy import Policy, parse_policy

ROOT = Path(__file__).resolve().parent.parent
TCP_FIN, TCP_RST = 0x01, 0x04

# --------------------------------------------------------------------------
# Policy: examples/policy.yaml (its source rule 10.0.99.0/24 -> video) plus
# classes with metadata conditions, a class reached only by id, a longer
# IPv4 prefix and an IPv6 source rule, so that the rules, the LPM and the
# claims are all exercised.  The default class stays the least privileged
# one, which the source-rule invariant below relies on.
# --------------------------------------------------------------------------
EXTRA_CLASSES: list[dict[str, Any]] = [
    {"name": "video-hfr", "id": 20, "match": {"modalities": ["video"],
     "fps": {"min": 50, "max": 240}}, "rate": "50mbit", "priority": 2, "dscp": 36},
    {"name": "voice-hq", "id": 21, "match": {"modalities": ["audio"],
     "bitrate": {"min": 256000}}, "rate": "2mbit", "priority": 1, "dscp": 46},
    {"name": "dense", "id": 22, "match": {"modalities": ["point_cloud", "tensor"],
     "density": {"min": 100000, "max": 5000000}}, "rate": "40mbit", "priority": 3},
    {"name": "bulk", "id": 40, "rate": "1mbit", "priority": 6, "dscp": 8},
]
EXTRA_SOURCE_RULES: list[dict[str, str]] = [
    {"prefix": "10.0.99.128/25", "max_class": "lidar"},
    {"prefix": "fd00:99::/64", "max_class": "best-effort"},
]


def fuzz_policy() -> Policy:
    raw = yaml.safe_load((ROOT / "examples" / "policy.yaml").read_text())
    raw["classes"] = list(raw["classes"]) + EXTRA_CLASSES
    raw["source_rules"] = list(raw.get("source_rules") or []) + EXTRA_SOURCE_RULES
    return parse_policy(raw)


# --------------------------------------------------------------------------
# Addresses
# --------------------------------------------------------------------------
def _v4(s: str) -> bytes:
    return ipaddress.IPv4Address(s).packed


def _v6(s: str) -> bytes:
    return ipaddress.IPv6Address(s).packed


SRC4 = [_v4(a) for a in ("10.0.1.5", "10.0.2.77", "192.168.1.1", "10.0.98.255", "10.0.100.0",
                         "10.0.99.0", "10.0.99.7", "10.0.99.127", "10.0.99.128", "10.0.99.255")]
SRC6 = [_v6(a) for a in ("fd00::1", "2001:db8::5", "fd00:99::5", "fd00:99::ffff",
                         "fd00:98::1", "::ffff:10.0.99.5", "::ffff:10.0.99.200",
                         "::ffff:10.0.1.5")]
DST4 = _v4("10.0.2.9")
DST6 = _v6("fd00::2")
MAPPED = b"\0" * 10 + b"\xff\xff"

ETH_P_IP, ETH_P_IPV6, ETH_P_8021Q, ETH_P_8021AD = 0x0800, 0x86DD, 0x8100, 0x88A8
MACS = bytes.fromhex("020000000002020000000001")
MAC_DST, MAC_SRC = "02:00:00:00:00:02", "02:00:00:00:00:01"  # scapy: no ARP/ND look-up

# Metadata values around the rule boundaries of fuzz_policy().
FPS_VALUES = [0, 1, 24, 30, 49, 50, 60, 120, 240, 241, 1000, 65535]
BITRATES = [0, 64000, 255999, 256000, 1536000, 0xFFFFFFFF]
DENSITIES = [0, 99999, 100000, 4999999, 5000000, 5000001, 0xFFFFFFFF]
KNOWN_TLV = {int(t) for t in abi.Tlv}
UNKNOWN_TLV = [t for t in range(256) if t not in KNOWN_TLV]


# --------------------------------------------------------------------------
# Frames
# --------------------------------------------------------------------------
@dataclass
class Frame:
    data: bytes
    proto: int = 0  # 6/17, 0 = not built as TCP/UDP
    l3: int = 0  # 4/6 as built
    l3_off: int = 0
    l4_off: int = 0
    payload: bytes = b""  # L4 payload (the UDP datagram's payload) as built
    src: bytes = b""  # 4 or 16 bytes as built
    consistent: bool = False  # L2-L4 exactly as built: the cross-check applies
    kind: str = ""
    sport: int = 0
    dport: int = 0
    tcp_flags: int = 0


def rand_tlvs(r: random.Random) -> list[bytes]:
    rnd = r.random
    out: list[bytes] = []
    if rnd() < 0.4:
        out.append(b"\x01\x04" + r.randbytes(4))
    if rnd() < 0.3:
        out.append(b"\x02\x08" + r.randbytes(8))
    if rnd() < 0.2:
        out.append(b"\x03\x08" + r.randbytes(8))
    if rnd() < 0.15:
        out.append(b"\x04\x08" + r.randbytes(8))
    if rnd() < 0.35:
        out.append(b"\x10\x02" + struct.pack("!H", r.choice(FPS_VALUES)))
    if rnd() < 0.35:
        out.append(b"\x11\x04" + struct.pack("!I", r.choice(BITRATES)))
    if rnd() < 0.35:
        out.append(b"\x12\x04" + struct.pack("!I", r.choice(DENSITIES)))
    if rnd() < 0.15:
        nd = r.randint(0, 8)
        out.append(bytes((0x20, 2 + 4 * nd, r.randint(0, 16), nd)) + r.randbytes(4 * nd))
    if rnd() < 0.1:
        out.append(b"\x30\x1a" + r.randbytes(26))
    if rnd() < 0.1:
        msg = r.choice([b"", b"ok", "d\u00e9j\u00e0 vu".encode(), b"\xff\xfe", b"bad \xc3"])
        out.append(bytes((0x40, 2 + len(msg))) + r.randbytes(2) + msg)
    for _ in range(r.choice((0, 0, 0, 1, 2))):
        ln = r.randint(0, 12)
        out.append(bytes((0, ln)) + bytes(ln))
    for _ in range(r.choice((0, 0, 0, 1, 2))):
        ln = r.randint(0, 10)
        out.append(bytes((r.choice(UNKNOWN_TLV), ln)) + r.randbytes(ln))
    r.shuffle(out)
    while out and 12 + sum(map(len, out)) > 255:
        out.pop()
    return out


def rand_preamble_fields(r: random.Random, class_ids: list[int]) -> tuple[int, int, int]:
    x = r.random()
    modality = r.randint(0, 7) if x < 0.85 else (r.randint(8, 255) if x < 0.95 else 0)
    x = r.random()
    sla = 0 if x < 0.5 else r.choice(class_ids) if x < 0.75 else r.choice((63, 64, 255, 1, 9, 15))
    if r.random() < 0.2:
        sla = r.randint(0, 255)
    flags = 0 if r.random() < 0.8 else r.randint(0, 255)
    return modality, sla, flags


def mmh_payload(r: random.Random, class_ids: list[int], mutate: float = 0.5) -> bytes:
    """A valid MMH frame (header + payload bytes), then maybe mutated."""
    modality, sla, flags = rand_preamble_fields(r, class_ids)
    tlvs = rand_tlvs(r)
    plen = r.choice((0, r.randint(0, 64), r.randint(0, 600)))
    body_tlvs = b"".join(tlvs)
    hl = 12 + len(body_tlvs)
    hdr = bytearray(struct.pack("!IBBBBI", 0x4D4D4801, hl, modality, sla, flags, plen) + body_tlvs)
    if r.random() < mutate:
        for _ in range(r.choice((1, 1, 1, 2, 3))):
            mutate_header(r, hdr)
    plen = struct.unpack_from("!I", hdr, 8)[0] if len(hdr) >= 12 else 0
    x = r.random()
    if x < 0.65:
        blen = plen  # exactly one frame
    elif x < 0.75:
        blen = plen + r.randint(1, 16)  # trailing bytes after the frame
    elif x < 0.85:
        blen = max(0, plen - r.randint(1, 4))  # payload does not fit
    else:
        blen = r.randint(0, 256)
    blen = min(blen, 1200)
    return bytes(hdr) + r.randbytes(blen)


def _set_hdr_len(h: bytearray, value: int) -> None:
    if len(h) > 4 and value <= 255:
        h[4] = value


def mutate_header(r: random.Random, h: bytearray) -> None:
    n = len(h)
    op = r.randrange(11)
    if op == 0 and n:  # bit flips
        for _ in range(r.randint(1, 3)):
            i = r.randrange(min(n, 12) if r.random() < 0.5 else n)
            h[i] ^= 1 << r.randrange(8)
    elif op == 1 and n > 4:  # random hdr_len
        h[4] = r.choice((0, 11, 12, 13, n - 1, n, n + 1, r.randint(0, 255))) & 0xFF
    elif op == 2 and n >= 12:  # payload_len
        v = r.choice((0, 1 << 30, (1 << 30) + 1, 0xFFFFFFFF, r.getrandbits(32), r.randint(0, 2000)))
        h[8:12] = struct.pack("!I", v)
    elif op == 3 and n > 12:  # random TLV bytes
        for _ in range(r.randint(1, 4)):
            h[r.randrange(12, n)] = r.getrandbits(8)
    elif op == 4 and n > 3:  # version
        h[3] = r.choice((0, 2, 0xFF, r.getrandbits(8)))
    elif op == 5 and n > 12:  # truncate the header
        del h[r.randrange(1, n):]
    elif op == 6:  # more TLVs: past MMH_MAX_TLVS sometimes
        k = r.randint(1, 18)
        h += b"\x00\x00" * k
        _set_hdr_len(h, len(h))
    elif op == 7 and n > 12:  # duplicate the first TLV
        ln = h[13] if n > 13 else 0
        h += h[12:14 + ln]
        _set_hdr_len(h, len(h))
    elif op == 8:  # a TLV with a random type and length
        t = r.getrandbits(8)
        ln = r.choice((0, 1, 2, 4, 8, 26, r.randint(0, 40)))
        h += bytes((t, ln)) + r.randbytes(r.choice((ln, ln, max(0, ln - 1))))
        _set_hdr_len(h, len(h) if r.random() < 0.8 else r.getrandbits(8))
    elif op == 9 and n > 12:  # odd byte left at the end of the TLVs
        h += b"\x00"
        _set_hdr_len(h, len(h))
    elif op == 10 and n > 12:  # a TENSOR TLV with wrong ndim / length
        nd = r.randint(0, 12)
        ln = r.choice((2 + 4 * nd, 2 + 4 * nd + 1, 1, 0))
        h += bytes((0x20, ln & 0xFF, 1, nd)) + bytes(4 * nd)
        _set_hdr_len(h, len(h))


def special_payload(r: random.Random) -> bytes:
    return r.choice((
        b"", b"M", b"MM", b"MMH", b"MMH\x01", b"MMH\x01\x0c", b"MMH\x01\x0c\x04\x00\x00",
        b"MMH\x01\x0c\x04\x00\x00\x00\x00\x00", b"MMH\x01\x0c\x04\x00\x00\x00\x00\x00\x00",
        b"MMH\x02\x0c\x04\x00\x00\x00\x00\x00\x00", b"MMI\x01\x0c\x04\x00\x00\x00\x00\x00\x00",
        b"\x4d\x4d\x48\x01\x0b\x04\x00\x00\x00\x00\x00\x00",
    )) + (r.randbytes(r.randint(0, 8)) if r.random() < 0.3 else b"")


def build_frame(r: random.Random, proto: int, payload: bytes, v6: bool | None = None,
                src: bytes | None = None, sport: int | None = None,
                dport: int | None = None) -> Frame:
    """An Ethernet frame whose lengths (IP, UDP) all agree with ``payload``."""
    out = bytearray(MACS)
    tags = r.choice((0, 0, 0, 0, 0, 0, 1, 1, 2))
    for _ in range(tags):
        out += struct.pack("!HH", r.choice((ETH_P_8021Q, ETH_P_8021AD)), r.getrandbits(12))
    if v6 is None:
        v6 = r.random() < 0.3
    if src is None:
        src = r.choice(SRC6 if v6 else SRC4)
    if sport is None:
        sport = r.randint(40000, 40015)
    if dport is None:
        dport = 7000 + (proto == 6)
    tcp_flags = 0
    tos = r.getrandbits(8) if r.random() < 0.5 else 0
    if proto == 17:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
    else:
        optw = r.choice((0, 0, 3, 3, r.randint(0, 10)))
        opts = (b"\x01\x01\x08\x0a" + r.randbytes(8))[: 4 * optw] if optw <= 3 \
            else r.randbytes(4 * optw)
        opts = opts.ljust(4 * optw, b"\x00")
        # PSH+ACK, ACK, SYN, FIN+ACK, RST+ACK, RST
        tcp_flags = r.choice((0x18, 0x18, 0x10, 0x10, 0x02, 0x11, 0x14, 0x04))
        l4 = struct.pack("!HHIIBBHHH", sport, dport, r.getrandbits(32), r.getrandbits(32),
                         (5 + optw) << 4, tcp_flags, 512, 0, 0) + opts
    if v6:
        out += struct.pack("!H", ETH_P_IPV6)
        l3_off = len(out)
        ext = b""
        nh = proto
        for _ in range(r.choice((0, 0, 0, 0, 1, 2, 3))):
            t = r.choice((0, 60, 43, 44, 51))
            if t == 44:
                eh = bytes((nh, 0)) + struct.pack("!H", r.choice((0, 1))) + r.randbytes(4)
            elif t == 51:
                eh = bytes((nh, 1, 0, 0)) + r.randbytes(8)
            elif t == 43:
                eh = bytes((nh, 0, 0, 0)) + bytes(4)
            else:
                eh = bytes((nh, 0, 1, 4)) + bytes(4)
            ext = eh + ext
            nh = t
        plen = len(ext) + len(l4) + len(payload)
        out += struct.pack("!IHBB16s16s", (6 << 28) | (tos << 20) | r.getrandbits(20), plen,
                           nh, 64, src, DST6)
        out += ext
    else:
        out += struct.pack("!H", ETH_P_IP)
        l3_off = len(out)
        optw = r.choice((0, 0, 0, 0, 1, 2, 10))
        opts = (b"\x01" * (4 * optw)) if r.random() < 0.5 else r.randbytes(4 * optw)
        tot = 20 + 4 * optw + len(l4) + len(payload)
        out += struct.pack("!BBHHHBBH4s4s", 0x40 | (5 + optw), tos, tot, r.getrandbits(16),
                           r.choice((0, 0x4000, 0x2000)), 64, proto, 0, src, DST4) + opts
    l4_off = len(out)
    out += l4
    out += payload
    if r.random() < 0.1:  # L2 padding behind the IP packet (ingress frames)
        out += r.randbytes(r.randint(1, 30))
    return Frame(bytes(out), proto, 6 if v6 else 4, l3_off, l4_off, payload, src,
                 consistent=tags <= abi.MAX_VLAN, sport=sport, dport=dport,
                 tcp_flags=tcp_flags)


def mutate_frame(r: random.Random, f: Frame) -> Frame:
    """Structural damage: the cross-check no longer applies, the invariants do."""
    b = bytearray(f.data)
    n = len(b)
    for _ in range(r.choice((1, 1, 2, 3))):
        op = r.randrange(10)
        if op == 0:
            for _ in range(r.randint(1, 8)):
                i = r.randrange(len(b))
                b[i] ^= 1 << r.randrange(8)
        elif op == 1 and len(b) > 15:
            del b[r.randint(14, len(b) - 1):]
        elif op == 2 and f.l3 == 4 and len(b) > f.l3_off:  # IHL
            b[f.l3_off] = (b[f.l3_off] & 0xF0) | r.getrandbits(4)
        elif op == 3 and f.l3 and len(b) > f.l3_off + 6:  # IPv4 tot_len / IPv6 payload_len
            o = f.l3_off + (2 if f.l3 == 4 else 4)
            b[o:o + 2] = struct.pack("!H", r.choice((0, 1, 20, n, n + 1, r.getrandbits(16))))
        elif op == 4 and f.proto == 17 and len(b) > f.l4_off + 6:  # UDP length
            v = r.choice((0, 7, 8, 9, len(f.payload) + 7, len(f.payload) + 9, r.getrandbits(16)))
            b[f.l4_off + 4:f.l4_off + 6] = struct.pack("!H", v)
        elif op == 5 and f.proto == 6 and len(b) > f.l4_off + 12:  # TCP data offset
            b[f.l4_off + 12] = r.getrandbits(4) << 4
        elif op == 6 and f.l3 == 4 and len(b) > f.l3_off + 8:  # fragment offset / MF
            b[f.l3_off + 6:f.l3_off + 8] = struct.pack("!H", r.getrandbits(16))
        elif op == 7 and len(b) > 13:  # ethertype / VLAN stacks
            b[12:14] = struct.pack("!H", r.choice((ETH_P_IP, ETH_P_IPV6, ETH_P_8021Q,
                                                   ETH_P_8021AD, r.getrandbits(16))))
        elif op == 8 and f.l3 and len(b) > f.l3_off + 10:  # protocol / next header
            o = f.l3_off + (9 if f.l3 == 4 else 6)
            b[o] = r.choice((0, 6, 17, 43, 44, 51, 60, 59, r.getrandbits(8)))
        elif op == 9:
            i = r.randrange(len(b))
            b[i:i + 8] = r.randbytes(8)
    while len(b) < 14:
        b.append(0)
    return Frame(bytes(b), f.proto, f.l3, f.l3_off, f.l4_off, f.payload, f.src, False,
                 sport=f.sport, dport=f.dport, tcp_flags=f.tcp_flags)


# --------------------------------------------------------------------------
# What the BPF program sees: the source address (IPv4 mapped) and where the
# DSCP lives.  Same L2/L3 walk as bpf/lib/parse.h.
# --------------------------------------------------------------------------
def bpf_l3(data: bytes) -> tuple[int, int, bytes | None]:
    """(4|6|0, l3 offset, 16-byte source as the flow key holds it, or None)."""
    if len(data) < 14:
        return 0, 0, None
    proto = (data[12] << 8) | data[13]
    off = 14
    for _ in range(abi.MAX_VLAN):
        if proto not in (ETH_P_8021Q, ETH_P_8021AD):
            break
        if len(data) < off + 4:
            return 0, 0, None
        proto = (data[off + 2] << 8) | data[off + 3]
        off += 4
    if proto == ETH_P_IP:
        if len(data) < off + 20 or (data[off] & 0x0F) < 5:
            return 0, 0, None
        return 4, off, MAPPED + data[off + 12:off + 16]
    if proto == ETH_P_IPV6:
        if len(data) < off + 40:
            return 0, 0, None
        return 6, off, data[off + 8:off + 24]
    return 0, 0, None




def csum16(b: bytes) -> int:
    """The Internet checksum of ``b`` (even length): 0 over a header whose
    checksum field is right."""
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def ipv4_header(data: bytes, l3_off: int) -> bytes | None:
    """The whole IPv4 header (options included) at ``l3_off``, None if cut short."""
    n = (data[l3_off] & 0x0F) * 4
    return data[l3_off:l3_off + n] if n >= 20 and l3_off + n <= len(data) else None


def with_ip_csum(f: Frame) -> Frame:
    """Fill in a correct IPv4 header checksum so that the incremental update of
    the DSCP rewrite can be checked."""
    if f.l3 != 4:
        return f
    d = bytearray(f.data)
    o = f.l3_off
    d[o + 10:o + 12] = b"\0\0"
    hdr = ipv4_header(bytes(d), o)
    if hdr is None:
        return f
    d[o + 10:o + 12] = struct.pack("!H", csum16(hdr))
    f.data = bytes(d)
    return f

