"""What the aggregation trees carry and how it adds up: one *part* per
(stage, class, modality) row, summed bin by bin and count by count.

A part is the sum over some set of members of their latest window of one
row (``mmmesh.sla``'s rules, the same as the board's and the per-node
view's, ``_merge.py``):

* ``frames`` and ``misses`` (frames not within their deadline) add up, so
  the attainment of a sum is ``1 - misses / frames``: every member's
  attainment weighted by its frames;
* ``sketch``: the bin-by-bin sum (``SketchSum``) of the sketches of the
  members that sent one, so a quantile of the sum is the quantile of the
  union of their samples (DDSketch merges exactly; never an average of
  percentiles); ``sketched`` members of ``nodes`` had one, and
  ``lo``/``hi`` bound the p99s of those without (their digests' own p99):
  the p99 of all of them lies within [min(lo, p99), max(hi, p99)];
* ``nodes`` members with a fresh window, ``stale`` members whose window is
  stale (counted, not merged);
* ``newest``/``oldest``: the end of the newest and the oldest window merged
  (the host's clock), which is what the view's age is made of.

The sum is associative and commutative, so a tree may add the parts up in
any grouping and order and the root gets the same sums as one member
adding every window (the quantile keys are exactly equal; tested).  A
*record* is what the root publishes of a sum: the counts and the quantile
keys (p50, p99, p999) of its sketch, without the sketch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mmmesh.sla import NO_KEY, Sketch, SketchSum, attainment, key_value

from ._codec import Key, Window

__all__ = ["Census", "Part", "RecordRow", "add_parts", "leaf_part", "record_row",
           "sketch_total", "snapshot_row"]

QUANTILES = (0.5, 0.99, 0.999)


@dataclass(frozen=True, slots=True)
class Part:
    """One row summed over some members (see the module doc)."""

    key: Key
    frames: int = 0
    misses: int = 0
    nodes: int = 0
    stale: int = 0
    sketched: int = 0
    sketch: Sketch | None = None
    lo: int = NO_KEY
    """Lowest p99 key of the members without a sketch (NO_KEY: none)."""
    hi: int = NO_KEY
    window_ms: int = 0
    newest: float = -math.inf
    """End of the newest window merged (the holder's clock; -inf: none)."""
    oldest: float = math.inf
    total: int = 0
    """Values in ``sketch`` (the frames its quantiles are over)."""

    def aged(self, offset: float) -> Part:
        """The same sums with ``newest``/``oldest`` moved by ``offset`` seconds
        (a receiver's clock)."""
        return Part(self.key, self.frames, self.misses, self.nodes, self.stale, self.sketched,
                    self.sketch, self.lo, self.hi, self.window_ms, self.newest + offset,
                    self.oldest + offset, self.total)


@functools.lru_cache(maxsize=8192)
def sketch_total(sk: Sketch) -> int:
    """The values a sketch holds, as a whole number (a leaf's is asked every round)."""
    return round(sk.count)


def _lo(a: int, b: int) -> int:
    return b if a == NO_KEY else a if b == NO_KEY else min(a, b)


def _hi(a: int, b: int) -> int:
    return b if a == NO_KEY else a if b == NO_KEY else max(a, b)


def leaf_part(w: Window, end: float, now: float, stale_s: float) -> Part:
    """A member's own window as a part: it ended at ``end`` (the host's clock);
    one older than ``stale_s`` at ``now`` counts as stale: nothing of it is merged."""
    if now - end > stale_s:
        return Part(w.key, stale=1, window_ms=w.window_ms)
    sk = w.sketch if w.sketch is not None and sketch_total(w.sketch) > 0 else None
    p99 = NO_KEY if sk is not None else w.quantiles[1]
    return Part(w.key, w.frames, w.misses, 1, 0, 1 if sk is not None else 0, sk, p99, p99,
                w.window_ms, end, end, sketch_total(sk) if sk is not None else 0)


def add_parts(parts: Iterable[Part]) -> dict[Key, Part]:
    """The sums of ``parts`` by row (inputs in any order give the same counts;
    sketches are summed in the order given)."""
    acc: dict[Key, list[Any]] = {}
    sums: dict[Key, SketchSum] = {}
    for p in parts:
        a = acc.get(p.key)
        if a is None:
            acc[p.key] = [p.frames, p.misses, p.nodes, p.stale, p.sketched, p.lo, p.hi,
                          p.window_ms, p.newest, p.oldest, p.sketch, p.total]
            continue
        a[0] += p.frames
        a[1] += p.misses
        a[2] += p.nodes
        a[3] += p.stale
        a[4] += p.sketched
        a[5] = _lo(a[5], p.lo)
        a[6] = _hi(a[6], p.hi)
        a[7] = max(a[7], p.window_ms)
        a[8] = max(a[8], p.newest)
        a[9] = min(a[9], p.oldest)
        a[11] += p.total
        if p.sketch is not None:
            s = sums.get(p.key)
            if s is None:
                s = sums[p.key] = SketchSum()
                if a[10] is not None:
                    s.add(a[10])
            s.add(p.sketch)
    out: dict[Key, Part] = {}
    for k, a in acc.items():
        s = sums.get(k)
        out[k] = Part(k, a[0], a[1], a[2], a[3], a[4], s.sketch() if s is not None else a[10],
                      a[5], a[6], a[7], a[8], a[9], a[11])
    return out


@dataclass(frozen=True, slots=True)
class RecordRow:
    """One row of a published record: a part's counts and quantile keys."""

    key: Key
    frames: int
    misses: int
    nodes: int
    stale: int
    sketched: int
    sketch_frames: int
    quantiles: tuple[int, int, int]
    lo: int
    hi: int
    window_ms: int
    newest: float
    oldest: float

    def aged(self, offset: float) -> RecordRow:
        return RecordRow(self.key, self.frames, self.misses, self.nodes, self.stale,
                         self.sketched, self.sketch_frames, self.quantiles, self.lo, self.hi,
                         self.window_ms, self.newest + offset, self.oldest + offset)


def record_row(p: Part) -> RecordRow:
    """The record of a sum: its quantiles by the one quantile rule."""
    if p.sketch is not None:
        k = p.sketch.quantile_keys(QUANTILES)
        q = (k[0], k[1], k[2])
        frames = p.total
    else:
        q, frames = (NO_KEY, NO_KEY, NO_KEY), 0
    return RecordRow(p.key, p.frames, p.misses, p.nodes, p.stale, p.sketched, frames, q,
                     p.lo, p.hi, p.window_ms, p.newest, p.oldest)


@dataclass(frozen=True, slots=True)
class Census:
    """The census tree's sums: who contributed, who reports, the classes."""

    members: int = 0
    """Members whose contribution reached the root."""
    reporting: int = 0
    """Of them, with at least one fresh window."""
    sketched: int = 0
    """Of them, with at least one fresh sketch."""
    classes: tuple[str, ...] = ()
    """Every class any of them reports (sorted, at most MAX_CLASSES)."""

    def add(self, other: Census, max_classes: int) -> Census:
        classes = tuple(sorted(set(self.classes) | set(other.classes)))[:max_classes]
        return Census(self.members + other.members, self.reporting + other.reporting,
                      self.sketched + other.sketched, classes)


def _r(x: float | None, places: int = 3) -> float | None:
    return None if x is None else round(float(x), places)


def snapshot_row(r: RecordRow, now: float, target_p99_ms: float | None, *,
                 stale: bool) -> dict[str, Any]:
    """A record row as the view's JSON row (the fields of ``GET
    /v1/cluster/sla``; ``stale``: the record is too old to be used, so it
    counts as no fresh data: nothing merged, every node stale)."""
    fields: dict[str, Any] = {} if r.key[0] is None else {"stage": r.key[0]}
    fields.update(sla_class=r.key[1], modality=r.key[2])
    if stale:
        return {**fields, "frames": 0, "deadline_misses": 0, "attainment": 1.0,
                "window_s": r.window_ms / 1000, "p50_ms": None, "p99_ms": None,
                "p999_ms": None, "p99_range_ms": None,
                "target_p99_ms": _r(target_p99_ms, 4), "meets_target": None, "nodes": 0,
                "sketch_nodes": 0, "sketch_frames": 0, "partial": False,
                "stale_nodes": r.nodes + r.stale, "age_s": _r(now - r.newest),
                "oldest_age_s": _r(now - r.oldest), "stale": True}
    p50, p99, p999 = (key_value(k) for k in r.quantiles)
    parts = [v for v in (p99, key_value(r.lo), key_value(r.hi)) if v is not None]
    meets = None if target_p99_ms is None or p99 is None else p99 <= target_p99_ms
    return {
        **fields,
        "frames": r.frames, "deadline_misses": r.misses,
        "attainment": attainment(r.frames, r.frames - r.misses),
        "window_s": r.window_ms / 1000,
        "p50_ms": p50, "p99_ms": p99, "p999_ms": p999,
        "p99_range_ms": [min(parts), max(parts)] if parts else None,
        "target_p99_ms": _r(target_p99_ms, 4), "meets_target": meets,
        "nodes": r.nodes, "sketch_nodes": r.sketched, "sketch_frames": r.sketch_frames,
        "partial": r.sketched < r.nodes, "stale_nodes": r.stale,
        "age_s": None if r.nodes == 0 else _r(now - r.newest),
        "oldest_age_s": None if r.nodes == 0 else _r(now - r.oldest),
        "stale": False,
    }


def census_of(windows: Iterable[tuple[Window, float]], now: float, stale_s: float,
              max_classes: int) -> Census:
    """A member's own census entry from its windows and when they ended."""
    ws = list(windows)
    fresh = [w for w, end in ws if now - end <= stale_s]
    sketched = any(w.sketch is not None and sketch_total(w.sketch) > 0 for w in fresh)
    classes = tuple(sorted({w.sla_class for w, _ in ws}))[:max_classes]
    return Census(1, 1 if fresh else 0, 1 if sketched else 0, classes)
