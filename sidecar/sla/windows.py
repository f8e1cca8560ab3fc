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

The per-frame cost: :meth:`SlaWindows.record` only appends the sample to a
buffer (thread-safe, no lock, ~0.1 µs); the buffer is added to the windows
in bulk (:meth:`SlaWindows._fold`) every ``FOLD_AT`` samples and before
anything reads them (``close``, ``current``, ``scrape``), so what a reader
sees is every sample recorded before it asked, as before.  In bulk a
series' values cost ~1.5 µs a frame instead of ~5.5 µs: one lock and one
dictionary lookup for the lot, a sketch's keys counted first and each bin
added to once, with ddsketch's own key arithmetic and in the order
ddsketch would have grown its bins (:func:`add_values`; tests hold it equal
to ``DDSketch.add`` one value at a time).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter as _KeyCount
from collections import deque
from collections.abc import Sequence

from ddsketch import DDSketch

from mmmesh.sla import MAX_SAMPLE_MS, attainment, new_sketch

from ..contract import SlaSample

__all__ = ["BUCKETS_S", "FOLD_AT", "MAX_MS", "Counts", "Hist", "Key", "SlaWindows", "Window",
           "add_values"]

MAX_MS = MAX_SAMPLE_MS  # one hour: larger values are clamped (bounds the sketches' keys)
# 0.1 ms .. 10 s; denser where real-time classes set their deadlines (10-300 ms)
BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
_BUCKETS_MS: tuple[float, ...] = tuple(b * 1000.0 for b in BUCKETS_S)

Key = tuple[str, str, str]  # (stage, sla_class, modality)


FOLD_AT = 512
"""Samples buffered before they are added to the windows (also before any read)."""


def _ms(ns: int) -> float:
    """Nanoseconds -> milliseconds within [0, MAX_MS]."""
    v = ns * 1e-6
    if v < 0.0:
        return 0.0
    return min(v, MAX_MS)


def _ms_all(ns: Sequence[int]) -> list[float]:
    """``[_ms(x) for x in ns]``, inlined."""
    out = []
    for x in ns:
        v = x * 1e-6
        out.append(0.0 if v < 0.0 else min(v, MAX_MS))
    return out


def _fast_adder_works() -> bool:
    """ddsketch's insides that :func:`add_values` uses are there and give
    what ``DDSketch.add`` gives (checked once, at import)."""
    try:
        a, b = new_sketch(), new_sketch()
        m = a._mapping
        if not (hasattr(m, "_multiplier") and hasattr(m, "_offset") and hasattr(m, "min_possible")
                and hasattr(a, "_store") and hasattr(a._store, "bins")):
            return False
        vals = [0.0, 5.0, 0.25, 1e-9, 3600000.0, 5.0, 12.5, 0.0, 7e-4, 250.0]
        for v in vals:
            a.add(v)
        _bulk_add(b, vals)
        return bool(a._store.bins == b._store.bins and a._store.offset == b._store.offset
                    and a._store.min_key == b._store.min_key
                    and a._store.max_key == b._store.max_key and a._count == b._count
                    and a._sum == b._sum and a._min == b._min and a._max == b._max
                    and a._zero_count == b._zero_count and a._store.count == b._store.count)
    except Exception:  # noqa: BLE001 - another ddsketch: the public add() is used
        return False


def _bulk_add(sk: DDSketch, vals: Sequence[float]) -> None:
    m = sk._mapping
    minpos = m.min_possible
    mult = m._multiplier
    off = m._offset
    log, ceil = math.log, math.ceil
    if off == 0.0:  # (int(ceil(x) + 0.0) is ceil(x))
        keys = [ceil(log(v, 2) * mult) for v in vals if v > minpos]
    else:
        keys = [int(ceil(log(v, 2) * mult) + off) for v in vals if v > minpos]
    store = sk._store
    for key, n in _KeyCount(keys).items():  # in the order ddsketch would have met them
        store.add(key, float(n))
    zero = len(vals) - len(keys)
    if zero:
        sk._zero_count += float(zero)
    sk._count += float(len(vals))
    total = sk._sum
    for v in vals:  # one by one, as add() sums them
        total += v
    sk._sum = total
    lo, hi = min(vals), max(vals)
    sk._min = min(sk._min, lo)
    sk._max = max(sk._max, hi)


def add_values(sk: DDSketch, vals: Sequence[float]) -> None:
    """``for v in vals: sk.add(v)`` for values >= 0, in bulk: the same bins,
    count, sum, min and max (see the module)."""
    if not vals:
        return
    if _FAST_ADD:
        _bulk_add(sk, vals)
    else:
        for v in vals:
            sk.add(v)


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

    def add_all(self, samples: Sequence[SlaSample], also: Counts | None = None) -> None:
        """``add(s)`` for each sample (into ``also`` as well)."""
        misses = met = drops = errors = 0
        for s in samples:
            if s.deadline_missed:
                misses += 1
            elif not s.dropped:
                met += 1
            if s.dropped:
                drops += 1
            if s.error:
                errors += 1
        for c in (self, also) if also is not None else (self,):
            c.frames += len(samples)
            c.misses += misses
            c.met += met
            c.drops += drops
            c.errors += errors

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

    def add_all(self, vals: Sequence[float]) -> None:
        """``add(v)`` for each value."""
        buckets, where, bounds = self.buckets, bisect.bisect_left, _BUCKETS_MS
        total = self.sum_ms
        for v in vals:
            buckets[where(bounds, v)] += 1
            total += v
        self.sum_ms = total
        self.n += len(vals)

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
    costs ~0.1 µs (the sample is buffered; see the module); the other methods
    copy what they return."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # open windows, counts and histograms
        self._cum_lock = threading.Lock()  # the totals' sketches (merged outside _lock)
        self._totals: dict[Key, _Total] = {}
        self._open: dict[Key, _Open] = {}
        self._last_attainment: dict[Key, float] = {}
        self._pending: deque[SlaSample] = deque()  # recorded, not yet in the windows
        self.created = self._opened = time.monotonic()

    # ------------------------------------------------------------------ hot path
    def record(self, s: SlaSample) -> None:
        pending = self._pending
        pending.append(s)  # (deque.append: atomic, any thread)
        if len(pending) >= FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Adds the buffered samples to their series' open window and totals
        (under ``_lock``; every reader calls it first)."""
        pending = self._pending
        n = len(pending)
        if not n:
            return
        take = pending.popleft
        by_key: dict[Key, list[SlaSample]] = {}
        for _ in range(n):  # (samples appended meanwhile wait for the next fold)
            s = take()
            key = (s.stage, s.sla_class, s.modality)
            group = by_key.get(key)
            if group is None:
                by_key[key] = [s]
            else:
                group.append(s)
        for key, samples in by_key.items():
            w = self._open.get(key)
            if w is None:
                t = self._totals.get(key)
                if t is None:
                    t = self._totals[key] = _Total()
                w = self._open[key] = _Open(t)
            t = w.total
            w.counts.add_all(samples, t.counts)
            q = _ms_all([s.queue_ns for s in samples])
            add_values(w.queue, q)
            t.queue.add_all(q)
            served = [s for s in samples if not s.dropped]
            if not served:
                continue
            v = _ms_all([s.service_ns for s in served])
            add_values(w.service, v)
            t.service.add_all(v)
            e2e = [s.e2e_ns for s in served if s.e2e_ns is not None]
            if e2e:
                v = _ms_all(e2e)
                add_values(w.e2e, v)
                t.e2e.add_all(v)

    # ------------------------------------------------------------------ windows
    def close(self) -> tuple[list[tuple[Key, Window]], float]:
        """Ends the open window: every series seen since start with its data
        in that window (empty when it was idle), sorted, and the window's
        length in seconds.  Merges the window into the totals' sketches and
        keeps each series' attainment for :meth:`scrape`."""
        now = time.monotonic()
        with self._lock:
            self._fold()
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
            self._fold()
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
            self._fold()
            for key, t in self._totals.items():
                att = self._last_attainment.get(key)
                if att is None:
                    w = self._open.get(key)
                    att = w.counts.attainment if w is not None else 1.0
                out.append((key, t.counts.copy(),
                            (t.queue.copy(), t.service.copy(), t.e2e.copy()), att))
        return out


_FAST_ADD = _fast_adder_works()
