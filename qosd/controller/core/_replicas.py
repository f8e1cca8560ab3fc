"""Per-replica weights for the socket layer's weighted split (docs/socklayer.md,
"Redirect"): a replica whose SLA windows miss gets a smaller share of its
stage's frames, within bounds; sans-I/O like the rest of the controller.

The class controller (``_core``) moves a class's (and a stage's) HTB
parameters; this one only shares a stage's frames out among its replicas on
one node, so it never adds capacity, it moves load from a replica that
misses to one that keeps its objective.  The caller judges each replica by
its own reports (the board's ``instances`` rows, tied to their sender by
qosd), feeds one :meth:`ReplicaWeights.step` a window and writes
:meth:`ReplicaWeights.weights` with ``SocketLayer.set_weights``.

The law (:class:`ReplicaLaw`; verdicts and windows as ``Law``'s):

=============  ===================================================================
equal          every replica starts at ``equal``; a stage with no usable data
               stays (or goes back) there
decrease       a replica that missed ``Law.miss_windows`` windows in a row, out of
               blackout, while another replica of its stage with data does not
               miss: weight x ``cut`` (rounded down), never below ``floor`` (it
               keeps some frames, so that it can show it recovered); if every
               replica with data misses, nothing moves (there is nowhere better
               to send frames: the class controller's job)
regain         a reduced replica comfortable (slack >= ``Law.comfort_margin``) for
               ``comfort_windows`` in a row, out of blackout: + ``regain``, never
               above ``equal``
blackout       ``Law.blackout_windows`` windows after a change of a replica
expiry         ``Law.expire_windows`` windows without usable data: back to
               ``equal`` at once
=============  ===================================================================

Weights are relative (the kernel's smooth weighted round robin gives a
replica ``w / sum(w)`` of the frames), so ``floor / equal`` is the least
share, relative to an equal one, that a replica can be cut to.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from mmmesh.policy import Objective
from mmmesh.sla import check_positive, decode_sketch, summary

from ._inputs import Measure, Row, _merge, _num
from ._law import Judgement, Law, Verdict, judge

ReplicaKey = tuple[str, int]  # (stage name, replica index)


@dataclass(frozen=True)
class ReplicaLaw:
    """The constants of the replica law (see the module doc)."""

    equal: int = 100
    """Every replica's weight while nothing is known (the socket layer's 0..65535)."""
    floor: int = 25
    """The least weight a replica is cut to: a quarter of an equal share."""
    cut: float = 0.5
    """One decrease keeps this share of the weight."""
    regain: int = 25
    """One step back toward ``equal``."""
    comfort_windows: int = 2
    """Comfortable windows in a row before a step back."""

    def __post_init__(self) -> None:
        check_positive(self, "replica_law")
        if not self.cut < 1:
            raise ValueError("replica_law.cut must be < 1")
        if not 1 <= self.floor <= self.equal <= 65535:
            raise ValueError("replica_law: need 1 <= floor <= equal <= 65535")

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    window: int
    at: float
    before: int
    after: int
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"window": self.window, "at": self.at, "change": f"{self.before} -> {self.after}",
                "why": self.why}


@dataclass
class _Replica:
    weight: int
    last_data: int
    miss: int = 0
    comfort: int = 0
    held_until: int = -1
    judgement: Judgement | None = None
    note: str = ""
    history: deque[ReplicaRecord] = field(default_factory=lambda: deque(maxlen=8))

    def held(self, w: int) -> bool:
        return w <= self.held_until


def judge_replica(by_class: Mapping[str, Measure], objectives: Mapping[str, Objective | None],
                  law: Law) -> Judgement:
    """One replica's window over the classes it reported: a miss if any class
    with an objective misses; comfortable if every judged class is; no data
    if none could be judged."""
    judged: list[tuple[str, Judgement]] = []
    nodata: list[str] = []
    for cls in sorted(by_class):
        obj = objectives.get(cls)
        if obj is None:
            continue
        j = judge(obj, by_class[cls], law)
        if j.verdict is Verdict.NODATA:
            nodata.append(f"{cls}: {j.why}")
        else:
            judged.append((cls, j))
    misses = [(c, j) for c, j in judged if j.verdict is Verdict.MISS]
    if misses:
        return Judgement(Verdict.MISS, min(j.slack or 0.0 for _, j in misses),
                         "; ".join(f"{c}: {j.why}" for c, j in misses))
    if not judged:
        return Judgement(Verdict.NODATA, None, "; ".join(nodata) or "no fresh SLA data")
    comfort = all(j.verdict is Verdict.COMFORT for _, j in judged)
    return Judgement(Verdict.COMFORT if comfort else Verdict.OK,
                     min(j.slack or 0.0 for _, j in judged),
                     "; ".join(f"{c}: {j.why}" for c, j in judged))


class ReplicaWeights:
    """The weights of each stage's replicas on one node (see the module doc).
    ``stages``: stage name -> its replica indexes.  Not thread-safe."""

    def __init__(self, stages: Mapping[str, Iterable[int]], law: Law | None = None,
                 rlaw: ReplicaLaw | None = None) -> None:
        self.law = law or Law()
        self.rlaw = rlaw or ReplicaLaw()
        self.replicas: dict[ReplicaKey, _Replica] = {
            (s, int(r)): _Replica(self.rlaw.equal, last_data=0)
            for s, rs in sorted(stages.items()) for r in sorted(set(rs))}  # fmt: skip
        self.epoch: float | None = None
        self.window = -1

    def weights(self) -> dict[str, dict[int, int]]:
        """``{stage: {replica: weight}}`` for every configured replica."""
        out: dict[str, dict[int, int]] = {}
        for (s, r), rep in sorted(self.replicas.items()):
            out.setdefault(s, {})[r] = rep.weight
        return out

    def step(self, now: float, measures: Mapping[ReplicaKey, Mapping[str, Measure]],
             objectives: Mapping[str, Objective | None]) -> list[str]:
        """One window (a call within the same window does nothing); returns
        the replicas changed, as ``stage/replica``."""
        law, rl = self.law, self.rlaw
        if self.epoch is None:
            self.epoch = now
        w = math.floor((now - self.epoch) / law.period_s)
        if w <= self.window:
            return []
        self.window = w
        for key, rep in self.replicas.items():
            j = judge_replica(measures.get(key, {}), objectives, law)
            rep.judgement = j
            rep.note = ""
            if j.verdict is not Verdict.NODATA:
                rep.last_data = w
            if rep.held(w):
                continue
            rep.miss = rep.miss + 1 if j.verdict is Verdict.MISS else 0
            rep.comfort = rep.comfort + 1 if j.verdict is Verdict.COMFORT else 0
        changed: list[str] = []
        for key, rep in self.replicas.items():
            before, why = rep.weight, ""
            if w - rep.last_data >= law.expire_windows:
                rep.miss = rep.comfort = 0
                if rep.weight != rl.equal:
                    rep.weight, why = rl.equal, (f"expired: no usable SLA data for "
                                                 f"{w - rep.last_data} windows")
            elif rep.held(w):
                rep.note = "blackout after a change"
            elif rep.miss >= law.miss_windows:
                why = self._decrease(key, rep)
            elif rep.comfort >= rl.comfort_windows and rep.weight < rl.equal:
                rep.weight = min(rl.equal, rep.weight + rl.regain)
                why = f"comfortable {rep.comfort} windows"
                rep.comfort = 0
            if rep.weight != before:
                rep.history.append(ReplicaRecord(
                    w, now, before, rep.weight,
                    why + (f" ({rep.judgement.why})" if rep.judgement else "")))
                rep.held_until = w + law.blackout_windows
                changed.append(f"{key[0]}/{key[1]}")
        return changed

    def _decrease(self, key: ReplicaKey, rep: _Replica) -> str:
        rl = self.rlaw
        healthy = [r for (s, r), o in self.replicas.items() if s == key[0] and r != key[1]
                   and o.judgement is not None
                   and o.judgement.verdict in (Verdict.OK, Verdict.COMFORT)]
        if not healthy:
            rep.note = "missing, as every other replica with data: nothing to shift to"
            return ""
        if rep.weight <= rl.floor:
            rep.note = "missing, at the floor"
            return ""
        rep.weight = max(rl.floor, math.floor(rep.weight * rl.cut))
        missed = rep.miss
        rep.miss = 0
        return (f"missed {missed} windows while replica(s) "
                f"{', '.join(map(str, healthy))} did not")

    def explain(self) -> dict[str, list[dict[str, Any]]]:
        """Per stage, per replica: weight, its share, the last verdict, the
        state and the last changes."""
        out: dict[str, list[dict[str, Any]]] = {}
        total: dict[str, int] = {}
        for (s, _), rep in self.replicas.items():
            total[s] = total.get(s, 0) + rep.weight
        for (s, r), rep in sorted(self.replicas.items()):
            j = rep.judgement
            out.setdefault(s, []).append({
                "replica": r, "weight": rep.weight,
                "share": round(rep.weight / total[s], 3) if total[s] else 0.0,
                "verdict": j.verdict.value if j else None, "why": j.why if j else "",
                "note": rep.note, "history": [h.as_dict() for h in rep.history]})
        return out


def replica_measures(rows: Iterable[Any], who: Mapping[tuple[str, str], int],
                     wall_now: float) -> dict[ReplicaKey, dict[str, Measure]]:
    """The board's ``instances`` rows (``SlaBoard.view()["instances"]``) as
    measures per (stage, replica) and class.  ``who`` maps (stage, instance)
    to a replica: the row's ``instance`` is the identity qosd tied the report
    to (a sender key, or the label only root and the admin socket may name),
    so a row of any other sender matches nothing.  Stale rows are left out;
    modalities of one class are merged; the p99 is the row's ``e2e_ms`` or its
    sketch's."""
    groups: dict[tuple[ReplicaKey, str], list[Row]] = {}
    for row in rows or ():
        if not isinstance(row, Mapping) or row.get("stale"):
            continue
        stage, inst, cls = row.get("stage"), row.get("instance"), row.get("sla_class")
        if not (isinstance(stage, str) and isinstance(inst, str) and isinstance(cls, str)):
            continue
        replica = who.get((stage, inst))
        frames = _num(row, "frames")
        if replica is None or frames is None or frames < 0:
            continue
        age = max(0.0, wall_now - (_num(row, "received_at") or wall_now))
        groups.setdefault(((stage, replica), cls), []).append(
            (int(frames), _num(row, "attainment"), _p99(row), 1, age,
             _num(row, "window_s") or 0.0, None))
    out: dict[ReplicaKey, dict[str, Measure]] = {}
    for (key, cls), rs in sorted(groups.items()):
        out.setdefault(key, {})[cls] = _merge(rs)
    return out


def _p99(row: Mapping[str, Any]) -> float | None:
    """A row's p99 (ms): its ``e2e_ms`` when given, else from its sketch (the
    board lists a sender's windows with the sketch only)."""
    e2e = row.get("e2e_ms")
    if isinstance(e2e, Mapping):
        return _num(e2e, "p99")
    sk = row.get("sketch_e2e")
    if not isinstance(sk, str) or not sk:
        return None
    try:
        s = summary(decode_sketch(sk))
    except Exception:  # noqa: BLE001 - an unreadable sketch is an unmeasured p99
        return None
    return None if s is None else _num(s, "p99")


def weight_list(by_replica: Mapping[int, int], replicas: Sequence[int]) -> list[int]:
    """``{replica: weight}`` as the socket layer's list by replica index (0 for
    replicas not given)."""
    n = max(replicas, default=-1) + 1
    return [int(by_replica.get(r, 0)) for r in range(n)]
