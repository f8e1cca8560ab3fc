"""The controller's state across a qosd restart: :func:`snapshot` and
:func:`read_saved` (which ``Controller.restore`` takes back).

The state is kept (docs/controller.md, "Restart"): qosd restarts while the
kernel keeps the adapted HTB classes, and starting over from the policy would
step the classes back to the values that missed, then re-learn them over
several windows.  A saved state is taken back only when all of these hold,
else the controller starts from the policy (as expiry would have brought it
there anyway) and says why:

* same format, same policy (digest of its canonical YAML), same law;
* saved no longer ago than ``expire_windows`` windows (older adaptations
  would have expired: the data they rested on is gone);
* every field reads back within its bounds; values are clamped into the
  class's ranges, and the guaranteed rates fit the link.

``now`` must be on the same clock as when it was saved: unix time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mmmesh.policy import KNOBS, Policy

from ._inputs import StageKey
from ._law import Law
from ._params import ClassSpec
from ._state import Subject, subject_from_dict

FORMAT = "qosd.controller.core/1"


class Saved(Protocol):
    """What :func:`snapshot` reads of a controller (``Controller`` is one)."""

    @property
    def policy(self) -> Policy: ...
    @property
    def law(self) -> Law: ...
    @property
    def epoch(self) -> float | None: ...
    @property
    def window(self) -> int: ...
    @property
    def now(self) -> float: ...
    @property
    def frozen(self) -> bool: ...
    @property
    def classes(self) -> Mapping[str, Subject]: ...
    @property
    def stages(self) -> Mapping[StageKey, Subject]: ...


@dataclass(frozen=True)
class Restored:
    """A saved state that applies, read back and checked (see the module doc)."""

    classes: dict[str, Subject]
    stages: dict[StageKey, Subject]
    epoch: float
    window: int
    saved_at: float
    frozen: bool


def policy_digest(policy: Policy) -> str:
    """sha256 of the policy's canonical YAML (what ``policy diff`` compares)."""
    return hashlib.sha256(policy.to_yaml().encode()).hexdigest()


def snapshot(ctrl: Saved) -> dict[str, Any]:
    """The state as JSON-able data."""
    return {
        "format": FORMAT, "policy": policy_digest(ctrl.policy), "law": ctrl.law.as_dict(),
        "epoch": ctrl.epoch, "window": ctrl.window, "saved_at": ctrl.now,
        "frozen": ctrl.frozen,
        "classes": {n: s.to_dict() for n, s in ctrl.classes.items()},
        "stages": [{"class": c, "stage": st, **s.to_dict()}
                   for (c, st), s in sorted(ctrl.stages.items())],
    }  # fmt: skip


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{v!r} is not a finite number")
    return float(v)


def read_saved(policy: Policy, data: Any, now: float, law: Law,
               specs: Mapping[str, ClassSpec]) -> tuple[Restored | None, str]:
    """``data``'s state for a controller of ``policy``, ``law`` and ``specs``
    (its classes) when it applies, else None; and a sentence saying which and
    why (``Controller.restore`` takes it)."""
    fresh = "started from the policy"
    try:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            return None, f"{fresh}: no saved state in a known format"
        if data.get("policy") != policy_digest(policy):
            return None, f"{fresh}: the saved state is of another policy"
        if data.get("law") != law.as_dict():
            return None, f"{fresh}: the law's constants changed"
        saved, epoch = _number(data["saved_at"]), _number(data["epoch"])
        horizon = law.expire_windows * law.period_s
        if not 0 <= now - saved <= horizon:
            return None, (f"{fresh}: the saved state is {now - saved:.0f} s "
                          f"old (kept up to {horizon:.0f} s, when it would have expired)")
        classes = data["classes"]
        if not isinstance(classes, Mapping) or set(classes) != set(specs):
            raise ValueError("classes: not the policy's")
        subjects = {n: subject_from_dict(classes[n], specs[n], KNOBS, law)
                    for n in specs}  # fmt: skip
        stages = {}
        for d in (data.get("stages") or [])[: law.max_stages]:
            c, st = d["class"], d["stage"]
            if c not in specs or not isinstance(st, str) or not 0 < len(st) <= 128:
                raise ValueError("stages: unknown class or bad stage name")
            stages[(c, st)] = subject_from_dict(d, specs[c], ("weight",), law)
        if sum(s.values["rate"] for s in subjects.values()) > int(policy.link.rate):
            raise ValueError("the saved rates do not fit the link")
        window = int(_number(data["window"]))
    except (KeyError, TypeError, ValueError) as e:
        return None, f"{fresh}: the saved state is unreadable ({e})"
    state = Restored(subjects, stages, epoch, window, saved, bool(data.get("frozen", False)))
    return state, f"restored the state of window {window}, saved {now - saved:.0f} s ago"
