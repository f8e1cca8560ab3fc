"""Reporting SLA windows to qosd: ``POST /v1/sla`` on its report-only unix socket.

A report is built with the one schema of it, :mod:`mmmesh.sla.report` (the
models qosd validates the request with): per stage one ``SlaReport`` with one
``SlaClassReport`` per (class, modality) seen since start::

    {"node": null, "stage": "asr", "instance": "asr-7d9f-x2k/1",
     "reports": [{"sla_class": "voice", "modality": "audio", "window_s": 5.0,
                  "frames": 250, "deadline_misses": 3, "drops": 1, "errors": 0,
                  "attainment": 0.984,
                  "e2e_ms": {"p50": 41.2, "p90": 63.0, "p99": 97.5, "max": 120.3} | null,
                  "queue_ms": {...} | null, "service_ms": {...} | null,
                  "sketch_e2e": "<base64 DDSketch protobuf, values in ms>" | null}]}

A series idle in a window is still reported (frames 0, the ``*_ms`` null);
``sketch_e2e`` is null when ddsketch's protobuf support does not import.
qosd being absent or failing never blocks or breaks the sidecar: a report
that could not be delivered is dropped, with one warning per outage.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
from ddsketch import DDSketch

from mmmesh.sla import (
    MAX_WINDOW_S,
    Quantiles,
    SlaClassReport,
    SlaReport,
    attainment,
    encode_sketch,
    summary,
)

from .windows import Key, Window

__all__ = ["SLA_PATH", "QosdReporter", "class_report", "reports_by_stage"]

log = logging.getLogger("sidecar.sla")

SLA_PATH = "/v1/sla"


def _quantiles(sketch: DDSketch) -> Quantiles | None:
    q = summary(sketch)
    return None if q is None else Quantiles.model_validate(q)


def class_report(key: Key, w: Window, window_s: float) -> SlaClassReport:
    """One series' window as reported.  ``window_s`` is capped at the schema's
    ``MAX_WINDOW_S`` (a day; only a since-start view is ever that long)."""
    c = w.counts
    return SlaClassReport(
        sla_class=key[1],
        modality=key[2],
        window_s=min(window_s, MAX_WINDOW_S),
        frames=c.frames,
        deadline_misses=c.misses,
        drops=c.drops,
        errors=c.errors,
        attainment=attainment(c.frames, c.met),
        e2e_ms=_quantiles(w.e2e),
        queue_ms=_quantiles(w.queue),
        service_ms=_quantiles(w.service),
        sketch_e2e=encode_sketch(w.e2e),
    )


def reports_by_stage(series: list[tuple[Key, Window]], window_s: float, *, instance: str,
                     default_stage: str) -> list[SlaReport]:
    """One report per stage name in ``series`` (normally one); an empty one
    for ``default_stage`` when no series was seen yet."""
    by_stage: dict[str, list[SlaClassReport]] = {}
    for key, w in series:
        by_stage.setdefault(key[0], []).append(class_report(key, w, window_s))
    if not by_stage:
        by_stage[default_stage] = []
    return [SlaReport(node=None, stage=stage, instance=instance, reports=reps)
            for stage, reps in by_stage.items()]


KEEPALIVE_S = 1.0  # reuse a connection to qosd only this long after its last use


class QosdReporter:
    """POSTs report bodies to qosd's unix socket ``path``; counts what was
    taken (``sent``) and what was not (``failed``)."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self.sent = 0
        self.failed = 0
        self.retried = 0  # reports sent again after a closed kept-alive connection
        self._failing: str | None = None  # the kind of failure while qosd refuses / is away
        self._client: httpx.AsyncClient | None = None

    @property
    def is_open(self) -> bool:
        return self._client is not None

    def open(self) -> None:
        if self._client is None:
            # qosd closes a connection idle for 5 s (qosd/httpd/http11.py): reuse one
            # only within KEEPALIVE_S of its last answer, well before that
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(
                    uds=str(self.path),
                    limits=httpx.Limits(max_connections=1, keepalive_expiry=KEEPALIVE_S)),
                base_url="http://qosd", timeout=max(0.5, min(5.0, self.interval_s)),
                headers={"user-agent": "mmmesh-sidecar"},
            )

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def post(self, body: dict[str, Any]) -> bool:
        """True when qosd took the report; False when it failed or refused it
        (or the reporter is closed)."""
        if self._client is None:
            return False
        try:
            try:
                r = await self._client.post(SLA_PATH, json=body)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # a kept-alive connection qosd closed as we sent on it: once more on
                # a new one (a report replaces its own window: a repeat is harmless)
                self.retried += 1
                r = await self._client.post(SLA_PATH, json=body)
        except httpx.HTTPError as e:
            self._failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
                         kind=type(e).__name__)
            return False
        if r.status_code >= 300:
            self._failed(f"HTTP {r.status_code}: {r.text[:300]}", kind=str(r.status_code))
            return False
        self.sent += 1
        if self._failing is not None:
            log.info("qosd at %s takes SLA reports again", self.path)
            self._failing = None
        return True

    def _failed(self, why: str, kind: str) -> None:
        self.failed += 1
        if self._failing != kind:  # once per outage (and once more if the reason changes)
            log.warning("SLA report to qosd at %s failed (%s); retrying every %ss, "
                        "reported once per outage", self.path, why, self.interval_s)
            self._failing = kind
