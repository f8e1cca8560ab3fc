"""Recording SLA windows: what :class:`SlaWindows` keeps of every frame.

Per series, that is per (stage, sla_class, modality):

* the current window: counts (frames, within deadline, misses, drops,
  errors) and mergeable DDSketches (1 % relative accuracy, values in ms) of
  queue, service and end-to-end time; :meth:`SlaWindows.close` hands it over
  and starts the next one;
* since start: the same counts, Prometheus histogram buckets (``BUCKETS_S``)
  and sums, and the closed windows' sketches merged.

Conventions:

* A frame is within its deadline unless ``deadline_missed`` or ``dropped``
  (a frame without a deadline is never missed, so it counts as within it);
  attainment = frames within their deadline / frames, 1.0 when there were
  none (``mmmesh.sla.attainment``, the one definition qosd's board and the
  global SLA view merge by: ``mmmesh/sla/_attainment.py`` says why).
* Dropped frames feed only the queue time (they had no service and were not
  delivered); ``e2e_ns=None`` feeds no e2e observation.
* Negative times (clock skew between nodes for e2e) count as 0; times above
  ``mmmesh.sla.MAX_SAMPLE_MS`` (one hour) are clamped to it (that bounds the
  sketches' keys).
* Sketches are ddsketch objects while they are live (they keep the exact
  max); windows merge into the totals with ddsketch's own merge, bin by bin
  like ``mmmesh.sla.SketchSum``.
"""

from __future__ import annotations

import bisect
import threading
import time

from ddsketch import DDSketch

from mmmesh.sla import MAX_SAMPLE_MS, attainment, new_sketch

from ..contract import SlaSample

__all__ = ["BUCKETS_S", "MAX_MS", "Counts", "Hist", "Key", "SlaWindows", "Window"]

MAX_MS = MAX_SAMPLE_MS  # one hour: larger values are clamped (bounds the sketches' keys)
# 0.1 ms .. 10 s; denser where real-time classes set their deadlines (10-300 ms)
BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
_BUCKETS_MS: tuple[float, ...] = tuple(b * 1000.0 for b in BUCKETS_S)

Key = tuple[str, str, str]  # (stage, sla_class, modality)


def _ms(ns: int) -> float:
    """Nanoseconds -> milliseconds within [0, MAX_MS]."""
    v = ns * 1e-6
    if v < 0.0:
        return 0.0
    return min(v, MAX_MS)


class Counts:
    """Frame counts of one series over some time."""

    __slots__ = ("drops", "errors", "frames", "met", "misses")

    def __init__(self) -> None:
        self.frames = 0
        self.met = 0  # within their deadline: neither missed nor dropped
        self.misses = 0
        self.drops = 0
        self.errors = 0

    def add(self, s: SlaSample) -> None:
        self.frames += 1
        if s.deadline_missed:
            self.misses += 1
        elif not s.dropped:
            self.met += 1
        if s.dropped:
            self.drops += 1
        if s.error:
            self.errors += 1

    def copy(self) -> Counts:
        c = Counts()
        c.frames, c.met, c.misses, c.drops, c.errors = (self.frames, self.met, self.misses,
                                                        self.drops, self.errors)
        return c

    @property
    def attainment(self) -> float:
        """Frames within their deadline / frames (1.0 when there were none), not rounded."""
        return attainment(self.frames, self.met, digits=None)


class Hist:
    """A Prometheus histogram of one kind of time: per-bucket counts (not
    cumulative; the last bucket is +Inf), count and sum in ms."""

    __slots__ = ("buckets", "n", "sum_ms")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS_S) + 1)
        self.n = 0
        self.sum_ms = 0.0

    def add(self, v: float) -> None:
        self.buckets[bisect.bisect_left(_BUCKETS_MS, v)] += 1
        self.n += 1
        self.sum_ms += v

    def copy(self) -> Hist:
        h = Hist()
        h.buckets, h.n, h.sum_ms = self.buckets[:], self.n, self.sum_ms
        return h


class Window:
    """One series' counts and sketches over one window (or merged windows)."""

    __slots__ = ("counts", "e2e", "queue", "service")

    def __init__(self, counts: Counts | None = None) -> None:
        self.counts = counts if counts is not None else Counts()
        self.queue: DDSketch = new_sketch()
        self.service: DDSketch = new_sketch()
        self.e2e: DDSketch = new_sketch()

    def merge(self, other: Window) -> None:
        """Adds ``other``'s sketches (not its counts) to this window's."""
        self.queue.merge(other.queue)
        self.service.merge(other.service)
        self.e2e.merge(other.e2e)


class _Total:
    """One series since start: counts and histograms (under ``_lock``), the
    closed windows' sketches (``sketches``, under ``_cum_lock``)."""

    __slots__ = ("counts", "e2e", "queue", "service", "sketches")

    def __init__(self) -> None:
        self.counts = Counts()
        self.queue = Hist()
        self.service = Hist()
        self.e2e = Hist()
        self.sketches = Window()


class _Open(Window):
    """A series' open window, tied to the series' totals (under ``_lock``)."""

    __slots__ = ("total",)

    def __init__(self, total: _Total) -> None:
        super().__init__()
        self.total = total


class SlaWindows:
    """Every series' open window and totals.  ``record()`` is thread-safe and
    costs a few microseconds (one lock, three sketch inserts, three bucket
    increments); the other methods copy what they return."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # open windows, counts and histograms
        self._cum_lock = threading.Lock()  # the totals' sketches (merged outside _lock)
        self._totals: dict[Key, _Total] = {}
        self._open: dict[Key, _Open] = {}
        self._last_attainment: dict[Key, float] = {}
        self.created = self._opened = time.monotonic()

    # ------------------------------------------------------------------ hot path
    def record(self, s: SlaSample) -> None:
        key = (s.stage, s.sla_class, s.modality)
        q = _ms(s.queue_ns)
        with self._lock:
            w = self._open.get(key)
            if w is None:
                t = self._totals.get(key)
                if t is None:
                    t = self._totals[key] = _Total()
                w = self._open[key] = _Open(t)
            t = w.total
            w.counts.add(s)
            t.counts.add(s)
            w.queue.add(q)
            t.queue.add(q)
            if s.dropped:
                return
            v = _ms(s.service_ns)
            w.service.add(v)
            t.service.add(v)
            if s.e2e_ns is not None:
                v = _ms(s.e2e_ns)
                w.e2e.add(v)
                t.e2e.add(v)

    # ------------------------------------------------------------------ windows
    def close(self) -> tuple[list[tuple[Key, Window]], float]:
        """Ends the open window: every series seen since start with its data
        in that window (empty when it was idle), sorted, and the window's
        length in seconds.  Merges the window into the totals' sketches and
        keeps each series' attainment for :meth:`scrape`."""
        now = time.monotonic()
        with self._lock:
            closed, self._open = self._open, {}
            keys = sorted(self._totals)
            started, self._opened = self._opened, now
        with self._cum_lock:
            for w in closed.values():
                w.total.sketches.merge(w)
        out: list[tuple[Key, Window]] = [(k, closed.get(k) or Window()) for k in keys]
        with self._lock:
            self._last_attainment.update((k, w.counts.attainment) for k, w in out)
        return out, round(now - started, 6)

    def current(self, cumulative: bool = False) -> tuple[list[tuple[Key, Window]], float]:
        """Copies of every series' open window and its length in seconds; with
        ``cumulative``, everything since start instead (length: the age)."""
        now = time.monotonic()
        with self._lock:  # copies: sketches are small
            cur: dict[Key, Window] = {}
            for key, w in self._open.items():
                cp = cur[key] = Window(w.counts.copy())
                cp.merge(w)
            totals = {k: t.counts.copy() for k, t in self._totals.items()}
            started = self._opened
        if not cumulative:
            return [(k, cur.get(k) or Window()) for k in sorted(totals)], round(now - started, 6)
        out: list[tuple[Key, Window]] = []
        with self._cum_lock:
            for key in sorted(totals):
                since_start = Window(totals[key])
                since_start.merge(self._totals[key].sketches)
                if key in cur:
                    since_start.merge(cur[key])
                out.append((key, since_start))
        return out, round(now - self.created, 6)

    def scrape(self) -> list[tuple[Key, Counts, tuple[Hist, Hist, Hist], float]]:
        """For Prometheus, per series: counts and (queue, service, e2e)
        histograms since start, and the attainment of the last closed window
        (of the open one before any closed)."""
        out: list[tuple[Key, Counts, tuple[Hist, Hist, Hist], float]] = []
        with self._lock:
            for key, t in self._totals.items():
                att = self._last_attainment.get(key)
                if att is None:
                    w = self._open.get(key)
                    att = w.counts.attainment if w is not None else 1.0
                out.append((key, t.counts.copy(),
                            (t.queue.copy(), t.service.copy(), t.e2e.copy()), att))
        return out
