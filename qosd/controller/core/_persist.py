"""The controller's state across a qosd restart: :func:`snapshot` and :func:`restore`.

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
from typing import TYPE_CHECKING, Any

from mmmesh.policy import KNOBS, Policy

from ._law import Law

if TYPE_CHECKING:
    from ._core import Controller

FORMAT = "qosd.controller.core/1"


def policy_digest(policy: Policy) -> str:
    """sha256 of the policy's canonical YAML (what ``policy diff`` compares)."""
    return hashlib.sha256(policy.to_yaml().encode()).hexdigest()


def snapshot(ctrl: Controller) -> dict[str, Any]:
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


def restore(policy: Policy, data: Any, now: float, law: Law | None = None
            ) -> tuple[Controller, str]:
    """A controller for ``policy`` with ``data``'s state when it applies, else
    a fresh one; and a sentence saying which and why."""
    from ._core import Controller
    from ._state import subject_from_dict

    ctrl = Controller(policy, law)
    try:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            return ctrl, "started from the policy: no saved state in a known format"
        if data.get("policy") != policy_digest(policy):
            return ctrl, "started from the policy: the saved state is of another policy"
        if data.get("law") != ctrl.law.as_dict():
            return ctrl, "started from the policy: the law's constants changed"
        saved, epoch = _number(data["saved_at"]), _number(data["epoch"])
        horizon = ctrl.law.expire_windows * ctrl.law.period_s
        if not 0 <= now - saved <= horizon:
            return ctrl, (f"started from the policy: the saved state is {now - saved:.0f} s "
                          f"old (kept up to {horizon:.0f} s, when it would have expired)")
        classes = data["classes"]
        if not isinstance(classes, Mapping) or set(classes) != set(ctrl.specs):
            raise ValueError("classes: not the policy's")
        subjects = {n: subject_from_dict(classes[n], ctrl.specs[n], KNOBS, ctrl.law)
                    for n in ctrl.specs}  # fmt: skip
        stages = {}
        for d in (data.get("stages") or [])[: ctrl.law.max_stages]:
            c, st = d["class"], d["stage"]
            if c not in ctrl.specs or not isinstance(st, str) or not 0 < len(st) <= 128:
                raise ValueError("stages: unknown class or bad stage name")
            stages[(c, st)] = subject_from_dict(d, ctrl.specs[c], ("weight",), ctrl.law)
        if sum(s.values["rate"] for s in subjects.values()) > int(policy.link.rate):
            raise ValueError("the saved rates do not fit the link")
        window = int(_number(data["window"]))
    except (KeyError, TypeError, ValueError) as e:
        why = f"started from the policy: the saved state is unreadable ({e})"
        return Controller(policy, law), why
    ctrl.classes, ctrl.stages = subjects, stages
    ctrl.epoch, ctrl.window, ctrl.now = epoch, window, saved
    ctrl.frozen = bool(data.get("frozen", False))
    ctrl.decision = ctrl._decide((), ctrl.frozen)
    return ctrl, f"restored the state of window {window}, saved {now - saved:.0f} s ago"
