"""The SLA controller tests' shared cases: the example policy, a tight
variant, window measures and a run helper (tests/qosd/controller/)."""

from __future__ import annotations

from collections.abc import Mapping

from mmmesh.policy import Policy, load_policy, parse_policy
from qosd.controller.core import Controller, Decision, Law, Measure, SlaInput, sim
from testkit import ROOT

# voice: rate [1.2mbit, 4.8mbit], weight [3, 10]
EXAMPLE = load_policy(ROOT / "examples" / "policy.yaml")


def _tight() -> Policy:
    """The simulation's policy (guarantees fill the 250 Mbit/s link: every rate
    step is paid by a donor), with an objective and a range for video, and a
    narrow one for best-effort."""
    doc = parse_policy(sim.DEFAULT_POLICY).model_dump(mode="json", by_alias=True,
                                                      exclude_none=True)
    video, be = doc["classes"][2], doc["classes"][4]
    video.update(sla={"p99_ms": 400}, adapt={"rate": ["100mbit", "150mbit"]})
    be["adapt"] = {"rate": ["16mbit", "16.8mbit"]}
    return parse_policy(doc)


TIGHT = _tight()


MISS = Measure(500, 0.90, 180.0)  # p99 180 ms > 120 ms, attainment 0.90 < 0.99


OKAY = Measure(500, 0.995, 100.0)  # inside, slack 0.17 < 0.3: not comfortable


COMFY = Measure(500, 0.999, 20.0)  # slack 0.83 (p99) and 0.9 (attainment)


BUSY = Measure(2000, 0.99, 50.0)  # video, heavy: 2000 frames a window


EASED = Measure(500, 0.99, 50.0)  # video, the load gone


class Run:
    """A controller on a fake clock: one ``step`` = one window of ``period_s``."""

    def __init__(self, policy: Policy = EXAMPLE, law: Law | None = None) -> None:
        self.ctrl = Controller(policy, law)
        self.now = 1_000_000.0
        self.decisions: list[Decision] = []

    def step(self, classes: Mapping[str, Measure] | None = None,
             stages: Mapping[tuple[str, str], Measure] | None = None,
             suspect: float = 0.0) -> Decision:
        d = self.ctrl.step(SlaInput(self.now, dict(classes or {}), dict(stages or {}), suspect))
        self.now += self.ctrl.law.period_s
        self.decisions.append(d)
        return d

    def run(self, n: int, classes: Mapping[str, Measure],
            stages: Mapping[tuple[str, str], Measure] | None = None,
            suspect: float = 0.0) -> list[Decision]:
        return [self.step(classes, stages, suspect) for _ in range(n)]

    def series(self, cls: str, knob: str) -> list[int]:
        return [d.classes[cls].get(knob) for d in self.decisions]

    def changes(self, cls: str) -> list[int]:
        """Window indices at which ``cls`` changed."""
        return [d.window for d in self.decisions if cls in d.changed]
