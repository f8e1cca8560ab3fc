"""What the sidecars on this node last reported about their SLAs, and the
node-wide view merged from it.

Every sidecar POSTs one window per (stage, class, modality) every few seconds
(``sidecar/sla.py``).  The board keeps the latest window of each sidecar
*instance* (so two replicas of a stage do not overwrite each other) and
answers three views:

* ``instances``: one row per (stage, instance, class, modality), as reported;
* ``stages``: per (stage, class, modality), the replicas merged;
* ``classes``: per (class, modality), node-wide, every stage merged.

Merging (:func:`mmmesh.slasketch.merge`): counts add up, attainment is
frame-weighted, e2e quantiles come from the merged DDSketches (the real p99
of all the frames, not an average of p99s).  The node-wide class view mixes
the stages of a pipeline (a frame seen by three stages counts three times, its
e2e measured at each hop); it is the view meant for peers and dashboards, the
per-stage view is the one to act on.

Windows not refreshed for a few of their own lengths are *stale* (the sidecar
went away, or restarted under a new instance name): still listed, no longer
merged.  Bounded: windows older than ``keep_s`` are forgotten, and at most
``max_rows`` rows are kept (the report socket is open to every pod on the
node; the oldest rows go first).  Sketches are checked before they are
decoded (``mmmesh.slasketch.check_sketch``: a hostile 40-byte sketch could
otherwise allocate hundreds of MiB) and decoded once, when reported.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mmmesh.slareport import SlaReport
from mmmesh.slasketch import check_sketch, merge

__all__ = ["SlaBoard"]

RowKey = tuple[str, str, str, str]  # (stage, instance, sla_class, modality)


class SlaBoard:
    def __init__(self, keep_s: float = 300.0, max_rows: int = 4096,
                 stale_windows: float = 3.0, stale_min_s: float = 15.0) -> None:
        self.keep_s = keep_s
        self.max_rows = max_rows
        self.stale_windows = stale_windows
        self.stale_min_s = stale_min_s
        self._rows: dict[RowKey, dict[str, Any]] = {}
        self._sketches: dict[RowKey, Any] = {}  # decoded sketch_e2e per row (or None)
        self._lock = threading.Lock()
        self.evicted = 0  # rows dropped because the board was full
        self.bad_sketches = 0  # sketches refused (kept out of the merge)

    def report(self, body: SlaReport, now: float | None = None) -> int:
        """Takes one validated ``POST /v1/sla`` body (the model refuses bad
        sketches; they are checked again here, since decoding is where a
        hostile sketch would hurt); returns the number of entries taken."""
        now = time.time() if now is None else now
        instance = body.instance or ""
        reports = [r.model_dump() for r in body.reports]
        decoded = []
        for r in reports:  # outside the lock: ~1 ms per sketch
            sk = None
            if r.get("sketch_e2e"):
                try:
                    sk = check_sketch(r["sketch_e2e"])
                except ValueError:
                    self.bad_sketches += 1
            decoded.append(sk)
        with self._lock:
            for r, sk in zip(reports, decoded, strict=True):
                key = (body.stage, instance, r["sla_class"], r["modality"])
                self._rows.pop(key, None)  # re-insert: dict order = age
                self._rows[key] = {**r, "stage": body.stage, "instance": instance or None,
                                   "node": body.node, "received_at": now}
                self._sketches[key] = sk
            while len(self._rows) > self.max_rows:
                old = next(iter(self._rows))
                del self._rows[old]
                self._sketches.pop(old, None)
                self.evicted += 1
            return len(reports)

    def _live(self, now: float) -> list[dict[str, Any]]:
        """Rows younger than ``keep_s`` (older ones are forgotten), sorted,
        each with its decoded sketch under ``_sketch`` and ``stale``."""
        with self._lock:
            for k in [k for k, v in self._rows.items() if now - v["received_at"] > self.keep_s]:
                del self._rows[k]
                self._sketches.pop(k, None)
            rows = [{**self._rows[k], "_sketch": self._sketches.get(k)} for k in sorted(self._rows)]
        for r in rows:
            r["stale"] = self._stale(r, now)
        return rows

    def _stale(self, row: dict[str, Any], now: float) -> bool:
        """A window older than a few of its own lengths: that sidecar stopped
        reporting (it went away or restarted under a new instance name)."""
        limit = max(self.stale_windows * float(row.get("window_s") or 0.0), self.stale_min_s)
        return now - float(row["received_at"]) > limit

    def instances(self, now: float | None = None) -> list[dict[str, Any]]:
        """The latest window of every sidecar instance, sorted, each with
        ``stale`` (see :meth:`view`)."""
        return self.view(now)["instances"]

    def view(self, now: float | None = None) -> dict[str, list[dict[str, Any]]]:
        """{"instances": [...], "stages": [...], "classes": [...]} (see the
        module doc).  Stale windows (not refreshed for ``stale_windows`` of
        their own length, at least ``stale_min_s``) are listed under
        instances but left out of the merged views.  Merged rows carry
        ``sources`` (how many windows were merged) and ``received_at`` (the
        newest of them)."""
        live = self._live(time.time() if now is None else now)
        fresh = [r for r in live if not r["stale"]]
        return {"instances": [{k: v for k, v in r.items() if k != "_sketch"} for r in live],
                "stages": _merged(fresh, ("stage", "sla_class", "modality")),
                "classes": _merged(fresh, ("sla_class", "modality"))}


def _merged(rows: list[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    newest: dict[tuple[Any, ...], float] = {}
    for r in rows:
        k = tuple(r.get(f) for f in by)
        newest[k] = max(newest.get(k, 0.0), float(r["received_at"]))
    out = merge(rows, by=by)["groups"]
    for g in out:
        g["received_at"] = newest[tuple(g.get(f) for f in by)]
    return out
