"""sidecar.sla: sketches, windows, Prometheus families, the qosd reporter, merge."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Self

import httpx
import numpy as np
import pytest
from ddsketch import DDSketch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmmesh.sla.report import SlaReport
from qosd import api
from sidecar.config import SidecarConfig
from sidecar.contract import SlaSample
from sidecar.sla import (
    BUCKETS_S,
    RELATIVE_ACCURACY,
    SlaRecorder,
    decode_sketch,
    encode_sketch,
    merge,
)

MS = 1_000_000  # ns


def make_cfg(socket: Path | None = None, interval: float = 5.0, **kw: Any) -> SidecarConfig:
    return SidecarConfig.model_validate({
        "stage": "asr",
        "runner": {"kind": "python", "target": "examples.x:y"},
        "qosd": {"socket": socket, "report_interval_s": interval},
        **kw,
    })


def sample(e2e_ms: float | None = 10.0, queue_ms: float = 1.0, service_ms: float = 5.0, *,
           cls: str = "voice", modality: str = "audio", stage: str = "asr",
           missed: bool = False, dropped: bool = False, error: bool = False) -> SlaSample:
    return SlaSample(stage=stage, sla_class=cls, modality=modality,
                     queue_ns=int(queue_ms * MS), service_ns=int(service_ms * MS),
                     e2e_ns=None if e2e_ms is None else int(e2e_ms * MS),
                     deadline_missed=missed, dropped=dropped, error=error)


def within(got: float, want: float, rel: float = 0.02) -> bool:
    return abs(got - want) <= rel * abs(want)


def true_q(values: list[float], q: float) -> float:
    # DDSketch's rank is q * (n - 1), the lower value at that rank
    return float(np.quantile(np.asarray(values), q, method="lower"))


def only(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(bodies) == 1
    return bodies[0]


# --------------------------------------------------------------------------
# Sketches and windows
# --------------------------------------------------------------------------
def test_quantiles_of_known_distributions() -> None:
    rng = random.Random(7)
    rec = SlaRecorder(make_cfg())
    e2e, queue, service = [], [], []
    for _ in range(20_000):
        e = rng.lognormvariate(3.5, 0.6)  # ms, median ~33 ms, long tail
        q = rng.expovariate(1 / 2.0)  # ms
        s = rng.uniform(5.0, 15.0)  # ms
        # the recorder sees whole nanoseconds
        e2e.append(int(e * MS) / MS)
        queue.append(int(q * MS) / MS)
        service.append(int(s * MS) / MS)
        rec.record(sample(e, q, s))
    rep = only(rec.roll())["reports"][0]
    assert rep["frames"] == 20_000
    for field, values in (("e2e_ms", e2e), ("queue_ms", queue), ("service_ms", service)):
        got = rep[field]
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            want = true_q(values, q)
            assert within(got[name], want, RELATIVE_ACCURACY + 0.001), (field, name, got, want)
        assert got["max"] == pytest.approx(max(values), abs=1e-4)  # exact (rounded to 0.1 us)


def test_window_resets_and_cumulative_keeps() -> None:
    rec = SlaRecorder(make_cfg())
    for i in range(100):
        rec.record(sample(e2e_ms=10.0 + i, missed=i < 10))
    first = only(rec.roll())["reports"][0]
    assert (first["frames"], first["deadline_misses"]) == (100, 10)
    assert first["window_s"] > 0

    # the next window starts empty; the series is still reported (idle)
    idle = only(rec.roll())["reports"]
    assert len(idle) == 1
    assert idle[0]["frames"] == 0 and idle[0]["deadline_misses"] == 0
    assert idle[0]["e2e_ms"] is None and idle[0]["queue_ms"] is None
    assert idle[0]["service_ms"] is None and idle[0]["attainment"] == 1.0

    for _ in range(50):
        rec.record(sample(e2e_ms=500.0))
    cur = rec.snapshot()[0]
    assert cur["frames"] == 50 and cur["e2e_ms"]["p50"] == pytest.approx(500, rel=0.01)
    cum = rec.snapshot(cumulative=True)[0]
    assert cum["frames"] == 150 and cum["deadline_misses"] == 10
    assert cum["attainment"] == pytest.approx(140 / 150)
    assert cum["e2e_ms"]["max"] == pytest.approx(500, rel=0.01)
    assert cum["e2e_ms"]["p50"] < 200  # both windows are in it
    third = only(rec.roll())["reports"][0]
    assert third["frames"] == 50 and third["deadline_misses"] == 0
    # snapshot does not reset; roll does
    assert rec.snapshot()[0]["frames"] == 0


def test_attainment_ratio_and_gauge() -> None:
    reg = CollectorRegistry()
    rec = SlaRecorder(make_cfg(), registry=reg)
    labels = {"stage": "asr", "class": "voice", "modality": "audio"}
    for i in range(100):
        # 7 late, 3 dropped (overload, not late): 90 within their deadline
        rec.record(sample(missed=i < 7, dropped=7 <= i < 10))
    # before any window closed the gauge shows the current window
    assert reg.get_sample_value("mmmesh_stage_sla_attainment_ratio", labels) == pytest.approx(0.9)
    rep = only(rec.roll())["reports"][0]
    assert rep["attainment"] == pytest.approx(0.9)
    assert (rep["deadline_misses"], rep["drops"]) == (7, 3)
    for _ in range(10):
        rec.record(sample(missed=True))
    # the gauge is the last closed window, not the running one
    assert reg.get_sample_value("mmmesh_stage_sla_attainment_ratio", labels) == pytest.approx(0.9)
    assert only(rec.roll())["reports"][0]["attainment"] == 0.0
    assert reg.get_sample_value("mmmesh_stage_sla_attainment_ratio", labels) == 0.0
    rec.roll()  # an idle window: nothing was late
    assert reg.get_sample_value("mmmesh_stage_sla_attainment_ratio", labels) == 1.0


def test_dropped_and_missing_e2e_and_clamping() -> None:
    rec = SlaRecorder(make_cfg())
    rec.record(sample(e2e_ms=None, queue_ms=2, service_ms=3))
    rec.record(sample(e2e_ms=50, queue_ms=4, service_ms=0, dropped=True, missed=True))
    rec.record(sample(e2e_ms=-5, queue_ms=1, service_ms=1))  # clock skew
    rep = only(rec.roll())["reports"][0]
    assert rep["frames"] == 3 and rep["drops"] == 1 and rep["deadline_misses"] == 1
    assert rep["e2e_ms"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}  # only the skewed
    assert rep["queue_ms"]["max"] == pytest.approx(4)  # the drop's queueing counts
    assert rep["service_ms"]["max"] == pytest.approx(3)  # the drop's service does not


def test_series_are_separate() -> None:
    rec = SlaRecorder(make_cfg())
    rec.record(sample(cls="voice", modality="audio"))
    rec.record(sample(cls="video", modality="video"))
    rec.record(sample(cls="video", modality="video", error=True))
    reps = {(r["sla_class"], r["modality"]): r for r in only(rec.roll())["reports"]}
    assert set(reps) == {("voice", "audio"), ("video", "video")}
    assert reps[("video", "video")]["frames"] == 2 and reps[("video", "video")]["errors"] == 1


def test_record_is_thread_safe() -> None:
    rec = SlaRecorder(make_cfg())
    n, workers = 5_000, 4

    def work() -> None:
        for i in range(n):
            rec.record(sample(e2e_ms=1 + i % 100, missed=i % 10 == 0))

    threads = [threading.Thread(target=work) for _ in range(workers)]
    rollers_done = threading.Event()
    rolled: list[dict[str, Any]] = []

    def roller() -> None:  # windows closing concurrently lose nothing
        while not rollers_done.is_set():
            rolled.extend(only(rec.roll())["reports"])
            time.sleep(0.001)

    r = threading.Thread(target=roller)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rollers_done.set()
    r.join()
    rolled.extend(only(rec.roll())["reports"])
    assert sum(x["frames"] for x in rolled) == n * workers
    assert sum(x["deadline_misses"] for x in rolled) == n * workers // 10
    assert rec.snapshot(cumulative=True)[0]["frames"] == n * workers


def test_record_cost() -> None:
    """record() is on every frame's path: it costs about what its three sketch
    inserts cost.  Measured against exactly that, interleaved in the same loop
    (a loaded host slows both alike).  The bug: per-frame work beyond the
    inserts, such as encoding or merging a sketch per frame (tens of us),
    logging, or waiting on a lock held while a window is reported."""
    rec = SlaRecorder(make_cfg())
    bare = DDSketch(RELATIVE_ACCURACY)
    rng = random.Random(1)
    samples = [sample(rng.lognormvariate(3, 1), rng.expovariate(1), rng.uniform(1, 9),
                      missed=rng.random() < 0.05) for _ in range(20_000)]
    for s in samples[:2_000]:  # warm up (sketch bins allocated)
        rec.record(s)
        bare.add(s.queue_ns * 1e-6)
    cost, base = [], []
    clock = time.perf_counter_ns
    for s in samples:
        t0 = clock()
        rec.record(s)
        t1 = clock()
        bare.add(s.queue_ns * 1e-6)
        bare.add(s.service_ns * 1e-6)
        bare.add((s.e2e_ns or 0) * 1e-6)
        t2 = clock()
        cost.append(t1 - t0)
        base.append(t2 - t1)
    med, med_base = statistics.median(cost) / 1000, statistics.median(base) / 1000
    p99 = sorted(cost)[int(len(cost) * 0.99)] / 1000
    print(f"\nSlaRecorder.record(): median {med:.2f} us, p99 {p99:.2f} us; "
          f"three sketch inserts: median {med_base:.2f} us")
    assert med < 10 * med_base, (med, med_base)


# --------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------
def test_prometheus_exposition() -> None:
    rec = SlaRecorder(make_cfg())
    for _ in range(10):
        rec.record(sample(e2e_ms=40, queue_ms=0.05, service_ms=12))
    rec.record(sample(e2e_ms=400, missed=True))
    rec.record(sample(dropped=True, missed=True))
    rec.record(sample(error=True, cls="video", modality="video"))
    text = generate_latest(rec.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["mmmesh_stage_latency_seconds"].type == "histogram"
    for name in ("mmmesh_stage_frames", "mmmesh_stage_deadline_misses", "mmmesh_stage_drops",
                 "mmmesh_stage_errors"):
        assert fams[name].type == "counter"
        for s in fams[name].samples:
            assert s.name == name + "_total"
            assert set(s.labels) == {"stage", "class", "modality"}
    assert fams["mmmesh_stage_sla_attainment_ratio"].type == "gauge"

    buckets = [s for s in fams["mmmesh_stage_latency_seconds"].samples
               if s.name.endswith("_bucket")]
    assert {frozenset(s.labels) for s in buckets} == {
        frozenset({"stage", "class", "modality", "kind", "le"})}
    assert {s.labels["kind"] for s in buckets} == {"queue", "service", "e2e"}
    les = sorted({float(s.labels["le"]) for s in buckets})
    assert les[0] == 0.0001 and les[-2] == 10.0 and les[-1] == float("inf")
    assert len(les) == len(BUCKETS_S) + 1

    v = {"stage": "asr", "class": "voice", "modality": "audio"}
    reg = rec.registry
    e2e = {**v, "kind": "e2e"}
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_bucket", {**e2e, "le": "0.03"}) == 0
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_bucket", {**e2e, "le": "0.05"}) == 10
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_bucket", {**e2e, "le": "0.5"}) == 11
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_count", e2e) == 11  # drop: no e2e
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_sum", e2e) == pytest.approx(0.8)
    queue = {**v, "kind": "queue", "le": "0.0001"}
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_bucket", queue) == 10
    assert reg.get_sample_value("mmmesh_stage_latency_seconds_count",
                                {**v, "kind": "queue"}) == 12  # the drop queued
    assert reg.get_sample_value("mmmesh_stage_frames_total", v) == 12
    assert reg.get_sample_value("mmmesh_stage_deadline_misses_total", v) == 2
    assert reg.get_sample_value("mmmesh_stage_drops_total", v) == 1
    assert reg.get_sample_value("mmmesh_stage_errors_total", v) == 0
    vid = {"stage": "asr", "class": "video", "modality": "video"}
    assert reg.get_sample_value("mmmesh_stage_errors_total", vid) == 1

    # counters are cumulative across windows
    rec.roll()
    rec.record(sample())
    assert reg.get_sample_value("mmmesh_stage_frames_total", v) == 13


def test_shared_registry_refuses_a_second_recorder() -> None:
    reg = CollectorRegistry()
    SlaRecorder(make_cfg(), registry=reg)
    with pytest.raises(ValueError, match="Duplicated"):
        SlaRecorder(make_cfg(), registry=reg)


def test_serve_metrics_over_http() -> None:
    rec = SlaRecorder(make_cfg(metrics_addr="127.0.0.1:0"))
    rec.record(sample())
    host, port = rec.serve()
    try:
        r = httpx.get(f"http://{host}:{port}/metrics", timeout=5)
        assert r.status_code == 200
        assert 'mmmesh_stage_frames_total{class="voice",modality="audio",stage="asr"} 1.0' in r.text
        assert "mmmesh_stage_latency_seconds_bucket{" in r.text
    finally:
        rec.close_metrics()


# --------------------------------------------------------------------------
# Mergeable sketches
# --------------------------------------------------------------------------
def test_sketch_roundtrip_and_mergeable_with_local() -> None:
    sk = DDSketch(RELATIVE_ACCURACY)
    for v in (0.0, 0.5, 3.0, 3.0, 1000.0):
        sk.add(v)
    back = decode_sketch(encode_sketch(sk) or "")
    assert back.count == sk.count
    for q in (0.0, 0.25, 0.5, 0.75, 1.0):
        assert back.get_quantile_value(q) == pytest.approx(sk.get_quantile_value(q), rel=1e-12)
    local = DDSketch(RELATIVE_ACCURACY)
    local.merge(back)  # same gamma: mergeable
    assert local.count == 5
    empty = decode_sketch(encode_sketch(DDSketch(RELATIVE_ACCURACY)) or "")
    assert empty.count == 0


def test_merge_equals_sketch_of_union() -> None:
    rng = random.Random(3)
    a, b = SlaRecorder(make_cfg()), SlaRecorder(make_cfg())
    va = [rng.lognormvariate(3.0, 0.5) for _ in range(8_000)]  # one replica: fast
    vb = [rng.lognormvariate(4.5, 0.3) for _ in range(2_000)]  # another: slow
    union = DDSketch(RELATIVE_ACCURACY)
    for rec, values, late_every in ((a, va, 10), (b, vb, 4)):
        for i, v in enumerate(values):
            rec.record(sample(e2e_ms=v, missed=i % late_every == 0))
            union.add(int(v * MS) / MS * 1.0)  # as the recorder saw it (ns resolution, ms)
    bodies = a.roll() + b.roll()
    summary = merge(bodies)
    assert len(summary["groups"]) == 1
    g = summary["groups"][0]
    assert (g["sla_class"], g["modality"], g["sources"]) == ("voice", "audio", 2)
    assert g["frames"] == 10_000
    assert g["deadline_misses"] == 800 + 500
    assert g["attainment"] == pytest.approx(1 - 1300 / 10_000)
    allv = [int(v * MS) / MS for v in va + vb]
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert g["e2e_ms"][name] == pytest.approx(union.get_quantile_value(q), abs=1e-4)
        assert within(g["e2e_ms"][name], true_q(allv, q), RELATIVE_ACCURACY + 0.001)
    assert g["e2e_ms"]["max"] == pytest.approx(max(allv), abs=1e-4)
    # the merged sketch travels on: decoding it gives the union again
    again = decode_sketch(g["sketch_e2e"])
    assert again.count == 10_000
    assert again.get_quantile_value(0.9) == pytest.approx(union.get_quantile_value(0.9))
    assert summary["total"]["frames"] == 10_000


def test_merge_groups_and_entries() -> None:
    a = SlaRecorder(make_cfg())
    a.record(sample(cls="voice", modality="audio"))
    a.record(sample(cls="video", modality="video", e2e_ms=None))
    b = SlaRecorder(make_cfg(stage="tts"))
    b.record(sample(stage="tts", cls="voice", modality="audio", missed=True))
    bodies = a.roll() + b.roll()
    by_stage = merge(bodies, by=("stage", "sla_class"))
    keys = [(g["stage"], g["sla_class"]) for g in by_stage["groups"]]
    assert keys == [("asr", "video"), ("asr", "voice"), ("tts", "voice")]
    video = by_stage["groups"][0]
    assert video["e2e_ms"] is None and video["frames"] == 1
    # bare report entries work too
    entries = [r for body in bodies for r in body["reports"]]
    total = merge(entries)["total"]
    assert total["frames"] == 3 and total["attainment"] == pytest.approx(2 / 3)
    assert merge([])["total"]["frames"] == 0


# --------------------------------------------------------------------------
# Reporter: a real HTTP server on a unix socket
# --------------------------------------------------------------------------
# the contract is the one report schema, the model qosd validates requests with
SlaBody = SlaReport


class FakeQosd:
    """POST /v1/sla on a unix socket, validated against qosd's request model
    (a stand-in that records the bodies; the real qosd takes them in
    tests/system/qosd/test_qosd.py::test_sidecar_replicas_are_merged_node_wide)."""

    def __init__(self, path: Path, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = status
        self.got = threading.Event()
        app = FastAPI()

        @app.post("/v1/sla")
        async def sla(body: SlaBody, request: Request) -> JSONResponse:
            self.bodies.append(await request.json())
            self.got.set()
            if self.status != 200:
                return JSONResponse({"error": "internal"}, status_code=self.status)
            return JSONResponse({"ok": True})

        self.server = api.bind_uds(app, path)

    def __enter__(self) -> Self:
        self.server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_reporter_posts_windows_to_qosd(tmp_path: Path) -> None:
    path = tmp_path / "qosd.sock"
    rec = SlaRecorder(make_cfg(socket=path, interval=0.1))

    async def main(q: FakeQosd) -> None:
        await rec.start()
        for i in range(200):
            rec.record(sample(e2e_ms=10 + i % 50, missed=i % 20 == 0))
        await wait_for(lambda: any(b["reports"] and b["reports"][0]["frames"] for b in q.bodies))
        for _ in range(30):
            rec.record(sample(cls="video", modality="video"))
        await rec.stop()  # lets a report in flight finish, then sends a final one

    with FakeQosd(path) as q:
        asyncio.run(main(q))
    assert rec.reports_failed == 0 and rec.reports_sent == len(q.bodies)
    for body in q.bodies:
        SlaBody.model_validate(body)  # the schema qosd accepts
        assert body["node"] is None and body["stage"] == "asr"
        for r in body["reports"]:
            assert 0.0 <= r["window_s"] < 5
            assert set(r) == {"sla_class", "modality", "window_s", "frames", "deadline_misses",
                              "drops", "errors", "attainment", "e2e_ms", "queue_ms",
                              "service_ms", "sketch_e2e"}
            decode_sketch(r["sketch_e2e"])
    # nothing lost between windows, nothing counted twice
    reps = [r for body in q.bodies for r in body["reports"]]
    voice = [r for r in reps if r["sla_class"] == "voice"]
    assert sum(r["frames"] for r in voice) == 200
    assert sum(r["deadline_misses"] for r in voice) == 10
    assert sum(r["frames"] for r in reps if r["sla_class"] == "video") == 30
    # the final report had the video frames recorded just before stop()
    assert any(r["sla_class"] == "video" and r["frames"] for r in q.bodies[-1]["reports"])
    merged = merge(q.bodies)["total"]
    assert merged["frames"] == 230


def test_reporter_survives_absent_qosd_and_recovers(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "qosd.sock"  # nothing listens yet
    rec = SlaRecorder(make_cfg(socket=path, interval=0.05))

    async def main() -> None:
        caplog.set_level(logging.INFO, logger="sidecar.sla")
        await rec.start()
        for _ in range(5):
            rec.record(sample())
        await wait_for(lambda: rec.reports_failed >= 4)
        rec.record(sample())  # the event loop and record() are fine
        warnings = [r for r in caplog.records
                    if r.name == "sidecar.sla" and r.levelno == logging.WARNING]
        assert len(warnings) == 1  # once per outage
        assert "qosd.sock" in warnings[0].getMessage()
        with FakeQosd(path) as q:  # qosd comes (back)
            await wait_for(lambda: q.got.is_set())
            rec.record(sample(e2e_ms=77))
            await wait_for(lambda: any(r["frames"] for b in q.bodies for r in b["reports"]))
            sent = rec.reports_sent
            await wait_for(lambda: rec.reports_sent > sent)  # its answer was seen
        assert any("again" in r.getMessage() for r in caplog.records)
        await rec.stop()  # qosd gone again: the final report fails quietly, stop() returns

    asyncio.run(asyncio.wait_for(main(), 30))
    assert rec.reports_sent >= 1


def test_reporter_survives_qosd_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "qosd.sock"
    rec = SlaRecorder(make_cfg(socket=path, interval=0.05))

    async def main(q: FakeQosd) -> None:
        await rec.start()
        rec.record(sample())
        await wait_for(lambda: len(q.bodies) >= 3)
        q.status = 200
        await wait_for(lambda: rec.reports_sent >= 1)
        await rec.stop()

    with caplog.at_level(logging.INFO, logger="sidecar.sla"), FakeQosd(path, status=500) as q:
        asyncio.run(asyncio.wait_for(main(q), 30))
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "sidecar.sla" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 500" in warnings[0]
    assert rec.reports_failed >= 3


class ClosingQosd:
    """A unix socket server that reads each request whole and, for the first
    ``close_first`` connections, closes without answering (a kept-alive
    connection qosd closed just as the report went out); then answers 200."""

    def __init__(self, path: Path, close_first: int) -> None:
        import socket as so

        self.close_first, self.requests, self.closed = close_first, 0, 0
        self.sock = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                               if ln.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                self.requests += 1
                if self.closed < self.close_first:
                    self.closed += 1
                    continue  # closed without an answer
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 11\r\nconnection: close\r\n\r\n{\"ok\": true}")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("close_first, taken, retried, failed", [(1, True, 1, 0),
                                                                   (2, False, 1, 1)])
def test_reporter_sends_once_more_on_a_connection_closed_without_an_answer(
        tmp_path: Path, close_first: int, taken: bool, retried: int, failed: int) -> None:
    """One retry on a new connection (qosd closes a connection idle for 5 s,
    which raced a sidecar reporting every 5 s: one window in five was lost);
    never more than one, and the failure is counted."""
    from sidecar.sla.reporter import KEEPALIVE_S, QosdReporter

    assert KEEPALIVE_S < 5.0  # below qosd's keep-alive timeout (qosd/httpd/http11.py)
    server = ClosingQosd(tmp_path / "q.sock", close_first)
    rep = QosdReporter(tmp_path / "q.sock", interval_s=1.0)

    async def main() -> bool:
        rep.open()
        try:
            return await rep.post({"stage": "asr", "reports": []})
        finally:
            await rep.aclose()

    try:
        assert asyncio.run(asyncio.wait_for(main(), 10)) is taken
    finally:
        server.close()
    assert (rep.retried, rep.failed, rep.sent) == (retried, failed, int(taken))
    assert server.requests == 2


def test_no_qosd_socket_still_rolls_windows() -> None:
    reg = CollectorRegistry()
    rec = SlaRecorder(make_cfg(socket=None, interval=0.05), registry=reg)
    labels = {"stage": "asr", "class": "voice", "modality": "audio"}

    async def main() -> None:
        await rec.start()
        rec.record(sample(missed=True))
        rec.record(sample())
        await wait_for(lambda: rec.last_body is not None
                       and any(r["frames"] for r in rec.last_body["reports"]))
        assert reg.get_sample_value("mmmesh_stage_sla_attainment_ratio", labels) == 0.5
        await rec.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert rec.reports_sent == 0 and rec.reports_failed == 0


def test_transport_counters_are_exported_at_scrape_time() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    class Counters:
        def __init__(self) -> None:
            self.n = 0

        def snapshot(self) -> dict[str, Any]:
            self.n += 1
            return {"server": {"frames_in": 10 * self.n, "bytes_in": 5,
                               "malformed": {"bad_magic": 2}, "conn_closed": {"eof": 1}},
                    "stage": {"in_flight": 1, "errors": {"STAGE_FAILED": 3}},
                    "senders": {"fusion": {"frames_out": 7, "dropped_deadline": 1,
                                           "dropped_overload": 0, "reconnects": 2,
                                           "connected": True}}}

    reg = CollectorRegistry()
    rec = SlaRecorder(make_cfg(), registry=reg)
    c = Counters()
    rec.bind_counters(c)
    first = generate_latest(reg).decode()
    second = generate_latest(reg).decode()
    assert 'mmmesh_sidecar_frames_received_total{stage=' in first
    assert 'mmmesh_sidecar_malformed_frames_total{reason="bad_magic"' in first
    assert 'mmmesh_sidecar_frames_sent_total{output="fusion"' in first
    assert first != second  # read when scraped, not copied once
