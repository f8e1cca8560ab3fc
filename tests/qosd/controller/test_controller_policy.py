"""The policy's SLA objectives (``sla``) and adaptation bounds (``adapt``):
the shipped example, canonical YAML (what ``mmmeshctl policy diff`` shows),
every refusal with its field named, and anti-escalation checked exactly."""

from __future__ import annotations

import difflib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmmesh.errors import PolicyError
from mmmesh.policy import Policy, bounds, parse_policy
from testkit.policy_cases import Mut, example_doc, rejected_with_field_named
from testkit.policy_cases import set_field as _set


def _and(*muts: Mut) -> Mut:
    def mut(doc: dict[str, Any]) -> None:
        for m in muts:
            m(doc)

    return mut


def _set_adapt(i: int, **ranges: Any) -> Mut:
    def mut(doc: dict[str, Any]) -> None:
        doc["classes"][i]["adapt"] = ranges

    return mut


# fmt: off
ADAPT_REJECTIONS: list[tuple[str, Mut, str, str]] = [
    ("no part", _set("classes.1.sla", {}), "classes[1].sla", "state p99_ms, attainment or both"),
    ("p99 zero", _set("classes.1.sla", {"p99_ms": 0}), "classes[1].sla.p99_ms", "greater than 0"),
    ("p99 string", _set("classes.1.sla", {"p99_ms": "120"}), "classes[1].sla.p99_ms",
     "valid number"),
    ("p99 bool", _set("classes.1.sla", {"p99_ms": True}), "classes[1].sla.p99_ms", "valid number"),
    ("p99 a day", _set("classes.1.sla", {"p99_ms": 86_400_001}), "classes[1].sla.p99_ms",
     "less than or equal to 86400000"),
    ("attainment 1", _set("classes.1.sla", {"attainment": 1.0}), "classes[1].sla.attainment",
     "less than 1"),
    ("attainment 0", _set("classes.1.sla", {"attainment": 0}), "classes[1].sla.attainment",
     "greater than 0"),
    ("sla unknown", _set("classes.1.sla", {"p95_ms": 3}), "classes[1].sla.p95_ms", "unknown"),
    ("adapt unknown", _set_adapt(1, quantum=[1, 2]), "classes[1].adapt.quantum", "unknown"),
    ("one value", _set_adapt(1, rate=["1mbit"]), "classes[1].adapt.rate", "[min, max]"),
    ("three values", _set_adapt(1, weight=[1, 2, 3]), "classes[1].adapt.weight", "[min, max]"),
    ("not a list", _set_adapt(1, weight=3), "classes[1].adapt.weight", "[min, max]"),
    ("upside down", _set_adapt(1, rate=["5mbit", "1mbit"]), "classes[1].adapt.rate",
     "min 5mbit is greater than max 1mbit"),
    ("bad rate", _set_adapt(1, rate=["1mbps", "2mbit"]), "classes[1].adapt.rate[0]",
     "ambiguous"),
    ("weight 101", _set_adapt(1, weight=[3, 101]), "classes[1].adapt.weight",
     "101 is outside 1..100"),
    ("weight string", _set_adapt(1, weight=[3, "5"]), "classes[1].adapt.weight[1]",
     "valid integer"),
    ("priority 8", _set_adapt(1, priority=[1, 8]), "classes[1].adapt.priority",
     "8 is outside 0..7"),
    ("own rate outside", _set_adapt(1, rate=["2mbit", "5mbit"]), "classes[1].adapt.rate",
     "the range [2mbit, 5mbit] does not hold the class's own rate 1.2mbit"),
    ("own weight outside", _set_adapt(1, weight=[4, 9]), "classes[1].adapt.weight",
     "does not hold the class's own weight 3"),
    ("own priority outside", _set_adapt(1, priority=[2, 3]), "classes[1].adapt.priority",
     "does not hold the class's own priority 1"),
    ("own ceil is the link", _set_adapt(1, ceil=["1mbit", "2mbit"]), "classes[1].adapt.ceil",
     "does not hold the class's own ceil 1gbit"),
    ("rate past link", _set_adapt(1, rate=["1mbit", "2gbit"]), "classes[1].adapt.rate",
     "max 2gbit (2000000000 bit/s) exceeds the link rate 1gbit (1000000000 bit/s)"),
    ("ceil past link", _set_adapt(1, ceil=["1gbit", "2gbit"]), "classes[1].adapt.ceil",
     "exceeds the link rate"),
    ("rate past ceil", _and(_set("classes.1.ceil", "3mbit"),
                            _set_adapt(1, rate=["1.2mbit", "4mbit"])),
     "classes[1].adapt.rate", "max 4mbit is above the lowest ceil 3mbit"),
    ("rate past lowest ceil", _and(_set("classes.1.ceil", "5mbit"), _set_adapt(
        1, rate=["1.2mbit", "4mbit"], ceil=["3mbit", "5mbit"])),
     "classes[1].adapt.rate", "above the lowest ceil 3mbit"),
    ("default gains rate", _set_adapt(4, rate=["20mbit", "30mbit"]), "classes[4].adapt.rate",
     ("'best-effort' is the default class (traffic the mesh cannot read): it may give, never "
      "gain; the range may not go past its own rate 20mbit to 30mbit")),
    ("default gains priority", _set_adapt(4, priority=[6, 7]), "classes[4].adapt.priority",
     "may give, never gain"),
    ("default gains weight", _set_adapt(4, weight=[1, 2]), "classes[4].adapt.weight",
     "may give, never gain"),
    # source rule 10.0.99.0/24 caps at video (priority 2, 150mbit); lidar ranks below it
    ("lidar over video by priority", _set_adapt(3, priority=[1, 2]),
     "classes[3].adapt.priority",
     ("anti-escalation: 'lidar' ranks below 'video', the max_class of source_rules[0] "
      "(10.0.99.0/24), but could outrank it when adapted: lidar at priority 1, rate 80mbit "
      "against video at priority 2, rate 150mbit")),
    ("lidar over video by rate", _set_adapt(3, rate=["80mbit", "160mbit"]),
     "classes[3].adapt.rate", "lidar at priority 2, rate 160mbit against video at priority 2"),
    ("video under lidar by rate", _set_adapt(2, rate=["70mbit", "150mbit"]),
     "classes[2].adapt.rate",
     "lidar at priority 2, rate 80mbit against video at priority 2, rate 70mbit"),
    ("video under lidar by priority", _set_adapt(2, priority=[2, 3]),
     "classes[2].adapt.priority", "against video at priority 3"),
    ("best-effort over video", _and(_set("classes.4.priority", 3),
                                    _set_adapt(2, priority=[2, 4])),
     "classes[2].adapt.priority", "'best-effort' ranks below 'video'"),
]
# fmt: on


@pytest.mark.parametrize(
    ("mutate", "loc", "fragment"),
    [pytest.param(m, loc, frag, id=name) for name, m, loc, frag in ADAPT_REJECTIONS],
)
def test_adapt_rejected_with_field_named(mutate: Mut, loc: str, fragment: str) -> None:
    rejected_with_field_named(mutate, loc, fragment)


def test_example_voice_objective(example: Policy) -> None:
    voice = example.class_named("voice")
    assert voice.sla is not None and voice.adapt is not None
    assert (voice.sla.p99_ms, voice.sla.attainment) == (120, 0.99)  # the brief's SLA
    assert voice.adapt.rate == (1_200_000, 4_800_000)
    assert voice.adapt.weight == (3, 10)
    assert voice.adapt.ceil is None and voice.adapt.priority is None
    assert example.p99_targets() == {"voice": 120}
    assert [c.name for c in example.classes if c.sla is None and c.adapt is None] == [
        "control", "video", "lidar", "best-effort"]


def test_objective_and_bounds_in_canonical_yaml(example: Policy) -> None:
    """mmmeshctl policy diff compares canonical YAML: the new fields are in it."""
    text = example.to_yaml()
    assert "  sla:\n    p99_ms: 120\n    attainment: 0.99\n" in text  # 120, not 120.0
    assert "  adapt:\n    rate:\n    - 1.2mbit\n    - 4.8mbit\n" in text
    doc = example_doc()
    doc["classes"][1]["adapt"]["weight"] = [3, 12]
    doc["classes"][1]["sla"]["p99_ms"] = 100.5
    changed = parse_policy(doc).to_yaml()
    diff = [d for d in difflib.unified_diff(text.splitlines(), changed.splitlines(), lineterm="")
            if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert diff == ["-    p99_ms: 120", "+    p99_ms: 100.5", "-    - 10", "+    - 12"]


@pytest.mark.parametrize("ranges", [
    {"rate": ["100mbit", "150mbit"]},        # video may give down to lidar's 80 and above
    {"rate": ["80mbit", "150mbit"]},         # ties with lidar's rate: id 12 < 13 still wins
    {"priority": [1, 2], "weight": [1, 100]},  # more urgent than lidar is fine
    {"ceil": ["150mbit", "1gbit"]},
])  # fmt: skip
def test_adapt_accepted(ranges: dict[str, Any]) -> None:
    doc = example_doc()
    doc["classes"][2]["adapt"] = ranges
    p = parse_policy(doc)
    assert p.class_named("video").adapt is not None
    assert parse_policy(p.to_yaml()) == p


def _rank_key(prio: int, rate: int, cid: int) -> tuple[int, int, int]:
    return (prio, -rate, cid)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_anti_escalation_is_exact(data: st.DataObject) -> None:
    """Random ranges for video (the rule's max_class) and lidar, best-effort
    (below it): accepted exactly when no setting inside the ranges lets a
    class below video outrank it, else refused naming an adapt field."""
    doc = example_doc()
    rates = st.sampled_from(["10mbit", "20mbit", "50mbit", "80mbit", "100mbit", "150mbit",
                             "200mbit"])

    def rng(values: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
        return st.lists(values, min_size=2, max_size=2)

    for i in (2, 3, 4):
        ranges = data.draw(st.fixed_dictionaries({}, optional={
            "rate": rng(rates), "priority": rng(st.integers(0, 7))}))
        if ranges:
            doc["classes"][i]["adapt"] = ranges
    try:
        p = parse_policy(doc)
    except PolicyError as e:
        assert all(loc.startswith("classes[") and ".adapt" in loc for loc, _ in e.errors), e
        return
    video = p.class_named("video")
    vb = bounds(p, video)
    for name in ("lidar", "best-effort"):
        c = p.class_named(name)
        cb = bounds(p, c)
        for vp in vb["priority"]:
            for vr in vb["rate"]:
                for cp in cb["priority"]:
                    for cr in cb["rate"]:
                        assert _rank_key(cp, cr, c.id) > _rank_key(vp, vr, video.id)
