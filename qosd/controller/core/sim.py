"""The controller in a closed loop with a fluid model of one shaped link.

The model (pure, seeded): each window, every class offers ``bps`` in frames
of ``frame_bits``.  HTB is modelled as fluid: a class gets up to its
guaranteed rate; what is left goes to the classes that want more, lowest
prio first, shared by weight within a prio (water-filling), each up to its
ceil.  A class's service rate ``mu`` is what it would get if it were
backlogged.  Below ``mu`` the frames see an M/M/1 queue (sojourn time
exponential with rate ``(mu - lam) / frame_bits``: p99 = ln 100 / that); at or
above it a backlog builds (bounded to ``max_queue_s`` of service, the rest
dropped) and drains later.  Every frame also takes ``base_ms``.  The p99
carries a little seeded log-normal noise.

:func:`run` plays a scenario with the controller on and off and returns the
figures the closed-loop demo names (docs/controller.md): settle windows,
oscillations after settling, the largest step, attainment on vs off, windows
back to the policy after the load goes.  ``python -m qosd.controller.core.sim
[--json]`` prints them for :func:`default_scenario`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmmesh.policy import Policy, parse_policy

from ._core import Controller
from ._inputs import Measure, SlaInput
from ._law import Law, Verdict, judge
from ._params import Params

M = 10**6


@dataclass(frozen=True)
class Load:
    """What one class offers: bit/s, in frames of ``frame_bits``."""

    bps: float
    frame_bits: float
    measured: bool = True
    """Whether a sidecar reports its windows (a non-mesh flood does not)."""


@dataclass(frozen=True)
class Phase:
    name: str
    windows: int
    loads: Mapping[str, Load]


@dataclass(frozen=True)
class Scenario:
    policy: Policy
    phases: Sequence[Phase]
    watch: str = "voice"
    """The class whose objective the figures are about."""
    steady: str = "flood"
    """The phase whose load is steady (settling and oscillations are counted in it)."""
    gone: str = "after"
    """The phase after the load went (windows back at the policy are counted in it)."""
    base_ms: float = 10.0
    max_queue_s: float = 2.0
    noise: float = 0.05
    seed: int = 1


def htb_share(params: Mapping[str, Params], demand: Mapping[str, float],
              link: float) -> dict[str, float]:
    """Fluid HTB: guarantees first, then the spare by prio, by weight within one."""
    got = {c: min(demand.get(c, 0.0), float(p.rate)) for c, p in params.items()}
    spare = link - sum(got.values())
    for prio in sorted({p.priority for p in params.values()}):
        want = {c: min(demand.get(c, 0.0), float(p.ceil)) - got[c]
                for c, p in params.items() if p.priority == prio}  # fmt: skip
        want = {c: w for c, w in want.items() if w > 1e-9}
        while spare > 1e-9 and want:
            total_w = sum(params[c].weight for c in want)
            share = {c: spare * params[c].weight / total_w for c in want}
            for c in list(want):
                give = min(share[c], want[c])
                got[c] += give
                spare -= give
                want[c] -= give
                if want[c] <= 1e-9:
                    del want[c]
    return got


@dataclass
class _Link:
    scenario: Scenario
    rng: random.Random
    backlog: dict[str, float] = field(default_factory=dict)

    def window(self, params: Mapping[str, Params], loads: Mapping[str, Load],
               law: Law) -> dict[str, Measure]:
        """One window: a Measure for every class that offers load."""
        link = float(self.scenario.policy.link.rate)
        demand = {c: ld.bps for c, ld in loads.items()}
        out = {}
        for c, ld in loads.items():
            mu = htb_share(params, {**demand, c: float(params[c].ceil)}, link)[c]
            out[c] = self._measure(c, ld, mu, law)
        return out

    def _measure(self, c: str, ld: Load, mu: float, law: Law) -> Measure:
        sc, t = self.scenario, law.period_s
        deadline = _deadline(sc.policy, c)
        b0 = self.backlog.get(c, 0.0)
        b1 = min(max(0.0, b0 + (ld.bps - mu) * t), mu * sc.max_queue_s)
        self.backlog[c] = b1
        base = sc.base_ms / 1000
        if ld.bps < mu:
            drain = (b0 + b1) / 2 / mu
            nu = (mu - ld.bps) / ld.frame_bits
            p99 = base + drain + math.log(100) / nu
            room = deadline - base - drain
            att = 1 - math.exp(-nu * room) if room > 0 else 0.0
        else:
            d0, d1 = b0 / mu, b1 / mu
            p99 = base + d0 + 0.99 * (d1 - d0) + ld.frame_bits / mu
            span = max(d1 - d0, 1e-9)
            att = min(1.0, max(0.0, (deadline - base - d0) / span))
        p99 *= math.exp(sc.noise * self.rng.gauss(0.0, 1.0))
        frames = round(ld.bps * t / ld.frame_bits)
        return Measure(frames, att, p99 * 1000, 1, 0.0, t)


def _deadline(policy: Policy, c: str) -> float:
    """A frame's deadline, s: the class's p99 objective (1 s without one)."""
    sla = policy.class_named(c).sla
    return (sla.p99_ms if sla is not None and sla.p99_ms is not None else 1000.0) / 1000


def _play(sc: Scenario, law: Law, on: bool) -> list[dict[str, Any]]:
    ctrl = Controller(sc.policy, law)
    link = _Link(sc, random.Random(sc.seed))
    rows, now = [], 1_000_000.0
    params = dict(ctrl.decision.classes)
    for phase in sc.phases:
        for _ in range(phase.windows):
            measured = link.window(params, phase.loads, law)
            seen = {c: m for c, m in measured.items() if phase.loads[c].measured}
            if on:
                params = dict(ctrl.step(SlaInput(now, seen)).classes)
            rows.append({"phase": phase.name, "measured": measured, "params": params})
            now += law.period_s
    return rows


def _settle(rows: list[dict[str, Any]], sc: Scenario) -> tuple[int, int]:
    """(settle windows, index of the first settled row) of the steady phase:
    the first window (counted from 1 at the phase's start) that runs on the
    parameters that then hold to the end of the phase."""
    idx = [i for i, r in enumerate(rows) if r["phase"] == sc.steady]
    changes = [n for n, i in enumerate(idx) if rows[i]["params"] != rows[i - 1]["params"]]
    n = changes[-1] + 1 if changes else 0
    return n + 1, idx[n] if n < len(idx) else len(rows)


def _attainment(rows: Sequence[dict[str, Any]], c: str) -> float:
    frames = sum(r["measured"][c].frames for r in rows)
    met = sum(r["measured"][c].frames * (r["measured"][c].attainment or 0.0) for r in rows)
    return round(met / frames, 4) if frames else 1.0


def run(sc: Scenario | None = None, law: Law | None = None) -> dict[str, Any]:
    """The scenario with the loop off and on; the demo's figures."""
    sc = sc or default_scenario()
    law = law or Law()
    on, off = _play(sc, law, True), _play(sc, law, False)
    settle, first = _settle(on, sc)
    steady = [i for i, r in enumerate(on) if r["phase"] == sc.steady and i >= first]
    policy = dict(Controller(sc.policy, law).decision.classes)
    osc, max_step = 0, 0.0
    for c, p0 in policy.items():
        for k in ("rate", "ceil", "weight", "priority"):
            series = [r["params"][c].get(k) for r in on]
            deltas = [b - a for a, b in itertools.pairwise(series)]
            if k != "priority":
                max_step = max([max_step, *(abs(d) / p0.get(k) for d in deltas)])
            signs = [d > 0 for i, d in enumerate(deltas) if d and i + 1 in steady]
            osc += sum(a != b for a, b in itertools.pairwise(signs))
    gone = [i for i, r in enumerate(on) if r["phase"] == sc.gone]
    obj = sc.policy.class_named(sc.watch).sla
    back = next((n + 1 for n, i in enumerate(gone) if on[i]["params"] == policy), None)
    return {
        "windows": [_row(i, r, off[i], sc.watch) for i, r in enumerate(on)],
        "attainment_off": _attainment([off[i] for i in steady], sc.watch),
        "attainment_on": _attainment([on[i] for i in steady], sc.watch),
        "settle_windows": settle, "oscillations": osc, "max_step": round(max_step, 4),
        "back_at_policy_windows": back,
        "missed_windows_after_settling": sum(
            judge(obj, on[i]["measured"].get(sc.watch), law).verdict is Verdict.MISS
            for i in steady),
    }  # fmt: skip


def _row(i: int, on: dict[str, Any], off: dict[str, Any], c: str) -> dict[str, Any]:
    def view(r: dict[str, Any]) -> dict[str, Any]:
        m: Measure = r["measured"][c]
        return {"p99_ms": round(m.p99_ms or 0.0, 1), "attainment": round(m.attainment or 0.0, 4)}

    p = on["params"][c]
    return {"window": i, "phase": on["phase"], "on": view(on), "off": view(off),
            "rate": p.rate, "weight": p.weight, "priority": p.priority,
            "params": {k: v.as_dict() for k, v in on["params"].items()}}  # fmt: skip


DEFAULT_POLICY = """
apiVersion: mmmesh/v1
link: {device: eth0, rate: 250mbit}
classes:
  - {name: control, id: 10, match: {modalities: [control]}, rate: 2mbit, weight: 2, priority: 0}
  - name: voice
    id: 11
    match: {modalities: [audio]}
    rate: 1.2mbit
    weight: 3
    priority: 1
    sla: {p99_ms: 120, attainment: 0.99}
    adapt: {rate: [1.2mbit, 4.8mbit], weight: [3, 10]}
  - {name: video, id: 12, match: {modalities: [video]}, rate: 150mbit, weight: 7, priority: 2}
  - {name: lidar, id: 13, match: {modalities: [lidar]}, rate: 80mbit, weight: 5, priority: 2}
  - name: best-effort
    id: 14
    rate: 16.8mbit
    weight: 1
    adapt: {rate: [8.4mbit, 16.8mbit]}
default_class: best-effort
source_rules: [{prefix: 10.0.99.0/24, max_class: video}]
"""


def default_scenario() -> Scenario:
    """Guarantees fill a 250 Mbit/s link; voice offers 2 Mbit/s on a 1.2 Mbit/s
    guarantee.  Quiet (spare room: voice borrows), then a flood of video,
    LiDAR and non-mesh best effort (no room: voice misses), then quiet again."""
    quiet = {"control": Load(0.5 * M, 8e3), "voice": Load(2.0 * M, 40e3),
             "video": Load(100 * M, 5e6), "lidar": Load(40 * M, 8e6),
             "best-effort": Load(5 * M, 12e3, measured=False)}  # fmt: skip
    flood = {**quiet, "video": Load(200 * M, 5e6), "lidar": Load(80 * M, 8e6),
             "best-effort": Load(40 * M, 12e3, measured=False)}  # fmt: skip
    return Scenario(parse_policy(DEFAULT_POLICY),
                    [Phase("quiet", 5, quiet), Phase("flood", 30, flood),
                     Phase("after", 15, quiet)])  # fmt: skip


def table(result: Mapping[str, Any]) -> str:
    """The window-by-window table of :func:`run`'s result, and its figures."""
    lines = [(f"{'w':>3} {'phase':<6} {'p99 off':>8} {'att off':>7} {'p99 on':>7} "
              f"{'att on':>7} {'rate':>9} {'weight':>6}")]
    for r in result["windows"]:
        lines.append(f"{r['window']:>3} {r['phase']:<6} {r['off']['p99_ms']:>8.0f} "
                     f"{r['off']['attainment']:>7.3f} {r['on']['p99_ms']:>7.0f} "
                     f"{r['on']['attainment']:>7.3f} {r['rate'] / M:>8.2f}M {r['weight']:>6}")
    figures = {k: v for k, v in result.items() if k != "windows"}
    return "\n".join([*lines, "", json.dumps(figures)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    result = run()
    sys.stdout.write(json.dumps(result) + "\n" if "--json" in args else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
