"""Fuzzing the real TC classifier with BPF_PROG_TEST_RUN.

About 180,000 random and mutated frames go through one private copy of
``mm_egress`` (and some through ``mm_ingress``).  Every frame must pass
(TC_ACT_OK), get the priority of a class of the policy, and never get a class
more privileged than the source rule covering its source address allows.

Overrides are loaded (testkit/overrides.py: stage overrides that nest, one
the clamp makes dead, flow overrides): a frame's priority may be a boost leaf
of its class, never a leaf of another class, and for well-formed frames it
must be the one the override step of testkit/overrides.py gives.

Every frame's output bytes are checked against the class it should have:
when that class has a DSCP and the frame is IPv4/IPv6 on egress, the output
must carry that DSCP (ECN kept, a valid IPv4 checksum staying valid, no other
byte changed); otherwise the output must be the input, byte for byte.  For
well-formed UDP and TCP frames the class comes from the Python side alone
(``mmmesh.wire.decode_header``, ``mmmesh.policy.reference_verdict`` and a model
of the TCP flow table: learning, re-classification, FIN/RST), and the whole
verdict (reason, class, clamp, modality) must agree with it; for damaged or
random frames, whose parse the Python side does not model, it is the class the
program chose, which the invariants above constrain.

The frames are built by hand in ``testkit/bpf_fuzz_frames.py``.  Reproduce a
failure with ``MMMESH_FUZZ_SEED=<seed printed in the failure>``;
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

import pytest


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

from mmmesh import abi as _abi  # noqa: E402
from mmmesh.dataplane.classify import Classifier, Verdict  # noqa: E402
from mmmesh.errors import DataplaneError, WireError  # noqa: E402
from mmmesh.policy import Policy, reference_verdict  # noqa: E402
from mmmesh.wire import Header, decode_header, encode_header  # noqa: E402
from testkit.bpf_fuzz_frames import (  # noqa: E402
    DST4,
    DST6,
    ETH_P_8021AD,
    ETH_P_8021Q,
    ETH_P_IP,
    ETH_P_IPV6,
    MAC_DST,
    MAC_SRC,
    SRC4,
    TCP_FIN,
    TCP_RST,
    Frame,
    bpf_l3,
    build_frame,
    csum16,
    fuzz_policy,
    ipv4_header,
    mmh_payload,
    mutate_frame,
    special_payload,
    with_ip_csum,
)
from testkit.overrides import (  # noqa: E402
    FUZZ_ADAPT,
    FUZZ_OVERRIDES,
    OverrideModel,
    mapped16,
    with_adapt,
)

pytestmark = pytest.mark.privileged

SEED = int(os.environ.get("MMMESH_FUZZ_SEED", "20240611"))
SCALE = float(os.environ.get("MMMESH_FUZZ_SCALE", "1.0"))
MAX_REPORTED = 12
TCP_XCHECK_DPORT = 7101  # the TCP cross-check's own flows: no other test learns any
_MODS = {int(m) for m in _abi.Modality}


# --------------------------------------------------------------------------
# The Python side: what the program should decide for a well-formed frame
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Expect:
    reason: str
    class_id: int
    clamped: bool
    modality: str | int | None
    why: str  # what the Python side saw, for the failure report
    priority: int | None = None  # egress: the class's leaf or the override's boost leaf


def reported_modality(mod: int | None, reason: str) -> str | int | None:
    """A modality as ``classify`` reports it (docs/dataplane.md): a name, the
    number of an unknown one, None without header or flow."""
    if mod is None:
        return None
    return _abi.Modality(mod).name.lower() if mod in _MODS else mod


def decode_structure(pay: bytes) -> tuple[Header | None, WireError | None, bool]:
    """decode_header without the UTF-8 check of ERROR messages, which the
    classifier documents it does not make (docs/wire-format.md section 3.1, 7k):
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


class Reference:
    """The verdict of docs/wire-format.md section 7 computed in Python:
    ``decode_header`` for the header, ``reference_verdict`` for its class, and a
    dict for the TCP flow table (5-tuple + direction -> class, modality)."""

    def __init__(self, policy: Policy, stats: Counter[str], ovr: OverrideModel) -> None:
        self.policy = policy
        self.stats = stats
        self.ovr = ovr
        self.classid = {c.id: c.classid for c in policy.classes}
        # 5-tuple + direction -> class, modality, boost level (docs/dataplane.md)
        self.flows: dict[tuple[int, bytes, int, int, str], tuple[int, int, int]] = {}

    def leaf(self, f: Frame, direction: str, cid: int, level: int) -> int | None:
        """The priority an egress frame of class ``cid`` at boost ``level`` gets."""
        if direction != "egress":
            return None
        prio = self.ovr.priority(self.classid[cid], cid, level, cid)
        self.stats["xc:boosted"] += prio != self.classid[cid]
        return prio

    def header(self, f: Frame) -> tuple[str, Header | None, str]:
        """("ok" | "bad" | "none", the header if ok, what was seen)."""
        pay = f.payload
        if len(pay) < 4:
            if f.proto == 17 and pay and b"MMH".startswith(pay):
                return "bad", None, "short_magic"  # a UDP datagram of 1..3 magic bytes
            return "none", None, "short_tcp" if f.proto == 6 and pay else "short"
        if not pay.startswith(b"MMH"):
            return "none", None, "no_magic"
        h, err, utf8_fixed = decode_structure(pay)
        if utf8_fixed:
            self.stats["xc:invalid_utf8_ignored"] += 1
        if err is not None:
            return "bad", None, f"malformed ({err})"
        assert h is not None and h.hdr_len is not None
        if f.proto == 17 and h.hdr_len + h.payload_len > len(pay):
            return "bad", None, "udp_frame_does_not_fit"
        return "ok", h, "parsed"

    def expect(self, f: Frame, direction: str) -> Expect:
        status, h, seen = self.header(f)
        self.stats[f"xc:{seen.split(' ')[0]}"] += 1
        key = (f.l3, f.src, f.sport, f.dport, direction)
        if h is not None:
            src = ipaddress.ip_address(f.src)
            ref = reference_verdict(self.policy, h.modality, h.sla_class, fps=h.fps,
                                    bitrate=h.bitrate, density=h.density, src_ip=src)
            self.stats[f"xc:via_{ref.via}"] += 1
            self.stats["xc:clamped"] += ref.clamped
            level = 0 if direction != "egress" else self.ovr.level(
                src16=mapped16(f.src), dst16=mapped16(DST4 if f.l3 == 4 else DST6),
                sport=f.sport, dport=f.dport, proto=f.proto, class_id=ref.cls.id)
            out = Expect("parsed", ref.cls.id, ref.clamped, reported_modality(h.modality, "parsed"),
                         f"reference: class={ref.cls.name} via={ref.via} boost={level} "
                         f"header={h}", self.leaf(f, direction, ref.cls.id, level))
            if f.proto == 6:
                self.flows[key] = (ref.cls.id, h.modality, level)
        elif f.proto == 6 and key in self.flows:
            cid, mod, level = self.flows[key]
            reason = "malformed" if status == "bad" else "flow_hit"
            self.stats[f"xc:tcp_{reason}_of_flow"] += 1
            out = Expect(reason, cid, False, reported_modality(mod, reason), f"flow: {seen}",
                         self.leaf(f, direction, cid, level))
        else:
            reason = "malformed" if status == "bad" else "not_mesh"
            out = Expect(reason, self.policy.default.id, False, None, seen,
                         self.leaf(f, direction, self.policy.default.id, 0))
        if f.proto == 6 and f.tcp_flags & (TCP_FIN | TCP_RST) and self.flows.pop(key, None):
            self.stats["xc:flow_ended_by_fin_rst"] += 1
        return out


# --------------------------------------------------------------------------
# The checker
# --------------------------------------------------------------------------
def traffic_class(data: bytes, l3: int, off: int) -> int:
    """The IPv4 TOS / IPv6 traffic class byte (DSCP << 2 | ECN)."""
    return data[off + 1] if l3 == 4 else ((data[off] & 0x0F) << 4) | (data[off + 1] >> 4)


def with_traffic_class(data: bytes, l3: int, off: int, tc: int) -> bytearray:
    """``data`` with its traffic class set to ``tc`` (nothing else changed)."""
    out = bytearray(data)
    if l3 == 4:
        out[off + 1] = tc
    else:
        out[off] = (out[off] & 0xF0) | (tc >> 4)
        out[off + 1] = (out[off + 1] & 0x0F) | ((tc & 0x0F) << 4)
    return out


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
        self.names = {c.id: c.name for c in p.classes}
        self.class_ids = sorted(self.classid)
        self.video_rank = p.rank("video")
        rules = []
        for sr in p.source_rules:
            net = sr.lpm_prefix
            rules.append((net.prefixlen, int(net.network_address), int(net.netmask),
                          self.name_rank[sr.max_class], sr.max_class))
        self.rules = sorted(rules, reverse=True)  # longest prefix first
        self.restricted24 = ipaddress.IPv6Network("::ffff:10.0.99.0/120")
        self.ovr = OverrideModel.from_entries(self.clf.overrides(), p)
        self.leaves = {c.id: {c.classid} | {leaf for (cid, _), leaf in self.ovr.leaves.items()
                                            if cid == c.id} for c in p.classes}
        self.reference = Reference(p, self.stats, self.ovr)

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
    def run(self, f: Frame, direction: str = "egress", xcheck: bool = False) -> Verdict | None:
        """Runs one frame and checks the invariants and its output bytes; with
        ``xcheck`` (and a frame built consistent) the whole verdict against the
        Python side too.  None if the kernel refused the frame."""
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
        self.check_invariants(f, v, direction)
        want = self.reference.expect(f, direction) if xcheck and f.consistent else None
        if want is not None:
            got = (v.reason, v.class_id, v.clamped, v.modality)
            if got != (want.reason, want.class_id, want.clamped, want.modality):
                self.fail("BPF and the Python reference disagree", f, v, direction,
                          f"want reason={want.reason} class={self.names.get(want.class_id)} "
                          f"clamped={want.clamped} modality={want.modality!r}; {want.why}")
            elif want.priority is not None and v.priority != want.priority:
                self.fail("BPF and the override step disagree on the leaf", f, v, direction,
                          f"want priority={want.priority:#x}; {want.why}")
        self.check_bytes(f, v, direction, v.class_id if want is None else want.class_id)
        return v

    def check_invariants(self, f: Frame, v: Verdict, direction: str) -> None:
        if v.verdict != "pass" or v.retval != 0:
            self.fail("verdict is not TC_ACT_OK", f, v, direction)
        if direction == "ingress":
            # ingress classifies and counts but never sets skb->priority
            if v.priority != 0 or (v.class_id and v.class_id not in self.classid):
                self.fail("ingress set a priority or a class not in the policy", f, v,
                          direction)
        elif v.class_id not in self.classid or v.priority not in self.leaves[v.class_id]:
            if not (v.priority == 0 and v.class_id == 0):
                self.fail("priority/class not from the policy", f, v, direction)
            else:  # a policy is loaded, so the default class always applies
                self.fail("no class although a policy is loaded", f, v, direction)
        _, _, src = bpf_l3(f.data)
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

    def check_bytes(self, f: Frame, v: Verdict, direction: str, class_id: int) -> None:
        """The output is the input with the DSCP of ``class_id`` written (ECN
        kept, the IPv4 checksum still valid) when that class has a DSCP and the
        frame is IPv4/IPv6 on egress; otherwise the input, byte for byte."""
        out, inp = v.packet, f.data
        l3, off, _ = bpf_l3(inp)
        dscp = self.dscp.get(class_id)
        tc = traffic_class(inp, l3, off) if l3 else 0
        if direction != "egress" or not l3 or dscp is None or dscp == tc >> 2:
            self.stats["bytes:unchanged"] += 1
            if out != inp or v.dscp_rewritten:
                self.fail("frame changed although no DSCP was due", f, v, direction,
                          f"class={self.names.get(class_id)} dscp={dscp} out={out.hex()}")
            return
        self.stats[f"bytes:dscp_rewritten_ipv{l3}"] += 1
        want = with_traffic_class(inp, l3, off, (dscp << 2) | (tc & 0x3))
        if l3 == 4:
            want[off + 10:off + 12] = out[off + 10:off + 12]  # the checksum is checked below
        if out != want or not v.dscp_rewritten:
            got = traffic_class(out, l3, off) if len(out) == len(inp) else None
            self.fail("DSCP not rewritten as the class says (DSCP, ECN kept, nothing else)", f,
                      v, direction, f"class={self.names.get(class_id)} want dscp={dscp} "
                      f"ecn={tc & 3}, got traffic class={got} out={out.hex()}")
            return
        before, after = ipv4_header(inp, off), ipv4_header(out, off)
        if l3 == 4 and before is not None and after is not None and csum16(before) == 0:
            self.stats["bytes:ipv4_csum_checked"] += 1
            if csum16(after) != 0:
                self.fail("IPv4 checksum broken by the DSCP rewrite", f, v, direction)


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy() -> Policy:
    return with_adapt(fuzz_policy(), FUZZ_ADAPT)  # the overrides' boosts need adapt ranges


@pytest.fixture(scope="module")
def clf(policy: Policy) -> Iterator[Classifier]:
    c = Classifier(policy, overrides=FUZZ_OVERRIDES)
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
        if fz.run(f, direction, xcheck) is None:
            continue
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
    must agree with decode_header + reference_verdict, and the DSCP with its class."""
    ids = fuzzer.class_ids

    def gen(r: random.Random) -> Iterator[tuple[Frame, str, bool]]:
        while True:
            x = r.random()
            pay = mmh_payload(r, ids, mutate=0.5) if x < 0.9 else \
                special_payload(r) if x < 0.97 else r.randbytes(r.randint(0, 40))
            f = with_ip_csum(build_frame(r, 17, pay))
            f.kind = "udp-mmh"
            yield f, ("ingress" if r.random() < 0.1 else "egress"), True
    _run_all(fuzzer, gen, _n(80_000))
    assert fuzzer.stats["xc:parsed"] > _n(10_000)
    assert fuzzer.stats["xc:malformed"] > _n(5_000)
    assert fuzzer.stats["xc:clamped"] > _n(500)
    assert fuzzer.stats["xc:via_rule"] > _n(500)
    assert fuzzer.stats["xc:udp_frame_does_not_fit"] > _n(500)
    assert fuzzer.stats["bytes:dscp_rewritten_ipv4"] > _n(5_000)
    assert fuzzer.stats["bytes:dscp_rewritten_ipv6"] > _n(2_000)
    assert fuzzer.stats["bytes:ipv4_csum_checked"] > _n(5_000)
    assert fuzzer.stats["xc:boosted"] > _n(2_000)


def test_tcp_flows(fuzzer: Fuzzer) -> None:
    """TCP segments with and without headers on a small set of flows: every
    verdict (learning, re-classification, hits, malformed bytes in a flow, the
    end of a flow at FIN/RST) against a model of the flow table."""
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
            f = with_ip_csum(build_frame(r, 6, pay, sport=r.randint(40000, 40007),
                                         dport=TCP_XCHECK_DPORT))
            f.kind = "tcp"
            yield f, ("ingress" if r.random() < 0.15 else "egress"), True
    _run_all(fuzzer, gen, _n(30_000))
    assert fuzzer.stats["egress:flow_hit"] > _n(1_000)
    assert fuzzer.stats["xc:tcp_malformed_of_flow"] > _n(50)
    assert fuzzer.stats["xc:flow_ended_by_fin_rst"] > _n(500)
    assert fuzzer.stats["xc:parsed"] > _n(5_000)
    assert fuzzer.stats["xc:boosted"] > _n(500)


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

    from mmmesh.wire.scapy_layer import MMH, MMHTLV  # noqa: PLC0415

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
