"""The controller's outputs and what it knows of each class from the policy.

:class:`Params` is one class's effective HTB parameters; :class:`Decision`
is what a step returns: every class's Params and the per-stage weight
overrides, pure data for the wiring to write through ``mmmesh.dataplane``
(:func:`effective_policy` makes them a Policy that ``compile_policy``
takes as it is).  :class:`ClassSpec` is the policy's side of one class: its
values, ranges, step sizes, rank and objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmmesh.policy import KNOBS, QUANTUM_UNIT, Objective, Policy, bounds, format_rate, policy_values

from ._law import KILOBIT, Law, step_of

# Which way is "more privileged" for each knob: up for rates and weight, down for prio.
SIGN = {"rate": 1, "ceil": 1, "weight": 1, "priority": -1}


@dataclass(frozen=True, slots=True)
class Params:
    """A class's effective HTB parameters."""

    rate: int
    """Guaranteed rate, bit/s (HTB rate)."""
    ceil: int
    """Ceiling, bit/s (HTB ceil)."""
    weight: int
    """Share of spare bandwidth; HTB quantum = weight x QUANTUM_UNIT."""
    priority: int
    """HTB prio, 0 = most urgent."""

    @property
    def quantum(self) -> int:
        return self.weight * QUANTUM_UNIT

    def get(self, knob: str) -> int:
        value: int = getattr(self, knob)
        return value

    def as_dict(self) -> dict[str, int]:
        return {k: self.get(k) for k in KNOBS}


@dataclass(frozen=True)
class Decision:
    """What one step decided: the parameters to apply, pure data."""

    window: int
    """The controller's window index (counts from its first step)."""
    classes: Mapping[str, Params]
    """Every class of the policy, effective (the policy's own where nothing changed)."""
    stage_weights: Mapping[str, Mapping[str, int]]
    """``{class: {stage: weight}}``: the stages whose flows should get a weight
    above their class's (a higher-weight leaf, or sk_msg replica weights).
    Each weight lies within the class's weight range; stages not listed
    follow their class."""
    changed: tuple[str, ...]
    """Classes (and ``class/stage`` pairs) changed by this step."""
    frozen: bool

    def as_dict(self) -> dict[str, Any]:
        return {"window": self.window, "frozen": self.frozen, "changed": list(self.changed),
                "classes": {c: p.as_dict() | {"quantum": p.quantum}
                            for c, p in self.classes.items()},
                "stage_weights": {c: dict(s) for c, s in self.stage_weights.items()}}  # fmt: skip


@dataclass(frozen=True)
class ClassSpec:
    """One class as the policy states it, for the law."""

    name: str
    rank: int
    objective: Objective | None
    policy: Params
    ranges: Mapping[str, tuple[int, int]]
    steps: Mapping[str, int]

    def adaptable(self, knob: str) -> bool:
        lo, hi = self.ranges[knob]
        return lo < hi

    def can_raise(self, knob: str, value: int) -> bool:
        """True if ``value`` can still move toward privilege within the range by
        at least one unit of the knob (a kilobit of rate or ceil: a step that
        rounded down may stop a few bits short of the top, and a raise of those
        bits would cost a kernel write and a blackout for nothing)."""
        lo, hi = self.ranges[knob]
        unit = KILOBIT if knob in ("rate", "ceil") else 1
        return value + unit <= hi if SIGN[knob] > 0 else value - unit >= lo


def specs(policy: Policy, law: Law) -> dict[str, ClassSpec]:
    """Every class's spec, in rank order (most privileged first)."""
    out: dict[str, ClassSpec] = {}
    for rank, c in enumerate(policy.ranked()):
        own = policy_values(policy, c)
        out[c.name] = ClassSpec(
            c.name, rank, c.sla, Params(**own), bounds(policy, c),
            {k: step_of(k, own[k], law) for k in KNOBS})
    return out


def show(knob: str, v: int) -> str:
    """A knob's value as the policy writes it (rates in tc units)."""
    return format_rate(v) if knob in ("rate", "ceil") else str(v)


def clamp(spec: ClassSpec, knob: str, value: int) -> int:
    lo, hi = spec.ranges[knob]
    return min(hi, max(lo, value))


def effective_policy(policy: Policy, classes: Mapping[str, Params]) -> Policy:
    """What the kernel should run: ``policy`` with each class's rate, ceil,
    weight and priority replaced by ``classes``'s, and without ``sla`` and
    ``adapt`` (the controller's business, not the kernel's; their rules are
    about the policy's own values).  Validated again: a whole, valid Policy
    that ``compile_policy`` / ``Dataplane.up`` take as they are."""
    data = policy.model_dump(mode="python", by_alias=True)
    for c in data["classes"]:
        c.pop("sla", None)
        c.pop("adapt", None)
        p = classes.get(c["name"])
        if p is not None:
            c.update(rate=p.rate, ceil=p.ceil, weight=p.weight, priority=p.priority)
    return Policy.model_validate(data)
