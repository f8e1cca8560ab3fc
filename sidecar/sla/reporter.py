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

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import h11
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
MAX_ANSWER_BYTES = 64 * 1024  # qosd's answers are small; a longer one is cut and the connection closed


class _Closed(Exception):
    """The connection ended without a whole answer (qosd closed it, or it broke)."""


class _Conn:
    """One HTTP/1.1 connection to qosd's unix socket (h11 speaks the protocol;
    asyncio moves the bytes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=16 * 1024)
        self.used = time.monotonic()

    async def request(self, body: bytes) -> tuple[int, bytes]:
        c = self.h11
        out = c.send(h11.Request(method="POST", target=SLA_PATH, headers=[
            ("host", "qosd"), ("user-agent", "mmmesh-sidecar"),
            ("content-type", "application/json"), ("content-length", str(len(body)))]))
        out += c.send(h11.Data(data=body)) + c.send(h11.EndOfMessage())
        try:
            self.writer.write(out)
            await self.writer.drain()
        except OSError as e:
            raise _Closed(f"write: {e}") from e
        status, answer = 0, bytearray()
        while True:
            try:  # a stream that ends before the answer does is a RemoteProtocolError
                ev = c.next_event()
            except h11.RemoteProtocolError as e:
                raise _Closed(f"qosd's answer: {e}") from e
            if ev is h11.NEED_DATA:
                try:
                    data = await self.reader.read(65536)
                except OSError as e:
                    raise _Closed(f"read: {e}") from e
                c.receive_data(data)  # b"": the end of the stream
                continue
            if isinstance(ev, h11.ConnectionClosed):
                raise _Closed("closed without an answer")
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                if len(answer) < MAX_ANSWER_BYTES:
                    answer += ev.data[:MAX_ANSWER_BYTES - len(answer)]
            elif isinstance(ev, h11.EndOfMessage):
                self.used = time.monotonic()
                return status, bytes(answer)

    def reusable(self) -> bool:
        """Both sides done and neither asked to close: ready for the next request."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.writer.close()


class QosdReporter:
    """POSTs report bodies to qosd's unix socket ``path``; counts what was
    taken (``sent``) and what was not (``failed``).

    HTTP/1.1 with h11 (the protocol, sans I/O) over an asyncio unix stream: the
    sidecar needs one small request kind, and a full HTTP client (httpx: ~0.7 s
    of import and 7-16 MB of RSS, docs/sidecar.md "Footprint") was most of the
    sidecar's own footprint.  One connection, kept for reuse only within
    ``KEEPALIVE_S`` of its last answer (qosd closes one idle for 5 s); a whole
    request, connect to answer, within ``max(0.5, min(5, interval_s))`` s."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = max(0.5, min(5.0, interval_s))
        self.sent = 0
        self.failed = 0
        self.retried = 0  # reports sent again after a connection closed without an answer
        self._failing: str | None = None  # the kind of failure while qosd refuses / is away
        self._open = False
        self._conn: _Conn | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        self._open = True

    async def aclose(self) -> None:
        self._open = False
        self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def _connection(self) -> _Conn:
        conn = self._conn
        if conn is not None and time.monotonic() - conn.used <= KEEPALIVE_S:
            return conn
        self._drop()
        reader, writer = await asyncio.open_unix_connection(str(self.path), limit=65536)
        self._conn = _Conn(reader, writer)
        return self._conn

    async def _send(self, body: bytes) -> tuple[int, bytes]:
        conn = await self._connection()
        try:
            status, answer = await conn.request(body)
        except BaseException:
            self._drop()
            raise
        if not conn.reusable():
            self._drop()
        return status, answer

    async def post(self, body: dict[str, Any]) -> bool:
        """True when qosd took the report; False when it failed or refused it
        (or the reporter is closed)."""
        if not self._open:
            return False
        try:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            self._failed(f"cannot encode the report: {e}", kind="encode")
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    status, answer = await self._send(data)
                except _Closed:
                    # a connection qosd closed as we sent on it: once more on a new
                    # one (a report replaces its own window: a repeat is harmless)
                    self.retried += 1
                    status, answer = await self._send(data)
        except (OSError, _Closed, TimeoutError) as e:
            kind = "Timeout" if isinstance(e, TimeoutError) else type(e).__name__
            self._failed(f"{kind}: {e}" if str(e) else kind, kind=kind)
            return False
        if status >= 300:
            self._failed(f"HTTP {status}: {answer[:300].decode(errors='replace')}",
                         kind=str(status))
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
