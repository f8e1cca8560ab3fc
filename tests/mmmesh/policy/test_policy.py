"""The SLA policy schema: the shipped example, validation, rates, the reference classifier."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmmesh.abi import DSCP_KEEP, MAX_RULES, MetaKind, Modality
from mmmesh.errors import MeshError, PolicyError
from mmmesh.policy import (
    QUANTUM_UNIT,
    Match,
    MetaRange,
    Policy,
    Rate,
    TrafficClass,
    classify_reference,
    load_policy,
    parse_policy,
    policy_json_schema,
    reference_verdict,
)
from testkit.policy_cases import (
    DELETE as _DELETE,
)
from testkit.policy_cases import (
    EXAMPLE,
    ROOT,
    Mut,
    example_doc,
    refused,
    rejected_with_field_named,
)
from testkit.policy_cases import set_field as _set

M = 10**6


# --------------------------------------------------------------------------
# The shipped example
# --------------------------------------------------------------------------
def test_example_has_the_briefs_numbers(example: Policy) -> None:
    assert example.api_version == "mmmesh/v1"
    assert example.link.device == "eth0"
    assert example.link.rate == 1000 * M
    by_name = {c.name: c for c in example.classes}
    assert [c.name for c in example.classes] == [
        "control",
        "voice",
        "video",
        "lidar",
        "best-effort",
    ]
    # brief: 4K video 150 Mbit/s weight 7, LiDAR 80 Mbit/s weight 5, voice 1.2 Mbit/s weight 3
    assert (by_name["video"].rate, by_name["video"].weight) == (150 * M, 7)
    assert (by_name["lidar"].rate, by_name["lidar"].weight) == (80 * M, 5)
    assert (by_name["voice"].rate, by_name["voice"].weight) == (1_200_000, 3)
    assert (by_name["control"].rate, by_name["control"].weight) == (2 * M, 2)
    assert (by_name["best-effort"].rate, by_name["best-effort"].weight) == (20 * M, 1)
    assert {c.name: c.id for c in example.classes} == {
        "control": 10, "voice": 11, "video": 12, "lidar": 13, "best-effort": 14,
    }  # fmt: skip
    assert {c.name: c.priority for c in example.classes} == {
        "control": 0, "voice": 1, "video": 2, "lidar": 2, "best-effort": 7,
    }  # fmt: skip
    assert {c.name: c.dscp for c in example.classes} == {
        "control": 48, "voice": 46, "video": 34, "lidar": 26, "best-effort": None,
    }  # fmt: skip
    video = by_name["video"]
    assert video.match is not None
    assert video.match.modalities == (Modality.VIDEO, Modality.IMAGE)
    assert by_name["lidar"].match is not None
    assert by_name["lidar"].match.modalities == (Modality.POINT_CLOUD,)
    assert by_name["best-effort"].match is None
    assert example.default_class == "best-effort"
    assert example.default is by_name["best-effort"]
    assert len(example.source_rules) == 1
    rule = example.source_rules[0]
    assert rule.prefix == ipaddress.ip_network("10.0.99.0/24")
    assert rule.max_class == "video"
    assert "batch pods may not claim voice or control" in EXAMPLE.read_text()


def test_example_kernel_mapping(example: Policy) -> None:
    voice = example.class_named("voice")
    assert voice.classid == 0x1000B
    assert voice.handle == "1:b"
    assert voice.quantum == 3 * QUANTUM_UNIT
    assert voice.dscp_value == 46
    assert example.ceil_of(voice) == example.link.rate
    assert str(voice.rate) == "1.2mbit"
    assert voice.rate.bytes_per_second == 150_000


def test_ranks(example: Policy) -> None:
    # (priority, -rate, id): video and lidar share priority 2, video has the larger rate
    assert [c.name for c in example.ranked()] == [
        "control", "voice", "video", "lidar", "best-effort",
    ]  # fmt: skip
    assert example.rank("control") == 0
    assert example.rank(example.class_named("best-effort")) == 4
    with pytest.raises(KeyError):
        example.rank("nope")


def test_rank_ties_break_on_rate_then_id() -> None:
    doc = {
        "apiVersion": "mmmesh/v1",
        "link": {"device": "eth0", "rate": "100mbit"},
        "classes": [
            {"name": "a", "id": 5, "rate": "1mbit", "priority": 3},
            {"name": "b", "id": 4, "rate": "1mbit", "priority": 3},
            {"name": "c", "id": 9, "rate": "2mbit", "priority": 3},
            {"name": "d", "id": 1, "rate": "50mbit", "priority": 4},
            {"name": "e", "id": 2, "rate": "1mbit"},
        ],
        "default_class": "e",
    }
    p = parse_policy(doc)
    assert [c.name for c in p.ranked()] == ["c", "b", "a", "d", "e"]
    assert p.class_named("e").priority == 7  # the default priority: least urgent


def test_defaults() -> None:
    c = TrafficClass(name="x", id=1, rate=Rate("1mbit"))
    assert (c.weight, c.priority, c.dscp, c.ceil, c.match) == (1, 7, None, None, None)
    assert c.dscp_value == DSCP_KEEP
    assert c.quantum == QUANTUM_UNIT


# --------------------------------------------------------------------------
# Rates
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "bits", "compact"),
    [
        ("150mbit", 150_000_000, "150mbit"),
        ("1.2Mbit", 1_200_000, "1.2mbit"),
        ("1.2mbit/s", 1_200_000, "1.2mbit"),
        ("1.2MBIT/S", 1_200_000, "1.2mbit"),
        ("500kbit", 500_000, "500kbit"),
        ("10gbit", 10_000_000_000, "10gbit"),
        ("1000000", 1_000_000, "1mbit"),
        ("1000000bit", 1_000_000, "1mbit"),
        ("2500bit/s", 2_500, "2.5kbit"),
        (" 80 mbit ", 80_000_000, "80mbit"),
        ("0.5gbit", 500_000_000, "500mbit"),
        ("1.000001mbit", 1_000_001, "1000001bit"),
        ("8", 8, "8bit"),
        (1_000_000_000, 1_000_000_000, "1gbit"),
        (1_234_567, 1_234_567, "1234567bit"),
        (12_345_000, 12_345_000, "12345kbit"),
        (1_500_000_000, 1_500_000_000, "1.5gbit"),
        (64_000.0, 64_000, "64kbit"),
    ],
)
def test_rate_parses(text: str | float, bits: int, compact: str) -> None:
    r = Rate(text)
    assert int(r) == bits
    assert str(r) == compact
    assert Rate(str(r)) == bits
    assert repr(r) == f"Rate({compact!r})"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("150mbps", "ambiguous"),
        ("150MB", "ambiguous"),
        ("150Mb", "ambiguous"),
        ("150kbps", "ambiguous"),
        ("150Bps", "ambiguous"),
        ("150 bytes", "ambiguous"),
        ("150m", "unknown rate unit 'm'"),
        ("1.5tbit", "unknown rate unit"),
        ("150mibit", "unknown rate unit"),
        ("1000/s", "unknown rate unit '/s'"),
        ("fast", "cannot read 'fast' as a rate"),
        ("", "cannot read"),
        ("-5mbit", "cannot read"),
        ("1e6", "cannot read"),
        ("1 2mbit", "cannot read"),
        ("1.5bit", "not a whole number of bit/s"),
        ("1.0000001mbit", "not a whole number of bit/s"),
        ("0", "at least 8bit"),
        (7, "at least 8bit"),
        (-1, "at least 8bit"),
        (2**64, "at most"),
        (1.5, "not a whole number"),
        (float("inf"), "not a whole number"),
        (float("nan"), "not a whole number"),
    ],
)
def test_rate_rejects(value: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Rate(value)


@pytest.mark.parametrize("value", [True, None, [1], {"rate": 1}])
def test_rate_rejects_types(value: Any) -> None:
    with pytest.raises(TypeError):
        Rate(value)


@given(st.integers(min_value=8, max_value=2**64 - 1))
def test_rate_format_round_trips(bits: int) -> None:
    text = str(Rate(bits))
    assert Rate(text) == bits
    assert len(text) <= len(f"{bits}bit")


def test_rate_in_policy_is_named(example: Policy) -> None:
    doc = example_doc()
    doc["classes"][2]["rate"] = "150mbps"
    [(loc, msg)] = refused(doc)
    assert loc == "classes[2].rate"
    assert "ambiguous" in msg and "150mbit" in msg


# --------------------------------------------------------------------------
# Validation: each rule, with the field named
# --------------------------------------------------------------------------


def _add_class(**fields: Any) -> Mut:
    def mut(doc: dict[str, Any]) -> None:
        doc["classes"].append(fields)

    return mut


def _add_meta_rules(n: int) -> Mut:
    def mut(doc: dict[str, Any]) -> None:
        doc["link"]["rate"] = "10gbit"
        for i in range(n):
            doc["classes"].append(
                {"name": f"v{i}", "id": 20 + i, "rate": "1mbit",
                 "match": {"modalities": ["video"], "fps": {"min": 10 * i}}}
            )  # fmt: skip

    return mut


# fmt: off
REJECTIONS: list[tuple[str, Mut, str, str]] = [
    ("api version", _set("apiVersion", "mmmesh/v2"), "apiVersion", "mmmesh/v1"),
    ("api version missing", _set("apiVersion", _DELETE), "apiVersion", "required"),
    ("unknown top field", _set("colour", "blue"), "colour", "unknown field"),
    ("unknown class field", _set("classes.1.bandwidth", 5), "classes[1].bandwidth", "unknown"),
    ("ifname long", _set("link.device", "a" * 16), "link.device", "1 to 15"),
    ("ifname colon", _set("link.device", "eth0:1"), "link.device", "':'"),
    ("ifname slash", _set("link.device", "a/b"), "link.device", "'/'"),
    ("ifname space", _set("link.device", "a b"), "link.device", "whitespace"),
    ("ifname empty", _set("link.device", ""), "link.device", "1 to 15"),
    ("link rate", _set("link.rate", "1gbps"), "link.rate", "ambiguous"),
    ("name slug", _set("classes.0.name", "Control"), "classes[0].name", "not a valid class name"),
    ("name long", _set("classes.0.name", "a" * 33), "classes[0].name", "not a valid class name"),
    ("name type", _set("classes.0.name", 5), "classes[0].name", "valid string"),
    ("id zero", _set("classes.0.id", 0), "classes[0].id", "greater than or equal to 1"),
    ("id 64", _set("classes.0.id", 64), "classes[0].id", "less than or equal to 63"),
    ("id bool", _set("classes.0.id", True), "classes[0].id", "valid integer"),
    ("id string", _set("classes.0.id", "10"), "classes[0].id", "valid integer"),
    ("weight 0", _set("classes.1.weight", 0), "classes[1].weight", "greater than or equal to 1"),
    ("weight 101", _set("classes.1.weight", 101), "classes[1].weight", "less than or equal"),
    ("priority 8", _set("classes.1.priority", 8), "classes[1].priority", "less than or equal"),
    ("priority -1", _set("classes.1.priority", -1), "classes[1].priority", "greater than"),
    ("dscp 64", _set("classes.1.dscp", 64), "classes[1].dscp", "less than or equal to 63"),
    ("rate missing", _set("classes.1.rate", _DELETE), "classes[1].rate", "required"),
    ("modality", _set("classes.2.match.modalities", ["smell"]),
     "classes[2].match.modalities[0]", "unknown modality 'smell'"),
    ("modality int", _set("classes.2.match.modalities", [3]),
     "classes[2].match.modalities[0]", "a modality is a name"),
    ("no modality", _set("classes.2.match.modalities", []),
     "classes[2].match.modalities", "at least one modality"),
    ("modality twice", _set("classes.2.match.modalities", ["video", "Video"]),
     "classes[2].match.modalities", "listed twice"),
    ("alias twice", _set("classes.3.match.modalities", ["lidar", "pointcloud"]),
     "classes[3].match.modalities", "listed twice"),
    ("two conditions", _set("classes.2.match", {"modalities": ["video"], "fps": {"min": 30},
                                                "bitrate": {"max": 5}}),
     "classes[2].match", "at most one metadata condition"),
    ("range order", _set("classes.2.match.fps", {"min": 60, "max": 30}),
     "classes[2].match.fps", "min 60 is greater than max 30"),
    ("range negative", _set("classes.2.match.fps", {"min": -1}),
     "classes[2].match.fps.min", "greater than or equal to 0"),
    ("range u32", _set("classes.2.match.density", {"max": 2**32}),
     "classes[2].match.density.max", "less than or equal to 4294967295"),
    ("duplicate name", _set("classes.1.name", "control"), "classes[1].name",
     "duplicate class name 'control' (also classes[0])"),
    ("duplicate id", _set("classes.4.id", 12), "classes[4].id",
     "duplicate class id 12 (also classes[2] 'video')"),
    ("ceil below rate", _set("classes.2.ceil", "100mbit"), "classes[2].ceil",
     "ceil 100mbit (100000000 bit/s) is below the guaranteed rate 150mbit (150000000 bit/s)"),
    ("ceil above link", _set("classes.2.ceil", "2gbit"), "classes[2].ceil",
     "ceil 2gbit (2000000000 bit/s) exceeds the link rate 1gbit (1000000000 bit/s)"),
    ("rate above link", _set("link.rate", "100mbit"), "classes[2].rate",
     "guaranteed rate 150mbit (150000000 bit/s) exceeds the link rate 100mbit"),
    ("sum above link", _set("link.rate", "200mbit"), "classes",
     ("sum of guaranteed rates 253.2mbit (253200000 bit/s) exceeds the link rate "
      "200mbit (200000000 bit/s)")),
    ("default unknown", _set("default_class", "bulk"), "default_class",
     "unknown class 'bulk'; classes are: control, voice, video, lidar, best-effort"),
    ("max_class unknown", _set("source_rules.0.max_class", "gold"), "source_rules[0].max_class",
     "unknown class 'gold'"),
    ("prefix", _set("source_rules.0.prefix", "10.0.999.0/24"), "source_rules[0].prefix",
     "not an IPv4 or IPv6 prefix"),
    ("prefix type", _set("source_rules.0.prefix", 10), "source_rules[0].prefix",
     "a prefix is a string"),
    ("duplicate prefix",
     _set("source_rules", [{"prefix": "10.0.99.0/24", "max_class": "video"},
                           {"prefix": "10.0.99.1/24", "max_class": "lidar"}]),
     "source_rules[1].prefix", "duplicate prefix 10.0.99.0/24 (also source_rules[0])"),
    ("duplicate mapped prefix",
     _set("source_rules", [{"prefix": "10.0.99.0/24", "max_class": "video"},
                           {"prefix": "::ffff:10.0.99.0/120", "max_class": "lidar"}]),
     "source_rules[1].prefix", "duplicate prefix"),
    ("ambiguous modality", _add_class(name="tv", id=20, rate="1mbit",
                                      match={"modalities": ["image"]}),
     "classes[5].match.modalities",
     ("ambiguous: modality 'image' is claimed without a metadata condition by both 'video' "
      "(classes[2]) and 'tv' (classes[5])")),
    ("ambiguous alias", _add_class(name="talk", id=20, rate="1mbit",
                                   match={"modalities": ["voice"]}),
     "classes[5].match.modalities", "'voice' (classes[1]) and 'talk' (classes[5])"),
    ("too many meta rules", _add_meta_rules(MAX_RULES + 1), f"classes[{5 + MAX_RULES}].match",
     ("modality 'video' has more than 4 metadata rules ('v0', 'v1', 'v2', 'v3', 'v4'); "
      "the dataplane holds 4 per modality")),
    ("no classes", _set("classes", []), "classes", "at least one class"),
    ("classes not a list", _set("classes", "video"), "classes", "valid tuple"),
    ("description type", _set("description", 5), "description", "valid string"),
]
# fmt: on


@pytest.mark.parametrize(
    ("mutate", "loc", "fragment"),
    [pytest.param(m, loc, frag, id=name) for name, m, loc, frag in REJECTIONS],
)
def test_rejected_with_field_named(mutate: Mut, loc: str, fragment: str) -> None:
    rejected_with_field_named(mutate, loc, fragment)


def test_four_meta_rules_fit() -> None:
    doc = example_doc()
    _add_meta_rules(MAX_RULES)(doc)
    p = parse_policy(doc)  # as many metadata rules as the BPF map holds: accepted
    video_rules = [
        (c.name, c.match.meta, c.match.condition)
        for c in p.classes
        if c.match is not None and c.match.condition is not None
        and Modality.VIDEO in c.match.modalities
    ]  # fmt: skip
    assert MAX_RULES == 4
    assert video_rules == [
        (f"v{i}", MetaKind.FPS, MetaRange(min=10 * i)) for i in range(MAX_RULES)
    ]  # fmt: skip
    # the rules come before the fallback; without the TLV the fallback still takes video
    assert reference_verdict(p, Modality.VIDEO, fps=45)[:2] == (p.class_named("v0"), "rule")
    assert reference_verdict(p, Modality.VIDEO)[:2] == (p.class_named("video"), "fallback")


def test_conditional_and_fallback_share_a_modality() -> None:
    doc = example_doc()
    doc["classes"].append(
        {"name": "hd", "id": 20, "rate": "1mbit", "match": {"modalities": ["video"],
                                                              "fps": {"min": 50}}}
    )  # fmt: skip
    p = parse_policy(doc)
    assert p.class_named("hd").match is not None
    assert p.class_named("hd").match.meta is MetaKind.FPS  # type: ignore[union-attr]


def test_api_version_accepts_both_spellings() -> None:
    doc = example_doc()
    doc["api_version"] = doc.pop("apiVersion")
    assert parse_policy(doc) == load_policy(EXAMPLE)


def test_every_error_reported_together() -> None:
    doc = example_doc()
    doc["classes"][0]["weight"] = 0
    doc["classes"][1]["dscp"] = 99
    doc["classes"][3]["rate"] = "80MB"
    doc["link"]["device"] = "eth0:0"
    locs = [loc for loc, _ in refused(doc)]
    assert locs == ["link.device", "classes[0].weight", "classes[1].dscp", "classes[3].rate"]

    doc = example_doc()
    doc["classes"][1]["name"] = "control"
    doc["classes"][2]["ceil"] = "100mbit"
    doc["default_class"] = "bulk"
    doc["source_rules"][0]["max_class"] = "gold"
    locs = [loc for loc, _ in refused(doc)]
    assert locs == [
        "classes[1].name", "classes[2].ceil", "default_class", "source_rules[0].max_class",
    ]  # fmt: skip


def test_refused_whole_never_partial() -> None:
    doc = example_doc()
    doc["classes"][2]["rate"] = "2gbit"
    for build in (
        lambda: parse_policy(doc),
        lambda: parse_policy(json.dumps(doc)),
        lambda: Policy(**doc),
        lambda: Policy.model_validate(doc),
        lambda: Policy.model_validate_json(json.dumps(doc)),
    ):
        with pytest.raises(PolicyError) as info:
            build()
        assert isinstance(info.value, MeshError) and isinstance(info.value, ValueError)
        assert "classes[2].rate" in dict(info.value.errors), info.value.errors


def test_policy_is_immutable(example: Policy) -> None:
    with pytest.raises(Exception, match="frozen"):
        example.default_class = "voice"  # type: ignore[misc]
    assert isinstance(example.classes, tuple)
    assert isinstance(example.classes[0].match.modalities, tuple)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "loc", "fragment"),
    [
        ("", "", "empty"),
        ("- 1\n- 2\n", "", "a policy is a mapping"),
        ("apiVersion: [\n", "<string>:2:1", "invalid YAML"),
        ("link: {}\nlink: {}\n", "<string>:2:1", "duplicate key 'link'"),
        ("a: 2020-13-45\n", "<string>", "invalid YAML"),
        (42, "", "a policy is a mapping"),
    ],
)
def test_parse_bad_documents(data: Any, loc: str, fragment: str) -> None:
    [(e_loc, msg)] = refused(data)
    assert e_loc == loc and fragment in msg


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(missing)
    assert info.value.errors[0][0] == str(missing)
    assert "cannot read" in info.value.errors[0][1]

    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: mmmesh/v1\nlink:\n  device: eth0\n   rate: 1gbit\n")
    with pytest.raises(PolicyError) as info:
        load_policy(bad)
    [(loc, msg)] = info.value.errors
    assert loc.startswith(f"{bad}:4:") and msg.startswith("invalid YAML")

    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"apiVersion: \xff\xfe\n")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary)

    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path)  # a directory


# --------------------------------------------------------------------------
# YAML round trip and schema
# --------------------------------------------------------------------------
RICH = """
apiVersion: mmmesh/v1
link: {device: veth-a1, rate: 10gbit}
classes:
  - {name: hd-video, id: 1, rate: 1.5gbit, ceil: 8gbit, weight: 9, priority: 2, dscp: 34,
     match: {modalities: [video], fps: {min: 50}}}
  - {name: any-video, id: 8, rate: 1gbit, weight: 7, priority: 2,
     match: {modalities: [video], fps: {min: 0, max: 1000}}}
  - {name: video, id: 3, rate: 500mbit, weight: 6, priority: 3, match: {modalities: [video]}}
  - {name: hifi, id: 4, rate: 512kbit, weight: 3, priority: 1,
     match: {modalities: [audio], bitrate: {min: 256000}}}
  - {name: voice, id: 5, rate: 1.2mbit, weight: 3, priority: 1,
     match: {modalities: [voice, control]}}
  - {name: dense, id: 6, rate: 800mbit, weight: 5, priority: 2,
     match: {modalities: [lidar], density: {min: 100000, max: 200000}}}
  - {name: tensor, id: 9, rate: 100mbit, priority: 4, match: {modalities: [tensor, text]}}
  - {name: be, id: 7, rate: 10mbit}
  - {name: gold, id: 63, rate: 1mbit, priority: 0}
default_class: be
source_rules:
  - {prefix: 10.0.0.0/8, max_class: video}
  - {prefix: 10.1.0.0/16, max_class: be}
  - {prefix: 10.2.0.0/16, max_class: voice}
  - {prefix: "fd00:1::/64", max_class: be}
  - {prefix: "::/0", max_class: tensor}
"""


@pytest.fixture(scope="module")
def rich() -> Policy:
    return parse_policy(RICH)


def test_rich_ranks(rich: Policy) -> None:
    assert [c.name for c in rich.ranked()] == [
        "gold", "voice", "hifi", "hd-video", "any-video", "dense", "video", "tensor", "be",
    ]  # fmt: skip


@pytest.mark.parametrize("source", ["example", "rich"])
def test_yaml_round_trip(source: str, example: Policy, rich: Policy) -> None:
    p = example if source == "example" else rich
    text = p.to_yaml()
    again = parse_policy(text)
    assert again == p
    assert again.to_yaml() == text
    assert parse_policy(p.model_dump()) == p
    assert Policy.model_validate_json(p.model_dump_json()) == p


def test_yaml_is_compact(rich: Policy) -> None:
    text = rich.to_yaml()
    assert "rate: 1.5gbit" in text and "rate: 512kbit" in text and "ceil: 8gbit" in text
    assert "- point_cloud" in text and "- audio" in text  # aliases written canonically
    assert "prefix: fd00:1::/64" in text
    assert "null" not in text


def test_json_schema() -> None:
    schema = policy_json_schema()
    assert schema["additionalProperties"] is False
    assert "apiVersion" in schema["properties"]
    assert set(schema["required"]) >= {"apiVersion", "link", "classes", "default_class"}
    json.dumps(schema)  # serialisable
    tc = schema["$defs"]["TrafficClass"]["properties"]
    assert tc["id"]["maximum"] == 63 and tc["weight"]["maximum"] == 100


# --------------------------------------------------------------------------
# Reference classifier
# --------------------------------------------------------------------------
V, A, I, PC = Modality.VIDEO, Modality.AUDIO, Modality.IMAGE, Modality.POINT_CLOUD

EXAMPLE_TABLE: list[tuple[dict[str, Any], str, str, bool]] = [
    # (arguments, class, via, clamped)
    ({"modality": A}, "voice", "fallback", False),
    ({"modality": V}, "video", "fallback", False),
    ({"modality": I}, "video", "fallback", False),
    ({"modality": PC}, "lidar", "fallback", False),
    ({"modality": Modality.CONTROL}, "control", "fallback", False),
    ({"modality": Modality.TEXT}, "best-effort", "default", False),
    ({"modality": Modality.TENSOR}, "best-effort", "default", False),
    ({"modality": Modality.UNSPEC}, "best-effort", "default", False),
    ({"modality": 0x42}, "best-effort", "default", False),
    ({"modality": 0xFF}, "best-effort", "default", False),
    ({"modality": V, "fps": 60}, "video", "fallback", False),  # metadata is no condition here
    # a claimed class that exists wins over the modality
    ({"modality": V, "sla_class": 11}, "voice", "claim", False),
    ({"modality": Modality.TEXT, "sla_class": 10}, "control", "claim", False),
    ({"modality": A, "sla_class": 14}, "best-effort", "claim", False),
    # unknown ids fall through to the modality
    ({"modality": A, "sla_class": 0}, "voice", "fallback", False),
    ({"modality": A, "sla_class": 63}, "voice", "fallback", False),
    ({"modality": A, "sla_class": 200}, "voice", "fallback", False),
    # 10.0.99.0/24 may claim at most video (rank 2)
    ({"modality": A, "src_ip": "10.0.99.7"}, "video", "fallback", True),
    ({"modality": V, "sla_class": 10, "src_ip": "10.0.99.7"}, "video", "claim", True),
    ({"modality": V, "src_ip": "10.0.99.7"}, "video", "fallback", False),
    ({"modality": PC, "src_ip": "10.0.99.7"}, "lidar", "fallback", False),
    ({"modality": V, "sla_class": 14, "src_ip": "10.0.99.7"}, "best-effort", "claim", False),
    ({"modality": A, "src_ip": "::ffff:10.0.99.7"}, "video", "fallback", True),
    ({"modality": A, "src_ip": ipaddress.ip_address("10.0.99.255")}, "video", "fallback", True),
    ({"modality": A, "src_ip": "10.0.98.7"}, "voice", "fallback", False),
    ({"modality": A, "src_ip": "fd00::7"}, "voice", "fallback", False),
    ({"modality": A, "src_ip": None}, "voice", "fallback", False),
]


@pytest.mark.parametrize(("args", "name", "via", "clamped"), EXAMPLE_TABLE)
def test_classify_example(
    example: Policy, args: dict[str, Any], name: str, via: str, clamped: bool
) -> None:
    args = dict(args)
    modality = args.pop("modality")
    assert classify_reference(example, modality, **args).name == name
    assert tuple(reference_verdict(example, modality, **args))[1:] == (via, clamped)


RICH_TABLE: list[tuple[dict[str, Any], str]] = [
    # metadata rules in file order, then the fallback, then the default
    ({"modality": V, "fps": 60}, "hd-video"),
    ({"modality": V, "fps": 50}, "hd-video"),  # min is inclusive
    ({"modality": V, "fps": 49}, "any-video"),  # first rule that holds, in file order
    ({"modality": V, "fps": 1000}, "hd-video"),
    ({"modality": V, "fps": 1001}, "hd-video"),
    ({"modality": V}, "video"),  # no fps TLV: no rule holds
    ({"modality": V, "bitrate": 300000}, "video"),  # other metadata does not count
    ({"modality": A, "bitrate": 256000}, "hifi"),
    ({"modality": A, "bitrate": 255999}, "voice"),
    ({"modality": A}, "voice"),
    ({"modality": Modality.CONTROL, "bitrate": 300000}, "voice"),
    ({"modality": PC, "density": 100000}, "dense"),
    ({"modality": PC, "density": 200000}, "dense"),  # max is inclusive
    ({"modality": PC, "density": 200001}, "be"),  # no fallback for point clouds
    ({"modality": PC, "density": 99999}, "be"),
    ({"modality": PC}, "be"),
    ({"modality": Modality.TEXT}, "tensor"),
    ({"modality": I}, "be"),
    ({"modality": V, "sla_class": 63}, "gold"),
    ({"modality": V, "sla_class": 2, "fps": 60}, "hd-video"),  # id 2 is not a class
    # clamping: longest prefix wins; only a better rank is lowered
    ({"modality": V, "fps": 60, "src_ip": "10.9.0.1"}, "video"),  # /8: max video
    ({"modality": V, "fps": 60, "src_ip": "10.1.0.1"}, "be"),  # /16 beats /8
    ({"modality": A, "src_ip": "10.2.3.4"}, "voice"),  # /16: voice allowed
    ({"modality": V, "sla_class": 63, "src_ip": "10.2.3.4"}, "voice"),  # gold -> voice
    ({"modality": Modality.TEXT, "src_ip": "10.1.0.1"}, "be"),
    ({"modality": V, "src_ip": "10.9.0.1"}, "video"),  # equal rank: unchanged
    ({"modality": PC, "src_ip": "10.9.0.1"}, "be"),  # worse rank: unchanged
    ({"modality": A, "src_ip": "fd00:1::5"}, "be"),
    ({"modality": A, "src_ip": "fd00:2::5"}, "tensor"),  # ::/0
    ({"modality": A, "src_ip": "192.0.2.1"}, "tensor"),  # ::/0 covers IPv4-mapped too
    ({"modality": A}, "voice"),  # no source address: no clamp
]


@pytest.mark.parametrize(("args", "name"), RICH_TABLE)
def test_classify_rich(rich: Policy, args: dict[str, Any], name: str) -> None:
    args = dict(args)
    modality = args.pop("modality")
    assert classify_reference(rich, modality, **args).name == name


def test_match_holds() -> None:
    m = Match.model_validate({"modalities": ["video"], "fps": {"min": 30, "max": 60}})
    assert m.meta is MetaKind.FPS
    assert m.holds(fps=30) and m.holds(fps=60) and not m.holds(fps=61)
    assert not m.holds() and not m.holds(bitrate=45)
    plain = Match.model_validate({"modalities": ["lidar"]})
    assert plain.meta is MetaKind.NONE and plain.condition is None and plain.holds()
    assert plain.modalities == (Modality.POINT_CLOUD,)


# --------------------------------------------------------------------------
# Random input: PolicyError or a Policy, nothing else
# --------------------------------------------------------------------------
FIELD_NAMES = [
    "apiVersion", "api_version", "description", "link", "device", "rate", "classes", "name",
    "id", "match", "modalities", "fps", "bitrate", "density", "min", "max", "ceil", "weight",
    "priority", "dscp", "default_class", "source_rules", "prefix", "max_class",
]  # fmt: skip
leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-1, max_value=70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        ["mmmesh/v1", "150mbit", "1.2mbit/s", "eth0", "video", "lidar", "voice", "best-effort",
         "10.0.0.0/8", "fd00::/64", "150mbps", "x", ""]
    )
)  # fmt: skip
keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=8)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=30,
)


def _accepts_or_refuses(data: Any) -> None:
    try:
        p = parse_policy(data)
    except PolicyError as e:
        assert e.errors
        assert all(isinstance(loc, str) and isinstance(msg, str) for loc, msg in e.errors)
    else:
        assert isinstance(p, Policy)
        assert parse_policy(p.to_yaml()) == p


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=8))
def test_random_mappings(data: dict[Any, Any]) -> None:
    _accepts_or_refuses(data)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_example(data: st.DataObject) -> None:
    doc = example_doc()
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        path = data.draw(st.sampled_from(_paths(doc)))
        parent: Any = doc
        for part in path[:-1]:
            parent = parent[part]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(values)
        if not _paths(doc):
            break
    _accepts_or_refuses(copy.deepcopy(doc))


@settings(max_examples=200)
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    _accepts_or_refuses(text)


def test_docs_examples_are_exact(example: Policy) -> None:
    doc = (ROOT / "docs" / "policy.md").read_text()
    first = re.search(r"```yaml\n(.*?)```", doc, re.DOTALL)
    assert first is not None
    assert parse_policy(first[1]) == example.model_copy(update={"description": None})
    rejected = doc.split("## Rejected policies", 1)[1]
    pairs = re.findall(r"```yaml\n(.*?)```\s*```\n(.*?)```", rejected, re.DOTALL)
    assert len(pairs) == 5
    for text, shown in pairs:
        with pytest.raises(PolicyError) as info:
            parse_policy(text, source="policy.yaml")
        if str(info.value) in shown:
            continue
        for loc, msg in info.value.errors:
            assert re.search(re.escape(loc) + r" +" + re.escape(msg) + "\n", shown), (loc, msg)


# --------------------------------------------------------------------------
# The public face: mmmesh.policy re-exports one module per role
# --------------------------------------------------------------------------
PUBLIC = [
    "API_VERSION", "KNOBS", "MAX_WEIGHT", "MODALITY_ALIASES", "QUANTUM_UNIT", "Adapt", "IfName",
    "Link", "Match", "MetaRange", "Objective", "Policy", "Rate", "SourceRule", "TrafficClass", "Verdict",
    "bounds", "classify_reference", "format_rate", "load_policy", "parse_policy",
    "policy_json_schema", "policy_values", "reference_verdict",
]  # fmt: skip


def test_public_names() -> None:
    import mmmesh.policy as pkg
    from mmmesh import wire
    from mmmesh.policy import _adapt, _schema, _types, _yaml, reference

    assert pkg.__all__ == PUBLIC
    # nothing else public on the package but its public role modules
    assert {n for n in vars(pkg) if not n.startswith("_")} - set(PUBLIC) <= {"reference",
                                                                             "overrides", "egress"}
    # each name is the object its role module defines, not a copy
    homes = {
        "MODALITY_ALIASES": wire, "Rate": _types, "load_policy": _yaml, "parse_policy": _yaml,
        "Verdict": reference, "classify_reference": reference, "reference_verdict": reference,
        "Adapt": _adapt, "Objective": _adapt, "KNOBS": _adapt, "IfName": _types,
        "format_rate": _types,
    }  # fmt: skip
    for name in PUBLIC:
        assert getattr(pkg, name) is getattr(homes.get(name, _schema), name), name
