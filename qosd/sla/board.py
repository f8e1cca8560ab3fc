"""What the sidecars on this node last reported about their SLAs, and the
node-wide view merged from it.

Every sidecar POSTs one window per (stage, class, modality) every few seconds
(``sidecar/sla/``).  The board keeps the latest window of each *sender*
(qosd/identity.py: who sent it, from the connection's credentials, not from
the body) and answers three views:

* ``instances``: one row per (stage, sender, class, modality), as reported;
* ``stages``: per (stage, class, modality), the replicas merged;
* ``classes``: per (class, modality), node-wide, every stage merged.

A sender keeps one window per (stage, class, modality): its report replaces
its own, and can never touch another sender's.  The report's ``instance`` is
a label, except for root and the admin socket, which may speak for several
sidecars (their windows are kept apart by it).  Who may report which stage
is qosd/sla/reporters.py's rules (403 otherwise); how much each sender may keep
and how often it may report is qosd/sla/quota.py's (429, or the sender's own
oldest windows make room).

Merging (:func:`mmmesh.sla.merge`, the rules the global SLA view applies to
nodes too): counts add up, attainment is the frames within their deadline
over the frames (frame-weighted), e2e quantiles come from the merged
DDSketches (the real p99 of all the frames, not an average of p99s).  The
node-wide class view mixes the stages of a pipeline; it is the view meant for
peers and dashboards, the per-stage view is the one to act on.

Whoever acts on new windows (the SLA controller) subscribes (:meth:`SlaBoard.subscribe`)
instead of polling: the callback runs after every report taken (in the
reporting thread, outside the board's lock; it must only wake its owner).

Windows not refreshed for a few of their own lengths are *stale*: still
listed, no longer merged; after ``keep_s`` they are forgotten.  Every window
is checked again when it is taken (numbers within the report schema's
bounds, the sketch parsed into its canonical form, which is all that is
kept) and again when it is read: a row that cannot be read is left out of
the view and counted (``skipped``), so no row can make a read fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pydantic import ValidationError

from mmmesh.errors import field_path
from mmmesh.sla import Sketch, SlaEntry, SlaReport, SlaWindow, merge, parse_sketch
from qosd.identity import ADMIN, ReportRefused, Sender
from qosd.sla.quota import Ledger, SlaLimits

from .reporters import DEFAULT_REPORTERS, ReporterRule, authorize, may_report

__all__ = ["ROW_OVERHEAD", "SlaBoard"]

log = logging.getLogger(__name__)

RowKey = tuple[str, str, str, str, str]  # (stage, sender key, instance label, class, modality)

# Bytes a kept window takes besides its strings and sketch: the row's dict,
# its floats and ints, the key tuple and the ledger's entries (measured with
# tracemalloc by tests/qosd/test_slaboard.py, which keeps this within 25 %).
ROW_OVERHEAD = 1500


@dataclass(frozen=True, slots=True)
class _Row:
    sender: Sender
    entry: dict[str, Any]  # an SlaEntry's fields (but "stale"), sketch_e2e canonical
    sketch: Sketch | None
    nbytes: int
    at: float  # when it was taken (unix s; entry["received_at"] is the listed copy)


class SlaBoard:
    """The board (see the module doc); thread-safe; ``now`` is unix seconds."""

    def __init__(self, limits: SlaLimits | None = None,
                 reporters: Sequence[ReporterRule] = DEFAULT_REPORTERS,
                 stale_windows: float = 3.0, stale_min_s: float = 15.0) -> None:
        self.limits = limits or SlaLimits()
        self.reporters = tuple(reporters)
        self.stale_windows = stale_windows
        self.stale_min_s = stale_min_s
        self._rows: dict[RowKey, _Row] = {}  # oldest first
        self._ledger = Ledger(self.limits)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # accepted, refused:<code>, evicted_own, ...
        self._last_skip_log = 0.0
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """``callback()`` after every report taken (a new window); returns the
        function that unsubscribes.  It runs in the reporting thread, outside
        the board's lock, and must not block (e.g. ``loop.call_soon_threadsafe``)."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn()
            except Exception:  # a listener never breaks a report
                log.exception("SLA board: a new-window listener failed")

    # ---------------------------------------------------------- writing
    def admit(self, sender: Sender) -> None:
        """403 (:class:`ReportRefused`) when ``sender`` may report nothing at
        all: answered before its report is read."""
        try:
            may_report(self.reporters, sender)
        except ReportRefused as e:
            self.refused(e.code)
            raise

    def refused(self, code: str) -> None:
        """Counts a refusal (also one decided elsewhere, e.g. an unknown sender)."""
        with self._lock:
            self.counts[f"refused:{code}"] += 1

    def report(self, body: SlaReport, sender: Sender = ADMIN, now: float | None = None) -> int:
        """Takes one ``POST /v1/sla`` body from ``sender``; returns the number
        of windows kept.  Raises :class:`ReportRefused`: 403 (stage not
        allowed), 429 (rate or quota; nothing changed), 422 (a number out of
        bounds: only for a body that skipped the API's validation)."""
        now = time.time() if now is None else now
        try:
            authorize(self.reporters, sender, body.stage)
            rows = self._rows_of(body, sender, now)  # outside the lock: parses sketches
            with self._lock:
                self._expire(now)
                self._ledger.take(sender, now)
                evict = self._ledger.plan(sender, {k: r.nbytes for k, r in rows.items()})
                for k in evict:
                    self._drop(cast(RowKey, k))
                self.counts["evicted_own"] += len(evict)
                for k, row in rows.items():
                    self._drop(k)  # its previous window
                    self._rows[k] = row
                    self._ledger.add(sender, k, row.nbytes)
                self.counts["accepted"] += 1
        except ReportRefused as e:
            self.refused(e.code)
            raise
        self._notify()
        return len(rows)

    def _rows_of(self, body: SlaReport, sender: Sender, now: float) -> dict[RowKey, _Row]:
        """The report's windows, each checked again and its sketch made canonical."""
        try:
            head = SlaReport.model_validate({"node": body.node, "stage": body.stage,
                                             "instance": body.instance, "reports": []})
        except ValidationError as e:
            raise _invalid(e, ()) from None
        windows, sketches = [], []
        for i, r in enumerate(body.reports):
            try:
                w = SlaWindow.model_validate(_dump(r))
            except ValidationError as e:
                raise _invalid(e, ("reports", i)) from None
            try:
                sketches.append(parse_sketch(w.sketch_e2e) if w.sketch_e2e else None)
            except ValueError as e:
                raise ReportRefused(422, "invalid_request",
                                    f"reports[{i}].sketch_e2e: {e}") from None
            windows.append(w)
        label = head.instance
        named = label if sender.names_instances else None
        rows: dict[RowKey, _Row] = {}
        for w, sk in zip(windows, sketches, strict=True):
            entry = {**w.model_dump(), "sketch_e2e": sk.encode() if sk is not None else None,
                     "stage": head.stage, "instance": named if sender.names_instances
                     else sender.key, "sender": sender.key, "label": label, "node": head.node,
                     "received_at": now}
            key = (head.stage, sender.key, named or "", w.sla_class, w.modality)
            rows[key] = _Row(sender, entry, sk, _row_bytes(entry, sk), now)
        return rows

    def _drop(self, key: RowKey) -> None:
        row = self._rows.pop(key, None)
        if row is not None:
            self._ledger.remove(row.sender, key)

    def _expire(self, now: float) -> None:
        """Forgets windows older than ``keep_s`` (oldest first; stops at the
        first younger one)."""
        for key, row in list(self._rows.items()):
            if now - row.at <= self.limits.keep_s:
                break
            self._drop(key)
            self.counts["expired"] += 1

    # ---------------------------------------------------------- reading
    def _stale(self, entry: dict[str, Any], now: float) -> bool:
        """A window older than a few of its own lengths: that sidecar stopped
        reporting (it went away or restarted under a new identity)."""
        limit = max(self.stale_windows * float(entry.get("window_s") or 0.0), self.stale_min_s)
        return now - float(entry["received_at"]) > limit

    def instances(self, now: float | None = None) -> list[dict[str, Any]]:
        """The latest window of every sender, sorted, each with ``stale``."""
        return self.view(now)["instances"]  # type: ignore[no-any-return]

    def view(self, now: float | None = None) -> dict[str, Any]:
        """{"instances": [...], "stages": [...], "classes": [...], "skipped": n}
        (see the module doc).  Stale windows (not refreshed for
        ``stale_windows`` of their own length, at least ``stale_min_s``) are
        listed under instances but left out of the merged views.  Merged rows
        carry ``sources`` (how many windows were merged) and ``received_at``
        (the newest of them).  A row that cannot be read is left out
        everywhere and counted in ``skipped``."""
        now = time.time() if now is None else now
        with self._lock:
            self._expire(now)
            rows = [self._rows[k] for k in sorted(self._rows)
                    if now - self._rows[k].at <= self.limits.keep_s]
        listed: list[dict[str, Any]] = []
        fresh: list[dict[str, Any]] = []
        skipped = 0
        for row in rows:
            try:
                entry = _readable(row, self._stale(row.entry, now))  # may raise: skipped
            except Exception as e:  # noqa: BLE001 - whatever it is, the read goes on
                skipped += 1
                self._log_skip(row, e)
                continue
            listed.append(entry)
            if not entry["stale"]:
                fresh.append({**entry, "_sketch": row.sketch})
        stages = _merged(fresh, ("stage", "sla_class", "modality"))
        classes = _merged(fresh, ("sla_class", "modality"))
        if skipped:
            with self._lock:
                self.counts["skipped_reads"] += skipped
        return {"instances": listed, "stages": stages, "classes": classes, "skipped": skipped}

    def _log_skip(self, row: _Row, e: Exception) -> None:
        mono = time.monotonic()
        if mono - self._last_skip_log >= 60.0:
            self._last_skip_log = mono
            log.warning("SLA board: left a window of %s out of the view: %s: %s "
                        "(logged once a minute; counted in skipped)", row.sender.describe(),
                        type(e).__name__, e)

    def stats(self) -> dict[str, Any]:
        """Numbers for the metrics: rows, bytes, senders, rate buckets, and
        the counters (accepted, refused:<code>, evicted_own, expired,
        skipped_reads)."""
        with self._lock:
            return {**self._ledger.stats(), **self.counts}


def _dump(r: Any) -> dict[str, Any]:
    """A report entry as a plain dict (a model, or what model_construct left)."""
    if hasattr(r, "model_dump"):
        try:
            return dict(r.model_dump())
        except Exception:  # noqa: BLE001 - an unvalidated model may not dump
            return dict(vars(r))
    return dict(r)


def _invalid(e: ValidationError, where: tuple[str | int, ...]) -> ReportRefused:
    err = e.errors()[0]
    return ReportRefused(422, "invalid_request",
                         f"{field_path((*where, *err.get('loc', ())))}: {err.get('msg')}")


def _row_bytes(entry: dict[str, Any], sk: Sketch | None) -> int:
    strings = sum(len(v) for v in entry.values() if isinstance(v, str))
    return ROW_OVERHEAD + strings + (sk.nbytes if sk is not None else 0)


def _readable(row: _Row, stale: bool) -> dict[str, Any]:
    """The row as the view lists it, checked as GET /v1/sla will check it
    (raises whatever makes it unreadable)."""
    entry = {**row.entry, "stale": stale}
    SlaEntry.model_validate(entry)
    if row.sketch is not None:
        row.sketch.check()
    return entry


def _merged(rows: list[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    newest: dict[tuple[Any, ...], float] = {}
    for r in rows:
        k = tuple(r.get(f) for f in by)
        newest[k] = max(newest.get(k, 0.0), float(r["received_at"]))
    out: list[dict[str, Any]] = merge(rows, by=by)["groups"]
    for g in out:
        g["received_at"] = newest[tuple(g.get(f) for f in by)]
    return out
