"""The multimodal pipeline demo: real model stages in sidecars on three netns nodes.

::

    [sensors] up0 10.202.1.1 --veth, shaped--> eth0 10.202.1.2 [edge] core0 10.202.2.1 --veth--> eth0 10.202.2.2 [core]
     camera  -> video frames  (uint8 360x640x3, 20/s) -> vision-encoder (python) --+
     mic     -> audio chunks  (50 ms PCM, 20/s)       -> audio-frontend (python) --+--> fusion --> decoder (onnx) --> results
     LiDAR   -> sweeps        (16384 x 4, 20/s)       -> lidar-encoder  (onnx)   --+    (python)
     + a background video flood (paced UDP, MMH video frames) from sensors to edge

Every stage is an mmmesh sidecar (``sidecar.main.Sidecar``) in its own
process inside its node's namespace, configured by the YAML files in
``examples/pipeline/config/``; the stages are ``demo/pipeline/stages.py``
and the ONNX models ``onnx_models.py`` builds (into a temporary directory).
The processes are ``pipeline_procs.py``'s; the edge forwards between its two
links, so every node reaches every other.

The sensors' uplink is shaped to ``rate`` with the mesh off (one HTB class
and one FIFO: ``netlab.Lab.apply_fifo``), then with the mesh on
(``Dataplane.up`` with examples/policy.yaml, its link set to ``up0`` at
``rate``).  Per modality the result is the SLA attainment: the share of the
frames the sensors produced that reached fusion on the core node within
their deadline (audio 50 ms, video 200 ms, LiDAR 150 ms after capture).

    mmmesh-demo --pipeline [--rate 300mbit] [--duration 8] [--flood 0.5] [--no-mesh] [--json]

(the command line and the table are in ``pipeline_cli.py``).  With ``mesh``
(the default; ``--no-mesh`` leaves qosd out) the three nodes are a mesh, one
qosd each (``pipeline_mesh.py``):
the stages report their SLA windows to their node's qosd in the mesh-on
phase (the last one), the sensors' qosd applies the policy, and the results
end with the global SLA view (``mmmeshctl cluster sla``).

Needs root.  Namespaces are removed, and every process stopped, on exit,
failure, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from demo.netlab import Lab
from demo.pipeline.procs import (
    EXAMPLE_DIR,
    MODALITIES,
    STREAM_ID,
    SourceSpec,
    collector_child,
    flood_sink_child,
    sensors_child,
    sidecar_child,
)
from demo.testbed import NO_IPV6, Child, NetnsLab
from mmmesh.dataplane import Dataplane, handle

if TYPE_CHECKING:
    from demo.pipeline.mesh import PipelineMesh

CONFIG_DIR = EXAMPLE_DIR / "config"

UPLINK = "up0"  # sensors -> edge: the shaped uplink
EDGE_IF, EDGE_CORE_IF, CORE_IF = "eth0", "core0", "eth0"
SENSORS_ADDR, EDGE_ADDR = "10.202.1.1", "10.202.1.2"
EDGE_CORE_ADDR, CORE_ADDR = "10.202.2.1", "10.202.2.2"
SENSORS_NET, CORE_NET = "10.202.1.0/24", "10.202.2.0/24"
FLOOD_PORT = 9500
RESULTS_PORT = 9300
# deadlines for the pipeline's processes (to be ready; to answer after the run's
# end): only a process that is stuck reaches them; a CPU-starved host (load 15-20
# on 2 vCPUs) needed more than the 10-30 s these were
READY_S = 90.0
RESULT_SLACK_S = 90.0
REPORT_ONCE_S = 3600.0  # a sidecar's SLA window: longer than a phase, so one report, at its stop

STAGE_FILES = ("vision.yaml", "audio.yaml", "lidar.yaml", "fusion.yaml", "decoder.yaml")
EDGE_STAGES = ("vision.yaml", "audio.yaml", "lidar.yaml")
CORE_STAGES = ("fusion.yaml", "decoder.yaml")


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
    mesh: bool = True  # one qosd per node, joined as a mesh (pipeline_mesh.py)
    report_interval_s: float = REPORT_ONCE_S  # the stages' SLA window (reported to qosd)
    per_tick: tuple[tuple[str, int], ...] = ()  # SourceSpec.per_tick: e.g. (("audio", 5),)
    # modalities whose path runs under SCHED_FIFO: the sensor in a process of
    # its own and the edge stage it feeds (as audio stacks run audio threads)
    realtime: tuple[str, ...] = ()
    setup_s: float = 1.5  # forking, imports, ONNX sessions, connections before t0
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
    the sum of the classes' guarantees, every guarantee (and its ``adapt.rate``
    range) is scaled down alike (to 90 % of the link) so the policy still fits."""
    from demo.scenario import find_policy
    from mmmesh.policy import Rate, load_policy, parse_policy

    base = load_policy(find_policy(path))
    data = base.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": device, "rate": str(Rate(rate_bps))}
    total = sum(int(Rate(c["rate"])) for c in data["classes"])
    if total > 0.9 * rate_bps:
        k = 0.9 * rate_bps / total

        def scaled(r: Any) -> str:
            return str(Rate(max(1000, int(int(Rate(r)) * k))))

        for c in data["classes"]:
            c["rate"] = scaled(c["rate"])
            if c.get("ceil") is not None:
                c["ceil"] = str(Rate(min(int(Rate(c["ceil"])), rate_bps)))
            adapt = c.get("adapt") or {}
            if adapt.get("rate"):
                adapt["rate"] = [scaled(r) for r in adapt["rate"]]
            if adapt.get("ceil"):
                adapt["ceil"] = [str(Rate(min(int(Rate(r)), rate_bps))) for r in adapt["ceil"]]
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
        # the edge routes between its links: sensors and core reach each other through it
        self._create_namespaces({self.edge: {**NO_IPV6, "net/ipv4/ip_forward": "1"}})
        with Lab(self.sensors) as nl:
            nl.loopback_up()
            nl.add_veth(UPLINK, EDGE_IF, self.edge)
            nl.configure(UPLINK, f"{SENSORS_ADDR}/24")
            nl.add_route(CORE_NET, EDGE_ADDR)
        with Lab(self.edge) as nl:
            nl.loopback_up()
            nl.configure(EDGE_IF, f"{EDGE_ADDR}/24")
            nl.add_veth(EDGE_CORE_IF, CORE_IF, self.core)
            nl.configure(EDGE_CORE_IF, f"{EDGE_CORE_ADDR}/24")
        with Lab(self.core) as nl:
            nl.loopback_up()
            nl.configure(CORE_IF, f"{CORE_ADDR}/24")
            nl.add_route(SENSORS_NET, EDGE_CORE_ADDR)

    def nodes(self) -> list[tuple[str, str, str]]:
        """(node id, namespace, address) of each node (the edge's on the sensors' link)."""
        return [("sensors", self.sensors, SENSORS_ADDR), ("edge", self.edge, EDGE_ADDR),
                ("core", self.core, CORE_ADDR)]


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


def _stage_data(cfg: Any, node: str, sla_socket: str | None,
                report_interval_s: float = REPORT_ONCE_S) -> dict[str, Any]:
    """A stage's config as its child gets it: reporting to ``sla_socket`` (by
    default one window, when it stops) or, without one, to no qosd at all."""
    data: dict[str, Any] = cfg.model_dump(mode="json")
    data["qosd"] = {"socket": sla_socket, "report_interval_s": report_interval_s}
    if sla_socket:
        data["instance"] = f"{node}/{cfg.stage}"
    return data


def run_phase(topo: Topology, cfg: PipelineConfig, stage_cfgs: dict[str, Any],
              keep_scores: bool = False, sla: Mapping[str, str] | None = None,
              flood_child: Callable[..., dict[str, Any]] | None = None,
              flood_args: tuple[Any, ...] = (),
              on_t0: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Starts every process of the pipeline, runs the sensors (and the flood),
    and collects what each process saw.  ``sla``: namespace -> the qosd SLA
    socket its stages (and the sensors) report to; none: no reports.
    ``flood_child``: the flood's process (default ``traffic.flood_sender``),
    called with (dst, port, spec, start, stop, *flood_args); ``on_t0``: called
    with the phase's clock (unix seconds) before anything starts."""
    flood = cfg.flood_factor > 0 and not cfg.exact_ticks
    t0 = time.time() + cfg.setup_s
    if on_t0 is not None:
        on_t0(t0)
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
        collector.wait_ready(READY_S)
        stages: dict[str, Child] = {}
        sla = sla or {}
        rt_stages = {MODALITIES[m][0] for m in cfg.realtime}
        for name in ("decoder.yaml", "fusion.yaml", *EDGE_STAGES):
            node, ns = ("core", topo.core) if name in CORE_STAGES else ("edge", topo.edge)
            c = topo.spawn(ns, name.removesuffix(".yaml"), sidecar_child,
                           _stage_data(stage_cfgs[name], node, sla.get(ns),
                                       cfg.report_interval_s),
                           end + (0.25 if name in CORE_STAGES else 0.0),
                           name == "fusion.yaml", name in rt_stages)
            kids.append(c)
            stages[name] = c
        for c in stages.values():
            c.wait_ready(READY_S)
        extra: dict[str, Child] = {}
        if flood:
            from demo.streams import TrafficSpec
            from demo.traffic import flood_sender

            fspec = TrafficSpec(link_bps=cfg.rate_bps, flood_factor=cfg.flood_factor)
            extra["flood_sink"] = topo.spawn(topo.edge, "flood-sink", flood_sink_child,
                                             FLOOD_PORT, end)
            kids.append(extra["flood_sink"])
            extra["flood_sink"].wait_ready(READY_S)
            extra["flood"] = topo.spawn(topo.sensors, "flood", flood_child or flood_sender,
                                        EDGE_ADDR, FLOOD_PORT, fspec, t0, stop, *flood_args)
            kids.append(extra["flood"])
            extra["flood"].wait_ready(READY_S)
        targets = {m: f"{EDGE_ADDR}:{_port(stage_cfgs[MODALITIES[m][0]])}" for m in MODALITIES}
        spec = SourceSpec(tick_s=cfg.tick_s, exact_ticks=cfg.exact_ticks,
                          deadlines_ms=tuple(cfg.deadlines_ms.items()), per_tick=cfg.per_tick)
        rt = {m: t for m, t in targets.items() if m in cfg.realtime}
        sensors = topo.spawn(topo.sensors, "sensors", sensors_child,
                             {m: t for m, t in targets.items() if m not in rt}, spec, start,
                             stop, sla.get(topo.sensors))
        kids.append(sensors)
        rt_sensors = None
        if rt:  # the real-time sensors in a process of their own
            rt_sensors = topo.spawn(topo.sensors, "sensors-rt", sensors_child, rt, spec, start,
                                    stop, sla.get(topo.sensors), "sensors-rt", True)
            kids.append(rt_sensors)
            rt_sensors.wait_ready(READY_S)
        sensors.wait_ready(READY_S)
        slack = t0 - time.time()
        wait = end - time.time() + RESULT_SLACK_S
        src = sensors.result(wait)
        if rt_sensors is not None:
            more = rt_sensors.result(wait)
            reps = [r for r in (src.pop("sla_reports", None), more.pop("sla_reports", None))
                    if r]
            src.update(more)
            if reps:
                src["sla_reports"] = {k: sum(r[k] for r in reps) for k in ("sent", "failed")}
        res = {name.removesuffix(".yaml"): c.result(wait) for name, c in stages.items()}
        ext = {k: c.result(wait) for k, c in extra.items()}
        col = collector.result(wait)
    finally:
        for c in kids:
            topo.reap(c)
    fusion = res["fusion"]
    reports = {"sensors": src.pop("sla_reports", None),
               **{k: v.get("sla_reports") for k, v in res.items()}}
    produced = {m: st["produced"] for m, st in src.items()}
    out: dict[str, Any] = {
        "modalities": _attainment(fusion.pop("samples"), produced, cfg.deadlines_ms),
        "sensors": src,
        "stages": {k: {"clean": v["clean"], "counters": v["counters"]} for k, v in res.items()},
        "results": _results_summary(col["rows"]),
        "setup_slack_s": slack,
        "t0": t0,  # when the flood (if any) starts: the phase's clock, unix seconds
    }
    if keep_scores:
        out["results"]["rows"] = col["rows"]
    if sla:
        out["sla_reports"] = reports  # per process: windows qosd took / that failed
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


def _class_counts(st: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per class of a dataplane's status (``DataplaneStatus.as_dict()``, or
    qosd's ``/v1/status`` of the uplink): packets, bytes, HTB drops."""
    return {name: {"packets": c["egress_packets"], "bytes": c["egress_bytes"],
                   "htb_drops": (c.get("htb") or {}).get("drops", 0)}
            for name, c in (st.get("classes") or {}).items()}


def _phases(cfg: PipelineConfig) -> tuple[str, ...]:
    """The phases in their order; with the mesh, the mesh-on phase last (its
    qosd keeps the policy until the end, and its stages' windows are the view)."""
    if not _with_mesh(cfg):
        return cfg.phases
    return tuple(p for p in cfg.phases if p != "on") + ("on",)


def _with_mesh(cfg: PipelineConfig) -> bool:
    """The mesh runs with the mesh-on phase (it is what its qosd serves)."""
    return cfg.mesh and "on" in cfg.phases


def run_pipeline(cfg: PipelineConfig, progress: Progress = lambda _m: None,
                 onnx_dir: str | Path | None = None) -> dict[str, Any]:
    """Builds the topology (and with ``cfg.mesh`` its qosd mesh), runs each
    phase in ``cfg.phases``; returns the results (with the mesh, ``mesh``:
    its nodes and the global SLA view at the end)."""
    from demo.pipeline import onnx_models as make_onnx
    from mmmesh.policy import Rate

    t_start = time.monotonic()
    phases = _phases(cfg)
    policy = pipeline_policy(cfg.policy_path, UPLINK, cfg.rate_bps) if "on" in phases else None
    results: dict[str, Any] = {
        "version": 1,
        "config": {**asdict(cfg), "rate": str(Rate(cfg.rate_bps))},
        "phases": {},
    }
    with tempfile.TemporaryDirectory(prefix="mmmesh-pipeline-") as tmp:
        models = Path(onnx_dir) if onnx_dir else Path(tmp)
        make_onnx.ensure(models)
        stage_cfgs = load_stage_configs(models)
        with Topology() as topo, contextlib.ExitStack() as stack:
            progress(f"topology up: {topo.sensors} --{UPLINK} {Rate(cfg.rate_bps)}--> "
                     f"{topo.edge} --> {topo.core}")
            mesh = None
            if _with_mesh(cfg):
                from demo.pipeline.mesh import start_mesh

                mesh = stack.enter_context(start_mesh(topo.nodes(), Path(tmp) / "mesh",
                                                      progress))
            for i, phase in enumerate(phases, 1):
                label = {"off": "mesh OFF (one FIFO)", "on": "mesh ON (classifier + HTB)",
                         "none": "unshaped"}[phase]
                progress(f"phase {i}/{len(phases)}: {label}: sensors for "
                         f"{cfg.duration:g}s" + (f" + video flood ({cfg.flood_factor:g}x link)"
                                                  if cfg.flood_factor else ""))
                results["phases"][phase] = _one_phase(topo, cfg, stage_cfgs, phase, policy,
                                                      progress, mesh)
                progress(f"phase {i} done: " + ", ".join(
                    f"{m} {r['sla_attainment_pct']:.1f}% within {r['deadline_ms']:g} ms"
                    for m, r in results["phases"][phase]["modalities"].items()))
            if mesh is not None:
                from demo.pipeline.mesh import mesh_results

                results["mesh"] = mesh_results(mesh, "sensors", progress)
    results["elapsed_s"] = time.monotonic() - t_start
    return results


def _one_phase(topo: Topology, cfg: PipelineConfig, stage_cfgs: dict[str, Any], phase: str,
               policy: Any, progress: Progress, mesh: PipelineMesh | None = None
               ) -> dict[str, Any]:
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
    if mesh is not None:
        return _mesh_on_phase(topo, cfg, stage_cfgs, policy, progress, mesh)
    t = time.monotonic()
    dp = Dataplane(UPLINK, topo.sensors)
    dp.up(policy)
    try:
        progress(f"dataplane up on {UPLINK} in {time.monotonic() - t:.1f}s")
        before = _class_counts(dp.status(policy).as_dict())
        res = run_phase(topo, cfg, stage_cfgs)
        after = _class_counts(dp.status(policy).as_dict())
        res["classes"] = _delta(before, after)
        return res
    finally:
        dp.down()


def _mesh_on_phase(topo: Topology, cfg: PipelineConfig, stage_cfgs: dict[str, Any],
                   policy: Any, progress: Progress, mesh: PipelineMesh) -> dict[str, Any]:
    """The mesh-on phase with qosd: the sensors node's qosd applies the policy
    (and keeps it until the demo ends); every stage reports to its node's qosd."""
    t = time.monotonic()
    applied = mesh.apply_policy("sensors", policy.to_yaml())
    progress(f"qosd on sensors applied policy version {applied['version']} to {UPLINK} in "
             f"{time.monotonic() - t:.1f}s; stages report to their node's qosd")
    before = _class_counts(mesh.uplink_status("sensors", UPLINK))
    res = run_phase(topo, cfg, stage_cfgs, sla=mesh.sla_sockets())
    res["classes"] = _delta(before, _class_counts(mesh.uplink_status("sensors", UPLINK)))
    res["policy_version"] = applied["version"]
    return res


def _delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
           ) -> dict[str, dict[str, int]]:
    return {n: {k: v - before.get(n, {}).get(k, 0) for k, v in a.items()}
            for n, a in after.items()}


__all__ = ["MODALITIES", "STREAM_ID", "PipelineConfig", "SourceSpec", "Topology",
           "load_stage_configs", "pipeline_policy", "run_phase", "run_pipeline"]
