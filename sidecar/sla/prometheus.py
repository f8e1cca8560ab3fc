"""Prometheus export of a sidecar, read at scrape time.

The SLA families, from :class:`~sidecar.sla.windows.SlaWindows`::

    mmmesh_stage_latency_seconds{stage,class,modality,kind="queue"|"service"|"e2e"}  histogram
    mmmesh_stage_frames_total{stage,class,modality}                                 counter
    mmmesh_stage_deadline_misses_total{stage,class,modality}                        counter
    mmmesh_stage_drops_total{stage,class,modality}                                  counter
    mmmesh_stage_errors_total{stage,class,modality}                                 counter
    mmmesh_stage_sla_attainment_ratio{stage,class,modality}                         gauge

and the transport's counters (``Sidecar.counters``: frames in and out,
malformed input, closed connections, stage errors, output drops, reconnects).
:func:`serve_metrics` serves a registry on ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mmmesh.net import parse_hostport

from .windows import BUCKETS_S, SlaWindows

__all__ = ["CountersCollector", "SlaCollector", "serve_metrics"]

_LE: tuple[str, ...] = tuple(repr(b) for b in BUCKETS_S) + ("+Inf",)
_LABELS = ("stage", "class", "modality")


class SlaCollector(Collector):
    """The ``mmmesh_stage_*`` families of one recorder's windows."""

    def __init__(self, windows: SlaWindows) -> None:
        self.windows = windows

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
            for key, c, hists, attainment in self.windows.scrape():
                labels = list(key)
                for kind, h in zip(("queue", "service", "e2e"), hists, strict=True):
                    acc, buckets = 0, []
                    for le, n in zip(_LE, h.buckets, strict=True):
                        acc += n
                        buckets.append((le, float(acc)))
                    lat.add_metric([*labels, kind], buckets, h.sum_ms / 1000.0)
                frames.add_metric(labels, c.frames)
                misses.add_metric(labels, c.misses)
                drops.add_metric(labels, c.drops)
                errors.add_metric(labels, c.errors)
                ratio.add_metric(labels, attainment)
        yield from (lat, frames, misses, drops, errors, ratio)


class Snapshottable(Protocol):
    """What :class:`CountersCollector` reads: ``Sidecar.counters``."""

    def snapshot(self) -> dict[str, Any]: ...


class CountersCollector(Collector):
    """The ``mmmesh_sidecar_*`` families: reads ``counters.snapshot()`` (the
    server, stage and senders groups of docs/sidecar.md) when scraped."""

    def __init__(self, stage: str, counters: Snapshottable) -> None:
        self.stage = stage
        self.counters = counters

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
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
        for name, doc, counts in (
                ("malformed_frames", "malformed input that closed a connection or was dropped",
                 srv.get("malformed")),
                ("connections_closed", "inbound connections closed, by reason",
                 srv.get("conn_closed"))):
            c = CounterMetricFamily(f"mmmesh_sidecar_{name}", doc, labels=["stage", "reason"])
            for reason, n in (counts or {}).items():
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
        labels = ["stage", "output", "replica", "address"]
        lane_out = CounterMetricFamily("mmmesh_sidecar_lane_frames_sent",
                                       "MMH frames sent on each lane (replica) of an output",
                                       labels=labels)
        lane_up = GaugeMetricFamily("mmmesh_sidecar_lane_up", "1 when the lane is in the pick "
                                    "(connected, or its first connect pending)", labels=labels)
        for name, s in snd.items():
            out.add_metric([self.stage, name], s.get("frames_out", 0))
            drops.add_metric([self.stage, name, "deadline"], s.get("dropped_deadline", 0))
            drops.add_metric([self.stage, name, "overload"], s.get("dropped_overload", 0))
            rec.add_metric([self.stage, name], s.get("reconnects", 0))
            up.add_metric([self.stage, name], 1.0 if s.get("connected") else 0.0)
            for i, lane in enumerate(s.get("lanes") or []):
                lv = [self.stage, name, str(i), str(lane.get("address", ""))]
                lane_out.add_metric(lv, lane.get("frames_out", 0))
                lane_up.add_metric(lv, 1.0 if lane.get("up") else 0.0)
        yield from (out, drops, rec, up, lane_out, lane_up)


def serve_metrics(addr: str, registry: CollectorRegistry) -> tuple[Any, threading.Thread]:
    """Serves ``registry`` on ``/metrics`` at ``addr`` (``host:port``;
    ``:port`` = every interface; port 0 picks one) in a daemon thread;
    returns the HTTP server and its thread."""
    host, port = parse_hostport(addr, default_host="0.0.0.0", what="metrics_addr")
    return start_http_server(port, addr=host, registry=registry)
