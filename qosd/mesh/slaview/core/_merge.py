"""How the global SLA view merges nodes: one row per (class, modality) or
(stage, class, modality) from every node's latest window of it.

* Counts add up: ``frames``, ``deadline_misses``; ``attainment`` is
  ``1 - misses / frames`` of the sums (1.0 without frames).
* Quantiles come from one DDSketch: the sum, bin by bin, of the sketches of
  the nodes that have one fresh enough (never an average of percentiles).
  ``sketch_nodes`` of ``nodes`` had one; when some did not, the row is
  ``partial`` and ``p99_range_ms`` is the smallest and largest p99 of the
  parts (the merged sketch, and each other node's own p99 from its digest):
  the p99 of all of them together lies in that range.
* Stale windows are listed in the breakdown (``stale: true``), not merged.

Rows and their breakdown are sorted, and sums run in node order, so two
nodes holding the same windows produce the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmmesh.sla.sketch import MAX_ABS_KEY, Sketch, new_sketch
from qosd.mesh.slaview.core._codec import NO_KEY, ZERO_KEY

QUANTILES = (0.5, 0.99, 0.999)
_SPAN = 2 * MAX_ABS_KEY + 1
_MAPPING = new_sketch()._mapping


def key_value(key: int) -> float | None:
    """The latency (ms) a quantile key stands for, as ddsketch reports it."""
    if key == NO_KEY:
        return None
    if key == ZERO_KEY:
        return 0.0
    return round(float(_MAPPING.value(key)), 4)


def value_key(ms: float | None) -> int:
    """The key of a latency given as a number (a window without a sketch)."""
    if ms is None or not math.isfinite(ms) or ms < 0:
        return NO_KEY
    if ms <= _MAPPING.min_possible:
        return ZERO_KEY
    return max(-MAX_ABS_KEY, min(MAX_ABS_KEY, int(_MAPPING.key(ms))))


def quantile_keys(offset: int, counts: Sequence[float] | Any, zero: float,
                  ) -> tuple[int, int, int]:
    """p50, p99, p999 of a sketch as keys, by ddsketch's rule (rank
    ``q x (count - 1)``, the first bin whose running count exceeds it).
    ``counts`` (a sequence or numpy array) are the bins from key ``offset``."""
    import numpy as np  # only where sketches are merged

    arr = np.asarray(counts, dtype=np.float64)
    total = zero + float(arr.sum())
    if total <= 0:
        return (NO_KEY, NO_KEY, NO_KEY)
    cum = np.cumsum(arr)
    out: list[int] = []
    for q in QUANTILES:
        rank = q * (total - 1)
        if rank < zero or not len(arr):
            out.append(ZERO_KEY)
            continue
        i = int(np.searchsorted(cum, rank - zero, side="right"))
        out.append(offset + min(i, len(arr) - 1))
    return (out[0], out[1], out[2])


def sketch_keys(sk: Sketch) -> tuple[int, int, int]:
    return quantile_keys(sk.offset, sk.counts(), sk.zero)


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
    window_s: float
    age_s: float
    stale: bool
    quantiles: tuple[int, int, int]
    """From the node's digest (its latest publication)."""
    sketch: Sketch | None
    """Its freshest usable sketch of this row, or None."""
    sketch_quantiles: tuple[int, int, int]
    sketch_age_s: float | None


def _attainment(frames: int, misses: int) -> float:
    return round(1.0 - misses / frames, 6) if frames else 1.0


def _ms(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def _breakdown(w: NodeWindow) -> dict[str, Any]:
    source = "sketch" if w.sketch is not None else "digest" if w.quantiles[1] != NO_KEY else None
    q = w.sketch_quantiles if w.sketch is not None else w.quantiles
    return {
        "node": w.node, "seq": w.seq, "frames": w.frames, "deadline_misses": w.misses,
        "attainment": _attainment(w.frames, w.misses), "p99_ms": key_value(q[1]),
        "quantiles": source, "window_s": w.window_s, "age_s": round(w.age_s, 3),
        "sketch_age_s": None if w.sketch_age_s is None else round(w.sketch_age_s, 3),
        "stale": w.stale,
    }


def merge_row(fields: Mapping[str, Any], windows: Iterable[NodeWindow],
              target_p99_ms: float | None, *, breakdown: bool) -> dict[str, Any]:
    """The row of ``fields`` (its class, modality, maybe stage) from every
    node's window of it (in node order)."""
    import numpy as np  # only where sketches are merged

    ws = list(windows)
    fresh = [w for w in ws if not w.stale]
    frames = sum(w.frames for w in fresh)
    misses = sum(w.misses for w in fresh)
    bins = None
    zero = 0.0
    sketched = [w for w in fresh if w.sketch is not None]
    for w in sketched:
        sk = w.sketch
        assert sk is not None
        if bins is None:
            bins = np.zeros(_SPAN)
        start = sk.offset + MAX_ABS_KEY
        counts = np.frombuffer(sk.bins, dtype=np.float64)
        bins[start:start + len(counts)] += counts
        zero += sk.zero
    keys = (NO_KEY, NO_KEY, NO_KEY) if bins is None else quantile_keys(-MAX_ABS_KEY, bins, zero)
    p50, p99, p999 = (key_value(k) for k in keys)
    parts = [p99] if p99 is not None else []
    parts += [v for w in fresh if w.sketch is None
              for v in (key_value(w.quantiles[1]),) if v is not None]
    meets = None if target_p99_ms is None or p99 is None else p99 <= target_p99_ms
    row: dict[str, Any] = {
        **fields,
        "frames": frames, "deadline_misses": misses, "attainment": _attainment(frames, misses),
        "window_s": max((w.window_s for w in fresh), default=0.0),
        "p50_ms": p50, "p99_ms": p99, "p999_ms": p999,
        "p99_range_ms": [min(parts), max(parts)] if parts else None,
        "target_p99_ms": _ms(target_p99_ms), "meets_target": meets,
        "nodes": len(fresh), "sketch_nodes": len(sketched),
        "sketch_frames": round(zero + (0.0 if bins is None else float(bins.sum()))),
        "partial": len(sketched) < len(fresh), "stale_nodes": len(ws) - len(fresh),
    }
    if breakdown:
        row["breakdown"] = [_breakdown(w) for w in ws]
    return row
