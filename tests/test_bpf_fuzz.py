"""Fuzzing the real TC classifier with BPF_PROG_TEST_RUN.

About 180,000 random and mutated frames go through one private copy of
``mm_egress`` (and some through ``mm_ingress``).  Every frame must pass
(TC_ACT_OK), get the priority of a class of the policy, keep every byte but
the DSCP (and the IPv4 checksum), and never get a class more privileged than
the source rule covering its source address allows.  For well-formed UDP and
TCP frames the verdict is also cross-checked against the pure-Python decoder
(``mmmesh.wire.decode_header``) and reference classifier
(``mmmesh.policy.reference_verdict``).

The bulk of the frames is built by hand with ``struct`` (scapy is used for
a few templates only): scapy would need minutes for 100k packets.

Reproduce a failure with ``MMMESH_FUZZ_SEED=<seed printed in the failure>``;
``MMMESH_FUZZ_SCALE`` (default 1.0) scales the packet counts.
"""

from __future__ import annotations

import ipaddress
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "BPF fuzzing needs root (BPF_PROG_TEST_RUN)"
    try:
        import bcc  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure means no bcc
        return f"bcc is not importable ({e})"
    return None


_why = _unavailable()
if _why is not None:
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {_why}", pytrace=False)
    pytest.skip(_why, allow_module_level=True)

from mmmesh import _abi  # noqa: E402
from mmmesh._errors import DataplaneError, WireError  # noqa: E402
from mmmesh.dataplane.classify import Classifier, Verdict  # noqa: E402
from mmmesh.policy import Policy, parse_policy, reference_verdict  # noqa: E402
from mmmesh.wire import Header, decode_header, encode_header  # noqa: E402

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("MMMESH_FUZZ_SEED", "20240611"))
SCALE = float(os.environ.get("MMMESH_FUZZ_SCALE", "1.0"))
MAX_REPORTED = 12

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
KNOWN_TLV = {int(t) for t in _abi.Tlv}
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
                src: bytes | None = None, sport: int | None = None) -> Frame:
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
    dport = 7000 + (proto == 6)
    tos = r.getrandbits(8) if r.random() < 0.5 else 0
    if proto == 17:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
    else:
        optw = r.choice((0, 0, 3, 3, r.randint(0, 10)))
        opts = (b"\x01\x01\x08\x0a" + r.randbytes(8))[: 4 * optw] if optw <= 3 \
            else r.randbytes(4 * optw)
        opts = opts.ljust(4 * optw, b"\x00")
        l4 = struct.pack("!HHIIBBHHH", sport, dport, r.getrandbits(32), r.getrandbits(32),
                         (5 + optw) << 4, r.choice((0x18, 0x10, 0x02, 0x11)), 512, 0, 0) + opts
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
                 consistent=tags <= _abi.MAX_VLAN)


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
    return Frame(bytes(b), f.proto, f.l3, f.l3_off, f.l4_off, f.payload, f.src, False)


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
    for _ in range(_abi.MAX_VLAN):
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


# --------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------
@dataclass
class Fuzzer:
    clf: Classifier
    policy: Policy
    seed: int
    failures: list[str] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        p = self.policy
        self.classid = {c.id: c.classid for c in p.classes}
        self.rank = {c.id: p.rank(c) for c in p.classes}
        self.name_rank = {c.name: p.rank(c) for c in p.classes}
        self.dscp = {c.id: c.dscp for c in p.classes}
        self.class_ids = sorted(self.classid)
        self.video_rank = p.rank("video")
        rules = []
        for sr in p.source_rules:
            net = sr.lpm_prefix
            rules.append((net.prefixlen, int(net.network_address), int(net.netmask),
                          self.name_rank[sr.max_class], sr.max_class))
        self.rules = sorted(rules, reverse=True)  # longest prefix first
        self.restricted24 = ipaddress.IPv6Network("::ffff:10.0.99.0/120")

    # -- helpers ---------------------------------------------------------
    def cap(self, src16: bytes) -> tuple[int, str] | None:
        a = int.from_bytes(src16, "big")
        for _, net, mask, rank, name in self.rules:
            if a & mask == net:
                return rank, name
        return None

    def fail(self, what: str, f: Frame, v: Verdict, direction: str, extra: str = "") -> None:
        self.stats["failures"] += 1
        if len(self.failures) < MAX_REPORTED:
            self.failures.append(
                f"{what} [{f.kind}, {direction}] {extra}\n  verdict: reason={v.reason} "
                f"class={v.class_} id={v.class_id} prio={v.priority:#x} mod={v.modality} "
                f"clamped={v.clamped} retval={v.retval}\n  frame: {f.data.hex()}"
            )

    def report(self) -> str:
        return (f"seed {self.seed} (rerun with MMMESH_FUZZ_SEED={self.seed}): "
                f"{self.stats['failures']} failures, first {len(self.failures)}:\n"
                + "\n".join(self.failures))

    # -- one frame ---------------------------------------------------------
    def run(self, f: Frame, direction: str = "egress") -> Verdict | None:
        """Runs one frame and checks the invariants; None if the kernel refused it."""
        d = f.data
        et = (d[12] << 8) | d[13]
        try:
            v = self.clf.run(d, direction)
        except DataplaneError:
            # BPF_PROG_TEST_RUN itself refuses (EINVAL, seen on 6.18) Ethernet
            # frames whose ethertype announces IPv4/IPv6 but that are shorter
            # than the IP header: the program never sees them.
            if (et == ETH_P_IP and len(d) < 14 + 20) or (et == ETH_P_IPV6 and len(d) < 14 + 40):
                self.stats["kernel_refused_short_ip"] += 1
                return None
            raise
        self.stats[f"{direction}:{v.reason}"] += 1
        self.stats["frames"] += 1
        if v.verdict != "pass" or v.retval != 0:
            self.fail("verdict is not TC_ACT_OK", f, v, direction)
        if direction == "ingress":
            # ingress classifies and counts but never sets skb->priority
            if v.priority != 0 or (v.class_id and v.class_id not in self.classid):
                self.fail("ingress set a priority or a class not in the policy", f, v,
                          direction)
        elif v.class_id not in self.classid or v.priority != self.classid[v.class_id]:
            if not (v.priority == 0 and v.class_id == 0):
                self.fail("priority/class not from the policy", f, v, direction)
            else:  # a policy is loaded, so the default class always applies
                self.fail("no class although a policy is loaded", f, v, direction)
        l3, l3_off, src = bpf_l3(f.data)
        if src is not None and v.class_id in self.rank:
            cap = self.cap(src)
            if cap is not None and self.rank[v.class_id] < cap[0]:
                self.fail(f"class ranks above the source rule's max_class {cap[1]!r}",
                          f, v, direction)
            addr = ipaddress.IPv6Address(src)
            if addr in self.restricted24:
                self.stats["restricted_src"] += 1
                if self.rank[v.class_id] < self.video_rank:
                    self.fail("10.0.99.0/24 got a class above video", f, v, direction)
        self.check_bytes(f, v, direction, l3, l3_off)
        return v

    def check_bytes(self, f: Frame, v: Verdict, direction: str, l3: int, l3_off: int) -> None:
        """Only the DSCP (and the IPv4 checksum) may change, only on egress."""
        out, inp = v.packet, f.data
        if out == inp:
            if v.dscp_rewritten:
                self.fail("DSCP flag set but the frame is unchanged", f, v, direction)
            return
        if not v.dscp_rewritten or direction != "egress" or len(out) != len(inp) or not l3:
            self.fail("frame changed", f, v, direction, f"out={out.hex()}")
            return
        self.stats["dscp_rewritten"] += 1
        want = self.dscp.get(v.class_id)
        if l3 == 4:
            allowed = {l3_off + 1, l3_off + 10, l3_off + 11}
            got = out[l3_off + 1] >> 2
        else:
            allowed = {l3_off, l3_off + 1}
            got = ((out[l3_off] & 0x0F) << 2) | (out[l3_off + 1] >> 6)
        diff = {i for i in range(len(out)) if out[i] != inp[i]}
        if not diff <= allowed or got != want:
            self.fail("DSCP rewrite touched other bytes or wrote the wrong DSCP", f, v,
                      direction, f"dscp={got} want={want} diff={sorted(diff)} out={out.hex()}")
        elif l3 == 4 and _csum16(inp[l3_off:l3_off + 20]) == 0 \
                and _csum16(out[l3_off:l3_off + 20]) != 0 and (inp[l3_off] & 0x0F) == 5:
            self.fail("IPv4 checksum broken by the DSCP rewrite", f, v, direction)

    # -- cross-check with the Python decoder and reference ------------------
    def cross_check(self, f: Frame, v: Verdict, direction: str) -> None:
        pay = f.payload
        if f.proto == 17 and 0 < len(pay) < 3 and b"MMH".startswith(pay):
            # A datagram holding only the start of the magic: truncated.
            if v.reason != "malformed":
                self.fail("UDP datagram with a truncated magic not malformed", f, v, direction)
            self.stats["xc:short_magic"] += 1
            return
        if not pay.startswith(b"MMH"):
            if f.proto == 17 and v.reason != "not_mesh":
                self.fail("UDP payload without magic not not_mesh", f, v, direction)
            elif f.proto == 6 and v.reason not in ("not_mesh", "flow_hit"):
                self.fail("TCP payload without magic neither not_mesh nor flow_hit", f, v,
                          direction)
            self.stats["xc:no_magic"] += 1
            return
        if len(pay) < 4 and f.proto == 6:
            # TCP: a segment this short is continuation data, never a header.
            self.stats["xc:short_tcp_skipped"] += 1
            return
        h, err, utf8_fixed = decode_structure(pay)
        if utf8_fixed:
            self.stats["xc:invalid_utf8_ignored"] += 1
        if err is not None:
            self.stats["xc:malformed"] += 1
            if v.reason != "malformed":
                self.fail("Python decoder refuses the header, BPF does not", f, v, direction,
                          f"python: {err}")
            return
        assert h is not None and h.hdr_len is not None
        fits = h.hdr_len + h.payload_len <= len(pay)
        if f.proto == 17 and not fits:
            self.stats["xc:udp_frame_does_not_fit"] += 1
            if v.reason != "malformed":
                self.fail("UDP frame larger than its datagram not malformed", f, v, direction)
            return
        self.stats["xc:parsed"] += 1
        if v.reason != "parsed":
            self.fail("Python decodes the header, BPF does not", f, v, direction,
                      f"python: {h}")
            return
        src_ip = ipaddress.IPv4Address(f.src) if len(f.src) == 4 else ipaddress.IPv6Address(f.src)
        ref = reference_verdict(self.policy, h.modality, h.sla_class, fps=h.fps,
                                bitrate=h.bitrate, density=h.density, src_ip=src_ip)
        # Modality 255 is legal on the wire but is also cb's NO_MODALITY marker,
        # which Verdict reports as None.
        mod = None if h.modality == _abi.NO_MODALITY else \
            _abi.Modality(h.modality).name.lower() if h.modality in _MODS \
            else f"unknown-{h.modality}"
        if v.class_id != ref.cls.id or v.clamped != ref.clamped or v.modality != mod:
            self.fail("BPF and the reference classifier disagree", f, v, direction,
                      f"reference: class={ref.cls.name} via={ref.via} clamped={ref.clamped} "
                      f"modality={mod}; header={h}")
        self.stats[f"xc:via_{ref.via}"] += 1
        if ref.clamped:
            self.stats["xc:clamped"] += 1


_MODS = {int(m) for m in _abi.Modality}


def decode_structure(pay: bytes) -> tuple[Header | None, WireError | None, bool]:
    """decode_header without the UTF-8 check of ERROR messages, which the
    classifier documents it does not make (docs/wire-format.md section 3):
    each invalid byte the decoder reports is replaced with 'a' and the header
    decoded again.  Returns (header, error, whether a byte was replaced)."""
    buf = pay
    fixed = False
    for _ in range(256):
        try:
            return decode_header(buf), None, fixed
        except WireError as e:
            if "UTF-8" not in e.reason:
                return None, e, fixed
            buf = buf[:e.offset] + b"a" + buf[e.offset + 1:]
            fixed = True
    raise AssertionError(f"decode_structure did not converge on {pay.hex()}")


def _csum16(b: bytes) -> int:
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _with_ip_csum(f: Frame) -> Frame:
    """Fill in a correct IPv4 header checksum (20-byte headers) so the incremental
    update of the DSCP rewrite can be checked."""
    if f.l3 != 4 or (f.data[f.l3_off] & 0x0F) != 5:
        return f
    d = bytearray(f.data)
    o = f.l3_off
    d[o + 10:o + 12] = b"\0\0"
    d[o + 10:o + 12] = struct.pack("!H", _csum16(bytes(d[o:o + 20])))
    f.data = bytes(d)
    return f


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy() -> Policy:
    return fuzz_policy()


@pytest.fixture(scope="module")
def clf(policy: Policy) -> Iterator[Classifier]:
    c = Classifier(policy)
    yield c
    c.close()


@pytest.fixture
def fuzzer(clf: Classifier, policy: Policy, request: pytest.FixtureRequest) -> Fuzzer:
    # One sub-seed per test: each test is reproducible on its own.
    return Fuzzer(clf, policy, SEED + sum(map(ord, request.node.name)))


def _n(count: int) -> int:
    return max(1, int(count * SCALE))


def _run_all(fz: Fuzzer, gen: Callable[[random.Random], Iterator[tuple[Frame, str, bool]]],
             count: int) -> None:
    r = random.Random(fz.seed)
    t0 = time.monotonic()
    done = 0
    for f, direction, xcheck in gen(r):
        v = fz.run(f, direction)
        if v is None:
            continue
        if xcheck and f.consistent:
            fz.cross_check(f, v, direction)
        done += 1
        if done >= count:
            break
    dt = time.monotonic() - t0
    print(f"\n{done} frames in {dt:.1f} s, seed {fz.seed}: "
          + ", ".join(f"{k}={c}" for k, c in sorted(fz.stats.items())))
    assert not fz.failures, fz.report()


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------
def test_policy_has_the_restricted_source(policy: Policy) -> None:
    rules = {str(r.prefix): r.max_class for r in policy.source_rules}
    assert rules["10.0.99.0/24"] == "video"
    assert policy.rank(policy.default) == len(policy.classes) - 1  # least privileged


def test_random_bytes(fuzzer: Fuzzer) -> None:
    """Random bytes, and random bytes behind valid L2/L3 headers."""
    def gen(r: random.Random) -> Iterator[tuple[Frame, str, bool]]:
        while True:
            x = r.random()
            if x < 0.5:
                data = r.randbytes(r.randint(14, 400))
                if r.random() < 0.5:  # make the ethertype interesting
                    data = data[:12] + struct.pack("!H", r.choice(
                        (ETH_P_IP, ETH_P_IPV6, ETH_P_8021Q, ETH_P_8021AD))) + data[14:]
                f = Frame(data, kind="random")
            else:
                proto = r.choice((6, 17))
                f = build_frame(r, proto, r.randbytes(r.randint(0, 300)))
                f = Frame(f.data[:f.l3_off] + r.randbytes(len(f.data) - f.l3_off),
                          kind="random-l3")
            yield f, ("ingress" if r.random() < 0.1 else "egress"), False
    _run_all(fuzzer, gen, _n(20_000))


def test_udp_mmh_cross_check(fuzzer: Fuzzer) -> None:
    """Well-formed UDP frames with valid, mutated and odd MMH headers: the verdict
    must agree with decode_header + reference_verdict."""
    ids = fuzzer.class_ids

    def gen(r: random.Random) -> Iterator[tuple[Frame, str, bool]]:
        while True:
            x = r.random()
            pay = mmh_payload(r, ids, mutate=0.5) if x < 0.9 else \
                special_payload(r) if x < 0.97 else r.randbytes(r.randint(0, 40))
            f = _with_ip_csum(build_frame(r, 17, pay))
            f.kind = "udp-mmh"
            yield f, ("ingress" if r.random() < 0.1 else "egress"), True
    _run_all(fuzzer, gen, _n(80_000))
    assert fuzzer.stats["xc:parsed"] > _n(10_000)
    assert fuzzer.stats["xc:malformed"] > _n(5_000)
    assert fuzzer.stats["xc:clamped"] > _n(500)
    assert fuzzer.stats["xc:via_rule"] > _n(500)


def test_tcp_flows(fuzzer: Fuzzer) -> None:
    """TCP segments with and without headers on a small set of flows (learning,
    updates, hits), cross-checked like UDP for segments that start with a header."""
    ids = fuzzer.class_ids

    def gen(r: random.Random) -> Iterator[tuple[Frame, str, bool]]:
        while True:
            x = r.random()
            if x < 0.5:
                pay = mmh_payload(r, ids, mutate=0.3)
            elif x < 0.55:
                pay = special_payload(r)
            else:
                pay = r.randbytes(r.randint(0, 1200))
                if pay.startswith(b"MMH"):
                    pay = b"X" + pay
            f = _with_ip_csum(build_frame(r, 6, pay, sport=r.randint(40000, 40007)))
            f.kind = "tcp"
            yield f, ("ingress" if r.random() < 0.15 else "egress"), True
    _run_all(fuzzer, gen, _n(30_000))
    assert fuzzer.stats["egress:flow_hit"] > _n(1_000)


def test_structural_mutations(fuzzer: Fuzzer) -> None:
    """Damaged L2-L4: bit flips, truncation, IHL, lengths, data offsets, fragments,
    ethertypes, next headers.  Invariants only (the frames are not well-formed)."""
    ids = fuzzer.class_ids

    def gen(r: random.Random) -> Iterator[tuple[Frame, str, bool]]:
        while True:
            proto = r.choice((6, 17, 17))
            pay = mmh_payload(r, ids, mutate=0.3) if r.random() < 0.8 else special_payload(r)
            f = mutate_frame(r, build_frame(r, proto, pay, sport=r.randint(40000, 40007)))
            f.kind = f"mutated-{proto}"
            yield f, ("ingress" if r.random() < 0.1 else "egress"), False
    _run_all(fuzzer, gen, _n(50_000))


def test_scapy_templates(fuzzer: Fuzzer) -> None:
    """A few frames built with scapy and the MMH layer, as an independent check of
    the hand-built frames."""
    from scapy.layers.inet import IP, TCP, UDP  # noqa: PLC0415
    from scapy.layers.inet6 import IPv6, IPv6ExtHdrHopByHop  # noqa: PLC0415
    from scapy.layers.l2 import Dot1Q, Ether  # noqa: PLC0415
    from scapy.packet import Raw  # noqa: PLC0415

    from mmmesh.scapy_mmh import MMH, MMHTLV  # noqa: PLC0415

    body = b"\0" * 64
    eth = Ether(dst=MAC_DST, src=MAC_SRC)
    cases = [
        (eth / IP(src="10.0.1.5", dst="10.0.2.9") / UDP(sport=5000, dport=7000)
         / MMH(modality="audio", tlvs=[MMHTLV(type="bitrate", value=300000)]) / Raw(body),
         "voice-hq", False),
        (eth / Dot1Q(vlan=5) / IP(src="10.0.99.5", dst="10.0.2.9")
         / UDP(sport=5001, dport=7000) / MMH(modality="control") / Raw(body), "video", True),
        (eth / IPv6(src="::ffff:10.0.99.200", dst="fd00::2") / IPv6ExtHdrHopByHop()
         / UDP(sport=5002, dport=7000) / MMH(modality="control") / Raw(body), "lidar", True),
        (eth / IP(src="10.0.99.200", dst="10.0.2.9") / UDP(sport=5005, dport=7000)
         / MMH(modality="video", tlvs=[MMHTLV(type="fps", value=60)]) / Raw(body),
         "video-hfr", False),
        (eth / IP(src="10.0.1.5", dst="10.0.2.9", options=b"\x01" * 8)
         / TCP(sport=5003, dport=7001) / MMH(modality="point_cloud", sla_class=40,
                                              tlvs=[MMHTLV(type="density", value=200000)])
         / Raw(body), "bulk", False),
        (eth / IPv6(src="fd00:99::1", dst="fd00::2") / UDP(sport=5004, dport=7000)
         / MMH(modality="audio", sla_class=10) / Raw(body), "best-effort", True),
    ]
    for pkt, want, clamped in cases:
        data = bytes(pkt)
        v = fuzzer.clf.run(data)
        assert (v.reason, v.class_, v.clamped) == ("parsed", want, clamped), (pkt.summary(), v)
        fuzzer.run(Frame(data, kind="scapy"))
    assert not fuzzer.failures, fuzzer.report()


def test_error_tlv_utf8_is_not_checked_by_bpf(clf: Classifier) -> None:
    """Documented difference (docs/wire-format.md section 3): the classifier checks
    the ERROR TLV's structure only, the Python decoder also its UTF-8."""
    hdr = encode_header(Header(modality=6, payload_len=0, error=(1, "x")))
    bad = hdr[:-1] + b"\xff"
    with pytest.raises(WireError):
        decode_header(bad)
    f = build_frame(random.Random(1), 17, bad, v6=False, src=SRC4[0])
    assert clf.run(f.data).reason == "parsed"


def test_three_byte_mmh_payload_is_malformed(clf: Classifier) -> None:
    with pytest.raises(WireError):
        decode_header(b"MMH")
    for short in (b"M", b"MM", b"MMH"):
        f = build_frame(random.Random(2), 17, short, v6=False, src=SRC4[0])
        assert clf.run(f.data).reason == "malformed", f.data.hex()
    for short in (b"X", b"MX", b"MMX"):
        f = build_frame(random.Random(2), 17, short, v6=False, src=SRC4[0])
        assert clf.run(f.data).reason == "not_mesh", f.data.hex()
