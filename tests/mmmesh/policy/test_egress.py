"""Egress modes without a device: what each mode refuses (fields named), the
rule that picks a mode, and what egress mode fq compiles a policy into
(bands, band weights, priomap, pacers, boosts) and calls drift.

The properties that make fq safe are checked over many policies
(hypothesis): a band never gets less than its classes' guarantees under
contention, a class's pacers never add up to more than its ceil (beyond the
pacing floor), and a less privileged class never gets a better band."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmmesh import abi
from mmmesh.dataplane import Boost, Overrides, StageOverride
from mmmesh.dataplane._compile import (
    FQ_BASE_WEIGHT,
    BoostLeaf,
    compile_overrides,
    compile_policy,
    fq_band_weights,
    fq_plan,
    fq_priomap,
    pace_horizon_us,
)
from mmmesh.dataplane._egress import choose_egress, fq_drift, installed_egress
from mmmesh.dataplane._types import FqQdiscStats
from mmmesh.errors import DataplaneError, PolicyError
from mmmesh.policy import Policy, load_policy, parse_policy
from mmmesh.policy.egress import (
    EGRESS_MODES,
    FQ_BAND_OF_PRIORITY,
    FQ_MIN_PACE_BPS,
    check_egress,
    egress_errors,
    fq_band,
)
from testkit.overrides import with_adapt
from testkit.policy_cases import EXAMPLE, example_doc

POLICY = load_policy(EXAMPLE)


def with_classes(**changes: dict[str, Any]) -> Policy:
    doc = example_doc()
    for c in doc["classes"]:
        c.update(changes.get(c["name"], {}))
    return parse_policy(doc)


# ------------------------------------------------------------ what a mode refuses
def test_htb_realises_every_valid_policy_and_fq_the_example() -> None:
    assert EGRESS_MODES == ("htb", "fq")
    assert egress_errors(POLICY, "htb", line_rate_bps=100 * 10**9) == []
    assert egress_errors(POLICY, "fq") == []  # no ceil below the link, line rate unknown
    assert egress_errors(POLICY, "fq", line_rate_bps=10**9) == []  # link.rate = the line rate
    with pytest.raises(ValueError, match="egress mode 'prio'"):
        egress_errors(POLICY, "prio")


def test_fq_refuses_a_link_rate_below_the_line_rate_naming_the_field() -> None:
    errors = egress_errors(POLICY, "fq", line_rate_bps=25 * 10**9)
    assert [f for f, _ in errors] == ["link.rate"]
    assert "does not shape the device below its line rate 25gbit" in errors[0][1]
    assert "egress mode htb" in errors[0][1]
    with pytest.raises(PolicyError, match=r"^invalid policy: link.rate: egress mode fq"):
        check_egress(POLICY, "fq", line_rate_bps=25 * 10**9)
    check_egress(POLICY, "htb", line_rate_bps=25 * 10**9)  # htb shapes to link.rate


def test_fq_refuses_guarantees_its_band_weights_cannot_give() -> None:
    doc = example_doc()
    doc["link"]["rate"] = "1gbit"
    for c in doc["classes"]:
        c.pop("adapt", None)
        c["rate"] = "8bit"
    doc["classes"][2]["rate"] = "999990kbit"  # video (band 1): 99.999 % of the link
    pol = parse_policy(doc)
    errors = egress_errors(pol, "fq")
    assert [f for f, _ in errors] == ["classes"] and "band 1" in errors[0][1]
    doc["classes"][2]["rate"] = "999mbit"  # 99.9 %: fine
    assert egress_errors(parse_policy(doc), "fq") == []


def test_fq_refuses_a_ceil_it_cannot_pace_naming_the_field() -> None:
    assert FQ_MIN_PACE_BPS == 12112  # one 1514-byte frame per 1 s horizon
    low = with_classes(video={"rate": "8kbit", "ceil": "12kbit"})
    assert [f for f, _ in egress_errors(low, "fq")] == ["classes[2].ceil"]
    assert egress_errors(with_classes(video={"rate": "8kbit", "ceil": "12112"}), "fq") == []
    assert egress_errors(low, "htb") == []
    adapt = with_classes(lidar={"rate": "8kbit", "ceil": "1mbit",
                                "adapt": {"ceil": ["10kbit", "1mbit"]}})
    errors = egress_errors(adapt, "fq")
    assert [f for f, _ in errors] == ["classes[3].adapt.ceil"]
    assert "10kbit" in errors[0][1]


# ------------------------------------------------------------ the auto rule
@pytest.mark.parametrize(("requested", "queues", "bands", "mode"), [
    ("auto", 1, True, "htb"),   # one queue: nothing to scale, HTB's guarantees are hard
    ("auto", 4, True, "fq"),    # multiqueue and sch_fq bands
    ("auto", 64, False, "htb"),  # no bands (Linux < 6.7, or no sch_fq)
    ("htb", 64, True, "htb"),
    ("fq", 1, False, "fq"),     # asked for: up() refuses without bands, clearly
])
def test_the_auto_rule(requested: str, queues: int, bands: bool, mode: str) -> None:
    assert choose_egress(requested, tx_queues=queues, fq_bands=bands) == mode


def test_unknown_modes_are_refused() -> None:
    from mmmesh.dataplane import Dataplane

    with pytest.raises(ValueError, match="one of auto, htb, fq"):
        choose_egress("cake", tx_queues=1, fq_bands=True)
    with pytest.raises(ValueError, match="one of auto, htb, fq"):
        Dataplane("eth0", egress="cake")


# ------------------------------------------------------------ bands and weights
def test_bands_follow_priority_monotonically() -> None:
    assert FQ_BAND_OF_PRIORITY == (0, 0, 1, 1, 2, 2, 2, 2)
    assert [fq_band(p) for p in range(8)] == list(FQ_BAND_OF_PRIORITY)
    # the example: control, voice -> 0; video, lidar -> 1; best-effort -> 2
    assert [fq_band(c.priority) for c in POLICY.ranked()] == [0, 0, 1, 1, 2]


def test_the_example_gets_the_kernels_own_9_3_1() -> None:
    cp = compile_policy(POLICY, 7, egress="fq")
    assert cp.htb is None and cp.egress == "fq" and cp.fq is not None
    assert cp.fq.weights == (589824, 196608, 65536)  # sch_fq's defaults, band 2 at 64 KiB
    assert cp.fq.priomap == (2,) * 13 + (0, 1, 2) and cp.fq.default_band == 2
    assert cp.fq.horizon_us == abi.FQ_HORIZON_US
    slots = {POLICY.class_by_id(cid).name: int(i.classid) for cid, i in cp.classes.items()}
    assert slots == {"control": 13, "voice": 13, "video": 14, "lidar": 14, "best-effort": 15}
    assert all(i.pace_Bps == 0 for i in cp.classes.values())  # no ceil below the link
    assert not cp.config.flags & abi.CFG_PACING
    # the maps keep the policy's ranks and DSCP, as in htb
    htb = compile_policy(POLICY, 7)
    assert {c: (i.rank, i.dscp) for c, i in cp.classes.items()} == {
        c: (i.rank, i.dscp) for c, i in htb.classes.items()}


def test_a_band_whose_guarantees_need_more_gets_more() -> None:
    # video 600 Mbit/s of a 1 Gbit/s link: band 1 needs 60 % (9:3:1 gives 23 %)
    pol = with_classes(video={"rate": "600mbit"}, lidar={"rate": "200mbit"})
    w = compile_policy(pol, egress="fq").fq.weights  # type: ignore[union-attr]
    share = [Fraction(x, sum(w)) for x in w]
    assert share[1] >= Fraction(800, 1000)
    assert w[0] > w[2] == FQ_BASE_WEIGHT  # the rest keeps 9:1, the smallest at 64 KiB
    assert abs(Fraction(w[0], w[2]) - 9) < Fraction(1, 100)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(8, 10**9)), min_size=1, max_size=12),
       st.integers(10**6, 4 * 10**11))
def test_every_band_gets_at_least_its_guarantees(leaves: list[tuple[int, int]],
                                                  link: int) -> None:
    link = max(link, sum(r for _, r in leaves))  # the schema refuses guarantees above the link
    w = fq_band_weights(link, leaves)
    assert all(abi.FQ_MIN_WEIGHT <= x <= 0x7FFFFFFF for x in w)
    used = {b for b, _ in leaves}
    most = Fraction(0x7FFFFFFF, 0x7FFFFFFF + abi.FQ_MIN_WEIGHT * (len(used) - 1))
    for b in used:
        need = Fraction(sum(r for bb, r in leaves if bb == b), link)
        if need > most:  # egress_errors refuses this policy ("classes")
            continue
        # the band's share of the rounds, over the bands that have traffic
        share = Fraction(w[b], sum(w[x] for x in used))
        assert share >= need * Fraction(999, 1000) - Fraction(1, 10**6), (b, w, leaves)


def test_priomap_sends_only_our_slots_to_other_bands() -> None:
    for default in range(3):
        pm = fq_priomap(default)
        assert len(pm) == 16 and pm[13:] == (0, 1, 2)
        assert set(pm[:13]) == {default}  # a priority the classifier did not write


# ------------------------------------------------------------ pacers
def test_a_ceil_below_the_link_is_a_pacer_with_a_bounded_horizon() -> None:
    pol = with_classes(video={"rate": "10mbit", "ceil": "40mbit"})
    cp = compile_policy(pol, egress="fq")
    video = cp.classes[12]
    assert (int(video.pace_Bps), int(video.horizon_us)) == (5_000_000, pace_horizon_us(5_000_000))
    assert pace_horizon_us(5_000_000) == 100 * 1514 * 10**6 // 5_000_000  # 100 frames: 30 ms
    assert pace_horizon_us(10**12) == abi.PACE_MIN_HORIZON_US
    assert pace_horizon_us(1500) == abi.PACE_MAX_HORIZON_US
    assert cp.config.flags & abi.CFG_PACING


@settings(max_examples=200, deadline=None)
@given(st.integers(FQ_MIN_PACE_BPS, 10**9), st.integers(1, 100),
       st.lists(st.tuples(st.integers(1, 100), st.integers(0, 7)), max_size=3))
def test_boosts_never_add_guarantee_or_ceiling(ceil: int, weight: int,
                                               boosts: list[tuple[int, int]]) -> None:
    pol = with_classes(video={"rate": "8kbit", "ceil": str(ceil), "weight": weight})
    video = pol.class_named("video")
    bl = [BoostLeaf(video.id, i + 1, w, p) for i, (w, p) in enumerate(boosts)]
    plan = fq_plan(pol, bl)
    mine = [x for (c, _), x in plan.leaves.items() if c == video.id]
    assert len(mine) == 1 + len(bl)
    assert sum(x.rate_bps for x in mine) == int(video.rate)
    floor = -(-FQ_MIN_PACE_BPS // 8)  # a pacer is never slower than a frame per horizon
    paced = ceil < int(pol.link.rate)
    if paced:
        total = weight + sum(w for w, _ in boosts)
        if min([weight, *(w for w, _ in boosts)]) * (ceil // 8) // total > floor:
            assert sum(x.pace_Bps for x in mine) == ceil // 8  # exactly the ceil, split
        else:  # a share below the floor is raised to it
            assert sum(x.pace_Bps for x in mine) <= ceil // 8 + floor * len(mine)
        assert all(x.pace_Bps >= floor for x in mine)
    else:
        assert all(x.pace_Bps == 0 for x in mine)
    for b in bl:
        assert plan.leaves[(video.id, b.level)].band == fq_band(b.prio)


# ------------------------------------------------------------ overrides in fq
def test_fq_refuses_a_boost_that_changes_nothing_and_keeps_the_others() -> None:
    pol = with_adapt(POLICY, {"voice": {"priority": [1, 3]}})
    inert = Overrides(stages=(StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),))
    compile_overrides(pol, inert, bounds=pol)  # htb: a boost leaf
    with pytest.raises(DataplaneError, match=r"stages\[0\]: egress mode fq: .*split nothing"):
        compile_overrides(pol, inert, bounds=pol, egress="fq")
    band = Overrides(stages=(StageOverride("voice", "10.0.1.0/24", Boost(priority=3)),))
    co = compile_overrides(pol, band, bounds=pol, egress="fq")
    ((_, info),) = co.infos.items()
    assert int(info.classid) == abi.FQ_PRIO_BASE + 1 and info.valid and not info.pace_Bps
    # when up() keeps the kernel's overrides, the inert one is left out, said why
    both = Overrides(stages=inert.stages + band.stages[:0] + (
        StageOverride("voice", "10.0.2.0/24", Boost(priority=3)),))
    co = compile_overrides(pol, both, egress="fq", drop_invalid=True)
    assert len(co.stages) == 1 and "split nothing" in co.dropped[0]


def test_a_boost_priority_cannot_outrank_a_max_class_in_fq_either() -> None:
    # lidar ranks below video (the source rule's max_class): priority 1 would outrank it
    for egress in ("htb", "fq"):
        with pytest.raises(DataplaneError, match="outrank 'video'"):
            compile_overrides(POLICY, Overrides(stages=(
                StageOverride("lidar", "10.0.1.0/24", Boost(priority=1)),)), egress=egress)


def test_a_weight_boost_of_a_paced_class_splits_its_ceil() -> None:
    pol = with_adapt(with_classes(video={"rate": "10mbit", "ceil": "40mbit"}),
                     {"video": {"weight": [7, 21]}})
    co = compile_overrides(pol, Overrides(stages=(
        StageOverride("video", "10.0.1.0/24", Boost(weight=21)),)), bounds=pol, egress="fq")
    ((_, info),) = co.infos.items()
    assert int(info.pace_Bps) == 5_000_000 * 21 // 28 and int(info.classid) == 14
    plan = fq_plan(pol, co.boosts.values())
    assert plan.leaves[(12, 0)].pace_Bps == 5_000_000 - 5_000_000 * 21 // 28


def test_a_less_privileged_class_never_gets_a_better_band_within_its_ranges() -> None:
    """Anti-escalation in fq: for every source rule's max_class M and every
    class C ranking below it, C's best band within its adapt ranges is no
    better than M's worst (the schema's rank rule, seen through the bands)."""
    for pol in (POLICY, with_adapt(POLICY, {"lidar": {"priority": [2, 4]},
                                            "video": {"priority": [1, 2]}})):
        for rule in pol.source_rules:
            m = pol.class_named(rule.max_class)
            worst_m = fq_band((m.adapt.priority or (m.priority,) * 2)[1] if m.adapt
                              else m.priority)
            for c in pol.classes:
                if pol.rank(c) > pol.rank(m):
                    best_c = (c.adapt.priority or (c.priority,) * 2)[0] if c.adapt \
                        else c.priority
                    assert fq_band(best_c) >= worst_m, (c.name, m.name)


# ------------------------------------------------------------ drift
def fq(queue: int, **kw: Any) -> FqQdiscStats:
    spec = compile_policy(POLICY, egress="fq").fq
    assert spec is not None
    base = {"weights": spec.weights, "priomap": spec.priomap, "horizon_us": spec.horizon_us,
            "horizon_drop": True}
    return FqQdiscStats(queue=queue, handle=(0x4E00 + queue) << 16,
                        parent=0x4D4D0000 | (queue + 1), **{**base, **kw})


def test_fq_drift_names_what_changed() -> None:
    spec = compile_policy(POLICY, egress="fq").fq
    assert spec is not None
    mq = ("mq", 0x4D4D0000)
    assert installed_egress(mq) == "fq" and installed_egress(("fq", 0x4D4D0000)) == "fq"
    assert installed_egress(("htb", 0x10000)) == "htb" and installed_egress(("mq", 0)) is None
    ok = {q: fq(q) for q in range(4)}
    assert fq_drift(spec, mq, ok, {}, 4) == []
    assert fq_drift(spec, ("htb", 0x10000), {}, {}, 4) == [
        ("egress mode fq's root qdisc (mq 4d4d:) missing or replaced (the device runs egress "
         "mode htb)")]
    assert fq_drift(spec, ("fq", 0x4D4D0000), {0: fq(0)}, {}, 1) == []
    found = fq_drift(spec, mq, {**ok, 1: fq(1, weights=(65536,) * 3)}, {3: "pfifo_fast"}, 4)
    assert "TX queue 3 runs pfifo_fast, not egress mode fq's fq" in found
    assert any(f.startswith("TX queue 1: fq band weights or priomap changed") for f in found)
    assert fq_drift(spec, mq, {0: fq(0, horizon_us=10**7)}, {}, 4) == [
        "TX queue 0: fq horizon changed"]
    assert fq_drift(spec, mq, {0: fq(0, weights=None, priomap=None)}, {}, 4) == [
        "TX queue 0: fq without priority bands"]
