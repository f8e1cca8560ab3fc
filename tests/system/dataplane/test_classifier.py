"""Table-driven packet tests: scapy frames through the real compiled egress
and ingress programs with BPF_PROG_TEST_RUN.

Each row is {description, frame, expected reason, class, modality, ...}; the
whole table runs against two builds: the default one (headers read with
direct packet access) and one forced through bpf_skb_load_bytes(), the path
TCP GSO packets take on a real device.  Parsed rows are also checked against
the pure-Python reference classifier."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from mmmesh.policy import Policy, classify_reference, parse_policy
from testkit.classifier_cases import (  # the table (shared with test_egress_fq.py)
    BATCH,
    DST,
    EXAMPLE,
    ROWS,
    SRC,
    VOICE,
    M,
    hdr,
    raw_hdr,
    tcp,
    udp,
)
from testkit.privileged import require_privileged

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module", params=["direct", "skb_load_bytes"])
def clf(request: pytest.FixtureRequest) -> Iterator[object]:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    flags = ["-DMM_FORCE_SKB_LOAD=1"] if request.param == "skb_load_bytes" else []
    c = Classifier(EXAMPLE, extra_cflags=flags)
    yield c
    c.close()


def test_packet_table(clf: object) -> None:
    """Rows run in order in one classifier: the TCP rows share its flow table."""
    failures = []
    for row in ROWS:
        v = clf.run(row.frame, row.direction)  # type: ignore[attr-defined]
        got = (v.verdict, v.reason, v.class_, v.modality, v.clamped)
        want = ("pass", row.reason, row.cls, row.modality, row.clamped)
        if got != want:
            failures.append(f"{row.desc}: got {got}, want {want}")
        if row.cls is not None and row.direction == "egress":
            assert v.priority == EXAMPLE.class_named(row.cls).classid, row.desc
        elif row.direction == "ingress":
            assert v.priority == 0, f"{row.desc}: ingress must not set skb->priority"
        if row.ref is not None:
            ref = classify_reference(EXAMPLE, **row.ref)  # type: ignore[arg-type]
            assert ref.name == row.cls, f"{row.desc}: reference says {ref.name}"
    assert not failures, "\n".join(failures)


def test_dscp_rewrite_keeps_ecn_and_fixes_checksum(clf: object) -> None:
    frame = bytes(Ether() / IP(src=SRC, dst=DST, tos=0x02) / UDP(sport=1, dport=2) / Raw(VOICE))
    v = clf.run(frame)  # type: ignore[attr-defined]
    assert v.dscp_rewritten
    ip = Ether(v.packet)[IP]
    assert ip.tos == (46 << 2) | 0x02  # voice DSCP EF, ECN kept
    chk = ip.chksum
    del ip.chksum
    assert IP(bytes(ip)).chksum == chk, "IPv4 header checksum not fixed"
    assert Ether(v.packet)[UDP].load == VOICE


def test_dscp_rewrite_ipv6_traffic_class(clf: object) -> None:
    v = clf.run(bytes(Ether() / IPv6(src="fd00::1", dst="fd00::2", tc=0x01, fl=0xABCDE)
                      / UDP(sport=1, dport=2) / Raw(VOICE)))  # type: ignore[attr-defined]
    ip6 = Ether(v.packet)[IPv6]
    assert v.dscp_rewritten and ip6.tc == (46 << 2) | 0x01 and ip6.fl == 0xABCDE


def test_ingress_never_rewrites_dscp(clf: object) -> None:
    v = clf.run(udp(VOICE), "ingress")  # type: ignore[attr-defined]
    assert not v.dscp_rewritten and Ether(v.packet)[IP].tos == 0


def metadata_policy() -> Policy:
    data = EXAMPLE.model_dump(mode="json", by_alias=True)
    data["classes"] = [c for c in data["classes"] if c["name"] != "video"] + [
        {"name": "video-hd", "id": 20, "match": {"modalities": ["video"], "fps": {"min": 50}},
         "rate": "100mbit", "weight": 7, "priority": 2},
        {"name": "video-sd", "id": 21, "match": {"modalities": ["video"]}, "rate": "40mbit",
         "weight": 3, "priority": 3},
        {"name": "hifi", "id": 22, "match": {"modalities": ["audio"],
         "bitrate": {"min": 256000, "max": 2000000}}, "rate": "5mbit", "priority": 1},
    ]
    data["source_rules"] = [{"prefix": "10.0.99.0/24", "max_class": "video-hd"}]
    return parse_policy(data)


def test_metadata_rules() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = metadata_policy()
    cases = [
        (hdr(M.VIDEO, fps=60), "video-hd", {"fps": 60}),
        (hdr(M.VIDEO, fps=50), "video-hd", {"fps": 50}),
        (hdr(M.VIDEO, fps=30), "video-sd", {"fps": 30}),
        (hdr(M.VIDEO), "video-sd", {}),
        (hdr(M.AUDIO, bitrate=320000), "hifi", {"bitrate": 320000}),
        (hdr(M.AUDIO, bitrate=64000), "voice", {"bitrate": 64000}),
        (hdr(M.AUDIO, bitrate=3000000), "voice", {"bitrate": 3000000}),
        (hdr(M.AUDIO, fps=60), "voice", {"fps": 60}),  # fps means nothing to audio rules
    ]
    with Classifier(pol) as c:
        for frame_hdr, want, meta in cases:
            v = c.run(udp(frame_hdr))
            ref = classify_reference(pol, frame_hdr[5], **meta)  # type: ignore[arg-type]
            assert (v.class_, ref.name) == (want, want), (frame_hdr.hex(), v.class_, ref.name)


def test_policy_update_in_place_changes_verdicts() -> None:
    """Rewriting the maps of a loaded program takes effect on the next packet,
    and a flow whose class was removed falls back to the default class."""
    require_privileged()
    from mmmesh.dataplane._compile import compile_policy
    from mmmesh.dataplane.classify import Classifier

    with Classifier(EXAMPLE) as c:
        first = tcp(hdr(M.POINT_CLOUD, payload_len=10) + b"p" * 10, sport=45000)
        assert c.run(first).class_ == "lidar"
        data = EXAMPLE.model_dump(mode="json", by_alias=True)
        data["classes"] = [k for k in data["classes"] if k["name"] != "lidar"]
        smaller = parse_policy(data)
        c.maps.write_policy(compile_policy(smaller, version=2))
        assert c.maps.policy_version() == 2
        v = c.run(tcp(b"p" * 10, sport=45000))
        assert v.reason == "flow_hit" and v.class_id == smaller.default.id
        assert c.run(udp(hdr(M.POINT_CLOUD))).class_id == smaller.default.id

        # a source rule added after a flow was learnt still clamps that flow
        voice_flow = tcp(hdr(M.AUDIO, payload_len=10) + b"v" * 10, sport=46000, src=SRC)
        assert c.run(voice_flow).class_ == "voice"
        data["source_rules"] = [{"prefix": "10.0.1.0/24", "max_class": "video"}]
        c.maps.write_policy(compile_policy(parse_policy(data), version=3))
        v = c.run(tcp(b"v" * 10, sport=46000, src=SRC))
        assert (v.reason, v.class_, v.clamped) == ("flow_hit", "video", True)


def test_counters_count_per_class_and_reason() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    with Classifier(EXAMPLE) as c:
        for _ in range(3):
            c.run(udp(VOICE))
        c.run(udp(b"junk" * 5))
        c.run(udp(raw_hdr(M.AUDIO, version=9)))
        c.run(udp(VOICE, src=BATCH))
        st = c.maps.read_stats()["egress"]
        voice = EXAMPLE.class_named("voice").id
        video = EXAMPLE.class_named("video").id
        assert st.classes[voice][0] == 3
        assert st.classes[video][0] == 1
        assert st.reasons["parsed"] == 4
        assert st.reasons["not_mesh"] == 1
        assert st.reasons["malformed"] == 1
        assert st.reasons["clamped"] == 1
        assert st.classes[voice][1] == 3 * len(udp(VOICE))
