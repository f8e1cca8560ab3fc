"""A class's SLA objective (``sla``) and the bounds qosd may adapt it within (``adapt``).

Both are optional per class.  ``sla`` states what the class is promised:
``p99_ms`` (the 99th percentile of the frames' end-to-end latency over a
window) and/or ``attainment`` (the share of frames that arrived within their
own deadline).  ``adapt`` gives, per HTB parameter, the inclusive range
``[min, max]`` within which the controller (``qosd.controller.core``) may move
the class away from its policy value; a parameter without a range stays at
the policy's value.

The cross-field rules (:func:`adapt_errors`, run with the policy's others):

* every range holds the policy's own value (the controller starts there and
  decays back to it);
* rate and ceil ranges stay within the link, and the highest rate stays at or
  below the lowest ceil (HTB needs rate <= ceil at every step);
* **anti-escalation**: for every source rule capping senders at ``max_class``
  M, every class C that ranks below M in the policy must still rank below M
  at every setting within the ranges: C's most privileged setting (lowest
  priority, highest rate) keeps a rank key ``(priority, -rate, id)`` greater
  than M's least privileged one (highest priority, lowest rate).  So a
  sender capped at M never gets, through adaptation, a class served before
  M.  The default class (traffic the mesh cannot read) may give but never
  gain: its ranges end at its policy values on the privileged side;
* the sum of guaranteed rates at any moment is the controller's rule, not a
  schema rule: it pays every rate increase from the unreserved link or from
  another class, so the sum never exceeds the link (docs/controller.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictInt,
    model_validator,
)

from ._types import Rate, format_rate

if TYPE_CHECKING:
    from ._schema import Policy, TrafficClass

MAX_OBJECTIVE_MS = 86_400_000.0  # a day: the SLA report's bound on a latency (slareport.MAX_MS)
# Bounds of the HTB parameters (the schema's own, repeated to keep this module a leaf).
_WEIGHT = (1, 100)
_PRIORITY = (0, 7)


def _two(value: object) -> object:
    """A range is written ``[min, max]``: exactly two values."""
    if isinstance(value, list | tuple) and len(value) == 2:
        return tuple(value)
    raise ValueError("a range is [min, max]: a list of two values")


def _ordered(fmt: Callable[[int], str]) -> Callable[[tuple[int, int]], tuple[int, int]]:
    def check(value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError(f"min {fmt(value[0])} is greater than max {fmt(value[1])}")
        return value

    return check


def _whole_if_integral(v: float) -> float | int:
    return int(v) if float(v).is_integer() else v


RateRange = Annotated[
    tuple[Rate, Rate], BeforeValidator(_two), AfterValidator(_ordered(format_rate))
]
def _within(lo: int, hi: int) -> Callable[[tuple[int, int]], tuple[int, int]]:
    def check(value: tuple[int, int]) -> tuple[int, int]:
        bad = [v for v in value if not lo <= v <= hi]
        if bad:
            raise ValueError(f"{bad[0]} is outside {lo}..{hi}")
        return value

    return check


IntRange = Annotated[tuple[StrictInt, StrictInt], BeforeValidator(_two),
                     AfterValidator(_ordered(str))]  # fmt: skip
Millis = Annotated[
    float,
    Field(gt=0, le=MAX_OBJECTIVE_MS, strict=True),
    PlainSerializer(_whole_if_integral),
]
Share = Annotated[float, Field(gt=0, lt=1, strict=True)]


class Objective(BaseModel):
    """``sla``: what the class is promised over each SLA window.  At least one field.

    A window *meets* the objective when every stated part holds: the e2e p99
    at or below ``p99_ms`` and the attainment at or above ``attainment``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    p99_ms: Millis | None = Field(
        default=None, description="99th percentile of end-to-end latency, ms (> 0)"
    )
    attainment: Share | None = Field(
        default=None,
        description="share of frames within their own deadline, 0 < a < 1 (1 is unreachable: "
        "one late frame would be a miss)",
    )

    @model_validator(mode="after")
    def _something(self) -> Objective:
        if self.p99_ms is None and self.attainment is None:
            raise ValueError("state p99_ms, attainment or both")
        return self


class Adapt(BaseModel):
    """``adapt``: the ranges ``[min, max]`` within which qosd may move the class.

    A parameter left out is not adapted.  ``priority`` counts as HTB does,
    0 = most urgent, so ``[1, 2]`` lets the class move between 1 and 2.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: RateRange | None = Field(default=None, description="guaranteed rate range, bit/s")
    ceil: RateRange | None = Field(default=None, description="ceiling range, bit/s")
    weight: Annotated[IntRange, AfterValidator(_within(*_WEIGHT))] | None = Field(
        default=None, description="weight range, 1..100")
    priority: Annotated[IntRange, AfterValidator(_within(*_PRIORITY))] | None = Field(
        default=None, description="HTB prio range, 0..7")


KNOBS = ("rate", "ceil", "weight", "priority")


def bounds(p: Policy, c: TrafficClass) -> dict[str, tuple[int, int]]:
    """Per knob, the inclusive range the class may take: its ``adapt`` range, or
    its policy value alone where it has none (ceil: the effective ceiling)."""
    value = policy_values(p, c)
    out: dict[str, tuple[int, int]] = {}
    for knob in KNOBS:
        rng = getattr(c.adapt, knob) if c.adapt is not None else None
        out[knob] = (int(rng[0]), int(rng[1])) if rng is not None else (value[knob], value[knob])
    return out


def policy_values(p: Policy, c: TrafficClass) -> dict[str, int]:
    """The class's own values of the adaptable knobs (ceil: the effective one)."""
    return {"rate": int(c.rate), "ceil": int(p.ceil_of(c)), "weight": c.weight,
            "priority": c.priority}  # fmt: skip


def _show(knob: str, v: int) -> str:
    return format_rate(v) if knob in ("rate", "ceil") else str(v)


def adapt_errors(p: Policy) -> list[tuple[str, str]]:
    """The cross-field rules of ``adapt`` (see the module doc); [] when they hold."""
    errors: list[tuple[str, str]] = []
    link = int(p.link.rate)
    for i, c in enumerate(p.classes):
        if c.adapt is None:
            continue
        at = f"classes[{i}].adapt"
        own = policy_values(p, c)
        rng = bounds(p, c)
        for knob in KNOBS:
            if getattr(c.adapt, knob) is None:
                continue
            lo, hi = rng[knob]
            if not lo <= own[knob] <= hi:
                errors.append((f"{at}.{knob}", (
                    f"the range [{_show(knob, lo)}, {_show(knob, hi)}] does not hold the "
                    f"class's own {knob} {_show(knob, own[knob])}")))
            if knob in ("rate", "ceil") and hi > link:
                errors.append((f"{at}.{knob}", (
                    f"max {format_rate(hi)} ({hi} bit/s) exceeds the link rate "
                    f"{format_rate(link)} ({link} bit/s)")))
        if c.adapt.rate is not None and rng["rate"][1] > rng["ceil"][0] and rng["rate"][1] <= link:
            errors.append((f"{at}.rate", (
                f"max {format_rate(rng['rate'][1])} is above the lowest ceil "
                f"{format_rate(rng['ceil'][0])}: HTB needs rate <= ceil at every setting")))
        if c.name == p.default_class:
            errors.extend(_default_gains(p, c, at))
    errors.extend(_escalations(p))
    return errors


def _default_gains(p: Policy, c: TrafficClass, at: str) -> list[tuple[str, str]]:
    """The default class carries traffic the mesh cannot read: it may give, not gain."""
    own, rng = policy_values(p, c), bounds(p, c)
    gains = [(k, rng[k][1]) for k in ("rate", "ceil", "weight") if rng[k][1] > own[k]]
    if rng["priority"][0] < own["priority"]:
        gains.append(("priority", rng["priority"][0]))
    return [(f"{at}.{knob}", (
        f"{c.name!r} is the default class (traffic the mesh cannot read): it may give, never "
        f"gain; the range may not go past its own {knob} {_show(knob, own[knob])} "
        f"to {_show(knob, v)}")) for knob, v in gains]


def _escalations(p: Policy) -> list[tuple[str, str]]:
    """Anti-escalation: no class below a rule's max_class may outrank it when adapted."""
    errors: list[tuple[str, str]] = []
    index = {c.name: i for i, c in enumerate(p.classes)}
    ranks = {c.name: r for r, c in enumerate(p.ranked())}
    seen: set[tuple[str, str]] = set()
    for ri, rule in enumerate(p.source_rules):
        if rule.max_class not in index:
            continue  # reported by the schema's own rule
        m = p.classes[index[rule.max_class]]
        m_rng = bounds(p, m)
        worst_m = (m_rng["priority"][1], -m_rng["rate"][0], m.id)
        for c in p.classes:
            if ranks[c.name] <= ranks[m.name] or (m.name, c.name) in seen:
                continue
            c_rng = bounds(p, c)
            best_c = (c_rng["priority"][0], -c_rng["rate"][1], c.id)
            if best_c > worst_m:
                continue
            seen.add((m.name, c.name))
            knob = "priority" if best_c[0] < worst_m[0] else "rate"
            own_c = policy_values(p, c)[knob]
            blame_c = c_rng[knob][0] < own_c if knob == "priority" else c_rng[knob][1] > own_c
            who = c if blame_c else m
            errors.append((f"classes[{index[who.name]}].adapt.{knob}", (
                f"anti-escalation: {c.name!r} ranks below {m.name!r}, the max_class of "
                f"source_rules[{ri}] ({rule.prefix}), but could outrank it when adapted: "
                f"{c.name} at priority {best_c[0]}, rate {format_rate(-best_c[1])} against "
                f"{m.name} at priority {worst_m[0]}, rate {format_rate(-worst_m[1])}")))
    return errors
