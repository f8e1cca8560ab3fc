"""The controller's law on a fake clock with synthetic SLA series: miss, recover,
stale data, frozen membership, bounds, donors, blackout, no oscillation."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mmmesh.dataplane._compile import compile_policy
from mmmesh.policy import QUANTUM_UNIT, Policy, parse_policy
from qosd.controller.core import Law, Measure, SlaInput, effective_policy
from testkit.controller_cases import (
    BUSY,
    COMFY,
    EASED,
    EXAMPLE,
    MISS,
    OKAY,
    TIGHT,
    Run,
    _tight,  # noqa: F401
)

M = 10**6






VIDEO_SLACK = Measure(2000, None, 200.0)  # video: p99 200 ms <= 400 ms: slack 0.5




def direction_changes(values: list[int]) -> int:
    deltas = [b - a for a, b in itertools.pairwise(values) if b != a]
    return sum((a > 0) != (b > 0) for a, b in itertools.pairwise(deltas))


# --------------------------------------------------------------------------
# Miss: additive increase up to the bound, and no further
# --------------------------------------------------------------------------
def test_miss_steps_up_to_the_bounds_and_no_further() -> None:
    r = Run()
    r.run(40, {"voice": MISS, "video": BUSY})
    rate, weight = r.series("voice", "rate"), r.series("voice", "weight")
    # hysteresis 2 windows, then a step every other window (blackout 1)
    assert r.changes("voice") == [1, 3, 5, 7, 9, 11, 13]
    assert sorted(set(rate)) == [1_200_000 + k * 600_000 for k in range(7)]  # +0.5 x 1.2mbit
    assert max(rate) == 4_800_000 and rate[-1] == 4_800_000  # the range's max, no further
    assert sorted(set(weight)) == list(range(3, 11)) and weight[-1] == 10
    steps = [b - a for a, b in itertools.pairwise(rate)]
    assert max(steps) <= 0.5 * 1_200_000
    voice = r.ctrl.explain()["classes"][1]
    assert voice["class"] == "voice" and voice["note"] == "missing, at the top of its ranges"
    assert voice["state"] == "increasing"
    # other classes untouched: the example's link has room (no donor needed)
    assert all(d.classes["video"] == r.decisions[0].classes["video"] for d in r.decisions)


def test_a_step_that_rounded_down_stops_short_of_the_top_without_a_1_bit_raise() -> None:
    """Voice at 2,400,001 bit/s with a range to twice that: a step is 1,200,000
    (rounded down), so two steps end 2 bits below the top; a further miss must
    not raise it by those bits (a kernel write and a blackout for nothing)."""
    doc = EXAMPLE.model_dump(mode="json", by_alias=True, exclude_none=True)
    (voice,) = [c for c in doc["classes"] if c["name"] == "voice"]
    voice.update(rate=2_400_001, adapt={"rate": [2_400_001, 4_800_002]})
    r = Run(parse_policy(doc))
    r.run(20, {"voice": MISS, "video": BUSY})
    rate = r.series("voice", "rate")
    assert sorted(set(rate)) == [2_400_001, 3_600_001, 4_800_001]
    assert r.changes("voice") == [1, 3]
    voice_x = next(c for c in r.ctrl.explain()["classes"] if c["class"] == "voice")
    assert voice_x["note"] == "missing, at the top of its ranges"


def test_a_class_without_ranges_is_only_explained() -> None:
    policy = parse_policy(EXAMPLE.to_yaml().replace(
        "  adapt:\n    rate:\n    - 1.2mbit\n    - 4.8mbit\n    weight:\n    - 3\n    - 10\n",
        ""))
    r = Run(policy)
    r.run(6, {"voice": MISS})
    assert r.changes("voice") == []
    assert r.ctrl.explain()["classes"][1]["note"] == (
        "missing; the policy gives it nothing to adapt (no adapt ranges)")


def test_one_missed_window_is_not_a_miss() -> None:
    r = Run()
    for _ in range(15):
        r.step({"voice": MISS})
        r.step({"voice": OKAY})
    assert r.changes("voice") == []


def test_blackout_windows_neither_count_nor_reset() -> None:
    r = Run()
    r.run(2, {"voice": MISS})  # raised at window 1
    r.step({"voice": OKAY})  # window 2: blackout, ignored (does not reset the streak)
    r.step({"voice": MISS})  # window 3: third miss in a row -> raised
    assert r.changes("voice") == [1, 3]
    r.step({"voice": MISS})  # window 4: blackout, ignored (does not count either)
    r.step({"voice": OKAY})  # window 5: resets
    r.step({"voice": MISS})  # window 6: one
    r.step({"voice": MISS})  # window 7: two -> raised
    assert r.changes("voice") == [1, 3, 7]


def test_same_window_twice_is_one_step() -> None:
    r = Run()
    inp = SlaInput(r.now, {"voice": MISS})
    first = r.ctrl.step(inp)
    again = r.ctrl.step(replace(inp, now=r.now + 4.9))
    assert again is first and r.ctrl.classes["voice"].miss == 1


# --------------------------------------------------------------------------
# Recovery: multiplicative decay back to exactly the policy
# --------------------------------------------------------------------------
def test_recovery_decays_back_to_exactly_the_policy_values() -> None:
    r = Run()
    r.run(9, {"voice": MISS, "video": BUSY})
    top = r.decisions[-1].classes["voice"]
    assert (top.rate, top.weight) == (3_600_000, 7)
    start = len(r.decisions)
    r.run(10, {"voice": COMFY, "video": EASED})
    after = r.decisions[start:]
    policy = r.decisions[0].classes
    back = next(i for i, d in enumerate(after) if d.classes == policy)
    assert back + 1 <= 10  # within 10 windows of the load going
    assert after[-1].classes == policy  # exactly, every knob of every class
    rates = [d.classes["voice"].rate for d in after]
    assert rates == sorted(rates, reverse=True)  # only ever toward the policy
    # the excess halves: 2.4mbit -> 1.2mbit -> 0.6mbit -> 0 (below one step)
    assert sorted(set(rates), reverse=True) == [3_600_000, 2_400_000, 1_800_000, 1_200_000]
    why = r.ctrl.explain()["classes"][1]["decisions"][-1]["why"]
    assert "load eased: video 2000 -> 500 frames a window" in why


def test_comfortable_under_the_same_load_holds_until_a_probe() -> None:
    law = Law(probe_windows=10, probe_max_windows=40)
    r = Run(law=law)
    r.run(4, {"voice": MISS, "video": BUSY})  # raised twice
    raised = r.decisions[-1].classes["voice"]
    # comfortable, but the load it was raised for lasts (the first window is a blackout)
    r.run(10, {"voice": COMFY, "video": BUSY})
    assert all(d.classes["voice"] == raised for d in r.decisions[-10:])
    assert r.ctrl.explain()["classes"][1]["note"].startswith("comfortable; holding")
    r.step({"voice": COMFY, "video": BUSY})  # the 10th comfortable window counted: a probe
    assert r.decisions[-1].classes["voice"].rate < raised.rate
    assert "probe after 10 comfortable windows" in r.ctrl.classes["voice"].history[-1].why
    r.run(3, {"voice": MISS, "video": BUSY})  # blackout, miss, miss -> raised: the probe failed
    assert r.decisions[-1].classes["voice"] == raised
    assert r.ctrl.classes["voice"].probe == 20
    assert "the probe failed: next one after 20 windows" in r.ctrl.classes["voice"].history[-1].why


# --------------------------------------------------------------------------
# Stale data expires back to the policy; frozen membership changes nothing
# --------------------------------------------------------------------------
@pytest.mark.parametrize("nodata", [
    None,                                            # the class's row is gone
    Measure(500, 0.9, 180.0, age_s=60.0),            # 60 s old > 3 windows of 5 s
    Measure(20, 0.9, 180.0),                         # 20 frames < 100
    Measure(500, 0.9, 180.0, nodes=0),               # no node reporting
    Measure(500, None, None),                        # nothing measured
])  # fmt: skip
def test_stale_data_expires_to_the_policy_within_three_windows(nodata: Measure | None) -> None:
    r = Run()
    r.run(6, {"voice": MISS})
    assert r.decisions[-1].classes["voice"].rate > 1_200_000
    for _ in range(2):
        r.step({} if nodata is None else {"voice": nodata})
        assert r.decisions[-1].classes["voice"].rate > 1_200_000
    r.step({} if nodata is None else {"voice": nodata})
    assert r.decisions[-1].classes == r.decisions[0].classes  # the 3rd window without data
    rec = r.ctrl.classes["voice"].history[-1]
    assert rec.why.startswith("expired: no usable SLA data for 3 windows")
    assert r.ctrl.explain()["classes"][1]["state"] == "stale"


def test_frozen_membership_changes_nothing() -> None:
    r = Run()
    r.run(2, {"voice": MISS, "video": BUSY})
    raised = r.decisions[-1].classes
    r.run(10, {"voice": MISS, "video": BUSY}, suspect=0.5)  # misses: no increase
    r.run(5, {"voice": COMFY, "video": EASED}, suspect=0.25)  # eased: no decay
    assert all(d.classes == raised and d.frozen and not d.changed for d in r.decisions[2:])
    ex = r.ctrl.explain()
    assert ex["frozen"] and {c["state"] for c in ex["classes"]} == {"frozen"}
    assert ex["classes"][1]["note"] == "frozen: 25% of members suspect"
    r.step({"voice": COMFY, "video": EASED}, suspect=0.2)  # thawed (0.2 is not above 0.2):
    assert not r.decisions[-1].changed  # one window of blackout for everyone
    r.run(2, {"voice": COMFY, "video": EASED})
    assert "voice" in r.decisions[-1].changed or "voice" in r.decisions[-2].changed


def test_frozen_still_expires_stale_adaptations() -> None:
    """The policy is always safe: staleness is this node's own knowledge."""
    r = Run()
    r.run(2, {"voice": MISS})
    r.run(3, {}, suspect=0.9)
    assert r.decisions[-1].classes == r.decisions[0].classes


# --------------------------------------------------------------------------
# Donors: lowest-ranked first, within their bounds, never past their objective
# --------------------------------------------------------------------------
def test_donors_give_lowest_rank_first_within_bounds() -> None:
    r = Run(TIGHT)
    r.run(5, {"voice": MISS, "video": VIDEO_SLACK})
    d = r.decisions[-1].classes
    assert sum(p.rate for p in d.values()) == 250 * M
    # best-effort (rank 4, no objective) gave all its range allows (0.8mbit), then video
    assert d["best-effort"].rate == 16 * M
    assert d["voice"].rate == 2_400_000 and d["video"].rate == 150 * M - 400_000
    hist = r.ctrl.classes["voice"].history
    assert hist[0].why == ("missed 2 windows: p99 180 ms > 120 ms; attainment 0.900 < 0.99; "
                           "+600kbit from best-effort (no objective)")
    assert hist[1].why.endswith("+200kbit from best-effort (no objective); "
                                "+400kbit from video (slack 0.50)")
    assert r.ctrl.classes["video"].history[-1].why == "-400kbit gave to voice (slack 0.50)"
    # video's slack falls below the margin: it gives no more
    r.run(4, {"voice": MISS, "video": Measure(2000, None, 350.0)})
    assert r.decisions[-1].classes["video"].rate == 150 * M - 400_000
    assert r.ctrl.explain()["classes"][1]["note"] == (
        "missing; no rate to be had (no class has slack)")
    for dec in r.decisions:
        assert sum(p.rate for p in dec.classes.values()) <= 250 * M
        assert dec.classes["best-effort"].rate >= 16 * M and dec.classes["video"].rate >= 100 * M


def test_a_donor_that_misses_takes_its_share_back_first() -> None:
    r = Run(TIGHT)
    r.run(5, {"voice": MISS, "video": VIDEO_SLACK})
    assert r.decisions[-1].classes["video"].rate < 150 * M
    r.run(3, {"voice": OKAY, "video": Measure(2000, None, 500.0)})  # video misses now
    d = r.decisions[-1].classes
    assert d["video"].rate == 150 * M  # its policy share back, paid by voice
    assert d["voice"].rate == 2_000_000
    assert "+400kbit back from voice (lent)" in r.ctrl.classes["video"].history[-1].why
    assert "-400kbit returned to video (its policy share)" in (
        r.ctrl.classes["voice"].history[-1].why)


def test_lent_rate_comes_back_when_the_receiver_decays() -> None:
    r = Run(TIGHT)
    r.run(5, {"voice": MISS, "video": VIDEO_SLACK})
    r.run(8, {"voice": COMFY, "video": Measure(500, None, 100.0)})
    assert r.decisions[-1].classes == r.decisions[0].classes
    assert any("of its lent policy share back" in rec.why
               for rec in r.ctrl.classes["best-effort"].history)


def test_the_better_ranked_missing_class_is_paid_first() -> None:
    policy = parse_policy(TIGHT.to_yaml().replace("sla:\n    p99_ms: 400", "sla:\n    p99_ms: 40")
                          .replace("100mbit\n    - 150mbit", "150mbit\n    - 200mbit"))
    r = Run(policy)
    r.run(2, {"voice": MISS, "video": Measure(2000, None, 200.0)})  # both miss
    d = r.decisions[-1].classes
    assert d["voice"].rate == 1_800_000  # best-effort's 0.8mbit: voice first
    assert d["video"].rate == 150 * M + 200_000


# --------------------------------------------------------------------------
# Steady load: settles, then never changes direction
# --------------------------------------------------------------------------
def plant(rate: int) -> Measure:
    """Voice needs 2.2 Mbit/s: below it misses, above it is comfortably inside."""
    return MISS if rate < 2_200_000 else COMFY


@pytest.mark.parametrize("policy", [EXAMPLE, TIGHT], ids=["room", "tight"])
def test_steady_load_settles_without_oscillation(policy: Policy) -> None:
    r = Run(policy)
    r.step({"voice": plant(1_200_000), "video": VIDEO_SLACK})
    for _ in range(59):  # below the probe interval (60): a steady load is all it sees
        r.step({"voice": plant(r.decisions[-1].classes["voice"].rate), "video": VIDEO_SLACK})
    assert r.changes("voice")[-1] <= 4  # settled within 5 windows
    for cls in ("voice", "video", "best-effort"):
        for knob in ("rate", "weight", "priority", "ceil"):
            assert direction_changes(r.series(cls, knob)) == 0, (cls, knob)


# --------------------------------------------------------------------------
# Per-stage overrides
# --------------------------------------------------------------------------
def test_a_missing_stage_gets_a_weight_override() -> None:
    r = Run()
    stages = {("voice", "asr"): MISS, ("voice", "tts"): COMFY, ("video", "enc"): MISS}
    r.run(2, {"voice": OKAY}, stages=stages)
    d = r.decisions[-1]
    assert d.stage_weights == {"voice": {"asr": 4}}  # video has no objective: no override
    assert d.classes["voice"].weight == 3 and "voice/asr" in d.changed
    stage = r.ctrl.explain()["classes"][1]["stages"]
    assert [s["stage"] for s in stage] == ["asr", "tts"]
    assert stage[0]["params"]["weight"] == {"current": 4, "policy": 3, "range": [3, 10]}
    r.run(20, {"voice": MISS}, stages=stages)
    top = r.decisions[-1]
    assert top.classes["voice"].weight == 10 and top.stage_weights == {}  # the class caught up
    assert max(w for d in r.decisions for s in d.stage_weights.values() for w in s.values()) <= 10
    r.run(3, {"voice": OKAY})  # the stages' data is gone: overrides expire, then are forgotten
    r.run(3, {"voice": OKAY})
    assert r.ctrl.stages == {}


# --------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------
def test_decision_compiles_through_the_dataplane_face() -> None:
    r = Run()
    d = r.run(4, {"voice": MISS})[-1]
    eff = effective_policy(EXAMPLE, d.classes)
    leaves = {h.classid: h for h in compile_policy(eff).htb.leaves}  # type: ignore[union-attr]
    voice = EXAMPLE.class_named("voice")
    leaf = leaves[voice.classid]
    assert (leaf.rate_bps, leaf.ceil_bps, leaf.prio, leaf.quantum) == (
        2_400_000, 1000 * M, 1, 5 * QUANTUM_UNIT)
    assert d.classes["voice"].quantum == 5 * QUANTUM_UNIT
    assert eff.rank("voice") == EXAMPLE.rank("voice")
    assert eff.class_named("voice").adapt is None and eff.class_named("voice").sla is None
    assert d.as_dict()["classes"]["voice"] == {
        "rate": 2_400_000, "ceil": 1000 * M, "weight": 5, "priority": 1, "quantum": 7570}


def test_a_lending_default_class_compiles() -> None:
    """The default class below its own rate: the effective policy is still valid."""
    r = Run(TIGHT)
    d = r.run(3, {"voice": MISS, "video": VIDEO_SLACK})[-1]
    assert d.classes["best-effort"].rate < TIGHT.class_named("best-effort").rate
    eff = effective_policy(TIGHT, d.classes)
    assert eff.class_named("best-effort").rate == d.classes["best-effort"].rate


def test_a_new_policy_starts_over() -> None:
    r = Run()
    r.run(2, {"voice": MISS})
    assert not r.ctrl.set_policy(parse_policy(EXAMPLE.to_yaml()))  # the same policy
    assert r.ctrl.decision.classes["voice"].rate == 1_800_000
    assert r.ctrl.set_policy(TIGHT)
    assert r.ctrl.decision.classes["voice"].rate == 1_200_000 and r.ctrl.window == -1
