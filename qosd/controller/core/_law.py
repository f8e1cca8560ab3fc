"""The law and its constants, in one place (docs/controller.md has the same table
with the reasons).

One *window* is one control period (``period_s``, the sidecars' SLA window).
Per class with an objective, each window's measurement is judged:

* ``nodata``: absent, older than ``stale_windows`` windows, fewer than
  ``min_frames`` frames, or fewer than ``min_nodes`` nodes reporting (or a
  stated part of the objective not measured, unless the rest already misses);
* ``miss``: slack < 0; ``comfort``: slack >= ``comfort_margin``; else ``ok``.

Slack is the unused fraction of the objective, the smaller of the parts it
states: ``1 - p99 / p99_ms`` and ``(attainment - a) / (1 - a)``.  A miss is
*urgent* when at least ``urgent_share`` of the window's frames missed their
deadline (attainment <= 1 - ``urgent_share``): not a tail, the window itself.

Each window is counted once: a window already judged (the same data again),
one that began before the class's last change, and, right after an increase,
one that still misses but less than the window the increase was made on (the
queue built before it draining) neither count nor reset a streak.

The law, per class and window (``qosd.controller.core._core`` applies it):

=================  ==================================================================
increase           after ``miss_windows`` windows that miss in a row, or one urgent miss,
                   out of blackout: every adaptable knob one step toward privilege; a
                   step is ``add_step`` x the policy value (at least one unit; priority:
                   one level), scaled to the miss when it is urgent (x the late share /
                   ``urgent_share``, at most ``max_scale``), never past the range.
                   Rate is paid from the unreserved link, then from classes that have
                   slack (slack >= ``donor_margin``, or no objective), lowest-ranked
                   first, each giving at most one step of its own and never below its
                   range; a class below its policy rate (it lent) is raised back to
                   that rate first, and past it a window later (a step toward the
                   policy never passes it)
decay              after ``comfort_windows`` comfortable windows in a row, out of
                   blackout, and only if the load eased (the class's own frames per
                   window, or a class's that grew into the miss, fell by ``ease`` since
                   the last increase; a load that appeared, ten times what it was, in
                   the ``blackout_windows + 1`` windows after it counts as the
                   increase's) or the class has been
                   comfortable for ``probe_windows`` (doubling after each failed probe,
                   up to ``probe_max_windows``): the excess over the policy value is
                   multiplied by ``decay`` (rounded down; to zero below one step); a
                   load that fell to ``gone_share`` of what it was takes every knob
                   back to the policy value at once (toward the policy: always safe)
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
    """One increase, as a fraction of the policy value (``max_scale`` of it for an urgent miss)."""
    urgent_share: float = 0.2
    """A miss with this share of its window's frames late (or more) is acted on at once."""
    max_scale: float = 2.0
    """The largest step of an urgent miss, in ``add_step``s (late share / ``urgent_share``)."""
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
    gone_share: float = 0.1
    """A load down to this share of what it was is gone: back to the policy in one decay."""
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
        for name in ("add_step", "decay", "freeze_suspect", "ease", "urgent_share"):
            if not getattr(self, name) < 1:
                raise ValueError(f"law.{name} must be < 1")
        if not self.max_scale >= 1:
            raise ValueError("law.max_scale must be >= 1 (an urgent step is at least a step)")
        if not self.gone_share < 1 - self.ease:
            raise ValueError("law.gone_share must be below 1 - law.ease (gone is eased)")

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
    urgent: bool = False
    """A miss of at least ``urgent_share`` of the window's frames (acted on at once)."""
    scale: float = 1.0
    """The step it calls for, in steps: 1, or up to ``max_scale`` when urgent."""


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
        why = "; ".join(p[1] for p in parts if p[0] < 0)
        late = None if m.attainment is None else 1.0 - m.attainment
        if late is not None and late >= law.urgent_share - 1e-9:  # 1 - 0.8 is 0.19999...
            scale = min(law.max_scale, max(1.0, late / law.urgent_share))
            return Judgement(Verdict.MISS, worst[0], f"{why}; {late:.0%} of the frames late",
                             urgent=True, scale=scale)
        return Judgement(Verdict.MISS, worst[0], why)
    if unmeasured:
        return Judgement(Verdict.NODATA, None, f"{' and '.join(unmeasured)} not measured")
    assert worst is not None  # an Objective states at least one part
    text = "; ".join(p[1] for p in parts)
    verdict = Verdict.COMFORT if worst[0] >= law.comfort_margin else Verdict.OK
    return Judgement(verdict, worst[0], text)


def step_of(knob: str, policy_value: int, law: Law, scale: float = 1.0) -> int:
    """The size of one increase of ``knob`` (always >= one unit; priority one
    level whatever the scale), ``scale`` steps of ``add_step`` (an urgent miss:
    rounded down to whole kbit, never below one step)."""
    if knob == "priority":
        return 1
    unit = KILOBIT if knob in ("rate", "ceil") else 1
    scale = min(max(scale, 1.0), law.max_scale)
    one = max(unit, math.floor(law.add_step * policy_value))
    if scale == 1.0:
        return one
    # a scaled step in whole units (4.219mbit, not 4219548bit), never below one step
    return max(one, math.floor(law.add_step * scale * policy_value) // unit * unit)


def decayed(excess: int, step: int, law: Law) -> int:
    """The excess over the policy value after one decay (0 below one step)."""
    kept = math.floor(excess * law.decay)
    return 0 if kept < step else kept


def frame_rates(classes: Mapping[str, Measure], law: Law) -> dict[str, float]:
    """Frames per window of each class (the load context an increase is tied to)."""
    return {c: m.frames * law.period_s / m.window_s
            for c, m in classes.items() if m.window_s > 0}  # fmt: skip


def causes(now: Mapping[str, float], calm: Mapping[str, float] | None, own: str,
           law: Law) -> dict[str, float]:
    """The load an increase is for: of ``now`` (frames per window of every
    class), the class's own and every class that grew since ``calm`` (the
    last window the class kept its objective in) by as much as an ease would
    take back (x 1 / (1 - ``ease``)), or appeared; everything when no calm
    window is known.  A class whose load did not grow into the miss is no
    reason for the increase, and its later dips are no reason to decay."""
    if calm is None:
        return dict(now)
    return {c: v for c, v in now.items()
            if c == own or v * (1.0 - law.ease) >= calm.get(c, 0.0)}


def gone(need: Mapping[str, float], now: Mapping[str, float], cls: str, law: Law) -> bool:
    """Whether ``cls``'s load (which eased) fell to ``gone_share`` of ``need``'s."""
    return now.get(cls, 0.0) <= law.gone_share * need.get(cls, 0.0)


def eased(need: Mapping[str, float], now: Mapping[str, float], law: Law) -> str | None:
    """Which class's load fell by ``law.ease`` since ``need`` was recorded, or None.

    Only classes that carried at least ``min_frames`` a window then count.
    """
    for cls in sorted(need):
        before = need[cls]
        if before >= law.min_frames and now.get(cls, 0.0) <= (1.0 - law.ease) * before:
            return cls
    return None
