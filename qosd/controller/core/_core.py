"""The controller: a sans-I/O state machine, one :meth:`Controller.step` per window.

The caller (qosd's wiring, the simulator, the tests) owns the clock and the
views: it builds an :class:`~qosd.controller.core.SlaInput` from the node's board
or the global view, calls :meth:`Controller.step` once a window (more often
is harmless: a call within the same window returns the same decision), and
writes the :class:`~qosd.controller.core.Decision` through ``mmmesh.dataplane``.
The law is ``_law``'s; the rate budget ``_budget``'s.  Not thread-safe: one
caller at a time.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from mmmesh.policy import KNOBS, Policy, format_rate

from ._budget import Ledger, fund, recover, restore_budget
from ._explain import explain
from ._inputs import SlaInput, StageKey
from ._law import Law, Verdict, causes, decayed, eased, frame_rates, gone, judge, step_of
from ._params import SIGN, ClassSpec, Decision, Params, clamp, show, specs
from ._persist import read_saved, snapshot
from ._state import Record, Subject, same

Key = str | StageKey  # a class name, or (class, stage)
STAGE_KNOBS = ("weight",)
GRID_SLACK_S = 0.25
"""A window taken this much before the period's start is still the period's
(the clocks of the nodes that close it, as NTP keeps them)."""


def key_text(key: Key) -> str:
    return key if isinstance(key, str) else f"{key[0]}/{key[1]}"


def change_text(ch: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{k} {show(k, a)} -> {show(k, b)}" for k, (a, b) in ch.items())


class Controller:
    """Adapts each class within its policy bounds to keep its SLA objective.

    ``now`` (in :class:`SlaInput`) is the caller's clock, seconds; a state
    meant to survive a restart (:meth:`snapshot`) needs unix time."""

    def __init__(self, policy: Policy, law: Law | None = None) -> None:
        self.law = law or Law()
        self._reset(policy)

    def _reset(self, policy: Policy) -> None:
        self.policy = policy
        self.specs: dict[str, ClassSpec] = specs(policy, self.law)
        self.classes: dict[str, Subject] = {
            n: Subject(s.policy.as_dict(), last_data=-1, probe=self.law.probe_windows)
            for n, s in self.specs.items()}  # fmt: skip
        self.stages: dict[StageKey, Subject] = {}
        self.epoch: float | None = None
        self.window = -1
        self.frozen = False
        self.now = math.nan
        self.source = ""
        self.decision = self._decide((), False)

    def set_policy(self, policy: Policy) -> bool:
        """A new policy: the state starts over from its values (True) unless it
        is the same policy (False).  Adapted values of the old policy are not
        carried over: the new policy is the new contract."""
        if policy.to_yaml() == self.policy.to_yaml():
            return False
        self._reset(policy)
        return True

    # -- what it shows and keeps ---------------------------------------------------
    def explain(self) -> dict[str, Any]:
        """Per class: measured vs objective, current vs policy, last decisions, state."""
        return explain(self)

    def snapshot(self) -> dict[str, Any]:
        """The state as JSON-able data (for :meth:`restore` after a restart)."""
        return snapshot(self)

    @classmethod
    def restore(cls, policy: Policy, data: Any, now: float,
                law: Law | None = None) -> tuple[Controller, str]:
        """A controller with ``data``'s state if it still applies, else from
        the policy; and a sentence saying which and why (``_persist``)."""
        ctrl = cls(policy, law)
        saved, why = read_saved(policy, data, now, ctrl.law, ctrl.specs)
        if saved is not None:
            ctrl.classes, ctrl.stages = saved.classes, saved.stages
            # on the windows' grid (an older state may not be): a window may pass by one
            ctrl.epoch, ctrl.window, ctrl.now = (ctrl._grid(saved.epoch), saved.window,
                                                 saved.saved_at)
            ctrl.frozen = saved.frozen
            ctrl.decision = ctrl._decide((), ctrl.frozen)
        return ctrl, why

    # -- the step ------------------------------------------------------------------
    def _grid(self, t: float) -> float:
        """The start of the window holding ``t`` on the grid of multiples of
        ``period_s`` (the sidecars close their windows on it)."""
        return math.floor(t / self.law.period_s) * self.law.period_s

    def window_of(self, now: float) -> int:
        """The window ``now`` falls in (what :meth:`step` would take it for)."""
        epoch = self._grid(now) if self.epoch is None else self.epoch
        return math.floor((now - epoch) / self.law.period_s)

    def waiting(self, inp: SlaInput) -> tuple[str, ...]:
        """The classes with an objective whose window of this period has not
        come: the oldest part of their measure (every sender's and node's,
        :attr:`Measure.oldest`) was taken before the period began (the
        sidecars close their windows on its multiples), or is the window
        already judged.  A caller that can wait for them (until late in the
        period) steps once they have all come.  Classes without data, or
        with stale data, are not waited for."""
        law, out = self.law, []
        begun = self._grid(inp.now) - GRID_SLACK_S
        for name, spec in self.specs.items():
            m, subj = inp.classes.get(name), self.classes[name]
            if spec.objective is None or m is None:
                continue
            if m.oldest > law.stale_windows * max(m.window_s, law.period_s):
                continue
            taken = inp.now - m.oldest
            if taken < begun or (subj.seen is not None and abs(taken - subj.seen) < same(m)):
                out.append(name)
        return tuple(out)

    def step(self, inp: SlaInput) -> Decision:
        """One window: judge, expire, decay, raise, recover; the decision."""
        law = self.law
        if self.epoch is None:
            self.epoch = self._grid(inp.now)
        w = math.floor((inp.now - self.epoch) / law.period_s)
        if w <= self.window:
            return self.decision
        self.window, self.now, self.source = w, inp.now, inp.source
        frozen = inp.suspect_fraction > law.freeze_suspect
        thawed, self.frozen = self.frozen and not frozen, frozen
        before = {k: dict(s.values) for k, s, _, _ in self._subjects()}
        why: dict[Key, list[str]] = defaultdict(list)
        if thawed:  # this window's view may still miss the members that came back
            for _, subj, _, _ in self._subjects():
                subj.held_until = max(subj.held_until, w + law.blackout_windows - 1)
                subj.note = "thawed: blackout while the view refills"
        for name, spec in self.specs.items():
            m = inp.classes.get(name)
            subj = self.classes[name]
            subj.note = subj.note if subj.held(w) else ""
            subj.observe(judge(spec.objective, m, law), m, w, not frozen and not subj.held(w),
                         None if m is None else inp.now - m.oldest)
        self._observe_stages(inp, w, frozen)
        led = Ledger(int(self.policy.link.rate), self.specs, self.classes, w, law)
        self._expire(w, why)
        restore_budget(led, "a class went back to its policy rate")
        ctx = frame_rates(inp.classes, law)
        for _, subj, _, _ in self._subjects():
            j = subj.judgement
            if subj.counted and j is not None and j.verdict in (Verdict.OK, Verdict.COMFORT):
                subj.calm = dict(ctx)  # the load under which it kept its objective
            # the load of an increase: a class's load that appeared in the windows right
            # after it (reporters' windows arrive at their own pace: a flood's first one
            # may come after the miss it caused) is the load it was for
            if subj.need is not None and subj.raised_w is not None and (
                    w - subj.raised_w <= law.blackout_windows + 1):
                for c, now_f in ctx.items():
                    if now_f >= max(law.min_frames, subj.need.get(c, 0.0) / law.gone_share):
                        subj.need[c] = now_f
        if frozen:
            note = f"frozen: {inp.suspect_fraction:.0%} of members suspect"
            for _, subj, _, _ in self._subjects():
                subj.note = note
        else:
            for key, subj, spec, knobs in list(self._subjects()):
                self._decay(subj, spec, knobs, ctx, w, why[key])
            for name in led.by_rank():
                self._raise(name, self.classes[name], self.specs[name], KNOBS, led, ctx, why)
            for key, subj in list(self.stages.items()):
                self._raise(key, subj, self.specs[key[0]], STAGE_KNOBS, led, ctx, why)
            for name in led.by_rank():
                subj = self.classes[name]
                gave = name in led.given
                if not subj.held(w) and not subj.miss and not gave and (t := recover(led, name)):
                    why[name].append(f"+{format_rate(t)} of its lent policy share back "
                                     "(the link has room)")
        for src, text, amount, _ in led.moves:
            why[src].append(f"-{format_rate(amount)} {text}")
        changed = self._commit(before, why, w, inp.now)
        self._forget_stages(w)
        self.decision = self._decide(tuple(changed), frozen)
        return self.decision

    def _subjects(self) -> Iterator[tuple[Key, Subject, ClassSpec, tuple[str, ...]]]:
        for name, subj in self.classes.items():
            yield name, subj, self.specs[name], KNOBS
        for key, subj in self.stages.items():
            yield key, subj, self.specs[key[0]], STAGE_KNOBS

    def _observe_stages(self, inp: SlaInput, w: int, frozen: bool) -> None:
        """Stages of classes with an objective and a weight range are tracked."""
        law = self.law
        for key in inp.stages:
            spec = self.specs.get(key[0])
            if spec is None or spec.objective is None or not spec.adaptable("weight"):
                continue
            if key not in self.stages and len(self.stages) < law.max_stages:
                self.stages[key] = Subject({"weight": spec.policy.weight}, last_data=w,
                                           probe=law.probe_windows)
        for key, subj in self.stages.items():
            m = inp.stages.get(key)
            subj.note = subj.note if subj.held(w) else ""
            subj.observe(judge(self.specs[key[0]].objective, m, law), m, w,
                         not frozen and not subj.held(w), None if m is None else inp.now - m.oldest)

    def _forget_stages(self, w: int) -> None:
        for key, subj in list(self.stages.items()):
            at_policy = subj.values["weight"] == self.specs[key[0]].policy.weight
            if at_policy and w - subj.last_data >= self.law.expire_windows:
                del self.stages[key]

    def _expire(self, w: int, why: dict[Key, list[str]]) -> None:
        """No usable data for ``expire_windows``: back to the policy at once."""
        for key, subj, spec, knobs in self._subjects():
            idle = w - subj.last_data
            if spec.objective is None or idle < self.law.expire_windows:
                continue
            if any(subj.values[k] != spec.policy.get(k) for k in knobs):
                j = subj.judgement
                why[key].append(f"expired: no usable SLA data for {idle} windows"
                                + (f" ({j.why})" if j else ""))
                subj.values = {k: spec.policy.get(k) for k in knobs}
            subj.need, subj.probe, subj.probed = None, self.law.probe_windows, False
            subj.raised_w, subj.raised_on = None, None

    def _decay(self, subj: Subject, spec: ClassSpec, knobs: tuple[str, ...],
               ctx: dict[str, float], w: int, why: list[str]) -> None:
        """Comfortable long enough, and the load eased (or a probe is due):
        the excess over the policy value shrinks by ``law.decay``."""
        law = self.law
        if subj.held(w) or subj.comfort < law.comfort_windows:
            return
        over = [k for k in knobs if SIGN[k] * (subj.values[k] - spec.policy.get(k)) > 0]
        if not over:
            return
        gate, probed, home = None, False, False
        if subj.need is not None and (cls := eased(subj.need, ctx, law)) is not None:
            home = gone(subj.need, ctx, cls, law)
            gate = (f"load {'gone' if home else 'eased'}: {cls} {subj.need[cls]:.0f} -> "
                    f"{ctx.get(cls, 0.0):.0f} frames a window"
                    + ("; back to the policy" if home else ""))
        elif subj.comfort >= subj.probe:
            gate, probed = f"probe after {subj.comfort} comfortable windows", True
        if gate is None:
            subj.note = "comfortable; holding while the load it was raised for lasts"
            return
        for k in over:
            pol = spec.policy.get(k)
            kept = 0 if home else decayed(SIGN[k] * (subj.values[k] - pol), spec.steps[k], law)
            subj.values[k] = pol + SIGN[k] * kept
        j = subj.judgement
        why.append(f"comfortable {subj.comfort} windows ({j.why if j else ''}); {gate}")
        subj.decayed_at, subj.probed = w, probed
        subj.raised_w, subj.raised_on = None, None

    def _raise(self, key: Key, subj: Subject, spec: ClassSpec, knobs: tuple[str, ...],
               led: Ledger, ctx: dict[str, float], why: dict[Key, list[str]]) -> None:
        """Missed long enough (or urgently), out of blackout, in a window that
        counted: one step up on every knob that can, scaled to an urgent miss."""
        law, w = self.law, led.window
        if subj.held(w) or not subj.counted or subj.miss < 1:
            return
        urgent = subj.urgent > 0
        if subj.miss < law.miss_windows and not urgent:
            return
        scale = subj.urgent if urgent else 1.0
        notes = []
        if subj.probed and subj.decayed_at is not None and w - subj.decayed_at <= (
                law.miss_windows + law.blackout_windows + 1):
            subj.probe = min(subj.probe * 2, law.probe_max_windows)
            notes.append(f"the probe failed: next one after {subj.probe} windows")
        subj.probed = False
        start = dict(subj.values)
        steps = {k: spec.steps[k] if scale == 1.0 else step_of(k, spec.policy.get(k), law, scale)
                 for k in knobs}
        for k in knobs:
            v = subj.values[k]
            if not spec.can_raise(k, v):
                continue
            if k == "rate" and isinstance(key, str):
                want = min(steps[k], spec.ranges[k][1] - v)
                if v < spec.policy.rate:  # its own share back first: past it a window later
                    want = min(want, spec.policy.rate - v)
                got, parts = fund(led, key, want)
                notes[:0] = parts
                if not got:
                    subj.note = "missing; no rate to be had (no class has slack)"
            elif k != "rate":
                subj.values[k] = clamp(spec, k, v + SIGN[k] * steps[k])
        j, m = subj.judgement, subj.measure
        if subj.values != start:
            what = (f"missed {subj.miss} windows" if subj.miss >= law.miss_windows
                    else "an urgent miss")
            size = f" ({scale:.2g} step{'s' if scale != 1.0 else ''})" if urgent else ""
            why[key].append(f"{what}{size}: {j.why if j else ''}"
                            + "".join(f"; {n}" for n in notes))
            subj.need = causes(ctx, subj.calm, spec.name, law)
            subj.raised_w, subj.urgent = w, 0.0
            # an urgent step: the window after it may still hold the queue built before
            subj.raised_on = None if m is None or not urgent else (m.p99_ms, m.attainment)
        elif not any(spec.adaptable(k) for k in knobs):
            subj.note = "missing; the policy gives it nothing to adapt (no adapt ranges)"
        elif not any(spec.can_raise(k, subj.values[k]) for k in knobs):
            subj.note = "missing, at the top of its ranges"

    def _commit(self, before: dict[Key, dict[str, int]], why: dict[Key, list[str]],
                w: int, now: float) -> list[str]:
        """Records what changed, and puts it in blackout."""
        changed = []
        for key, subj, _, _ in self._subjects():
            old = before.get(key, subj.values)
            ch = {k: (old[k], v) for k, v in subj.values.items() if old[k] != v}
            if not ch:
                continue
            text = "; ".join(why.get(key) or ["the rate budget"])
            subj.remember(Record(w, now, ch, change_text(ch), text), self.law)
            subj.held_until = w + self.law.blackout_windows
            subj.changed_at = now
            changed.append(key_text(key))
        return changed

    def _decide(self, changed: tuple[str, ...], frozen: bool) -> Decision:
        classes = {n: Params(**s.values) for n, s in self.classes.items()}
        stage_weights: dict[str, dict[str, int]] = {}
        for (c, stage), subj in sorted(self.stages.items()):
            if subj.values["weight"] > classes[c].weight:
                stage_weights.setdefault(c, {})[stage] = subj.values["weight"]
        return Decision(self.window, classes, stage_weights, changed, frozen)
