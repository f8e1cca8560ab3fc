"""The closed-loop demo: the SLA controller keeps voice's objective under a
video flood, window by window, and gives the boost back when the flood goes.

::

    mmmesh-demo --closed-loop [--window 4] [--flood-windows 10] [--after-windows 10] [--json]

The pipeline demo's three namespace nodes, one real qosd each joined as a
mesh (:mod:`.pipeline`, :mod:`.pipeline_mesh`), run twice with the same
timeline and the same policy (``examples/closed-loop-policy.yaml``, which
under-provisions voice: a priority below video and a rate below its load):

1. the controller **off** (``sla_controller_enabled: false`` in every
   qosd.yaml): the kernel keeps the policy's values;
2. the controller **on**: the sensors node's qosd steps it once a window on
   the global SLA view and writes what it decides to the uplink's HTB.

Each run: ``warm`` windows of the pipeline starting up under the policy
without objectives (:func:`warmup_policy`: nothing for the controller to
keep), the demo's policy applied through qosd (same HTB values, reconciled in
place), ``quiet`` windows of the pipeline alone, ``flood`` windows with the
video flood on the sensors' uplink, then ``after`` windows without it.  The
stages report a window every ``window_s`` (the controller's period too); the
microphone sends a 50 ms chunk every 10 ms (``per_tick``), so that a window
holds the frames the controller needs to judge it (``Law.min_frames``), each
carrying voice's p99 objective as its deadline.  The microphone and the
audio front end run under SCHED_FIFO (``realtime_voice``).  The flood
reports its own windows (:mod:`.closed_loop_flood`).

What is measured, the same way in both runs: per class, the stages' own SLA
windows as the edge node's qosd holds them (``GET /v1/sla``: the audio front
end for voice, the vision and LiDAR encoders for video and LiDAR: latency
from capture to the stage's output, attainment = frames within their
deadline); the parameters are the kernel's, read through the sensors
node's qosd (``GET /v1/status``); the controller's windows through its
explain (:mod:`.closed_loop_observe`).  The figures are
:mod:`.closed_loop_report`'s, the table and plot :mod:`.closed_loop_show`'s;
docs/controller.md, "The closed-loop demo", says why each setting is what it
is.  Needs root.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from demo.closed_loop.config import POLICY, STAGES, WATCH, ClosedLoopConfig, Progress
from mmmesh.errors import MeshError

if TYPE_CHECKING:
    from demo.pipeline.run import Topology

def load(cfg: ClosedLoopConfig) -> Any:
    """The policy on the demo's uplink at its own link rate, with voice's
    objective and ranges checked."""
    from demo.pipeline.run import UPLINK, pipeline_policy
    from mmmesh.policy import load_policy

    path = str(cfg.policy_path or POLICY)
    policy = pipeline_policy(path, UPLINK, int(load_policy(path).link.rate))
    voice = policy.class_named(WATCH) if WATCH in {c.name for c in policy.classes} else None
    if voice is None or voice.sla is None or voice.adapt is None or voice.sla.p99_ms is None:
        raise MeshError(f"the closed-loop policy needs a {WATCH!r} class with adapt and "
                        f"sla.p99_ms (the microphone's chunks carry it as their deadline)")
    return policy


def warmup_policy(policy: Any) -> Any:
    """The policy without objectives: the same classes and values, nothing for
    the controller to keep (what the warm-up runs under)."""
    from mmmesh.policy import parse_policy

    data = policy.model_dump(mode="json", by_alias=True, exclude_none=True)
    for c in data["classes"]:
        c.pop("sla", None)
        c.pop("adapt", None)
    data["description"] = "closed-loop demo, warm-up: the policy without objectives"
    return parse_policy(data)


class _Switch:
    """Applies the demo's policy through the sensors node's qosd at a given
    unix time, from a thread of its own (the pipeline's phase blocks)."""

    def __init__(self, mesh: Any, text: str) -> None:
        self.mesh, self.text = mesh, text
        self.applied_at: float | None = None
        self.version: int | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def at(self, wall: float) -> None:
        def run() -> None:
            time.sleep(max(0.0, wall - time.time()))
            try:
                self.version = self.mesh.apply_policy("sensors", self.text)["version"]
                self.applied_at = time.time()
            except (MeshError, OSError, KeyError, ValueError) as e:  # reported after the phase
                self.error = f"{type(e).__name__}: {e}"

        self._thread = threading.Thread(target=run, name="closed-loop-switch", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(30.0)


def run_closed_loop(cfg: ClosedLoopConfig, progress: Progress = lambda _m: None,
                    onnx_dir: str | Path | None = None) -> dict[str, Any]:
    """Both runs on one topology; the raw observations and the figures
    (:func:`.closed_loop_report.figures`)."""
    from demo.closed_loop import report as closed_loop_report
    from demo.pipeline import onnx_models as make_onnx
    from demo.pipeline.run import UPLINK, Topology, load_stage_configs

    t_start = time.monotonic()
    policy = load(cfg)
    rate = int(policy.link.rate)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mmmesh-loop-") as tmp:
        models = Path(onnx_dir) if onnx_dir else Path(tmp)
        make_onnx.ensure(models)
        stage_cfgs = load_stage_configs(models)
        with Topology() as topo:
            progress(f"topology up: {topo.sensors} --{UPLINK} {policy.link.rate}--> "
                     f"{topo.edge} --> {topo.core}")
            for i, mode in enumerate(cfg.runs, 1):
                progress(f"run {i}/{len(cfg.runs)}: controller {mode.upper()}")
                runs[mode] = _one_run(topo, cfg, policy, stage_cfgs, mode == "on",
                                      Path(tmp) / mode, progress)
    result = closed_loop_report.figures(cfg, policy, runs)
    result["config"] = {**asdict(cfg), "rate": str(policy.link.rate), "rate_bps": rate,
                        "policy": str(cfg.policy_path or POLICY)}
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return result


def _one_run(topo: Topology, cfg: ClosedLoopConfig, policy: Any, stage_cfgs: dict[str, Any],
             on: bool, root: Path, progress: Progress) -> dict[str, Any]:
    from demo.closed_loop.flood import FLOOD_STAGE, reporting_flood
    from demo.closed_loop.observe import Observer
    from demo.pipeline.mesh import start_mesh
    from demo.pipeline.run import UPLINK, PipelineConfig, run_phase

    w = cfg.window_s
    begin, flood_from, flood_to, end = cfg.timeline(on)
    pcfg = replace(PipelineConfig(), rate_bps=int(policy.link.rate), duration=end, warmup=0.0,
                   flood_factor=cfg.flood_factor, report_interval_s=w,
                   per_tick=(("audio", cfg.audio_per_tick),), setup_s=cfg.setup_s,
                   realtime=("audio",) if cfg.realtime_voice else ())
    # every chunk carries voice's objective as its deadline: what the stage
    # counts as met is what the controller is asked to keep
    pcfg.deadlines_ms["audio"] = float(policy.class_named(WATCH).sla.p99_ms)
    qosd = {"sla_controller_enabled": on, "sla_controller_period_s": w}
    with start_mesh(topo.nodes(), root, progress, protocol={"push_pull_interval_s":
                                                                cfg.push_pull_s},
                    config=qosd) as mesh:
        warm = mesh.apply_policy("sensors", warmup_policy(policy).to_yaml())
        progress(f"qosd on sensors applied the warm-up policy (version {warm['version']}: "
                 f"no objectives); controller {'on' if on else 'off'}, window {w:g} s; "
                 f"{cfg.warm} warm-up + {cfg.quiet} quiet + {cfg.flood} flood + "
                 f"{cfg.after if on else cfg.after_off} after windows")
        sla = {n.ns: str(n.sla_sock) for n in mesh.nodes.values() if n.name != "sensors"}
        obs = Observer(mesh.request, UPLINK, stages=tuple(STAGES.values()), watch=WATCH,
                       state_file=mesh.node("sensors").dir / "state" / "controller.json").start()
        switch = _Switch(mesh, policy.to_yaml())

        def on_t0(t0: float) -> None:  # the phase's clock: the policy's time, the focus
            switch.at(t0 + begin)
            obs.focus([(t0 + flood_from - 1.0, t0 + flood_from + 6 * w),
                       (t0 + flood_to - 1.0, t0 + flood_to + 4 * w)])

        try:
            res = run_phase(topo, pcfg, stage_cfgs, sla=sla, flood_child=reporting_flood,
                            flood_args=(str(mesh.node("sensors").sla_sock), w, flood_from,
                                        flood_to),
                            on_t0=on_t0)
        finally:
            switch.join()
            seen = obs.stop()
        if switch.error or switch.applied_at is None:
            raise MeshError(f"applying the closed-loop policy failed: {switch.error}")
        explain = None
        if on:
            explain = mesh.request("sensors", "GET", "/v1/sla/explain")
    t0 = res["t0"]
    progress(f"run done: the policy (version {switch.version}) applied "
             f"{switch.applied_at - (t0 + begin):+.2f} s off its time; {len(seen.windows)} stage "
             f"windows, {len(seen.changes)} kernel changes"
             + (f", flood {res['flood']['mbit_s']:.0f} Mbit/s" if res.get("flood") else ""))
    return {"on": on, "t0": t0, "start": t0 + begin, "flood_from": t0 + flood_from,
            "flood_to": t0 + flood_to, "end": t0 + end, "applied_at": switch.applied_at,
            "observation": seen, "explain": explain, "flood": res.get("flood"),
            "setup_slack_s": round(res["setup_slack_s"], 2),
            "pipeline": {m: {k: r[k] for k in ("produced", "arrived", "sla_attainment_pct",
                                                "p50_ms", "p99_ms")}
                         for m, r in res["modalities"].items()},
            "flood_stage": FLOOD_STAGE}


__all__ = ["POLICY", "STAGES", "WATCH", "ClosedLoopConfig", "load", "run_closed_loop",
           "warmup_policy"]
