"""The law and its constants, in one place (docs/controller.md has the same table
with the reasons).

One *window* is one control period (``period_s``, the sidecars' SLA window).
Per class with an objective, each window's measurement is judged:

* ``nodata``: absent, older than ``stale_windows`` windows, fewer than
  ``min_frames`` frames, or fewer than ``min_nodes`` nodes reporting (or a
  stated part of the objective not measured, unless the rest already misses);
* ``miss``: slack < 0; ``comfort``: slack >= ``comfort_margin``; else ``ok``.

Slack is the unused fraction of the objective, the smaller of the parts it
states: ``1 - p99 / p99_ms`` and ``(attainment - a) / (1 - a)``.

The law, per class and window (``qosd.controller.core._core`` applies it):

=================  ==================================================================
increase           after ``miss_windows`` windows that miss in a row, out of blackout:
                   every adaptable knob one step toward privilege; a step is
                   ``add_step`` x the policy value (at least one unit; priority: one
                   level), never past the range.  Rate is paid from the unreserved
                   link, then from classes that have slack (slack >= ``donor_margin``,
                   or no objective), lowest-ranked first, each giving at most one step
                   of its own and never below its range; a class below its policy rate
                   (it lent) is raised back to that rate first, and past it a window
                   later (a step toward the policy never passes it)
decay              after ``comfort_windows`` comfortable windows in a row, out of
                   blackout, and only if the load eased (some class's frames per window
                   fell by ``ease`` since the last increase) or the class has been
                   comfortable for ``probe_windows`` (doubling after each failed probe,
                   up to ``probe_max_windows``): the excess over the policy value is
                   multiplied by ``decay`` (rounded down; to zero below one step)
blackout           ``blackout_windows`` windows after any change of a class: its
                   measurements are ignored and it is not changed (but see expiry)
expiry             ``expire_windows`` windows without usable data: back to the policy
                   values at once (the only unbounded step; always toward the policy)
frozen             suspect members > ``freeze_suspect`` of the cluster: no law changes;
                   one blackout for every class when it thaws
=================  ==================================================================
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from mmmesh.policy import Objective
from mmmesh.sla import check_positive

from ._inputs import Measure

KILOBIT = 1000


@dataclass(frozen=True)
class Law:
    """Every constant of the law (see the module doc and docs/controller.md)."""

    period_s: float = 5.0
    """One window: the sidecars' SLA window (sidecar/sla, 5 s)."""
    min_frames: int = 100
    """Frames a window needs to be judged: below 100 the p99 is the maximum."""
    min_nodes: int = 1
    """Nodes that must report the class (raise it for a cluster-wide view)."""
    stale_windows: float = 3.0
    """A measurement older than this many windows is no data (as the board's)."""
    miss_windows: int = 2
    """Windows missing in a row before the first increase (hysteresis)."""
    blackout_windows: int = 1
    """Windows a class is left alone after each change."""
    add_step: float = 0.5
    """One increase, as a fraction of the policy value (the bound of every step up)."""
    decay: float = 0.5
    """The share of the excess over the policy value one decay keeps."""
    comfort_margin: float = 0.3
    """Slack that counts as comfortably inside the objective."""
    comfort_windows: int = 2
    """Comfortable windows in a row before a decay."""
    donor_margin: float = 0.3
    """Slack a class needs to give rate to another."""
    ease: float = 0.3
    """Drop of a class's frames per window that says the load eased."""
    probe_windows: int = 60
    """Comfortable windows after which a decay is tried even if no load eased."""
    probe_max_windows: int = 960
    """Ceiling of the probe interval, doubled after each failed probe."""
    expire_windows: int = 3
    """Windows without usable data before a class goes back to its policy."""
    freeze_suspect: float = 0.2
    """Share of suspect members above which the controller freezes."""
    history: int = 8
    """Decisions kept per class (and per stage) for explain()."""
    max_stages: int = 256
    """(class, stage) pairs tracked at most; beyond, new stages are ignored."""

    def __post_init__(self) -> None:
        check_positive(self, "law")
        for name in ("add_step", "decay", "freeze_suspect", "ease"):
            if not getattr(self, name) < 1:
                raise ValueError(f"law.{name} must be < 1")

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Verdict(enum.StrEnum):
    """How one window of a class is judged."""

    NOOBJ = "no objective"
    NODATA = "no data"
    MISS = "miss"
    OK = "ok"
    COMFORT = "comfortable"


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    slack: float | None
    why: str
    """What decided it: 'p99 180 ms > 120 ms', '12 frames < 100', ..."""


def judge(obj: Objective | None, m: Measure | None, law: Law) -> Judgement:
    """The verdict on one window of a class (or a stage) against its objective."""
    if obj is None:
        return Judgement(Verdict.NOOBJ, None, "no objective")
    if m is None:
        return Judgement(Verdict.NODATA, None, "no fresh SLA data")
    limit = law.stale_windows * max(m.window_s, law.period_s)
    if m.age_s > limit:
        return Judgement(Verdict.NODATA, None, f"data {m.age_s:.0f} s old > {limit:.0f} s")
    if m.frames < law.min_frames:
        return Judgement(Verdict.NODATA, None, f"{m.frames} frames < {law.min_frames}")
    if m.nodes < law.min_nodes:
        return Judgement(Verdict.NODATA, None, f"{m.nodes} nodes < {law.min_nodes}")
    parts: list[tuple[float, str]] = []  # (slack, what was measured against what)
    unmeasured = []
    if obj.p99_ms is not None:
        if m.p99_ms is None:
            unmeasured.append("p99")
        else:
            s = 1.0 - m.p99_ms / obj.p99_ms
            rel = ">" if s < 0 else "<="
            parts.append((s, f"p99 {m.p99_ms:.0f} ms {rel} {obj.p99_ms:g} ms"))
    if obj.attainment is not None:
        if m.attainment is None:
            unmeasured.append("attainment")
        else:
            s = (m.attainment - obj.attainment) / (1.0 - obj.attainment)
            rel = "<" if s < 0 else ">="
            parts.append((s, f"attainment {m.attainment:.3f} {rel} {obj.attainment:g}"))
    worst = min(parts, default=None)
    if worst is not None and worst[0] < 0:
        return Judgement(Verdict.MISS, worst[0], "; ".join(p[1] for p in parts if p[0] < 0))
    if unmeasured:
        return Judgement(Verdict.NODATA, None, f"{' and '.join(unmeasured)} not measured")
    assert worst is not None  # an Objective states at least one part
    text = "; ".join(p[1] for p in parts)
    verdict = Verdict.COMFORT if worst[0] >= law.comfort_margin else Verdict.OK
    return Judgement(verdict, worst[0], text)


def step_of(knob: str, policy_value: int, law: Law) -> int:
    """The size of one increase of ``knob`` (always >= one unit)."""
    if knob == "priority":
        return 1
    unit = KILOBIT if knob in ("rate", "ceil") else 1
    return max(unit, math.floor(law.add_step * policy_value))


def decayed(excess: int, step: int, law: Law) -> int:
    """The excess over the policy value after one decay (0 below one step)."""
    kept = math.floor(excess * law.decay)
    return 0 if kept < step else kept


def frame_rates(classes: Mapping[str, Measure], law: Law) -> dict[str, float]:
    """Frames per window of each class (the load context an increase is tied to)."""
    return {c: m.frames * law.period_s / m.window_s
            for c, m in classes.items() if m.window_s > 0}  # fmt: skip


def eased(need: Mapping[str, float], now: Mapping[str, float], law: Law) -> str | None:
    """Which class's load fell by ``law.ease`` since ``need`` was recorded, or None.

    Only classes that carried at least ``min_frames`` a window then count.
    """
    for cls in sorted(need):
        before = need[cls]
        if before >= law.min_frames and now.get(cls, 0.0) <= (1.0 - law.ease) * before:
            return cls
    return None
