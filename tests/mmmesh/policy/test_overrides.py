"""Per-flow and per-stage overrides without a device: what compiles (boosts
checked against the policy, levels, HTB leaves) and what the real program
does with them (``mmmesh dataplane classify --overrides`` and the
``Classifier`` behind it, BPF_PROG_TEST_RUN)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.layers.inet import IP, TCP, UDP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402
from scapy.packet import Raw  # noqa: E402

from mmmesh import abi  # noqa: E402
from mmmesh.dataplane import Boost, FlowOverride, Overrides, StageOverride  # noqa: E402
from mmmesh.dataplane._compile import (  # noqa: E402
    MIN_RATE_BPS,
    BoostLeaf,
    boost_class,
    boosted_spec,
    compile_overrides,
    compile_policy,
    transition_spec,
)
from mmmesh.dataplane._types import HtbClassStats  # noqa: E402
from mmmesh.errors import DataplaneError  # noqa: E402
from mmmesh.policy import load_policy  # noqa: E402
from mmmesh.wire import Header, encode_header  # noqa: E402
from testkit.overrides import with_adapt  # noqa: E402
from testkit.privileged import require_privileged  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MMMESH = [sys.executable, "-m", "mmmesh.cli"]
# the example policy (voice: adapt weight [3, 10]) with more ranges to boost in
POLICY = with_adapt(load_policy(ROOT / "examples" / "policy.yaml"),
                    {"video": {"weight": [7, 20]}, "lidar": {"weight": [5, 15]}})
VOICE, VIDEO, LIDAR = (POLICY.class_named(n) for n in ("voice", "video", "lidar"))
DST = "10.0.2.2"


def udp(src: str, modality: int, sport: int = 1) -> bytes:
    return bytes(Ether() / IP(src=src, dst=DST) / UDP(sport=sport, dport=7000)
                 / Raw(encode_header(Header(modality=modality))))


def tcp(src: str, payload: bytes, sport: int = 5) -> bytes:
    return bytes(Ether() / IP(src=src, dst=DST) / TCP(sport=sport, dport=6, flags="PA")
                 / Raw(payload))


def msg(modality: int) -> bytes:
    return encode_header(Header(modality=modality, payload_len=4000)) + b"x" * 100


# ------------------------------------------------------------- compiling
def test_file_shape_round_trips_and_names_the_bad_field() -> None:
    o = Overrides.from_dict({
        "stages": [{"class": "voice", "prefix": "10.0.1.7/24", "weight": 8}],
        "flows": [{"class": "lidar", "src": "::ffff:10.0.1.2", "sport": 5, "dst": DST,
                   "dport": 6, "proto": 17, "priority": 2}]})
    assert o.stages == (StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),)
    assert o.flows[0].src == "10.0.1.2" and o.flows[0].proto == "udp"
    assert Overrides.from_dict(o.as_dict()) == o
    for bad, where in (({"stages": [{"class": "v"}]}, "stages[0].prefix: missing"),
                       ({"flows": [{"class": "v", "src": "x", "sport": 1, "dst": DST,
                                    "dport": 2}]}, "flows[0].src"),
                       ({"stages": [{"class": "v", "prefix": "::/0", "weight": 0}]},
                        "stages[0].weight"),
                       ({"stage": []}, "stage: unknown field")):
        with pytest.raises(DataplaneError, match=where.replace("[", r"\[").replace("]", r"\]")):
            Overrides.from_dict(bad)


def test_stage_weights_become_stage_overrides() -> None:
    o = Overrides.from_stage_weights({"voice": {"asr": 6, "tts": 4}},
                                     {"asr": ["10.1.0.7/32", "10.1.0.8/32"], "tts": []})
    assert o.stages == (StageOverride("voice", "10.1.0.7/32", Boost(weight=6)),
                        StageOverride("voice", "10.1.0.8/32", Boost(weight=6)))


@pytest.mark.parametrize("ovr,why", [
    (StageOverride("nope", "10.0.0.0/8"), "no class 'nope'"),
    (StageOverride("voice", "10.0.0.0/8", Boost(weight=11)), r"weight 11 outside .* \[3, 10\]"),
    (StageOverride("control", "10.0.0.0/8", Boost(weight=3)), r"outside .* \[2, 2\]"),
    (StageOverride("best-effort", "10.0.0.0/8", Boost(weight=1, priority=6)),
     r"priority 6 outside"),
])
def test_boosts_outside_the_bounds_are_refused(ovr: StageOverride, why: str) -> None:
    with pytest.raises(DataplaneError, match=why):
        compile_overrides(POLICY, Overrides(stages=(ovr,)), bounds=POLICY)


def test_safety_rules_hold_without_bounds() -> None:
    """``up`` keeps the kernel's overrides under an effective policy (no adapt):
    the default class still never gains, and a more urgent priority never lets
    a class outrank a source rule's max_class (10.0.99.0/24 -> video)."""
    for o, why in ((StageOverride("best-effort", "::/0", Boost(weight=2)), "may not gain"),
                   (StageOverride("lidar", "::/0", Boost(priority=1)), "outrank 'video'")):
        with pytest.raises(DataplaneError, match=why):
            compile_overrides(POLICY, Overrides(stages=(o,)))
        co = compile_overrides(POLICY, Overrides(stages=(o,)), drop_invalid=True)
        assert not co.stages and co.dropped


def test_at_most_three_boosts_per_class_and_no_duplicates() -> None:
    four = tuple(StageOverride("voice", f"10.0.{i}.0/24", Boost(weight=4 + i)) for i in range(4))
    with pytest.raises(DataplaneError, match="4 different boosts, at most 3"):
        compile_overrides(POLICY, Overrides(stages=four))
    dup = (StageOverride("voice", "10.0.1.0/24"), StageOverride("voice", "10.0.1.9/24"))
    with pytest.raises(DataplaneError, match="the same class and prefix"):
        compile_overrides(POLICY, Overrides(stages=dup))


def test_levels_are_stable_and_changed_boosts_stay_in_their_leaf() -> None:
    a = StageOverride("voice", "10.0.1.0/24", Boost(weight=5))
    b = StageOverride("voice", "10.0.2.0/24", Boost(weight=7))
    first = compile_overrides(POLICY, Overrides(stages=(a, b)))
    cur = {k: (v.weight, v.prio) for k, v in first.boosts.items()}
    assert set(cur) == {(VOICE.id, 1), (VOICE.id, 2)}
    # b's weight changes: b keeps its level (changed in place), a keeps its own
    b2 = StageOverride("voice", "10.0.2.0/24", Boost(weight=9))
    second = compile_overrides(POLICY, Overrides(stages=(b2, a)), current=cur)
    levels = {bytes(k): int(v.level) for k, v in second.stages}
    assert levels == {bytes(k): int(v.level) for k, v in first.stages}
    assert {(k, v.weight) for k, v in second.boosts.items()} == {
        ((VOICE.id, 1), 5), ((VOICE.id, 2), 9)}


def test_boost_leaves_split_the_class_and_never_collide() -> None:
    spec = compile_policy(POLICY).htb
    assert spec is not None
    boosts = [BoostLeaf(VOICE.id, 1, 6, VOICE.priority), BoostLeaf(VOICE.id, 2, 9, 0)]
    out = {x.classid: x for x in boosted_spec(spec, boosts).leaves}
    mine = [out[VOICE.classid], out[abi.boost_classid(VOICE.id, 1)],
            out[abi.boost_classid(VOICE.id, 2)]]
    assert [hex(x.classid) for x in mine] == ["0x1000b", "0x1004b", "0x1008b"]
    assert sum(x.rate_bps for x in mine) == int(VOICE.rate)  # the class's guarantee, split
    assert [x.rate_bps for x in mine] == [200_000, 400_000, 600_000]  # by weight 3 : 6 : 9
    assert all(x.ceil_bps == int(POLICY.link.rate) for x in mine)  # the link bounds the sum
    assert [x.quantum for x in mine] == [3 * 1514, 6 * 1514, 9 * 1514]
    # below the link, the ceiling is split too: the class never exceeds it
    capped = spec.__class__(spec.link_bps, spec.default_minor, tuple(
        x if x.classid != VIDEO.classid else x.__class__(x.classid, x.rate_bps, 200_000_000,
                                                         x.prio, x.quantum)
        for x in spec.leaves))
    vid = [x for x in boosted_spec(capped, [BoostLeaf(VIDEO.id, 1, 13, 2)]).leaves
           if (boost_class(x.classid) or x.classid & 0xFFFF) == VIDEO.id]
    assert sum(x.ceil_bps for x in vid) <= 200_000_000 and len(vid) == 2
    assert all(x.rate_bps <= x.ceil_bps for x in vid)
    # boost minors are 0x41..0xff: never a policy id (1..63) nor the link class 1:40
    ids = {abi.boost_classid(c, lvl) & 0xFFFF for c in range(1, 64) for lvl in (1, 2, 3)}
    assert min(ids) == 0x41 and max(ids) == 0xFF and 0x40 not in ids
    assert boost_class(0x10040) is None and boost_class(0x1000b) is None
    assert boost_class(0x100cb) == VOICE.id


def test_transition_never_guarantees_more_than_either_state() -> None:
    """Old: voice split with a weight-9 boost at level 1; new: level 1 gone,
    a weight-6 boost at level 2.  While the maps change, the old leaf stays at
    the smallest rate and every kept leaf at the lower of its two rates."""
    spec = compile_policy(POLICY).htb
    assert spec is not None
    old = boosted_spec(spec, [BoostLeaf(VOICE.id, 1, 9, 1)])
    new = boosted_spec(spec, [BoostLeaf(VOICE.id, 2, 6, 1)])
    have = {x.classid: HtbClassStats(x.classid, 0x10040, x.prio, x.quantum, x.rate_bps // 8,
                                     x.ceil_bps // 8) for x in old.leaves}
    trans = transition_spec(new, have)
    voice = [x for x in trans.leaves if (boost_class(x.classid) or x.classid) & 0x3F == VOICE.id]
    assert {x.classid for x in voice} == {0x1000B, 0x1004B, 0x1008B}
    assert sum(x.rate_bps for x in voice) <= int(VOICE.rate) + MIN_RATE_BPS
    assert next(x for x in voice if x.classid == 0x1004B).rate_bps == MIN_RATE_BPS
    assert transition_spec(spec, {}) == spec  # nothing boosted: the policy as it is


# ------------------------------------------------------ the real program
@pytest.fixture(scope="module")
def clf() -> Iterator[object]:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    c = Classifier(POLICY)
    yield c
    c.close()


def boost(cls_id: int, level: int) -> int:
    return abi.boost_classid(cls_id, level)


def test_stage_override_applies_to_the_stage_and_its_class_only(clf: object) -> None:
    from mmmesh.dataplane.classify import Classifier

    assert isinstance(clf, Classifier)
    clf.set_overrides(Overrides(stages=(StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),)))
    lvl = clf.overrides()[0].level
    for src in ("10.0.1.2", "10.0.1.200"):  # every flow of the stage
        for sport in (1, 2):
            v = clf.run(udp(src, 4, sport))
            assert (v.class_, v.priority, v.boosted) == ("voice", boost(VOICE.id, lvl), True)
    v = clf.run(udp("10.0.3.2", 4))  # another stage's voice
    assert (v.class_, v.priority, v.boosted) == ("voice", VOICE.classid, False)
    v = clf.run(udp("10.0.1.2", 3))  # the stage's video
    assert (v.class_, v.priority, v.boosted) == ("video", VIDEO.classid, False)
    assert clf.run(udp("10.0.1.2", 4), direction="ingress").priority == 0
    assert clf.overrides()[0].hits == 4  # one per datagram, egress only
    clf.set_overrides(Overrides())
    assert clf.run(udp("10.0.1.2", 4)).priority == VOICE.classid
    assert clf.overrides() == [] and clf.maps.read_boosts() == {}


def test_the_clamp_wins_over_an_override(clf: object) -> None:
    """10.0.99.0/24 may claim at most video: its voice is video, a voice
    override there does nothing, a video one boosts the clamped frames."""
    from mmmesh.dataplane.classify import Classifier

    assert isinstance(clf, Classifier)
    clf.set_overrides(Overrides(
        stages=(StageOverride("voice", "10.0.99.0/24", Boost(weight=10)),),
        flows=(FlowOverride("voice", "10.0.99.7", 1, DST, 7000, "udp", Boost(weight=9)),)))
    v = clf.run(udp("10.0.99.7", 4))
    assert (v.class_, v.clamped, v.priority, v.boosted) == ("video", True, VIDEO.classid, False)
    clf.set_overrides(Overrides(stages=(StageOverride("video", "10.0.99.0/24",
                                                      Boost(weight=12)),)))
    v = clf.run(udp("10.0.99.7", 4))
    assert (v.class_, v.clamped, v.boosted) == ("video", True, True)
    assert v.priority == boost(VIDEO.id, clf.overrides()[0].level)
    clf.set_overrides(Overrides())


def test_a_tcp_flow_changes_leaf_only_at_a_message_start(clf: object) -> None:
    """The leaf is taken at a segment that starts a message (a header) and kept
    by the flow's other segments; a removed boost leaf is left at once."""
    from mmmesh.dataplane.classify import Classifier

    assert isinstance(clf, Classifier)
    src, sport = "10.0.5.5", 4100
    flow = FlowOverride("lidar", src, sport, DST, 6, "tcp", Boost(weight=10))
    stage = StageOverride("lidar", "10.0.6.0/24", Boost(weight=10))  # keeps the boost loaded
    assert clf.run(tcp(src, msg(5), sport)).priority == LIDAR.classid
    clf.set_overrides(Overrides(stages=(stage,), flows=(flow,)))
    lidar_boost = boost(LIDAR.id, clf.overrides()[0].level)
    # mid-message: the flow stays in its leaf
    v = clf.run(tcp(src, b"x" * 500, sport))
    assert (v.reason, v.priority) == ("flow_hit", LIDAR.classid)
    v = clf.run(tcp(src, msg(5), sport))  # the next message moves it
    assert (v.reason, v.priority, v.boosted) == ("parsed", lidar_boost, True)
    assert clf.run(tcp(src, b"x" * 500, sport)).priority == lidar_boost
    # the flow's override goes (its boost stays loaded): the message in progress keeps it
    clf.set_overrides(Overrides(stages=(stage,)))
    assert clf.run(tcp(src, b"x" * 500, sport)).priority == lidar_boost
    assert clf.run(tcp(src, msg(5), sport)).priority == LIDAR.classid
    hits = {o.kind: o.hits for o in clf.overrides()}
    assert hits == {"stage": 0}
    # the boost itself goes: at once, mid-message too (its leaf is about to go)
    clf.set_overrides(Overrides(flows=(flow,)))
    assert clf.run(tcp(src, msg(5), sport)).priority == lidar_boost
    clf.set_overrides(Overrides())
    v = clf.run(tcp(src, b"x" * 500, sport))
    assert (v.reason, v.priority, v.boosted) == ("flow_hit", LIDAR.classid, False)
    clf.run(bytes(Ether() / IP(src=src, dst=DST) / TCP(sport=sport, dport=6, flags="R")))


def test_classify_cli_reads_overrides_from_a_file(tmp_path: Path) -> None:
    require_privileged()
    ovr = tmp_path / "ovr.yaml"
    ovr.write_text(
        "stages:\n  - {class: voice, prefix: 10.0.1.0/24, weight: 8}\n"
        "flows:\n  - {class: lidar, src: 10.0.1.2, sport: 5, dst: 10.0.2.2, dport: 6, "
        "proto: tcp, weight: 10}\n")
    pol = tmp_path / "policy.yaml"
    pol.write_text(POLICY.to_yaml())
    frames = [udp("10.0.1.2", 4), udp("10.0.3.2", 4), tcp("10.0.1.2", msg(5)),
              tcp("10.0.1.2", b"x" * 500)]
    args = [*MMMESH, "dataplane", "classify", "--policy", str(pol), "--json",
            "--hex", *(f.hex() for f in frames)]
    got = [json.loads(line) for line in subprocess.run(
        [*args, "--overrides", str(ovr)], check=True, capture_output=True, text=True,
        timeout=120, cwd=ROOT).stdout.splitlines()]
    assert [(g["classid"], g["boosted"]) for g in got] == [
        ("1:4b", True), ("1:b", False), ("1:4d", True), ("1:4d", True)]
    assert [g["class"] for g in got] == ["voice", "voice", "lidar", "lidar"]
    plain = [json.loads(line) for line in subprocess.run(
        args, check=True, capture_output=True, text=True, timeout=120, cwd=ROOT
    ).stdout.splitlines()]
    assert [g["classid"] for g in plain] == ["1:b", "1:b", "1:d", "1:d"]
    assert all("boosted" not in g for g in plain)  # the exact interface without overrides
    ovr.write_text("stages:\n  - {class: voice, prefix: 10.0.1.0/24, weight: 50}\n")
    bad = subprocess.run([*args, "--overrides", str(ovr)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 1 and "weight 50 outside the class's adapt range" in bad.stderr
