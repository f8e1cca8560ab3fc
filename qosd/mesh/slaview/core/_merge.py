"""How the global SLA view merges nodes: one row per (class, modality) or
(stage, class, modality) from every node's latest window of it.

The rules are ``mmmesh.sla``'s, the same the board applies to its sidecars:

* Counts add up: ``frames``, ``deadline_misses``.  A node's ``misses`` are
  its frames *not* within their deadline (late or dropped: ``frames -
  within_deadline`` of its board row, to the nearest frame), so ``attainment``
  is ``mmmesh.sla.attainment`` of the sums, ``1 - misses / frames``: the
  frames within their deadline over the frames, every node's attainment
  weighted by its frames (1.0 without frames).
* Quantiles come from one DDSketch: the sum, bin by bin
  (``mmmesh.sla.SketchSum``), of the sketches of the nodes that have one
  fresh enough (never an average of percentiles), by the one quantile rule
  (``mmmesh.sla.quantile_keys``).  ``sketch_nodes`` of ``nodes`` had one;
  when some did not, the row is ``partial`` and ``p99_range_ms`` is the
  smallest and largest p99 of the parts (the merged sketch, and each other
  node's own p99 from its digest): the p99 of all of them together lies in
  that range.
* Stale windows are listed in the breakdown (``stale: true``), not merged.

Rows and their breakdown are sorted, and sums run in node order, so two
nodes holding the same windows produce the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mmmesh.sla import NO_KEY, Sketch, SketchSum, attainment, key_value

QUANTILES = (0.5, 0.99, 0.999)
"""The quantiles a window carries (p50, p99, p999), as keys."""


def sketch_keys(sk: Sketch) -> tuple[int, int, int]:
    p50, p99, p999 = sk.quantile_keys(QUANTILES)
    return (p50, p99, p999)


def collapse(sk: Sketch, max_bins: int) -> Sketch:
    """At most ``max_bins`` bins: the lowest ones folded into the lowest bin
    kept (DDSketch's collapsing-lowest store: high quantiles stay exact)."""
    counts = sk.counts()
    cut = len(counts) - max_bins
    if cut <= 0:
        return sk
    kept = counts[cut:]
    kept[0] += math.fsum(counts[:cut])
    return Sketch.of_counts(sk.offset + cut, kept, sk.zero)


@dataclass(frozen=True, slots=True)
class NodeWindow:
    """One node's window of one row, as the merge sees it."""

    node: str
    seq: int
    frames: int
    misses: int
    """Frames not within their deadline (late or dropped)."""
    window_s: float
    age_s: float
    stale: bool
    quantiles: tuple[int, int, int]
    """From the node's digest (its latest publication)."""
    sketch: Sketch | None
    """Its freshest usable sketch of this row, or None."""
    sketch_quantiles: tuple[int, int, int]
    sketch_age_s: float | None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def _breakdown(w: NodeWindow) -> dict[str, Any]:
    source = "sketch" if w.sketch is not None else "digest" if w.quantiles[1] != NO_KEY else None
    q = w.sketch_quantiles if w.sketch is not None else w.quantiles
    return {
        "node": w.node, "seq": w.seq, "frames": w.frames, "deadline_misses": w.misses,
        "attainment": attainment(w.frames, w.frames - w.misses), "p99_ms": key_value(q[1]),
        "quantiles": source, "window_s": w.window_s, "age_s": round(w.age_s, 3),
        "sketch_age_s": None if w.sketch_age_s is None else round(w.sketch_age_s, 3),
        "stale": w.stale,
    }


def merge_row(fields: Mapping[str, Any], windows: Iterable[NodeWindow],
              target_p99_ms: float | None, *, breakdown: bool) -> dict[str, Any]:
    """The row of ``fields`` (its class, modality, maybe stage) from every
    node's window of it (in node order)."""
    ws = list(windows)
    fresh = [w for w in ws if not w.stale]
    frames = sum(w.frames for w in fresh)
    misses = sum(w.misses for w in fresh)
    total = SketchSum()
    sketched = [w for w in fresh if w.sketch is not None]
    for w in sketched:
        assert w.sketch is not None
        total.add(w.sketch)
    p50, p99, p999 = (key_value(k) for k in total.quantile_keys(QUANTILES))
    parts = [p99] if p99 is not None else []
    parts += [v for w in fresh if w.sketch is None
              for v in (key_value(w.quantiles[1]),) if v is not None]
    meets = None if target_p99_ms is None or p99 is None else p99 <= target_p99_ms
    row: dict[str, Any] = {
        **fields,
        "frames": frames, "deadline_misses": misses,
        "attainment": attainment(frames, frames - misses),
        "window_s": max((w.window_s for w in fresh), default=0.0),
        "p50_ms": p50, "p99_ms": p99, "p999_ms": p999,
        "p99_range_ms": [min(parts), max(parts)] if parts else None,
        "target_p99_ms": _ms(target_p99_ms), "meets_target": meets,
        "nodes": len(fresh), "sketch_nodes": len(sketched),
        "sketch_frames": round(total.count),
        "partial": len(sketched) < len(fresh), "stale_nodes": len(ws) - len(fresh),
    }
    if breakdown:
        row["breakdown"] = [_breakdown(w) for w in ws]
    return row
