"""SLA measurement in the sidecar: every frame's timings go to :class:`SlaRecorder`.

The recorder is the sidecar's ``contract.SlaSink``; it puts three parts
together:

* ``windows``: per (stage, sla_class, modality), the current window and
  everything since start (counts, DDSketches, histogram buckets): the
  conventions (attainment, drops, clamping) are written there;
* ``prometheus``: the ``mmmesh_stage_*`` families and the transport counters,
  read at scrape time, served on ``metrics_addr``;
* ``reporter``: every ``cfg.qosd.report_interval_s`` the window is closed and
  POSTed to qosd as an ``mmmesh.sla.report.SlaReport`` (the schema qosd
  validates with).  Windows close on the wall clock's multiples of the
  interval (:func:`next_close`; the first one at least an interval after the
  start), so every sidecar of the mesh closes the same window at the same
  moment and qosd's controller, woken by it, judges them together
  (docs/controller.md, "The loop's delay").

:func:`merge` (from :mod:`mmmesh.sla`, shared with qosd: one merge, one
quantile rule, one attainment) combines the reports of several sidecars (the
point of the mergeable sketches) into a node-wide summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from mmmesh.sla import QUANTILES, RELATIVE_ACCURACY, decode_sketch, encode_sketch, merge

from ..config import SidecarConfig
from ..contract import SlaSample
from .prometheus import CountersCollector, SlaCollector, Snapshottable, serve_metrics
from .reporter import SLA_PATH, QosdReporter, class_report, reports_by_stage
from .windows import BUCKETS_S, SlaWindows

__all__ = [
    "BUCKETS_S",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "SLA_PATH",
    "SlaRecorder",
    "decode_sketch",
    "encode_sketch",
    "merge",
    "next_close",
]

log = logging.getLogger("sidecar.sla")


def next_close(now: float, interval: float, *, first: bool = False) -> float:
    """When the open window closes (unix seconds): the next multiple of
    ``interval`` after ``now`` (the first window: after ``now + interval``, so
    that it is never shorter than one interval).  A window that closes late
    (the loop was busy) is followed by the next multiple after its close: a
    sidecar that fell behind skips, it does not burst."""
    return (math.floor((now + (interval if first else 0.0)) / interval) + 1) * interval


class SlaRecorder:
    """Records per-frame SLA samples (implements ``contract.SlaSink``).

    ``record()`` is thread-safe and costs a few microseconds.  ``await
    start()`` runs the reporter (and /metrics when ``cfg.metrics_addr`` is
    set); ``await stop()`` sends a final report and stops both.
    """

    def __init__(self, cfg: SidecarConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.instance = cfg.instance or f"{socket.gethostname()}/{os.getpid()}"
        self.windows = SlaWindows()
        self._reporter: QosdReporter | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None
        self.last_body: dict[str, Any] | None = None  # last body built (for debugging)
        self.registry.register(SlaCollector(self.windows))

    def record(self, s: SlaSample) -> None:
        self.windows.record(s)

    @property
    def reports_sent(self) -> int:
        """Reports qosd took."""
        return self._reporter.sent if self._reporter is not None else 0

    @property
    def reports_failed(self) -> int:
        """Reports not delivered (qosd away, or it refused them)."""
        return self._reporter.failed if self._reporter is not None else 0

    # ------------------------------------------------------------------ windows
    def roll(self) -> list[dict[str, Any]]:
        """Closes the current window and returns its POST bodies (one per
        stage name seen; normally one).  Updates the attainment gauge and
        merges the window into the cumulative sketches."""
        series, window_s = self.windows.close()
        reports = reports_by_stage(series, window_s, instance=self.instance,
                                   default_stage=self.cfg.stage)
        bodies = [r.model_dump(mode="json") for r in reports]
        self.last_body = bodies[0] if len(bodies) == 1 else {"bodies": bodies}
        return bodies

    def snapshot(self, cumulative: bool = False) -> list[dict[str, Any]]:
        """Report entries (the POST schema, plus "stage") for the current
        window, or, with ``cumulative``, everything since the recorder was
        made (``window_s``: its age, at most a day); does not reset anything."""
        series, window_s = self.windows.current(cumulative)
        return [{"stage": key[0], **class_report(key, w, window_s).model_dump(mode="json")}
                for key, w in series]

    # ------------------------------------------------------------------ reporting
    async def start(self, serve_metrics: bool = True) -> None:
        """Starts the reporter task (and /metrics on cfg.metrics_addr)."""
        if self._task is not None:
            return
        if serve_metrics and self.cfg.metrics_addr and self._metrics_server is None:
            self.serve(self.cfg.metrics_addr)
        sock = self.cfg.qosd.socket
        if sock is not None:
            if self._reporter is None:
                self._reporter = QosdReporter(sock, self.cfg.qosd.report_interval_s)
            self._reporter.open()
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
        if self._reporter is not None:
            with contextlib.suppress(Exception):
                await self._reporter.aclose()
        self.close_metrics()

    async def _run(self) -> None:
        interval = self.cfg.qosd.report_interval_s
        due = next_close(time.time(), interval, first=True)
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, due - time.time()))
            if self._stopping.is_set():
                return
            if time.time() < due:  # woke a little early (timer granularity): not yet
                continue
            due = next_close(time.time(), interval)
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
        reporter = self._reporter
        if reporter is None or not reporter.is_open:
            return False
        ok = True
        for body in bodies:
            ok = await reporter.post(body) and ok
        return ok

    # ------------------------------------------------------------------ /metrics
    def serve(self, addr: str | None = None) -> tuple[str, int]:
        """Serves /metrics on ``addr`` ("host:port", default cfg.metrics_addr;
        port 0 picks one) in a daemon thread; returns the bound address."""
        addr = addr or self.cfg.metrics_addr
        if not addr:
            raise ValueError("no metrics address (cfg.metrics_addr is not set)")
        if self._metrics_server is not None:
            raise RuntimeError("already serving /metrics")
        server, thread = serve_metrics(addr, self.registry)
        self._metrics_server, self._metrics_thread = server, thread
        bound = server.server_address
        return (str(bound[0]), int(bound[1]))

    def bind_counters(self, counters: Snapshottable) -> None:
        """Exports the sidecar's transport counters (``Sidecar.counters``) from
        this recorder's registry, read at scrape time."""
        self.registry.register(CountersCollector(self.cfg.stage, counters))

    def close_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._metrics_thread is not None:
            self._metrics_thread.join(5)
            self._metrics_thread = None
