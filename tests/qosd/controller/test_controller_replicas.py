"""The per-replica law (qosd/controller/core/_replicas.py) on a fake clock with
synthetic SLA series: a replica that misses while another keeps its
objective loses weight down to the floor, regains it when comfortable,
goes back to equal when its data goes stale; nothing moves when every
replica misses or during a blackout; only configured (stage, instance)
rows count."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from mmmesh.policy import Objective
from qosd.controller.core import Law, ReplicaLaw, ReplicaWeights, replica_measures
from qosd.controller.core._inputs import Measure
from qosd.controller.core._replicas import weight_list

PERIOD = 5.0
OBJ = {"voice": Objective(p99_ms=120, attainment=0.99), "bulk": None}
MISS = Measure(500, 0.5, 300.0, window_s=PERIOD)
GOOD = Measure(500, 1.0, 30.0, window_s=PERIOD)  # slack 0.75: comfortable
OK = Measure(500, 0.995, 100.0, window_s=PERIOD)  # slack ~0.17: ok, not comfortable


def run(rw: ReplicaWeights, series: list[dict[int, Measure | None]], start: int = 0
        ) -> list[dict[int, int]]:
    """One step a window of stage 'asr'; the weights after each."""
    out = []
    for i, per in enumerate(series, start):
        ms = {("asr", r): {"voice": m} for r, m in per.items() if m is not None}
        rw.step(i * PERIOD + 0.5, ms, OBJ)
        out.append(rw.weights()["asr"])
    return out


def fresh(n: int = 2, **kw: Any) -> ReplicaWeights:
    return ReplicaWeights({"asr": range(n)}, Law(period_s=PERIOD), ReplicaLaw(**kw))


def test_starts_equal_and_a_missing_replica_loses_weight_after_the_hysteresis() -> None:
    rw = fresh()
    assert rw.weights() == {"asr": {0: 100, 1: 100}}
    ws = run(rw, [{0: MISS, 1: GOOD}] * 2)
    assert ws == [{0: 100, 1: 100}, {0: 50, 1: 100}]  # miss_windows = 2
    why = rw.explain()["asr"][0]["history"][-1]["why"]
    assert "missed 2 windows while replica(s) 1 did not" in why and "p99 300 ms" in why


def test_blackout_then_floor_never_below() -> None:
    rw = fresh()
    ws = run(rw, [{0: MISS, 1: GOOD}] * 12)
    w0 = [w[0] for w in ws]
    # 2 windows to the first cut; after each: 1 blackout window, then 2 misses
    assert w0[:2] == [100, 50]
    assert w0[2] == 50  # blackout: the window after a change is ignored
    assert min(w0) == 25 and w0[-1] == 25  # the floor
    assert all(w[1] == 100 for w in ws)
    assert rw.explain()["asr"][0]["note"] in ("missing, at the floor", "blackout after a change")


def test_every_replica_missing_moves_nothing() -> None:
    rw = fresh(3)
    ws = run(rw, [{0: MISS, 1: MISS, 2: MISS}] * 6)
    assert all(w == {0: 100, 1: 100, 2: 100} for w in ws)
    assert "nothing to shift to" in rw.explain()["asr"][0]["note"]


def test_a_replica_without_data_is_not_a_healthy_one() -> None:
    rw = fresh()
    ws = run(rw, [{0: MISS, 1: None}] * 3)  # replica 1 reports nothing
    assert ws[-1] == {0: 100, 1: 100}


def test_comfortable_regains_and_ok_holds() -> None:
    rw = fresh()
    run(rw, [{0: MISS, 1: GOOD}] * 2)
    assert rw.weights()["asr"][0] == 50
    ws = run(rw, [{0: OK, 1: GOOD}] * 6, start=2)
    assert all(w[0] == 50 for w in ws)  # ok is not comfortable: hold
    ws = run(rw, [{0: GOOD, 1: GOOD}] * 8, start=8)
    w0 = [w[0] for w in ws]
    assert w0[-1] == 100 and max(w0) == 100  # back to equal, never above
    steps = [b - a for a, b in itertools.pairwise(w0) if b != a]
    assert steps and all(0 < s <= 25 for s in steps)  # regain steps are bounded


def test_stale_data_goes_back_to_equal_at_once() -> None:
    rw = fresh()
    run(rw, [{0: MISS, 1: GOOD}] * 6)
    assert rw.weights()["asr"][0] < 100
    ws = run(rw, [{}] * 4, start=6)  # nobody reports
    assert ws[2] == {0: 100, 1: 100}  # expire_windows = 3
    assert "expired" in rw.explain()["asr"][0]["history"][-1]["why"]


def test_a_call_within_the_same_window_does_nothing() -> None:
    rw = fresh()
    ms = {("asr", 0): {"voice": MISS}, ("asr", 1): {"voice": GOOD}}
    for t in (0.1, 5.1, 5.2, 5.3, 5.4):
        rw.step(t, ms, OBJ)
    assert rw.weights()["asr"][0] == 50  # two windows, not five


def test_classes_without_objective_are_not_judged_and_any_class_missing_counts() -> None:
    rw = fresh()
    for i in range(2):
        rw.step(i * PERIOD, {("asr", 0): {"bulk": MISS, "voice": GOOD},
                             ("asr", 1): {"voice": GOOD}}, OBJ)
    assert rw.weights()["asr"] == {0: 100, 1: 100}
    for i in range(2, 4):
        rw.step(i * PERIOD, {("asr", 0): {"bulk": GOOD, "voice": MISS},
                             ("asr", 1): {"voice": GOOD, "bulk": MISS}}, OBJ)
    assert rw.weights()["asr"] == {0: 50, 1: 100}


def test_too_few_frames_is_no_data() -> None:
    rw = fresh()
    few = Measure(20, 0.1, 900.0, window_s=PERIOD)
    ws = run(rw, [{0: few, 1: GOOD}] * 4)
    assert ws[-1] == {0: 100, 1: 100}
    assert rw.explain()["asr"][0]["verdict"] == "no data"


def row(stage: str, inst: str, cls: str = "voice", frames: int = 500, att: float = 0.5,
        p99: float = 300.0, at: float = 100.0, stale: bool = False) -> dict[str, Any]:
    return {"stage": stage, "instance": inst, "sla_class": cls, "modality": "audio",
            "frames": frames, "attainment": att, "e2e_ms": {"p99": p99}, "window_s": PERIOD,
            "received_at": at, "stale": stale}


def test_replica_measures_take_configured_identities_only() -> None:
    who = {("asr", "unit:mmmesh-sidecar@asr-0.service"): 0,
           ("asr", "unit:mmmesh-sidecar@asr-1.service"): 1}
    rows = [row("asr", "unit:mmmesh-sidecar@asr-0.service"),
            {**row("asr", "unit:mmmesh-sidecar@asr-0.service"), "modality": "video",
             "frames": 100, "attainment": 1.0, "e2e_ms": {"p99": 400.0}},
            row("asr", "unit:mmmesh-sidecar@asr-1.service", stale=True),
            row("asr", "uid:65534:/user.slice/x", att=0.0),  # another sender: no replica
            row("tts", "unit:mmmesh-sidecar@asr-0.service"),  # another stage
            {"stage": "asr", "instance": None}, "junk"]
    got = replica_measures(rows, who, 101.0)
    assert set(got) == {("asr", 0)}
    m = got[("asr", 0)]["voice"]
    assert m.frames == 600 and m.p99_ms == 400.0 and m.age_s == pytest.approx(1.0)
    assert m.attainment == pytest.approx((500 * 0.5 + 100 * 1.0) / 600)


def test_replica_measures_read_the_p99_from_the_sketch() -> None:
    from mmmesh.sla.sketch import encode_sketch, new_sketch

    sk = new_sketch()
    sk.add(300.0, 500)
    r = {**row("asr", "asr-0"), "e2e_ms": None, "sketch_e2e": encode_sketch(sk)}
    bad = {**row("asr", "asr-1"), "e2e_ms": None, "sketch_e2e": "not a sketch"}
    got = replica_measures([r, bad], {("asr", "asr-0"): 0, ("asr", "asr-1"): 1}, 101.0)
    assert got[("asr", 0)]["voice"].p99_ms == pytest.approx(300.0, rel=0.02)
    assert got[("asr", 1)]["voice"].p99_ms is None


def test_law_bounds_are_checked_and_weight_list() -> None:
    with pytest.raises(ValueError, match="floor <= equal"):
        ReplicaLaw(equal=10, floor=20)
    with pytest.raises(ValueError, match="cut"):
        ReplicaLaw(cut=1.0)
    assert weight_list({0: 3, 2: 1}, [0, 2]) == [3, 0, 1]
