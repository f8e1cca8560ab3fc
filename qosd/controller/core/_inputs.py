"""What the controller reads each window: one :class:`Measure` per class (and
per (class, stage)), plus the membership's health, as :class:`SlaInput`.

Two views feed it, through pure adapters that take their documented JSON
shapes (no import of either producer):

* :func:`from_board`: the node's own ``SlaBoard.view()`` (``GET /v1/sla``);
* :func:`from_cluster`: the global ``SlaView.snapshot()`` (``GET
  /v1/cluster/sla``).

Both give rows per (class, modality) and per (stage, class, modality); a class
may take several modalities, so the rows of one class are merged: frames
add up, attainment is frame-weighted, the p99 is the largest of the rows'
(an upper bound of the merged p99: above the largest, each row holds at most
1 % of its frames), nodes is the largest count, age the oldest row's.

Which window a measure is (``oldest_s``): the age of the oldest window merged
into it, every sender's and every node's (the board's ``instances``, the
global view's ``breakdown``), so that the controller knows when *every* part
of a class has a new window, not only the quickest, and never counts one
window twice (docs/controller.md, "The loop's delay").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

StageKey = tuple[str, str]  # (class, stage)


@dataclass(frozen=True, slots=True)
class Measure:
    """One window of one class (or one stage of a class), as a view saw it."""

    frames: int
    attainment: float | None
    """Share of frames within their deadline (None: not measured)."""
    p99_ms: float | None
    """End-to-end p99, ms (None: not measured)."""
    nodes: int = 1
    """Nodes whose fresh window is merged in (1 for the node's own board)."""
    age_s: float = 0.0
    """How old the data is (the oldest row merged), seconds."""
    window_s: float = 5.0
    """The length of the window measured."""
    oldest_s: float | None = None
    """The age of the oldest window merged in, every sender's (None: ``age_s``)."""

    @property
    def oldest(self) -> float:
        """The age of the oldest window merged in."""
        return self.age_s if self.oldest_s is None else max(self.age_s, self.oldest_s)


@dataclass(frozen=True)
class SlaInput:
    """Everything one control step reads.  ``now`` is the caller's clock in
    seconds (unix time if the state is to survive a restart)."""

    now: float
    classes: Mapping[str, Measure]
    stages: Mapping[StageKey, Measure] = field(default_factory=dict)
    suspect_fraction: float = 0.0
    """Share of the cluster's members currently suspect (0 on a single node)."""
    source: str = "board"
    """Which view it came from ('board' or 'cluster'), for explain()."""


def _num(row: Mapping[str, Any], key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


Row = tuple[int, float | None, float | None, int, float, float, float | None]
"""(frames, attainment, p99, nodes, age, window, oldest) of one view row."""


def _merge(rows: list[Row]) -> Measure:
    """The rows of one key as one Measure."""
    frames = sum(r[0] for r in rows)
    att: float | None = None
    if frames and all(r[1] is not None for r in rows if r[0]):
        att = sum(r[0] * (r[1] or 0.0) for r in rows) / frames
    p99s = [r[2] for r in rows if r[0]]
    p99 = None if not p99s or any(p is None for p in p99s) else max(p or 0.0 for p in p99s)
    oldest = [r[6] for r in rows if r[6] is not None]
    return Measure(frames, att, p99, max(r[3] for r in rows), max(r[4] for r in rows),
                   max(r[5] for r in rows), max(oldest) if oldest else None)  # fmt: skip


def _collect(rows: Iterable[Any], keyed: Any, read: Any) -> dict[Any, Measure]:
    groups: dict[Any, list[Row]] = {}
    for row in rows or ():
        if not isinstance(row, Mapping):
            continue
        key = keyed(row)
        frames = _num(row, "frames")
        if key is None or frames is None or frames < 0:
            continue
        groups.setdefault(key, []).append((int(frames), *read(row)))
    return {k: _merge(v) for k, v in sorted(groups.items())}


def _class_key(row: Mapping[str, Any]) -> str | None:
    c = row.get("sla_class")
    return c if isinstance(c, str) and c else None


def _stage_key(row: Mapping[str, Any]) -> StageKey | None:
    c, s = row.get("sla_class"), row.get("stage")
    ok = isinstance(c, str) and c and isinstance(s, str) and s
    return (str(c), str(s)) if ok else None


def _oldest(rows: Iterable[Any], wall_now: float) -> dict[Any, float]:
    """Per (class, modality) and per (stage, class, modality), the age of the
    oldest fresh window among the board's ``instances`` (every sender's own)."""
    out: dict[Any, float] = {}
    for row in rows or ():
        if not isinstance(row, Mapping) or row.get("stale"):
            continue
        at = _num(row, "received_at")
        c, s, mod = row.get("sla_class"), row.get("stage"), row.get("modality")
        if at is None or not isinstance(c, str) or not isinstance(s, str):
            continue
        age = max(0.0, wall_now - at)
        for key in ((c, mod), (s, c, mod)):
            out[key] = max(out.get(key, 0.0), age)
    return out


def from_board(view: Mapping[str, Any], wall_now: float) -> SlaInput:
    """The node's own board (``SlaBoard.view()``): one node, age from
    ``received_at`` (unix seconds, as ``wall_now``), the oldest window's from
    its ``instances``."""
    oldest = _oldest(view.get("instances") or (), wall_now)

    def read(row: Mapping[str, Any]) -> tuple[float | None, float | None, int, float, float,
                                              float | None]:
        e2e = row.get("e2e_ms")
        p99 = _num(e2e, "p99") if isinstance(e2e, Mapping) else None
        age = max(0.0, wall_now - (_num(row, "received_at") or wall_now))
        key = ((row.get("sla_class"), row.get("modality")) if row.get("stage") is None else
               (row.get("stage"), row.get("sla_class"), row.get("modality")))
        return (_num(row, "attainment"), p99, 1, age, _num(row, "window_s") or 0.0,
                oldest.get(key))

    return SlaInput(now=wall_now, classes=_collect(view.get("classes") or (), _class_key, read),
                    stages=_collect(view.get("stages") or (), _stage_key, read),
                    suspect_fraction=0.0, source="board")  # fmt: skip


def from_cluster(snapshot: Mapping[str, Any], now: float, suspect_fraction: float) -> SlaInput:
    """The global view (``SlaView.snapshot()``): ``nodes`` fresh nodes per row,
    the age of a row its freshest node's, the oldest window its stalest fresh
    node's (from ``breakdown`` when present)."""

    def read(row: Mapping[str, Any]) -> tuple[float | None, float | None, int, float, float,
                                              float | None]:
        ages = [a for b in row.get("breakdown") or () if isinstance(b, Mapping)
                and not b.get("stale") for a in (_num(b, "age_s"),) if a is not None]
        return (_num(row, "attainment"), _num(row, "p99_ms"), int(_num(row, "nodes") or 0),
                min(ages, default=0.0), _num(row, "window_s") or 0.0,
                max(ages) if ages else None)  # fmt: skip

    return SlaInput(now=now, classes=_collect(snapshot.get("classes") or (), _class_key, read),
                    stages=_collect(snapshot.get("stages") or (), _stage_key, read),
                    suspect_fraction=suspect_fraction, source="cluster")  # fmt: skip
