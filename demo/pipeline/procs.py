"""The pipeline demo's processes (:mod:`demo.pipeline.run`): each runs in
a child inside its node's namespace, gets a :class:`~.testbed.Ctl` first,
says ready, and stops by itself at a wall-clock deadline.

* :func:`sidecar_child`: one stage's sidecar (``sidecar.main.Sidecar``); with
  a qosd socket in its config it reports its SLA window there when it stops
  (``sidecar.sla.SlaRecorder``, as ``mmmesh-sidecar`` does);
* :func:`sensors_child`: camera, microphone and LiDAR; with ``sla_socket`` it
  reports, as stage ``sensors``, how long each item took to be handed to the
  uplink's sender (a skipped tick is a dropped frame);
* :func:`collector_child`: receives the decoder's scores;
* :func:`flood_sink_child`: where the background video flood goes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo import EXAMPLES
from demo.testbed import Ctl

EXAMPLE_DIR = EXAMPLES / "pipeline"
STREAM_ID = 1  # the three sensor streams of one scene share it; fusion keys on it
SENSORS_STAGE = "sensors"  # the stage name the sensors report their SLA windows as

# modality -> (stage config file, wire modality byte, deadline ms, SLA class name)
MODALITIES: dict[str, tuple[str, int, float, str]] = {
    "audio": ("audio.yaml", 4, 50.0, "voice"),
    "video": ("vision.yaml", 3, 200.0, "video"),
    "lidar": ("lidar.yaml", 5, 150.0, "lidar"),
}
WIRE_NAMES = {"audio": "audio", "video": "video", "lidar": "point_cloud"}


def realtime(prio: int = 10) -> bool:
    """Switches the calling process to SCHED_FIFO ``prio`` (as audio stacks run
    their audio threads, e.g. through rtkit); False where it is not allowed."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(prio))
    except (AttributeError, OSError):
        return False
    return True


def _run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _sleep_until(wall: float) -> None:
    d = wall - time.time()
    if d > 0:
        await asyncio.sleep(d)


class _Samples:
    """An SlaSink keeping (modality, e2e ns, missed, dropped, error) per frame."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int | None, bool, bool, bool]] = []

    def record(self, s: Any) -> None:
        self.rows.append((s.modality, s.e2e_ns, s.deadline_missed, s.dropped, s.error))


class _Tee:
    """An SlaSink handing every sample to each of ``sinks``."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def record(self, s: Any) -> None:
        for sink in self.sinks:
            sink.record(s)


def sidecar_child(ctl: Ctl, cfg_data: dict[str, Any], stop_wall: float,
                  keep_samples: bool = False, rt: bool = False) -> dict[str, Any]:
    """One stage's sidecar until ``stop_wall``, then a short drain (and, with
    ``qosd.socket`` set, its SLA window reported to that qosd); ``rt``: under
    SCHED_FIFO (:func:`realtime`)."""
    if rt:
        realtime()
    from demo.pipeline.stages import make_runner
    from sidecar.config import SidecarConfig
    from sidecar.main import Sidecar
    from sidecar.sla import SlaRecorder

    cfg = SidecarConfig.model_validate(cfg_data)
    samples = _Samples() if keep_samples else None

    async def main() -> dict[str, Any]:
        recorder = SlaRecorder(cfg) if cfg.qosd.socket is not None else None
        if recorder is not None:
            await recorder.start(serve_metrics=False)
        sink = _Tee(samples, recorder) if samples or recorder else None
        sc = Sidecar(cfg, runner=make_runner(cfg), sink=sink, backoff_max=0.2)
        await sc.start()
        ctl.ready(sc.port)
        await _sleep_until(stop_wall)
        clean = await sc.stop(timeout=1.0)
        out: dict[str, Any] = {"stage": cfg.stage, "clean": clean,
                               "counters": sc.counters.snapshot(),
                               "samples": samples.rows if samples else []}
        if recorder is not None:
            await recorder.stop()
            out["sla_reports"] = {"sent": recorder.reports_sent,
                                  "failed": recorder.reports_failed}
        return out

    return _run_async(main())  # type: ignore[no-any-return]


def collector_child(ctl: Ctl, listen: str, stop_wall: float,
                    keep_scores: bool = False) -> dict[str, Any]:
    """Receives the decoder's outputs: per frame (sequence, e2e ns, error, scores)."""
    from sidecar.config import Limits, Listen
    from sidecar.contract import tensor_from_frame
    from sidecar.transport import FrameServer

    async def main() -> dict[str, Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        server = FrameServer(Listen(tcp=listen, udp=None), Limits(), q, name="results")
        await server.start()
        ctl.ready(server.port)
        rows: list[dict[str, Any]] = []

        async def consume() -> None:
            while True:
                f = await q.get()
                h = f.header
                row: dict[str, Any] = {"stream": h.stream_id, "seq": h.sequence,
                                       "e2e_ns": (f.received_ns - h.timestamp_ns
                                                  if h.timestamp_ns else None)}
                if h.error is not None:
                    row["error"] = list(h.error)
                elif keep_scores:
                    row["scores"] = tensor_from_frame(h, f.payload).tolist()
                rows.append(row)

        task = asyncio.get_running_loop().create_task(consume())
        await _sleep_until(stop_wall)
        await server.close(grace=0.5)
        while not q.empty():
            await asyncio.sleep(0)
        task.cancel()
        return {"rows": rows, "counters": server.counters.snapshot()}

    return _run_async(main())  # type: ignore[no-any-return]


@dataclass(frozen=True)
class SourceSpec:
    tick_s: float = 0.050
    exact_ticks: int = 0  # > 0: exactly these ticks with exact seeded data, then stop
    cycle: int = 4  # else: this many precomputed items per sensor, cycled
    deadlines_ms: tuple[tuple[str, float], ...] = (("audio", 50.0), ("video", 200.0),
                                                   ("lidar", 150.0))
    per_tick: tuple[tuple[str, int], ...] = ()  # items per tick of a modality (default 1),
    # evenly spaced, all with the tick's sequence (fusion aligns on it): e.g. audio 5,
    # a 50 ms chunk every 10 ms, as a streaming speech front end hops

    def items_per_tick(self, m: str) -> int:
        return max(1, dict(self.per_tick).get(m, 1))


class _SensorSla:
    """The sensors' SLA window, reported to qosd once, at the end (stage
    ``sensors``): per item the time from capture until the sender took it;
    a skipped tick is a dropped frame (it missed its deadline)."""

    def __init__(self, sla_socket: str, node: str) -> None:
        from sidecar.sla.windows import SlaWindows

        self.path = Path(sla_socket)
        self.instance = f"{node}/{SENSORS_STAGE}"
        self.windows = SlaWindows()

    def record(self, m: str, ts_ns: int | None, deadline_ms: float) -> None:
        from sidecar.contract import SlaSample

        now = time.time_ns()
        took = None if ts_ns is None else now - ts_ns
        self.windows.record(SlaSample(
            stage=SENSORS_STAGE, sla_class=MODALITIES[m][3], modality=WIRE_NAMES[m],
            queue_ns=0, service_ns=took or 0, e2e_ns=took,
            deadline_missed=took is None or took > deadline_ms * 1e6, dropped=took is None))

    async def report(self) -> dict[str, int]:
        from sidecar.sla.reporter import QosdReporter, reports_by_stage

        series, window_s = self.windows.close()
        reporter = QosdReporter(self.path, 5.0)
        reporter.open()
        try:
            for r in reports_by_stage(series, window_s, instance=self.instance,
                                      default_stage=SENSORS_STAGE):
                await reporter.post(r.model_dump(mode="json"))
        finally:
            await reporter.aclose()
        return {"sent": reporter.sent, "failed": reporter.failed}


def sensors_child(ctl: Ctl, targets: dict[str, str], spec: SourceSpec, start_wall: float,
                  stop_wall: float, sla_socket: str | None = None,
                  node: str = "sensors", rt: bool = False) -> dict[str, Any]:
    """Camera, microphone and LiDAR: one item per tick each, sent with the
    sidecar's FrameSender (zero-copy) to the edge encoders.  A sensor that
    falls behind its schedule (its uplink is backed up) skips ticks, as a
    driver drops frames; skipped ticks count as produced and missed.  With
    ``sla_socket``: the window reported there at the end (:class:`_SensorSla`).
    ``rt``: under SCHED_FIFO (:func:`realtime`), e.g. a microphone alone."""
    if rt:
        realtime()
    from demo.pipeline import stages
    from mmmesh.wire import Header
    from sidecar.config import Limits, Output
    from sidecar.contract import tensor_spec
    from sidecar.transport import FrameSender

    gens: dict[str, Callable[[int], Any]] = {
        "video": stages.video_frame, "audio": stages.audio_chunk, "lidar": stages.lidar_sweep}
    meta: dict[str, dict[str, Any]] = {"video": {"fps": round(1 / spec.tick_s)},
                                       "audio": {"bitrate": stages.SAMPLE_RATE * 32},
                                       "lidar": {"density": stages.LIDAR_POINTS}}
    deadlines = dict(spec.deadlines_ms)
    sla = _SensorSla(sla_socket, node) if sla_socket else None
    cached: dict[str, list[Any]] = {}
    if not spec.exact_ticks:
        cached = {m: [g(i) for i in range(spec.cycle)] for m, g in gens.items()}

    async def main() -> dict[str, Any]:
        limits = Limits(outbound_queue=8)
        senders = {}
        for m, addr in targets.items():
            o = Output(name=m, address=addr, modality="point_cloud" if m == "lidar" else m,
                       sla_class=MODALITIES[m][3])
            s = FrameSender(o, limits, backoff_initial=0.02, backoff_max=0.2)
            await s.start()
            senders[m] = s
        ctl.ready()
        loop = asyncio.get_running_loop()
        start = loop.time() + (start_wall - time.time())
        stop = loop.time() + (stop_wall - time.time())
        stats: dict[str, dict[str, Any]] = {m: {"produced": 0, "sent": 0, "skipped": 0}
                                            for m in targets}

        async def sensor(m: str) -> None:
            s, st = senders[m], stats[m]
            modality = MODALITIES[m][1]
            per = spec.items_per_tick(m)
            item = 0
            while True:
                tick, t = item // per, start + item * spec.tick_s / per
                if spec.exact_ticks and tick >= spec.exact_ticks:
                    break
                if not spec.exact_ticks and t >= stop:
                    break
                now = loop.time()
                if now < t:
                    await asyncio.sleep(t - now)
                elif now - t > spec.tick_s and not spec.exact_ticks:  # behind: skip this tick
                    st["produced"] += 1
                    st["skipped"] += 1
                    item += 1
                    if sla is not None:
                        sla.record(m, None, deadlines[m])
                    continue
                data = gens[m](tick) if spec.exact_ticks else cached[m][tick % spec.cycle]
                ts = time.time_ns()
                h = Header(modality=modality, stream_id=STREAM_ID, sequence=tick,
                           timestamp_ns=ts, deadline_ns=ts + int(deadlines[m] * 1e6),
                           tensor=tensor_spec(data), **meta[m])
                st["produced"] += 1
                await s.send(h, data)
                st["sent"] += 1
                if sla is not None:
                    sla.record(m, ts, deadlines[m])
                item += 1

        await asyncio.gather(*(sensor(m) for m in targets))
        for s in senders.values():
            await s.flush(max(0.5, stop_wall - time.time() + 0.5))
        for m, s in senders.items():
            stats[m]["sender"] = s.counters.snapshot()
            await s.close()
        if sla is not None:
            stats["sla_reports"] = await sla.report()
        return stats

    return _run_async(main())  # type: ignore[no-any-return]


def flood_sink_child(ctl: Ctl, port: int, stop_wall: float) -> dict[str, Any]:
    """A UDP socket the flood is sent to, never read: the kernel drops what
    overflows its small receive buffer (no ICMP, no CPU spent here)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    s.bind(("0.0.0.0", port))
    ctl.ready()
    while time.time() < stop_wall:
        time.sleep(min(0.2, max(0.0, stop_wall - time.time())))
    s.close()
    return {}


__all__ = ["MODALITIES", "SENSORS_STAGE", "STREAM_ID", "SourceSpec", "collector_child",
           "flood_sink_child", "realtime", "sensors_child",
           "sidecar_child"]
