"""The rate budget: guaranteed rates are paid for, so their sum never passes the link.

Rate is the one knob that is a budget: HTB guarantees what ``rate`` says, and
the link holds at most its rate.  Ceil, weight and priority share what is
spare, and are raised without payment (within their ranges).  An increase
of a class's rate is paid, in this order, by:

1. the unreserved link (``link - sum of current rates``);
2. if the class is below its own policy rate (it lent some): classes above
   theirs, least privileged first, whatever their state: a policy share is
   lent, never given away;
3. classes that have slack (``donor_margin``) or no objective, least
   privileged first, each at most one step of its own per window and never
   below its range (nor, for a class above its policy rate, below that rate
   in the same window); classes in blackout or missing do not give.

A class that lent rate gets it back (:func:`recover`) as the link frees up,
multiplicatively like a decay; :func:`restore_budget` takes back from classes
above their policy rate when an expiry made the sum pass the link.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mmmesh.policy import format_rate

from ._law import Law, Verdict, decayed
from ._params import ClassSpec
from ._state import Subject


@dataclass
class Ledger:
    """The classes' rate state during one step, and what moved."""

    link: int
    specs: Mapping[str, ClassSpec]
    subjects: Mapping[str, Subject]
    window: int
    law: Law
    given: dict[str, int] = field(default_factory=dict)
    """Rate each donor gave this step (at most one step of its own)."""
    moves: list[tuple[str, str, int, str]] = field(default_factory=list)
    """(from class, why it gave, bit/s, to class) this step."""
    start: dict[str, int] = field(default_factory=dict)
    """Every class's rate when the step began."""

    def __post_init__(self) -> None:
        self.start = {n: s.values["rate"] for n, s in self.subjects.items()}

    def headroom(self) -> int:
        return self.link - sum(s.values["rate"] for s in self.subjects.values())

    def by_rank(self, reverse: bool = False) -> list[str]:
        return sorted(self.specs, key=lambda n: self.specs[n].rank, reverse=reverse)

    def excess(self, name: str) -> int:
        return self.subjects[name].values["rate"] - self.specs[name].policy.rate

    def _move(self, src: str, why: str, amount: int, dst: str) -> None:
        self.subjects[src].values["rate"] -= amount
        self.moves.append((src, why, amount, dst))


def donor_slack(spec: ClassSpec, subj: Subject, law: Law) -> float | None:
    """The slack that lets a class give (inf without an objective); None: it may not."""
    if spec.objective is None:
        return float("inf")
    j = subj.judgement
    if j is None or j.slack is None or j.verdict not in (Verdict.OK, Verdict.COMFORT):
        return None
    return j.slack if j.slack >= law.donor_margin else None


def fund(led: Ledger, name: str, want: int) -> tuple[int, list[str]]:
    """Pays up to ``want`` bit/s of rate for ``name``; returns what it got and
    where it came from ('+0.6mbit from video (slack 0.40)')."""
    got, parts = 0, []
    take = max(0, min(want, led.headroom()))
    if take:
        got += take
        parts.append(f"+{format_rate(take)} from the unreserved link")
    owed = led.specs[name].policy.rate - led.subjects[name].values["rate"] - got
    for r in led.by_rank(reverse=True):
        if got >= want or owed <= 0:
            break
        t = min(want - got, owed, led.excess(r)) if r != name else 0
        if t > 0:
            led._move(r, f"returned to {name} (its policy share)", t, name)
            got, owed = got + t, owed - t
            parts.append(f"+{format_rate(t)} back from {r} (lent)")
    for d in led.by_rank(reverse=True):
        if got >= want:
            break
        spec, subj = led.specs[d], led.subjects[d]
        slack = donor_slack(spec, subj, led.law)
        if d == name or slack is None or subj.held(led.window) or subj.miss:
            continue
        # a donor above its policy rate gives down to it, and below it a window later
        # (a step toward the policy never passes it)
        lo = spec.ranges["rate"][0]
        floor = spec.policy.rate if led.start.get(d, 0) > spec.policy.rate else lo
        room = min(spec.steps["rate"] - led.given.get(d, 0), subj.values["rate"] - floor)
        t = min(want - got, room)
        if t > 0:
            why = "no objective" if spec.objective is None else f"slack {slack:.2f}"
            led._move(d, f"gave to {name} ({why})", t, name)
            led.given[d] = led.given.get(d, 0) + t
            got += t
            parts.append(f"+{format_rate(t)} from {d} ({why})")
    led.subjects[name].values["rate"] += got
    return got, parts


def recover(led: Ledger, name: str) -> int:
    """A class below its policy rate takes back what the link has free
    (a multiplicative step of its deficit, all of it below one step)."""
    spec, subj = led.specs[name], led.subjects[name]
    deficit = spec.policy.rate - subj.values["rate"]
    if deficit <= 0:
        return 0
    t = min(deficit - decayed(deficit, spec.steps["rate"], led.law), led.headroom())
    if t > 0:
        subj.values["rate"] += t
    return max(0, t)


def restore_budget(led: Ledger, cause: str) -> None:
    """If the rates sum past the link, classes above their policy rate give
    back, least privileged first, until they fit (whatever their blackout)."""
    for r in led.by_rank(reverse=True):
        over = -led.headroom()
        if over <= 0:
            return
        t = min(over, led.excess(r))
        if t > 0:
            led._move(r, f"returned: {cause}", t, "")
