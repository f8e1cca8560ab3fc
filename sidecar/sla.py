"""SLA measurement in the sidecar: every frame's timings go to :class:`SlaRecorder`.

Per (stage, sla_class, modality) the recorder keeps

* mergeable quantile sketches (DDSketch, 1 % relative accuracy, values in
  milliseconds) of queueing, service and end-to-end time, for the current
  window and cumulative since start;
* counts of frames, deadline misses, drops and errors;
* Prometheus families (its own registry unless one is given)::

    mmmesh_stage_latency_seconds{stage,class,modality,kind="queue"|"service"|"e2e"}  histogram
    mmmesh_stage_frames_total{stage,class,modality}                                 counter
    mmmesh_stage_deadline_misses_total{stage,class,modality}                        counter
    mmmesh_stage_drops_total{stage,class,modality}                                  counter
    mmmesh_stage_errors_total{stage,class,modality}                                 counter
    mmmesh_stage_sla_attainment_ratio{stage,class,modality}                         gauge

Every ``cfg.qosd.report_interval_s`` the reporter task closes the window and
POSTs it to qosd (``POST /v1/sla`` on its unix socket)::

    {"node": null, "stage": "asr", "instance": "asr-7d9f-x2k/1",
     "reports": [{"sla_class": "voice", "modality": "audio", "window_s": 5.0,
                  "frames": 250, "deadline_misses": 3, "drops": 1, "errors": 0,
                  "attainment": 0.984,
                  "e2e_ms": {"p50": 41.2, "p90": 63.0, "p99": 97.5, "max": 120.3} | null,
                  "queue_ms": {...} | null, "service_ms": {...} | null,
                  "sketch_e2e": "<base64 DDSketch protobuf, values in ms>"}]}

A series is reported in every window once it has been seen (frames 0 and the
``*_ms`` null when idle).  ``sketch_e2e`` is only present when ddsketch's
protobuf support imports.  Windows that could not be delivered are dropped
(the counters in Prometheus stay cumulative); qosd being absent or failing
never blocks or breaks the sidecar: one warning per outage, retried every
interval.

Conventions:

* ``attainment`` = frames delivered within their deadline / frames.  A frame
  is *not* within its deadline when ``deadline_missed`` or ``dropped``.
  SlaSample does not say whether a frame had a deadline at all, so frames
  without one count as met; if SlaSample grows a ``has_deadline: bool`` field
  the denominator becomes the frames that had one (1.0 when none had).
* Dropped frames feed only the queue sketch/histogram (they had no service
  and were not delivered); ``e2e_ns=None`` feeds no e2e observation.
* Negative times (clock skew between nodes for e2e) count as 0; times above
  one hour are clamped to one hour.

:func:`merge` (from :mod:`mmmesh.slasketch`, shared with qosd) combines the
reports of several sidecars (the point of the mergeable sketches) into a
node-wide summary.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from ddsketch import DDSketch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mmmesh.slasketch import (
    QUANTILES,
    RELATIVE_ACCURACY,
    decode_sketch,
    encode_sketch,
    merge,
)
from mmmesh.slasketch import new_sketch as _sketch
from mmmesh.slasketch import summary as _summary

from .config import SidecarConfig
from .iface import SlaSample

__all__ = [
    "BUCKETS_S",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "SLA_PATH",
    "SlaRecorder",
    "decode_sketch",
    "encode_sketch",
    "merge",
]

log = logging.getLogger("sidecar.sla")

SLA_PATH = "/v1/sla"
MAX_MS = 3_600_000.0  # one hour: larger values are clamped (bounds the sketches' bins)
# 0.1 ms .. 10 s; denser where real-time classes set their deadlines (10-300 ms)
BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
_BUCKETS_MS: tuple[float, ...] = tuple(b * 1000.0 for b in BUCKETS_S)
_LE: tuple[str, ...] = tuple(repr(b) for b in BUCKETS_S) + ("+Inf",)
_NB = len(BUCKETS_S) + 1
_KINDS = ("queue", "service", "e2e")
_LABELS = ("stage", "class", "modality")

# SlaSample may later say whether the frame had a deadline at all.
_HAS_DEADLINE_FIELD = "has_deadline" in getattr(SlaSample, "__dataclass_fields__", {})

Key = tuple[str, str, str]  # (stage, sla_class, modality)


class _Win:
    """One series' current window (mutated under SlaRecorder._lock only)."""

    __slots__ = ("cum", "deadline_frames", "drops", "e", "errors", "frames", "met", "misses",
                 "q", "s")

    def __init__(self, cum: _Cum) -> None:
        self.cum = cum
        self.frames = 0
        self.deadline_frames = 0
        self.met = 0
        self.misses = 0
        self.drops = 0
        self.errors = 0
        self.q = _sketch()
        self.s = _sketch()
        self.e = _sketch()


class _Cum:
    """One series' cumulative counters and Prometheus buckets (under _lock)."""

    __slots__ = ("deadline_frames", "drops", "eb", "en", "errors", "esum", "frames", "met",
                 "misses", "qb", "qn", "qsum", "sb", "sn", "ssum")

    def __init__(self) -> None:
        self.frames = 0
        self.deadline_frames = 0
        self.met = 0
        self.misses = 0
        self.drops = 0
        self.errors = 0
        self.qb = [0] * _NB
        self.sb = [0] * _NB
        self.eb = [0] * _NB
        self.qn = self.sn = self.en = 0
        self.qsum = self.ssum = self.esum = 0.0  # milliseconds


@dataclass
class _Sketches:
    queue: DDSketch
    service: DDSketch
    e2e: DDSketch


def _attainment(met: int, denom: int) -> float:
    return 1.0 if denom <= 0 else met / denom


# --------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------
class SlaRecorder:
    """Records per-frame SLA samples (implements sidecar.iface.SlaSink).

    ``record()`` is thread-safe and costs a few microseconds (one lock, three
    sketch inserts, three bucket increments).  ``await start()`` runs the
    reporter (and /metrics when ``cfg.metrics_addr`` is set); ``await stop()``
    sends a final report and stops both.
    """

    def __init__(self, cfg: SidecarConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.instance = cfg.instance or f"{socket.gethostname()}/{os.getpid()}"
        self._lock = threading.Lock()  # windows and cumulative counters (record's lock)
        self._cum_lock = threading.Lock()  # cumulative sketches
        self._cum: dict[Key, _Cum] = {}
        self._win: dict[Key, _Win] = {}
        self._created = self._win_started = time.monotonic()
        self._cum_sketches: dict[Key, _Sketches] = {}
        self._last_attainment: dict[Key, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None
        self._failing: str | None = None  # reason while qosd is unreachable/refusing
        self.reports_sent = 0
        self.reports_failed = 0
        self.last_body: dict[str, Any] | None = None  # last body built (for debugging)
        self.registry.register(_Collector(self))

    # ------------------------------------------------------------------ hot path
    def record(self, s: SlaSample) -> None:
        key = (s.stage, s.sla_class, s.modality)
        q = s.queue_ns * 1e-6
        if q < 0.0:
            q = 0.0
        elif q > MAX_MS:
            q = MAX_MS
        dropped = s.dropped
        missed = s.deadline_missed
        had_deadline = s.has_deadline if _HAS_DEADLINE_FIELD else True  # type: ignore[attr-defined]
        with self._lock:
            w = self._win.get(key)
            if w is None:
                w = self._new_window(key)
            c = w.cum
            w.frames += 1
            c.frames += 1
            if had_deadline:
                w.deadline_frames += 1
                c.deadline_frames += 1
                if not (missed or dropped):
                    w.met += 1
                    c.met += 1
            if missed:
                w.misses += 1
                c.misses += 1
            if s.error:
                w.errors += 1
                c.errors += 1
            w.q.add(q)
            c.qb[bisect.bisect_left(_BUCKETS_MS, q)] += 1
            c.qn += 1
            c.qsum += q
            if dropped:
                w.drops += 1
                c.drops += 1
                return
            v = s.service_ns * 1e-6
            if v < 0.0:
                v = 0.0
            elif v > MAX_MS:
                v = MAX_MS
            w.s.add(v)
            c.sb[bisect.bisect_left(_BUCKETS_MS, v)] += 1
            c.sn += 1
            c.ssum += v
            e = s.e2e_ns
            if e is not None:
                v = e * 1e-6
                if v < 0.0:
                    v = 0.0
                elif v > MAX_MS:
                    v = MAX_MS
                w.e.add(v)
                c.eb[bisect.bisect_left(_BUCKETS_MS, v)] += 1
                c.en += 1
                c.esum += v

    def _new_window(self, key: Key) -> _Win:  # under _lock
        c = self._cum.get(key)
        if c is None:
            c = self._cum[key] = _Cum()
        w = self._win[key] = _Win(c)
        return w

    # ------------------------------------------------------------------ windows
    def roll(self) -> list[dict[str, Any]]:
        """Closes the current window and returns its POST bodies (one per
        stage name seen; normally one).  Updates the attainment gauge and
        merges the window into the cumulative sketches."""
        now = time.monotonic()
        with self._lock:
            wins, self._win = self._win, {}
            keys = list(self._cum)
            started, self._win_started = self._win_started, now
        window_s = round(now - started, 6)
        with self._cum_lock:
            for key, w in wins.items():
                cs = self._cum_sketches.get(key)
                if cs is None:
                    cs = self._cum_sketches[key] = _Sketches(_sketch(), _sketch(), _sketch())
                cs.queue.merge(w.q)
                cs.service.merge(w.s)
                cs.e2e.merge(w.e)
        by_stage: dict[str, list[dict[str, Any]]] = {}
        attain: dict[Key, float] = {}
        for key in sorted(keys):
            w = wins.get(key) or _Win(_Cum())
            rep = _report(key, w, window_s)
            attain[key] = rep["attainment"]
            by_stage.setdefault(key[0], []).append(rep)
        with self._lock:
            self._last_attainment.update(attain)
        if not by_stage:
            by_stage[self.cfg.stage] = []
        bodies = [{"node": None, "stage": stage, "instance": self.instance, "reports": reps}
                  for stage, reps in by_stage.items()]
        self.last_body = bodies[0] if len(bodies) == 1 else {"bodies": bodies}
        return bodies

    def snapshot(self, cumulative: bool = False) -> list[dict[str, Any]]:
        """Report entries (the POST schema, plus "stage") for the current
        window, or since the recorder was made with ``cumulative`` (window_s =
        its age); does not reset anything."""
        now = time.monotonic()
        out: list[dict[str, Any]] = []
        with self._lock:  # copies: sketches are small
            started = self._win_started
            cur: dict[Key, _Win] = {}
            for key, w in self._win.items():
                cp = _Win(w.cum)
                for f in ("frames", "deadline_frames", "met", "misses", "drops", "errors"):
                    setattr(cp, f, getattr(w, f))
                cp.q.merge(w.q)
                cp.s.merge(w.s)
                cp.e.merge(w.e)
                cur[key] = cp
            cum_counts = {k: (c.frames, c.deadline_frames, c.met, c.misses, c.drops, c.errors)
                          for k, c in self._cum.items()}
        if not cumulative:
            for key in sorted(cum_counts):
                rep = _report(key, cur.get(key) or _Win(_Cum()), round(now - started, 6))
                out.append({"stage": key[0], **rep})
            return out
        with self._cum_lock:
            for key in sorted(cum_counts):
                w = _Win(_Cum())
                cs = self._cum_sketches.get(key)
                if cs is not None:
                    w.q.merge(cs.queue)
                    w.s.merge(cs.service)
                    w.e.merge(cs.e2e)
                c = cur.get(key)
                if c is not None:
                    w.q.merge(c.q)
                    w.s.merge(c.s)
                    w.e.merge(c.e)
                (w.frames, w.deadline_frames, w.met, w.misses, w.drops,
                 w.errors) = cum_counts[key]
                out.append({"stage": key[0], **_report(key, w, round(now - self._created, 6))})
        return out

    # ------------------------------------------------------------------ reporting
    async def start(self, serve_metrics: bool = True) -> None:
        """Starts the reporter task (and /metrics on cfg.metrics_addr)."""
        if self._task is not None:
            return
        if serve_metrics and self.cfg.metrics_addr and self._metrics_server is None:
            self.serve(self.cfg.metrics_addr)
        sock = self.cfg.qosd.socket
        if sock is not None:
            interval = self.cfg.qosd.report_interval_s
            timeout = max(0.5, min(5.0, interval))
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=str(sock)),
                base_url="http://qosd", timeout=timeout,
                headers={"user-agent": "mmmesh-sidecar"},
            )
        self._stopping = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="sla-reporter")

    async def stop(self, final_timeout_s: float = 2.0) -> None:
        """Stops the reporter (a report in flight is let finish), then sends a
        final report of the open window, bounded by ``final_timeout_s``."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), final_timeout_s)
            except (TimeoutError, Exception):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        try:
            await asyncio.wait_for(self.report_now(), final_timeout_s)
        except Exception as e:  # never fail the shutdown for a report
            log.warning("final SLA report not sent: %s", e or type(e).__name__)
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.aclose()
        self.close_metrics()

    async def _run(self) -> None:
        interval = self.cfg.qosd.report_interval_s
        loop = asyncio.get_running_loop()
        nxt = loop.time() + interval
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, nxt - loop.time()))
            if self._stopping.is_set():
                return
            nxt += interval
            if nxt < loop.time():  # fell behind (slow qosd): skip, do not burst
                nxt = loop.time() + interval
            try:
                await self.report_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not kill the reporter
                log.exception("SLA report failed")

    async def report_now(self) -> bool:
        """Closes the window and POSTs it to qosd; True when qosd took it
        (False when it failed or there is no qosd socket configured)."""
        bodies = await asyncio.to_thread(self.roll)
        if self._client is None:
            return False
        ok = True
        for body in bodies:
            ok = await self._post(body) and ok
        return ok

    async def _post(self, body: dict[str, Any]) -> bool:
        assert self._client is not None
        try:
            r = await self._client.post(SLA_PATH, json=body)
        except httpx.HTTPError as e:
            self._failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
                         kind=type(e).__name__)
            return False
        if r.status_code >= 300:
            self._failed(f"HTTP {r.status_code}: {r.text[:300]}", kind=str(r.status_code))
            return False
        self.reports_sent += 1
        if self._failing is not None:
            log.info("qosd at %s takes SLA reports again", self.cfg.qosd.socket)
            self._failing = None
        return True

    def _failed(self, why: str, kind: str) -> None:
        self.reports_failed += 1
        if self._failing != kind:  # once per outage (and once more if the reason changes)
            log.warning("SLA report to qosd at %s failed (%s); retrying every %ss, "
                        "reported once per outage", self.cfg.qosd.socket, why,
                        self.cfg.qosd.report_interval_s)
            self._failing = kind

    # ------------------------------------------------------------------ /metrics
    def serve(self, addr: str | None = None) -> tuple[str, int]:
        """Serves /metrics on ``addr`` ("host:port", default cfg.metrics_addr;
        port 0 picks one) in a daemon thread; returns the bound address."""
        addr = addr or self.cfg.metrics_addr
        if not addr:
            raise ValueError("no metrics address (cfg.metrics_addr is not set)")
        if self._metrics_server is not None:
            raise RuntimeError("already serving /metrics")
        host, _, port = addr.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        server, thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._metrics_server, self._metrics_thread = server, thread
        bound = server.server_address
        return (str(bound[0]), int(bound[1]))

    def bind_counters(self, counters: Any) -> None:
        """Exports the sidecar's transport counters (``Sidecar.counters``) from
        this recorder's registry, read at scrape time."""
        self.registry.register(_CountersCollector(self.cfg.stage, counters))

    def close_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._metrics_thread is not None:
            self._metrics_thread.join(5)
            self._metrics_thread = None

    def _metric_state(self) -> tuple[list[tuple[Key, _Cum]], dict[Key, float]]:
        with self._lock:
            cums = []
            for key, c in self._cum.items():
                cp = _Cum()
                cp.frames, cp.misses, cp.drops, cp.errors = c.frames, c.misses, c.drops, c.errors
                cp.qb, cp.sb, cp.eb = c.qb[:], c.sb[:], c.eb[:]
                cp.qsum, cp.ssum, cp.esum = c.qsum, c.ssum, c.esum
                cums.append((key, cp))
            att = dict(self._last_attainment)
            for key in self._cum:  # before the first window closes: the current one
                if key not in att:
                    w = self._win.get(key)
                    att[key] = (_attainment(w.met, w.deadline_frames) if w is not None else 1.0)
        return cums, att


def _report(key: Key, w: _Win, window_s: float | None) -> dict[str, Any]:
    rep: dict[str, Any] = {
        "sla_class": key[1],
        "modality": key[2],
        "window_s": window_s,
        "frames": w.frames,
        "deadline_misses": w.misses,
        "drops": w.drops,
        "errors": w.errors,
        "attainment": round(_attainment(w.met, w.deadline_frames), 6),
        "e2e_ms": _summary(w.e),
        "queue_ms": _summary(w.q),
        "service_ms": _summary(w.s),
    }
    enc = encode_sketch(w.e)
    if enc is not None:
        rep["sketch_e2e"] = enc
    return rep


class _Collector(Collector):
    def __init__(self, rec: SlaRecorder) -> None:
        self.rec = rec

    def describe(self) -> Iterable[Metric]:
        return list(self._families(with_data=False))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(with_data=True))

    def _families(self, with_data: bool) -> Iterator[Metric]:
        lat = HistogramMetricFamily(
            "mmmesh_stage_latency_seconds",
            "Per-frame time in the stage: kind=queue (arrival to runner start), service "
            "(runner), e2e (now minus the frame's timestamp)",
            labels=[*_LABELS, "kind"])
        frames = CounterMetricFamily("mmmesh_stage_frames", "Frames seen by the stage",
                                     labels=_LABELS)
        misses = CounterMetricFamily("mmmesh_stage_deadline_misses",
                                     "Frames past their deadline when done (or dropped for it)",
                                     labels=_LABELS)
        drops = CounterMetricFamily("mmmesh_stage_drops",
                                    "Frames dropped (deadline or overload) instead of delivered",
                                    labels=_LABELS)
        errors = CounterMetricFamily("mmmesh_stage_errors", "Frames that ended in an error",
                                     labels=_LABELS)
        ratio = GaugeMetricFamily("mmmesh_stage_sla_attainment_ratio",
                                  "Share of frames within their deadline in the last report "
                                  "window (1 when there were none)", labels=_LABELS)
        if with_data:
            cums, att = self.rec._metric_state()
            for key, c in cums:
                labels = list(key)
                for kind, b, total in (("queue", c.qb, c.qsum), ("service", c.sb, c.ssum),
                                       ("e2e", c.eb, c.esum)):
                    acc, buckets = 0, []
                    for le, n in zip(_LE, b, strict=True):
                        acc += n
                        buckets.append((le, float(acc)))
                    lat.add_metric([*labels, kind], buckets, total / 1000.0)
                frames.add_metric(labels, c.frames)
                misses.add_metric(labels, c.misses)
                drops.add_metric(labels, c.drops)
                errors.add_metric(labels, c.errors)
                ratio.add_metric(labels, att.get(key, 1.0))
        yield from (lat, frames, misses, drops, errors, ratio)


# --------------------------------------------------------------------------
# Transport counters (frames in/out, malformed, drops, reconnects) at scrape time
# --------------------------------------------------------------------------
class _CountersCollector:
    """Reads ``Sidecar.counters.snapshot()`` when Prometheus scrapes."""

    def __init__(self, stage: str, counters: Any) -> None:
        self.stage = stage
        self.counters = counters

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.counters.snapshot()
        srv, stg, snd = snap.get("server", {}), snap.get("stage", {}), snap.get("senders", {})
        st = [self.stage]
        c = CounterMetricFamily("mmmesh_sidecar_frames_received", "MMH frames received",
                                labels=["stage"])
        c.add_metric(st, srv.get("frames_in", 0))
        yield c
        c = CounterMetricFamily("mmmesh_sidecar_received_bytes", "payload bytes received",
                                labels=["stage"])
        c.add_metric(st, srv.get("bytes_in", 0))
        yield c
        c = CounterMetricFamily("mmmesh_sidecar_malformed_frames",
                                "malformed input that closed a connection or was dropped",
                                labels=["stage", "reason"])
        for reason, n in (srv.get("malformed") or {}).items():
            c.add_metric([self.stage, reason], n)
        yield c
        c = CounterMetricFamily("mmmesh_sidecar_connections_closed",
                                "inbound connections closed, by reason",
                                labels=["stage", "reason"])
        for reason, n in (srv.get("conn_closed") or {}).items():
            c.add_metric([self.stage, reason], n)
        yield c
        g = GaugeMetricFamily("mmmesh_sidecar_stage_in_flight", "frames in the stage now",
                              labels=["stage"])
        g.add_metric(st, stg.get("in_flight", 0))
        yield g
        c = CounterMetricFamily("mmmesh_sidecar_stage_errors", "error frames produced",
                                labels=["stage", "code"])
        for code, n in (stg.get("errors") or {}).items():
            c.add_metric([self.stage, str(code)], n)
        yield c
        out = CounterMetricFamily("mmmesh_sidecar_frames_sent", "MMH frames sent",
                                  labels=["stage", "output"])
        drops = CounterMetricFamily("mmmesh_sidecar_output_drops",
                                    "frames dropped instead of sent late or queued",
                                    labels=["stage", "output", "reason"])
        rec = CounterMetricFamily("mmmesh_sidecar_reconnects", "downstream reconnects",
                                  labels=["stage", "output"])
        up = GaugeMetricFamily("mmmesh_sidecar_output_connected", "1 when connected",
                               labels=["stage", "output"])
        for name, s in snd.items():
            out.add_metric([self.stage, name], s.get("frames_out", 0))
            drops.add_metric([self.stage, name, "deadline"], s.get("dropped_deadline", 0))
            drops.add_metric([self.stage, name, "overload"], s.get("dropped_overload", 0))
            rec.add_metric([self.stage, name], s.get("reconnects", 0))
            up.add_metric([self.stage, name], 1.0 if s.get("connected") else 0.0)
        yield from (out, drops, rec, up)

