"""Why the controller did what it did: :func:`explain` (JSON-able data) and
:func:`render` (the text ``mmmeshctl sla explain`` prints; docs/controller.md).

Per class: the objective against the last measurement, every knob's current
value against the policy's and its range, the last decisions (window, time,
what changed, why), and one state:

==========  ===============================================================
frozen      too many members suspect: nothing changes
stale       no usable data this window (expires to the policy after a few)
blackout    changed in the last window: the coming window is ignored
increasing  outside its objective: steps up once the hysteresis allows
decaying    moving back to the policy's values
steady      nothing due (at the policy, or holding an adapted value)
==========  ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from mmmesh.policy import KNOBS

from ._inputs import StageKey
from ._law import Law, Verdict
from ._params import SIGN, ClassSpec, show
from ._state import Subject


class Explained(Protocol):
    """What :func:`explain` reads of a controller (``Controller`` is one)."""

    @property
    def law(self) -> Law: ...
    @property
    def specs(self) -> Mapping[str, ClassSpec]: ...
    @property
    def classes(self) -> Mapping[str, Subject]: ...
    @property
    def stages(self) -> Mapping[StageKey, Subject]: ...
    @property
    def window(self) -> int: ...
    @property
    def now(self) -> float: ...
    @property
    def source(self) -> str: ...
    @property
    def frozen(self) -> bool: ...


def state_of(ctrl: Explained, subj: Subject, spec: ClassSpec, knobs: tuple[str, ...]) -> str:
    """The one word for a subject's state (see the module doc)."""
    j = subj.judgement
    if ctrl.frozen:
        return "frozen"
    if spec.objective is not None and (j is None or j.verdict is Verdict.NODATA):
        return "stale"
    if subj.held(ctrl.window + 1):
        return "blackout"
    if subj.miss:
        return "increasing"
    off = any(subj.values[k] != spec.policy.get(k) for k in knobs)
    last = subj.history[-1] if subj.history else None
    back = last is not None and all(
        abs(b - spec.policy.get(k)) < abs(a - spec.policy.get(k))
        for k, (a, b) in last.changes.items())
    return "decaying" if off and back else "steady"


def _measured(subj: Subject) -> dict[str, Any] | None:
    j, m = subj.judgement, subj.measure
    if j is None:
        return None
    out: dict[str, Any] = {"verdict": j.verdict.value, "slack": None if j.slack is None
                           else round(j.slack, 3), "why": j.why}  # fmt: skip
    if m is not None:
        out.update(p99_ms=m.p99_ms, attainment=m.attainment, frames=m.frames, nodes=m.nodes,
                   age_s=round(m.age_s, 3))
    return out


def _subject(ctrl: Explained, subj: Subject, spec: ClassSpec,
             knobs: tuple[str, ...]) -> dict[str, Any]:
    return {
        "state": state_of(ctrl, subj, spec, knobs), "note": subj.note,
        "measured": _measured(subj),
        "streaks": {"miss": subj.miss, "comfort": subj.comfort},
        "params": {k: {"current": subj.values[k], "policy": spec.policy.get(k),
                       "range": list(spec.ranges[k])} for k in knobs},
        "decisions": [r.as_dict() for r in subj.history],
    }  # fmt: skip


def explain(ctrl: Explained) -> dict[str, Any]:
    """Everything explain shows, as data (JSON-able), classes in rank order."""
    classes = []
    for name, spec in ctrl.specs.items():
        obj = spec.objective
        row = {"class": name, "rank": spec.rank,
               "objective": None if obj is None else obj.model_dump(exclude_none=True),
               **_subject(ctrl, ctrl.classes[name], spec, KNOBS)}  # fmt: skip
        row["stages"] = [{"stage": st, **_subject(ctrl, subj, spec, ("weight",))}
                         for (c, st), subj in sorted(ctrl.stages.items()) if c == name]
        classes.append(row)
    return {"window": ctrl.window, "now": ctrl.now, "source": ctrl.source,
            "frozen": ctrl.frozen, "law": ctrl.law.as_dict(), "classes": classes}  # fmt: skip


def _param(p: dict[str, Any], knob: str) -> str:
    cur, pol = p["current"], p["policy"]
    if cur == pol:
        return show(knob, cur)
    arrow = "^" if SIGN[knob] * (cur - pol) > 0 else "v"
    return f"{show(knob, cur)}{arrow}({show(knob, pol)})"


def _vs(m: dict[str, Any] | None, obj: dict[str, Any] | None, key: str, fmt: str) -> str:
    got = None if m is None else m.get(key)
    want = None if obj is None else obj.get(key)
    if want is None:
        return "-"
    return f"{'?' if got is None else format(got, fmt)}/{want:g}"


def render(data: dict[str, Any], decisions: int = 3) -> str:
    """The text of ``mmmeshctl sla explain``: a table, then each class's last
    ``decisions`` decisions and notes."""
    head = (f"controller: window {data['window']}, source {data['source'] or '-'}, "
            f"{'FROZEN' if data['frozen'] else 'not frozen'}")
    rows = [("CLASS", "STATE", "P99 ms/OBJ", "ATTAIN/OBJ", "RATE", "CEIL", "WEIGHT", "PRIO")]
    for c in data["classes"]:
        m, obj, p = c["measured"], c["objective"], c["params"]
        rows.append((c["class"], c["state"], _vs(m, obj, "p99_ms", ".0f"),
                     _vs(m, obj, "attainment", ".3f"), *(_param(p[k], k) for k in KNOBS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, *("  ".join(x.ljust(wd) for x, wd in zip(r, widths, strict=True)).rstrip()
                     for r in rows)]  # fmt: skip
    for c in data["classes"]:
        extra = [f"  note: {c['note']}"] if c["note"] else []
        for st in c["stages"]:
            extra.append(f"  stage {st['stage']}: {st['state']}, weight "
                         f"{_param(st['params']['weight'], 'weight')}")
        for r in c["decisions"][-decisions:]:
            ago = data["now"] - r["at"]
            extra.append(f"  w{r['window']} ({ago:.0f} s ago): {r['change']}: {r['why']}")
        if extra:
            lines += ["", f"{c['class']}:", *extra]
    return "\n".join(lines) + "\n"
