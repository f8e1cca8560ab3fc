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

Bounded: windows older than ``keep_s`` are forgotten (the sidecar went away),
and at most ``max_rows`` rows are kept (the report socket is open to every
pod on the node; the oldest rows go first).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mmmesh.slasketch import merge

__all__ = ["SlaBoard"]

RowKey = tuple[str, str, str, str]  # (stage, instance, sla_class, modality)


class SlaBoard:
    def __init__(self, keep_s: float = 300.0, max_rows: int = 4096) -> None:
        self.keep_s = keep_s
        self.max_rows = max_rows
        self._rows: dict[RowKey, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.evicted = 0  # rows dropped because the board was full

    def report(self, body: dict[str, Any], now: float | None = None) -> int:
        """Takes one ``POST /v1/sla`` body (already validated); returns the
        number of entries taken."""
        now = time.time() if now is None else now
        stage = body["stage"]
        instance = body.get("instance") or ""
        with self._lock:
            for r in body["reports"]:
                key = (stage, instance, r["sla_class"], r["modality"])
                self._rows.pop(key, None)  # re-insert: dict order = age
                self._rows[key] = {**r, "stage": stage, "instance": instance or None,
                                   "node": body.get("node"), "received_at": now}
            while len(self._rows) > self.max_rows:
                del self._rows[next(iter(self._rows))]
                self.evicted += 1
            return len(body["reports"])

    def instances(self, now: float | None = None) -> list[dict[str, Any]]:
        """The latest window of every sidecar instance, sorted."""
        now = time.time() if now is None else now
        with self._lock:
            for k in [k for k, v in self._rows.items() if now - v["received_at"] > self.keep_s]:
                del self._rows[k]
            return [dict(self._rows[k]) for k in sorted(self._rows)]

    def view(self, now: float | None = None) -> dict[str, list[dict[str, Any]]]:
        """{"instances": [...], "stages": [...], "classes": [...]} (see the
        module doc); merged rows carry ``sources`` (how many windows were
        merged) and ``received_at`` (the newest of them)."""
        rows = self.instances(now)
        return {"instances": rows,
                "stages": _merged(rows, ("stage", "sla_class", "modality")),
                "classes": _merged(rows, ("sla_class", "modality"))}


def _merged(rows: list[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    newest: dict[tuple[Any, ...], float] = {}
    for r in rows:
        k = tuple(r.get(f) for f in by)
        newest[k] = max(newest.get(k, 0.0), float(r["received_at"]))
    out = merge(rows, by=by)["groups"]
    for g in out:
        g["received_at"] = newest[tuple(g.get(f) for f in by)]
    return out
