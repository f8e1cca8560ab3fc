"""The controller's memory per subject (a class, or one stage of a class), and
its JSON form.

A subject remembers its current knob values, its streaks (windows missing /
comfortable in a row), its blackout, the last window it had usable data,
which window it judged last (its data time: each window counts once), when it
last changed, the load it was last raised under and the window it was raised
on, its probe interval and its last decisions.  :meth:`Subject.to_dict` /
:func:`subject_from_dict` are the persisted form (docs/controller.md,
"Restart"); reading one back checks
every field and clamps every value into the class's ranges, so a state
file can never push a class beyond its bounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._inputs import Measure
from ._law import Judgement, Law, Verdict
from ._params import ClassSpec, clamp

MAX_TEXT = 400  # characters of a persisted record's texts


@dataclass(frozen=True, slots=True)
class Record:
    """One decision about one subject."""

    window: int
    at: float
    """The caller's clock at the step that made it."""
    changes: Mapping[str, tuple[int, int]]
    """knob -> (before, after)."""
    change: str
    """The changes as text: 'rate 1.2mbit -> 1.8mbit, weight 3 -> 4'."""
    why: str
    """'missed 3 windows: p99 180 ms > 120 ms; +0.6mbit from video (slack 0.40)'."""

    def as_dict(self) -> dict[str, Any]:
        return {"window": self.window, "at": self.at, "change": self.change, "why": self.why,
                "changes": {k: list(v) for k, v in self.changes.items()}}  # fmt: skip


@dataclass
class Subject:
    """What the controller remembers of one class or (class, stage)."""

    values: dict[str, int]
    """The knobs it adapts (all four for a class; weight for a stage)."""
    last_data: int
    """The last window with usable data (or the window the subject was made)."""
    probe: int
    """Comfortable windows before a decay is tried without eased load."""
    miss: int = 0
    comfort: int = 0
    held_until: int = -1
    """In blackout through this window."""
    need: dict[str, float] | None = None
    """Frames per window, when it was last raised, of the classes it was raised for."""
    calm: dict[str, float] | None = None
    """Frames per window of every class in the last counted window that kept the
    objective (what the load grew from, when it misses)."""
    decayed_at: int | None = None
    probed: bool = False
    """Whether the last decay was a probe (a miss soon after doubles ``probe``)."""
    history: deque[Record] = field(default_factory=deque)
    judgement: Judgement | None = None
    measure: Measure | None = None
    note: str = ""
    """Why nothing moved although the class misses ('at its bounds', 'frozen', ...)."""
    seen: float | None = None
    """The data time (caller's clock) of the last window taken: each counts once."""
    changed_at: float | None = None
    """The caller's clock at the last change: a window that began before it is not counted."""
    raised_w: int | None = None
    """The window of the last increase (its load is refreshed for a few windows)."""
    raised_on: tuple[float | None, float | None] | None = None
    """(p99, attainment) of the window the last urgent increase was made on, until
    the first window judged after it (a smaller, not urgent miss is the queue
    built before it draining)."""
    urgent: float = 0.0
    """The step the last counted window calls for when it was an urgent miss (0: none)."""
    counted: bool = False
    """Whether this window's verdict moved the streaks (only such a window raises)."""

    def held(self, window: int) -> bool:
        return window <= self.held_until

    def observe(self, j: Judgement, m: Measure | None, window: int, counting: bool,
                data_t: float | None = None) -> None:
        """Takes one window's verdict; streaks move only when ``counting``
        (not frozen, not in blackout) and the window is one to count:
        ``data_t`` (when the data was taken, the caller's clock) is a window
        not judged before and that began after the subject's last change; the
        first window judged after an urgent increase does not count either
        when it misses, not urgently, by less than the one the increase was
        made on (the queue built before the increase, draining)."""
        self.judgement, self.measure = j, m
        self.counted = False
        if j.verdict is not Verdict.NODATA:
            self.last_data = window
        again = False
        if m is not None and data_t is not None:
            again = self.seen is not None and abs(data_t - self.seen) < same(m)
            if not again:
                self.seen = data_t
        if not counting:
            return
        if j.verdict is not Verdict.NODATA and m is not None and data_t is not None:
            if again:
                self.note = "the window judged already: not counted again"
                return
            if self.changed_at is not None and data_t - m.window_s < self.changed_at:
                self.note = "the window began before the last change: not counted"
                return
            trigger, self.raised_on = self.raised_on, None
            if j.verdict is Verdict.MISS and trigger is not None and not j.urgent and \
                    _smaller(m, trigger):
                self.note = ("missing by less than the window it was raised on: the queue "
                             "built before is draining (not counted)")
                return
        self.miss = self.miss + 1 if j.verdict is Verdict.MISS else 0
        self.comfort = self.comfort + 1 if j.verdict is Verdict.COMFORT else 0
        self.urgent = j.scale if j.urgent else 0.0
        self.counted = True

    def remember(self, rec: Record, law: Law) -> None:
        self.history.append(rec)
        while len(self.history) > law.history:
            self.history.popleft()

    def to_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "last_data": self.last_data, "probe": self.probe,
                "miss": self.miss, "comfort": self.comfort, "held_until": self.held_until,
                "need": self.need, "calm": self.calm, "decayed_at": self.decayed_at,
                "probed": self.probed,
                "seen": self.seen, "changed_at": self.changed_at, "raised_w": self.raised_w,
                "raised_on": None if self.raised_on is None else list(self.raised_on),
                "urgent": self.urgent,
                "judgement": None if self.judgement is None else {
                    "verdict": self.judgement.verdict.value, "slack": self.judgement.slack,
                    "why": self.judgement.why},
                "history": [r.as_dict() for r in self.history]}  # fmt: skip


def same(m: Measure) -> float:
    """Two data times closer than this are the same window (half its length)."""
    return max(0.25, 0.5 * m.window_s)


def _smaller(m: Measure, trigger: tuple[float | None, float | None]) -> bool:
    """Whether ``m`` misses by less than the window ``trigger`` (p99, attainment)."""
    p99, att = trigger
    if m.p99_ms is not None and p99 is not None:
        return m.p99_ms < p99
    return m.attainment is not None and att is not None and m.attainment > att


def _int(d: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key}: {v!r} is not an integer within {lo}..{hi}")
    return v


def _float(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{key}: {v!r} is not a finite number")
    return float(v)


def _text(v: Any, key: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise ValueError(f"{key}: not a string of at most {MAX_TEXT} characters")
    return v


def _record(d: Any) -> Record:
    if not isinstance(d, Mapping):
        raise TypeError("a record is an object")
    changes = d.get("changes") or {}
    if not isinstance(changes, Mapping) or len(changes) > 4:
        raise ValueError("record.changes: at most 4 knobs")
    ch = {}
    for k, v in changes.items():
        if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)):
            raise ValueError(f"record.changes.{k}: [before, after]")
        ch[_text(k, "knob")] = (v[0], v[1])
    return Record(_int(d, "window", -(2**62), 2**62), _float(d["at"], "at"), ch,
                  _text(d["change"], "change"), _text(d["why"], "why"))  # fmt: skip


def subject_from_dict(d: Any, spec: ClassSpec, knobs: tuple[str, ...], law: Law) -> Subject:
    """A persisted subject, checked field by field, its values clamped into the
    class's ranges; ValueError (or KeyError) when anything does not fit."""
    if not isinstance(d, Mapping):
        raise TypeError("a subject is an object")
    values = d["values"]
    if not isinstance(values, Mapping) or set(values) != set(knobs):
        raise ValueError(f"values: exactly {', '.join(knobs)}")
    big = 2**62
    s = Subject({k: clamp(spec, k, _int(values, k, 0, 2**64)) for k in knobs},
                last_data=_int(d, "last_data", -big, big),
                probe=_int(d, "probe", law.probe_windows, law.probe_max_windows),
                miss=_int(d, "miss", 0, big), comfort=_int(d, "comfort", 0, big),
                held_until=_int(d, "held_until", -big, big))  # fmt: skip
    for key in ("need", "calm"):
        loads = d.get(key)
        if loads is not None:
            if not isinstance(loads, Mapping) or len(loads) > 64:
                raise ValueError(f"{key}: an object of at most 64 classes")
            setattr(s, key, {_text(k, key): _float(v, key) for k, v in loads.items()})
    if d.get("decayed_at") is not None:
        s.decayed_at = _int(d, "decayed_at", -big, big)
    s.probed = bool(d.get("probed", False))
    for key in ("seen", "changed_at"):
        if d.get(key) is not None:
            setattr(s, key, _float(d[key], key))
    if d.get("raised_w") is not None:
        s.raised_w = _int(d, "raised_w", -big, big)
    on = d.get("raised_on")
    if on is not None:
        if not isinstance(on, list) or len(on) != 2:
            raise ValueError("raised_on: [p99, attainment]")
        s.raised_on = (None if on[0] is None else _float(on[0], "raised_on"),
                       None if on[1] is None else _float(on[1], "raised_on"))
    urgent = _float(d.get("urgent", 0.0), "urgent")
    if not 0.0 <= urgent <= law.max_scale:
        raise ValueError(f"urgent: {urgent} is not within 0..{law.max_scale}")
    s.urgent = urgent
    j = d.get("judgement")
    if j is not None:
        slack = None if j["slack"] is None else _float(j["slack"], "slack")
        s.judgement = Judgement(Verdict(j["verdict"]), slack, _text(j["why"], "why"))
    hist = d.get("history") or []
    if not isinstance(hist, list):
        raise TypeError("history: a list")
    for r in hist[-law.history:]:
        s.history.append(_record(r))
    return s
