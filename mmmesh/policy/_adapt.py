"""A class's SLA objective (``sla``) and the bounds qosd may adapt it within
(``adapt``): the models, a leaf of the schema (``_schema.py`` builds on them).

Both are optional per class.  ``sla`` states what the class is promised:
``p99_ms`` (the 99th percentile of the frames' end-to-end latency over a
window) and/or ``attainment`` (the share of frames that arrived within their
own deadline).  ``adapt`` gives, per HTB parameter (:data:`KNOBS`), the
inclusive range ``[min, max]`` within which the controller
(``qosd.controller.core``) may move the class away from its policy value; a
parameter without a range stays at the policy's value.

What a range must hold against the rest of the policy (the policy's own value,
the link, anti-escalation, the default class) are cross-field rules of the
whole policy: ``_schema.py`` has them beside the others (``bounds``,
``policy_values``, ``adapt_errors``), so that the models here know nothing of
the policy they are part of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

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

MAX_OBJECTIVE_MS = 86_400_000.0  # a day: the SLA report's bound on a latency (mmmesh.sla.report MAX_MS)
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
