"""A node's own windows: the board's rows (``SlaBoard.view()``) read as
:class:`~qosd.mesh.slaview.core._codec.Window` values, the one reading the
per-node view (:class:`SlaView`) and the aggregation trees (:class:`SlaTree`)
share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmmesh.sla import MAX_COUNT, MAX_NAME, NO_KEY, parse_sketch, value_key, within_deadline

from ._codec import MAX_AGE_MS, MAX_STAGE, MAX_WINDOW_MS, MAX_WINDOWS, Key, Window
from ._merge import collapse, sketch_keys

__all__ = ["board_windows", "window_of"]


def window_of(row: Mapping[str, Any], node_wide: bool, wall: float, max_bins: int) -> Window:
    """One board row (``SlaMerged``) as a window; raises what makes it unreadable."""
    stage = None if node_wide else str(row["stage"])
    cls, mod = str(row["sla_class"]), str(row["modality"])
    if not (0 < len(cls) <= MAX_NAME and 0 < len(mod) <= MAX_NAME) or (
            stage is not None and not 0 < len(stage) <= MAX_STAGE):
        raise ValueError("name out of bounds")
    frames, late = int(row["frames"]), int(row["deadline_misses"])
    if not 0 <= late <= frames or frames > MAX_COUNT:
        raise ValueError("counts out of bounds")
    # carried: the frames not within their deadline (late or dropped), what
    # the row's attainment is made of (mmmesh.sla's one definition)
    misses = frames - round(within_deadline(frames, row.get("attainment"), late))
    window_ms = min(MAX_WINDOW_MS, max(0, round(float(row.get("window_s") or 0) * 1000)))
    age_ms = min(MAX_AGE_MS, max(0, round((wall - float(row["received_at"])) * 1000)))
    sketch = parse_sketch(row["sketch_e2e"]) if row.get("sketch_e2e") else None
    if sketch is not None and sketch.count > 0:
        sketch = collapse(sketch, max_bins)
        quantiles = sketch_keys(sketch)
    else:
        sketch = None
        e2e = row.get("e2e_ms") or {}
        quantiles = (value_key(e2e.get("p50")), value_key(e2e.get("p99")), NO_KEY)
        if quantiles[0] > quantiles[1] and quantiles[1] != NO_KEY:
            quantiles = (NO_KEY, NO_KEY, NO_KEY)
    return Window(stage, cls, mod, frames, misses, window_ms, age_ms, quantiles, sketch)


def row_order(row: Any) -> tuple[str, str, str]:
    """Board rows in a fixed order (whatever the board's order was)."""
    if not isinstance(row, Mapping):
        return ("", "", "")
    return (str(row.get("stage") or ""), str(row.get("sla_class") or ""),
            str(row.get("modality") or ""))


def board_windows(board_view: Mapping[str, Any], wall: float, max_bins: int
                  ) -> tuple[dict[Key, Window], int]:
    """The board's ``classes`` (node-wide) and ``stages`` rows as windows (at
    most ``MAX_WINDOWS``, in a fixed order), and how many rows could not be read."""
    windows: dict[Key, Window] = {}
    skipped = 0
    for node_wide, rows in ((True, board_view.get("classes")),
                            (False, board_view.get("stages"))):
        for row in sorted(rows or (), key=row_order):
            try:
                w = window_of(row, node_wide, wall, max_bins)
            except (ValueError, KeyError, TypeError, AttributeError):
                skipped += 1
                continue
            if w.key not in windows and len(windows) < MAX_WINDOWS:
                windows[w.key] = w
    return windows, skipped
