"""Properties of the controller over random valid policies and random SLA series:
bounds, the link budget, anti-escalation, blackout, bounded steps, frozen,
and expiry back to the policy."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mmmesh.errors import PolicyError
from mmmesh.policy import Policy, parse_policy
from qosd.controller.core import Controller, Law, Measure, SlaInput, effective_policy
from qosd.controller.core._law import step_of

K = 1000
LAW = Law()


def _range(draw: st.DrawFn, value: int, lo: int, hi: int) -> list[int]:
    return [draw(st.integers(lo, value)), draw(st.integers(value, hi))]


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    n = draw(st.integers(2, 5))
    link = draw(st.sampled_from([10, 100, 250])) * 1000 * K
    classes: list[dict[str, Any]] = []
    rates = [draw(st.integers(8, link // n // K)) * K for _ in range(n)]
    if draw(st.booleans()):  # a full link: every rate step is paid by donors
        rates[draw(st.integers(0, n - 1))] += link - sum(rates)
    for i, rate in enumerate(rates):
        c: dict[str, Any] = {"name": f"c{i}", "id": i + 1, "rate": rate,
                             "priority": draw(st.integers(0, 7)),
                             "weight": draw(st.integers(1, 20))}  # fmt: skip
        ceil = draw(st.integers(rate, link)) if draw(st.booleans()) else link
        if ceil != link:
            c["ceil"] = ceil
        sla = draw(st.sampled_from([None, {"p99_ms": 120}, {"attainment": 0.99},
                                    {"p99_ms": 120, "attainment": 0.99}]))
        if sla:
            c["sla"] = sla
        adapt: dict[str, Any] = {}
        if draw(st.booleans()):
            adapt["rate"] = _range(draw, rate, 8, ceil)
        if draw(st.booleans()):
            adapt["weight"] = _range(draw, c["weight"], 1, 100)
        if draw(st.booleans()):
            adapt["priority"] = _range(draw, c["priority"], 0, 7)
        if draw(st.booleans()):
            hi_rate = adapt.get("rate", [rate, rate])[1]
            adapt["ceil"] = _range(draw, ceil, hi_rate, link)
        if adapt:
            c["adapt"] = adapt
        classes.append(c)
    rules = [{"prefix": f"10.{j}.0.0/16", "max_class": draw(st.sampled_from(classes))["name"]}
             for j in range(draw(st.integers(0, 2)))]
    doc = {"apiVersion": "mmmesh/v1", "link": {"device": "eth0", "rate": link},
           "classes": classes, "default_class": draw(st.sampled_from(classes))["name"],
           "source_rules": rules}  # fmt: skip
    try:
        return parse_policy(doc)
    except PolicyError:
        assume(False)
        raise


MEASURES = [
    None, Measure(500, 0.90, 180.0), Measure(500, 0.995, 100.0), Measure(500, 0.999, 20.0),
    Measure(20, 0.5, 900.0), Measure(500, 0.999, 1e9), Measure(2000, 0.999, 10.0),
    Measure(500, 0.97, None), Measure(500, 1.0, 0.0, age_s=100.0),
]  # fmt: skip


def _key(p: Any, cid: int) -> tuple[int, int, int]:
    return (p.priority, -p.rate, cid)


def _check(policy: Policy, ctrl: Controller) -> None:
    d = ctrl.decision
    link = int(policy.link.rate)
    assert sum(p.rate for p in d.classes.values()) <= link
    for name, spec in ctrl.specs.items():
        p = d.classes[name]
        assert p.rate <= p.ceil
        for knob, (lo, hi) in spec.ranges.items():
            assert lo <= p.get(knob) <= hi, (name, knob)
    for cls, stages in d.stage_weights.items():
        lo, hi = ctrl.specs[cls].ranges["weight"]
        assert all(lo <= w <= hi for w in stages.values())
    # anti-escalation on the effective values
    ids = {c.name: c.id for c in policy.classes}
    for rule in policy.source_rules:
        cap = rule.max_class
        for c in policy.classes:
            if policy.rank(c) > policy.rank(cap):
                assert _key(d.classes[c.name], c.id) > _key(d.classes[cap], ids[cap])
    effective_policy(policy, d.classes)  # a whole, valid policy


def _check_records(ctrl: Controller, w: int, frozen: bool) -> None:
    """Records of window ``w``: bounded steps away from the policy, never past
    it on the way back; blackout and frozen let only expiry and give-backs through."""
    for name, subj in ctrl.classes.items():
        spec = ctrl.specs[name]
        recs = [r for r in subj.history if r.window == w]
        prev = [r for r in subj.history if r.window == w - 1]
        for r in recs:
            forced = "expired" in r.why or "returned" in r.why
            if prev or frozen:
                assert forced, (name, r, prev)
            for knob, (a, b) in r.changes.items():
                pol = spec.policy.get(knob)
                if abs(b - pol) > abs(a - pol):  # away from the policy: one step at most
                    assert abs(b - a) <= step_of(knob, pol, LAW), (name, knob, a, b)
                else:  # toward it: never past it
                    assert (b - pol) * (a - pol) >= 0, (name, knob, a, b, pol, r.why)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(policies(), st.data())
def test_bounds_budget_rank_and_blackout_hold(policy: Policy, data: st.DataObject) -> None:
    ctrl = Controller(policy, LAW)
    names = [c.name for c in policy.classes]
    now = 1_000_000.0
    windows = data.draw(st.integers(5, 40))
    for w in range(windows):
        classes = {n: m for n in names
                   if (m := data.draw(st.sampled_from(MEASURES))) is not None}  # fmt: skip
        stages = {(names[0], f"s{j}"): m for j in range(2)
                  if (m := data.draw(st.sampled_from(MEASURES))) is not None}  # fmt: skip
        suspect = data.draw(st.sampled_from([0.0, 0.0, 0.0, 0.5]))
        ctrl.step(SlaInput(now, classes, stages, suspect))
        assert ctrl.window == w
        _check(policy, ctrl)
        _check_records(ctrl, w, suspect > LAW.freeze_suspect)
        now += LAW.period_s
    for _ in range(LAW.expire_windows):  # the data stops: expiry within 3 windows
        ctrl.step(SlaInput(now, {}))
        now += LAW.period_s
        _check(policy, ctrl)
    policy_values = Controller(policy, LAW).decision.classes
    for name, spec in ctrl.specs.items():
        if spec.objective is not None:
            assert ctrl.decision.classes[name] == policy_values[name], name
    assert ctrl.decision.stage_weights == {}
    for _ in range(10):  # and lent rate comes home
        ctrl.step(SlaInput(now, {}))
        now += LAW.period_s
    assert ctrl.decision.classes == policy_values


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(policies(), st.lists(st.sampled_from(MEASURES), min_size=3, max_size=30))
def test_frozen_changes_nothing_but_expiry(policy: Policy, series: list[Measure | None]) -> None:
    ctrl = Controller(policy, LAW)
    now = 1_000_000.0
    names = [c.name for c in policy.classes]
    for m in series[:3]:  # some adaptation first
        ctrl.step(SlaInput(now, {n: m for n in names} if m else {}))
        now += LAW.period_s
    for w, m in enumerate(series, start=ctrl.window + 1):
        before = ctrl.decision.classes
        ctrl.step(SlaInput(now, {n: m for n in names} if m else {}, suspect_fraction=0.3))
        now += LAW.period_s
        assert ctrl.decision.frozen
        for name in ctrl.decision.changed:
            rec = ctrl.classes[name].history[-1]
            assert rec.window == w and ("expired" in rec.why or "returned" in rec.why)
        if not ctrl.decision.changed:
            assert ctrl.decision.classes == before


URGENT_MEASURES = [*MEASURES, Measure(500, 0.2, 480.0), Measure(500, 0.75, 300.0),
                   Measure(500, 0.0, 900.0, age_s=3.0), Measure(500, 0.5, None)]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(policies(), st.data())
def test_urgent_steps_are_bounded_and_the_guards_hold(policy: Policy,
                                                      data: st.DataObject) -> None:
    """With urgent misses in the series (issue 20): every step away from the
    policy is at most ``max_scale`` steps (priority one level), every other
    guarantee holds as for the rest, and the data stopping still expires."""
    ctrl = Controller(policy, LAW)
    names = [c.name for c in policy.classes]
    now = 1_000_000.0
    for w in range(data.draw(st.integers(5, 30))):
        classes = {n: m for n in names
                   if (m := data.draw(st.sampled_from(URGENT_MEASURES))) is not None}  # fmt: skip
        suspect = data.draw(st.sampled_from([0.0, 0.0, 0.5]))
        ctrl.step(SlaInput(now + data.draw(st.floats(0.0, 1.0)), classes, {}, suspect))
        _check(policy, ctrl)
        frozen = suspect > LAW.freeze_suspect
        for name, subj in ctrl.classes.items():
            spec = ctrl.specs[name]
            recs = [r for r in subj.history if r.window == ctrl.window]
            prev = [r for r in subj.history if r.window == ctrl.window - 1]
            for r in recs:
                if prev or frozen:
                    assert "expired" in r.why or "returned" in r.why, (name, r, prev)
                for knob, (a, b) in r.changes.items():
                    pol = spec.policy.get(knob)
                    if abs(b - pol) > abs(a - pol):
                        assert abs(b - a) <= step_of(knob, pol, LAW, LAW.max_scale), (
                            name, knob, a, b)
                        if abs(b - a) > step_of(knob, pol, LAW):  # only an urgent miss's
                            assert knob != "priority" and " steps): " in r.why, (name, r)
        now += LAW.period_s
    for _ in range(LAW.expire_windows):
        ctrl.step(SlaInput(now, {}))
        now += LAW.period_s
    policy_values = Controller(policy, LAW).decision.classes
    for name, spec in ctrl.specs.items():
        if spec.objective is not None:
            assert ctrl.decision.classes[name] == policy_values[name], name
