"""The multimodal pipeline demo: real model stages in sidecars on three netns nodes.

::

    [sensors] up0 10.202.1.1 --veth, shaped--> eth0 10.202.1.2 [edge] core0 10.202.2.1 --veth--> eth0 10.202.2.2 [core]
     camera  -> video frames  (uint8 360x640x3, 20/s) -> vision-encoder (python) --+
     mic     -> audio chunks  (50 ms PCM, 20/s)       -> audio-frontend (python) --+--> fusion --> decoder (onnx) --> results
     LiDAR   -> sweeps        (16384 x 4, 20/s)       -> lidar-encoder  (onnx)   --+    (python)
     + a background video flood (paced UDP, MMH video frames) from sensors to edge

Every stage is an mmmesh sidecar (``sidecar.main.Sidecar``) in its own
process inside its node's namespace, configured by the YAML files in
``examples/pipeline/config/``; the stages are ``examples/pipeline/stages.py``
and the ONNX models ``make_onnx.py`` builds (into a temporary directory).

The sensors' uplink is shaped to ``rate`` with the mesh off (one HTB class
and one FIFO: ``netlab.Lab.apply_fifo``), then with the mesh on
(``Dataplane.up`` with examples/policy.yaml, its link set to ``up0`` at
``rate``).  Per modality the result is the SLA attainment: the share of the
frames the sensors produced that reached fusion on the core node within
their deadline (audio 50 ms, video 200 ms, LiDAR 150 ms after capture).

    mmmesh demo --pipeline [--rate 300mbit] [--duration 8] [--flood 0.5] [--json]

(the command line and the table are in ``pipeline_cli.py``).

Needs root.  Namespaces are removed, and every process stopped, on exit,
failure, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..dataplane import Dataplane, DataplaneStatus, handle
from .netlab import Lab
from .testbed import Child, Ctl, NetnsLab

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DIR = REPO / "examples" / "pipeline"
CONFIG_DIR = EXAMPLE_DIR / "config"

UPLINK = "up0"  # sensors -> edge: the shaped uplink
EDGE_IF, EDGE_CORE_IF, CORE_IF = "eth0", "core0", "eth0"
SENSORS_ADDR, EDGE_ADDR = "10.202.1.1", "10.202.1.2"
EDGE_CORE_ADDR, CORE_ADDR = "10.202.2.1", "10.202.2.2"
FLOOD_PORT = 9500
RESULTS_PORT = 9300
STREAM_ID = 1  # the three sensor streams of one scene share it; fusion keys on it

# modality -> (stage config file, wire modality byte, deadline ms, SLA class name)
MODALITIES: dict[str, tuple[str, int, float, str]] = {
    "audio": ("audio.yaml", 4, 50.0, "voice"),
    "video": ("vision.yaml", 3, 200.0, "video"),
    "lidar": ("lidar.yaml", 5, 150.0, "lidar"),
}
STAGE_FILES = ("vision.yaml", "audio.yaml", "lidar.yaml", "fusion.yaml", "decoder.yaml")
EDGE_STAGES = ("vision.yaml", "audio.yaml", "lidar.yaml")
CORE_STAGES = ("fusion.yaml", "decoder.yaml")


def examples_importable() -> None:
    """Puts the source tree on sys.path so ``examples.pipeline`` imports."""
    if (EXAMPLE_DIR / "stages.py").is_file() and str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@dataclass
class PipelineConfig:
    rate_bps: int = 300_000_000  # the sensors' uplink
    duration: float = 8.0  # seconds the sensors produce, per phase
    tick_s: float = 0.050  # every sensor produces one item per tick (20 Hz)
    warmup: float = 0.7  # the flood starts this long before the sensors
    drain: float = 1.0  # sidecars keep running this long after the sensors stop
    flood_factor: float = 0.5  # background video flood (UDP, paced) in x link rate; 0: none
    fifo_limit: int = 1000  # packets in the mesh-off FIFO
    policy_path: str | None = None  # None: examples/policy.yaml
    exact_ticks: int = 0  # > 0: that many ticks of exact seeded data (tests), else cycled
    phases: tuple[str, ...] = ("off", "on")  # "off", "on", "none" (unshaped)
    deadlines_ms: dict[str, float] = field(
        default_factory=lambda: {m: v[2] for m, v in MODALITIES.items()})


def load_stage_configs(onnx_dir: Path, config_dir: Path = CONFIG_DIR) -> dict[str, Any]:
    """The stage configs from the YAML files, ONNX targets pointed at ``onnx_dir``."""
    from sidecar.config import SidecarConfig, load_config

    out = {}
    for name in STAGE_FILES:
        cfg = load_config(config_dir / name)
        if cfg.runner.kind == "onnx":
            data = cfg.model_dump(mode="json")
            data["runner"]["target"] = str(onnx_dir / Path(cfg.runner.target).name)
            cfg = SidecarConfig.model_validate(data)
        out[name] = cfg
    return out


def pipeline_policy(path: str | None, device: str, rate_bps: int) -> Any:
    """examples/policy.yaml on ``device`` at ``rate_bps``; when the link is below
    the sum of the classes' guarantees, every guarantee is scaled down alike
    (to 90 % of the link) so the policy still fits."""
    from ..policy import Rate, load_policy, parse_policy
    from .scenario import find_policy

    base = load_policy(find_policy(path))
    data = base.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": device, "rate": str(Rate(rate_bps))}
    total = sum(int(Rate(c["rate"])) for c in data["classes"])
    if total > 0.9 * rate_bps:
        k = 0.9 * rate_bps / total
        for c in data["classes"]:
            c["rate"] = str(Rate(max(1000, int(int(Rate(c["rate"])) * k))))
            if c.get("ceil") is not None:
                c["ceil"] = str(Rate(min(int(Rate(c["ceil"])), rate_bps)))
    return parse_policy(data)


# --------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------
class Topology(NetnsLab):
    """Three namespaces (sensors, edge, core) joined by two veth links.

    Use as a context manager: processes started with :meth:`spawn` are
    stopped and the namespaces removed when the block ends, also on Ctrl-C
    and SIGTERM (turned into KeyboardInterrupt in the creating process)."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"mmp{os.getpid()}-"
        self.sensors = f"{self.prefix}sensors"
        self.edge = f"{self.prefix}edge"
        self.core = f"{self.prefix}core"
        self._init_lab()

    @property
    def namespaces(self) -> list[str]:
        return [self.sensors, self.edge, self.core]

    @property
    def uplink(self) -> tuple[str, str]:
        return self.sensors, UPLINK

    def create(self) -> None:
        self._create_namespaces({})
        with Lab(self.sensors) as nl:
            nl.loopback_up()
            nl.add_veth(UPLINK, EDGE_IF, self.edge)
            nl.configure(UPLINK, f"{SENSORS_ADDR}/24")
        with Lab(self.edge) as nl:
            nl.loopback_up()
            nl.configure(EDGE_IF, f"{EDGE_ADDR}/24")
            nl.add_veth(EDGE_CORE_IF, CORE_IF, self.core)
            nl.configure(EDGE_CORE_IF, f"{EDGE_CORE_ADDR}/24")
        with Lab(self.core) as nl:
            nl.loopback_up()
            nl.configure(CORE_IF, f"{CORE_ADDR}/24")


# --------------------------------------------------------------------------
# Child processes (first argument: Ctl; they stop by themselves at a deadline)
# --------------------------------------------------------------------------
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


def sidecar_child(ctl: Ctl, cfg_data: dict[str, Any], stop_wall: float,
                  keep_samples: bool = False) -> dict[str, Any]:
    """One stage's sidecar until ``stop_wall``, then a short drain."""
    examples_importable()
    from examples.pipeline.stages import make_runner
    from sidecar.config import SidecarConfig
    from sidecar.main import Sidecar

    cfg = SidecarConfig.model_validate(cfg_data)
    sink = _Samples() if keep_samples else None

    async def main() -> dict[str, Any]:
        sc = Sidecar(cfg, runner=make_runner(cfg), sink=sink, backoff_max=0.2)
        await sc.start()
        ctl.ready(sc.port)
        await _sleep_until(stop_wall)
        clean = await sc.stop(timeout=1.0)
        return {"stage": cfg.stage, "clean": clean, "counters": sc.counters.snapshot(),
                "samples": sink.rows if sink else []}

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


def sensors_child(ctl: Ctl, targets: dict[str, str], spec: SourceSpec, start_wall: float,
                  stop_wall: float) -> dict[str, Any]:
    """Camera, microphone and LiDAR: one item per tick each, sent with the
    sidecar's FrameSender (zero-copy) to the edge encoders.  A sensor that
    falls behind its schedule (its uplink is backed up) skips ticks, as a
    driver drops frames; skipped ticks count as produced and missed."""
    examples_importable()
    from examples.pipeline import stages
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
            tick = 0
            while True:
                t = start + tick * spec.tick_s
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
                    tick += 1
                    continue
                data = gens[m](tick) if spec.exact_ticks else cached[m][tick % spec.cycle]
                ts = time.time_ns()
                h = Header(modality=modality, stream_id=STREAM_ID, sequence=tick,
                           timestamp_ns=ts, deadline_ns=ts + int(deadlines[m] * 1e6),
                           tensor=tensor_spec(data), **meta[m])
                st["produced"] += 1
                await s.send(h, data)
                st["sent"] += 1
                tick += 1

        await asyncio.gather(*(sensor(m) for m in targets))
        for s in senders.values():
            await s.flush(max(0.5, stop_wall - time.time() + 0.5))
        for m, s in senders.items():
            stats[m]["sender"] = s.counters.snapshot()
            await s.close()
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


# --------------------------------------------------------------------------
# One phase
# --------------------------------------------------------------------------
def _percentile(v: list[float], q: float) -> float:
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _attainment(samples: list[tuple[str, int | None, bool, bool, bool]],
                produced: dict[str, int], deadlines: dict[str, float]) -> dict[str, Any]:
    """Per modality: frames produced, reached fusion, within deadline, latency."""
    wire_name = {"audio": "audio", "video": "video", "lidar": "point_cloud"}
    out: dict[str, Any] = {}
    for m, n in produced.items():
        rows = [r for r in samples if r[0] == wire_name[m] and not r[3] and not r[4]]
        lat = sorted(r[1] / 1e6 for r in rows if r[1] is not None)
        met = sum(1 for r in rows if not r[2])
        out[m] = {
            "deadline_ms": deadlines[m],
            "produced": n,
            "arrived": len(rows),
            "within_deadline": met,
            "sla_attainment_pct": 100.0 * met / n if n else math.nan,
            "p50_ms": _percentile(lat, 50),
            "p99_ms": _percentile(lat, 99),
            "max_ms": lat[-1] if lat else math.nan,
        }
    return out


def run_phase(topo: Topology, cfg: PipelineConfig, stage_cfgs: dict[str, Any],
              keep_scores: bool = False) -> dict[str, Any]:
    """Starts every process of the pipeline, runs the sensors (and the flood),
    and collects what each process saw."""
    flood = cfg.flood_factor > 0 and not cfg.exact_ticks
    setup = 1.5  # forking, imports, ONNX sessions, connections
    t0 = time.time() + setup
    start = t0 + (cfg.warmup if flood else 0.0)
    produce_s = cfg.exact_ticks * cfg.tick_s if cfg.exact_ticks else cfg.duration
    stop = start + produce_s
    end = stop + cfg.drain + (2.0 if cfg.exact_ticks else 0.0)
    kids: list[Child] = []
    try:
        # core first, so that every sender finds its downstream listening
        collector = topo.spawn(topo.core, "results", collector_child,
                               f"127.0.0.1:{RESULTS_PORT}", end + 0.5, keep_scores)
        kids.append(collector)
        collector.wait_ready(15.0)
        stages: dict[str, Child] = {}
        for name in ("decoder.yaml", "fusion.yaml", *EDGE_STAGES):
            ns = topo.core if name in CORE_STAGES else topo.edge
            c = topo.spawn(ns, name.removesuffix(".yaml"), sidecar_child,
                           stage_cfgs[name].model_dump(mode="json"),
                           end + (0.25 if name in CORE_STAGES else 0.0),
                           name == "fusion.yaml")
            kids.append(c)
            stages[name] = c
        for c in stages.values():
            c.wait_ready(30.0)
        extra: dict[str, Child] = {}
        if flood:
            from .streams import TrafficSpec
            from .traffic import flood_sender

            fspec = TrafficSpec(link_bps=cfg.rate_bps, flood_factor=cfg.flood_factor)
            extra["flood_sink"] = topo.spawn(topo.edge, "flood-sink", flood_sink_child,
                                             FLOOD_PORT, end)
            kids.append(extra["flood_sink"])
            extra["flood_sink"].wait_ready(10.0)
            extra["flood"] = topo.spawn(topo.sensors, "flood", flood_sender, EDGE_ADDR,
                                        FLOOD_PORT, fspec, t0, stop)
            kids.append(extra["flood"])
            extra["flood"].wait_ready(10.0)
        targets = {m: f"{EDGE_ADDR}:{_port(stage_cfgs[MODALITIES[m][0]])}" for m in MODALITIES}
        spec = SourceSpec(tick_s=cfg.tick_s, exact_ticks=cfg.exact_ticks,
                          deadlines_ms=tuple(cfg.deadlines_ms.items()))
        sensors = topo.spawn(topo.sensors, "sensors", sensors_child, targets, spec, start, stop)
        kids.append(sensors)
        sensors.wait_ready(20.0)
        slack = t0 - time.time()
        wait = end - time.time() + 20.0
        src = sensors.result(wait)
        res = {name.removesuffix(".yaml"): c.result(wait) for name, c in stages.items()}
        ext = {k: c.result(wait) for k, c in extra.items()}
        col = collector.result(wait)
    finally:
        for c in kids:
            topo.reap(c)
    fusion = res["fusion"]
    produced = {m: st["produced"] for m, st in src.items()}
    out: dict[str, Any] = {
        "modalities": _attainment(fusion.pop("samples"), produced, cfg.deadlines_ms),
        "sensors": src,
        "stages": {k: {"clean": v["clean"], "counters": v["counters"]} for k, v in res.items()},
        "results": _results_summary(col["rows"]),
        "setup_slack_s": slack,
    }
    if keep_scores:
        out["results"]["rows"] = col["rows"]
    if flood:
        f = ext["flood"]
        secs = f.get("seconds") or 1.0
        out["flood"] = {"factor": cfg.flood_factor, "target_pps": f.get("target_pps"),
                        "sent_ok": f.get("sent_ok"), "send_errors": f.get("send_errors"),
                        "mbit_s": f.get("bytes", 0) * 8 / secs / 1e6}
    return out


def _port(cfg: Any) -> int:
    return int(cfg.listen.tcp.rpartition(":")[2])


def _results_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lat = sorted(r["e2e_ns"] / 1e6 for r in rows if r.get("e2e_ns") is not None
                 and "error" not in r)
    return {"outputs": len(rows), "errors": sum(1 for r in rows if "error" in r),
            "e2e_p50_ms": _percentile(lat, 50), "e2e_p99_ms": _percentile(lat, 99)}


# --------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------
Progress = Callable[[str], None]


def _class_counts(st: DataplaneStatus) -> dict[str, dict[str, int]]:
    return {c.name: {"packets": c.egress_packets, "bytes": c.egress_bytes,
                     "htb_drops": c.htb.drops if c.htb else 0}
            for c in st.classes}


def run_pipeline(cfg: PipelineConfig, progress: Progress = lambda _m: None,
                 onnx_dir: str | Path | None = None) -> dict[str, Any]:
    """Builds the topology, runs each phase in ``cfg.phases``; returns the results."""
    from ..policy import Rate

    examples_importable()
    from examples.pipeline import make_onnx

    t_start = time.monotonic()
    policy = pipeline_policy(cfg.policy_path, UPLINK, cfg.rate_bps) if "on" in cfg.phases else None
    results: dict[str, Any] = {
        "version": 1,
        "config": {**asdict(cfg), "rate": str(Rate(cfg.rate_bps))},
        "phases": {},
    }
    with tempfile.TemporaryDirectory(prefix="mmmesh-pipeline-") as tmp:
        models = Path(onnx_dir) if onnx_dir else Path(tmp)
        make_onnx.ensure(models)
        stage_cfgs = load_stage_configs(models)
        with Topology() as topo:
            progress(f"topology up: {topo.sensors} --{UPLINK} {Rate(cfg.rate_bps)}--> "
                     f"{topo.edge} --> {topo.core}")
            for i, phase in enumerate(cfg.phases, 1):
                label = {"off": "mesh OFF (one FIFO)", "on": "mesh ON (classifier + HTB)",
                         "none": "unshaped"}[phase]
                progress(f"phase {i}/{len(cfg.phases)}: {label}: sensors for "
                         f"{cfg.duration:g}s" + (f" + video flood ({cfg.flood_factor:g}x link)"
                                                  if cfg.flood_factor else ""))
                results["phases"][phase] = _one_phase(topo, cfg, stage_cfgs, phase, policy,
                                                      progress)
                progress(f"phase {i} done: " + ", ".join(
                    f"{m} {r['sla_attainment_pct']:.1f}% within {r['deadline_ms']:g} ms"
                    for m, r in results["phases"][phase]["modalities"].items()))
    results["elapsed_s"] = time.monotonic() - t_start
    return results


def _one_phase(topo: Topology, cfg: PipelineConfig, stage_cfgs: dict[str, Any], phase: str,
               policy: Any, progress: Progress) -> dict[str, Any]:
    if phase == "none":
        return run_phase(topo, cfg, stage_cfgs)
    if phase == "off":
        topo.shape_uplink_fifo(cfg.rate_bps, cfg.fifo_limit)
        try:
            res = run_phase(topo, cfg, stage_cfgs)
            res["htb"] = {handle(k): {"packets": v.packets, "drops": v.drops}
                          for k, v in topo.htb_classes().items()}
            return res
        finally:
            topo.unshape()
    t = time.monotonic()
    dp = Dataplane(UPLINK, topo.sensors)
    dp.up(policy)
    try:
        progress(f"dataplane up on {UPLINK} in {time.monotonic() - t:.1f}s")
        before = _class_counts(dp.status(policy))
        res = run_phase(topo, cfg, stage_cfgs)
        after = _class_counts(dp.status(policy))
        res["classes"] = {n: {k: v - before.get(n, {}).get(k, 0) for k, v in a.items()}
                          for n, a in after.items()}
        return res
    finally:
        dp.down()


__all__ = ["PipelineConfig", "SourceSpec", "Topology", "load_stage_configs", "pipeline_policy",
           "run_phase", "run_pipeline"]
