"""The pipeline demo with its nodes joined as a mesh (``mmmesh-demo --pipeline``,
its default; demo/pipeline/mesh.py): one real qosd per node namespace
over gRPC with mutual TLS, every stage reporting its SLA window to its own
node's qosd, the sensors' qosd applying the policy for the mesh-on phase.

Privileged: a short run of the whole demo (both phases, the flood) through
its command line; the global view from the sensors node must list the
stages and classes of all three nodes with frames, ``mmmeshctl cluster
sla``'s table must be printed, the mesh-off vs mesh-on comparison must still
be there, and nothing may be left behind (namespaces, qosd processes).  A
SIGTERM while the mesh is up stops everything too.  About 40 s."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.pipeline import run as pl
from demo.pipeline.mesh import PipelineMesh, render_view

ROOT = Path(__file__).resolve().parents[3]
NODE_STAGES = {"sensors": {"sensors"},
               "edge": {"vision-encoder", "audio-frontend", "lidar-encoder"},
               "core": {"fusion", "decoder"}}


# --------------------------------------------------------------------------
# unprivileged: the pieces
# --------------------------------------------------------------------------
def test_the_mesh_runs_the_mesh_on_phase_last() -> None:
    assert pl._phases(pl.PipelineConfig()) == ("off", "on")
    assert pl._phases(pl.PipelineConfig(phases=("on", "off", "none"))) == ("off", "none", "on")
    assert pl._phases(pl.PipelineConfig(mesh=False, phases=("on", "off"))) == ("on", "off")
    # no mesh-on phase, no qosd to serve it
    assert not pl._with_mesh(pl.PipelineConfig(phases=("off",)))
    assert pl._with_mesh(pl.PipelineConfig()) and not pl._with_mesh(pl.PipelineConfig(mesh=False))


def test_stages_report_to_their_node_or_to_no_qosd(tmp_path: Path) -> None:
    cfgs = pl.load_stage_configs(tmp_path)
    data = pl._stage_data(cfgs["audio.yaml"], "edge", "/x/edge/sla.sock")
    assert data["qosd"]["socket"] == "/x/edge/sla.sock" and data["instance"] == "edge/audio-frontend"
    assert data["qosd"]["report_interval_s"] > 600  # one window per phase, sent at the stop
    assert data["default_sla_class"] == "voice"  # the encoders report their inputs' class
    alone = pl._stage_data(cfgs["fusion.yaml"], "core", None)
    assert alone["qosd"]["socket"] is None  # without the mesh: never /run/mmmesh/sla.sock


def test_mesh_configs_seed_each_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from qosd.config import load_config

    monkeypatch.delenv("MMMESH_QOSD_CONFIG", raising=False)  # load_config sets it: put it back
    mesh = PipelineMesh([("a", "ns-a", "10.0.0.1"), ("b", "ns-b", "10.0.0.2")], tmp_path)
    mesh.write_configs()  # what start() runs qosd with, read by qosd's own loader
    cfg = load_config(str(mesh.node("a").config))
    assert cfg.peers is not None and cfg.peers.seeds == ["10.0.0.2:7946"]
    assert cfg.peers.listen == "10.0.0.1:7946" and cfg.node_name == "a"
    assert cfg.sla_socket == mesh.node("a").sla_sock and cfg.metrics_addr is None
    assert (tmp_path / "certs" / "b.pem").exists()
    assert yaml.safe_load(mesh.node("b").config.read_text())["peers"]["protocol"] == \
        {"push_pull_interval_s": 2.0}
    assert mesh.sla_sockets() == {"ns-a": str(tmp_path / "a" / "sla.sock"),
                                  "ns-b": str(tmp_path / "b" / "sla.sock")}


def test_socket_paths_too_long_are_refused_before_anything_starts(tmp_path: Path) -> None:
    from demo.pipeline.mesh import MeshDemoError

    deep = tmp_path / ("d" * 100)
    with pytest.raises(MeshDemoError, match="too long for a unix socket"):
        PipelineMesh([("a", "ns-a", "10.0.0.1")], deep).start()
    assert not (deep / "certs").exists()


def test_render_view_prints_the_ctl_table_and_the_stages() -> None:
    view = {"node": "sensors", "members": 3, "nodes_reporting": 3, "nodes_with_sketches": 3,
            "classes": [{"sla_class": "voice", "modality": "audio", "p99_ms": 12.5,
                         "target_p99_ms": 120.0, "meets_target": True, "attainment": 1.0,
                         "frames": 120, "nodes": 2, "sketch_nodes": 2, "partial": False,
                         "p99_range_ms": [12.5, 12.5]}],
            "stages": [{"stage": "audio-frontend", "sla_class": "voice", "modality": "audio",
                        "breakdown": [{"node": "edge", "frames": 60, "attainment": 1.0,
                                       "p99_ms": 13.1}]}]}
    text = render_view(view)
    assert "global SLA view from sensors: 3 of 3 members reporting, 3 with sketches" in text
    assert "120.0 ms" in text and "100.00%" in text
    assert any(line.split()[:4] == ["audio-frontend", "voice", "audio", "edge"]
               for line in text.splitlines())


# --------------------------------------------------------------------------
# privileged: the demo as a mesh
# --------------------------------------------------------------------------
@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short directory for the run (unix socket paths below pytest's
    tmp_path are too long), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="pm", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _leftovers(prefix: str, marker: str) -> tuple[list[str], list[str]]:
    """Namespaces named ``prefix...`` and processes whose command line has ``marker``."""
    from demo import netlab

    procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd and "qosd" in cmd:
                procs.append(f"{pid}: {cmd}")
    return [n for n in netlab.list_netns() if n.startswith(prefix)], procs


@pytest.mark.privileged
@pytest.mark.timeout(120)
def test_the_demo_as_a_mesh_shows_the_global_view(run_dir: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from testkit.privileged import require_privileged

    require_privileged()
    from demo.pipeline import cli as pipeline_cli

    monkeypatch.setattr(tempfile, "tempdir", str(run_dir))  # the run's directory: ours
    t0 = time.monotonic()
    rc = pipeline_cli.main(["--mesh", "--duration", "3", "--out", str(run_dir / "out")])
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert rc == 0, out
    assert took < 300, took  # a deadline: the run is ~30 s on a quiet host
    res: dict[str, Any] = json.loads((run_dir / "out" / "pipeline.json").read_text())

    # the comparison is intact: both phases, every modality measured
    assert set(res["phases"]) == {"off", "on"}
    for phase in res["phases"].values():
        assert {m: r["produced"] > 0 for m, r in phase["modalities"].items()} == \
            {"audio": True, "video": True, "lidar": True}
    on = res["phases"]["on"]
    assert on["policy_version"] == 1 and on["classes"]["voice"]["packets"] > 0
    assert all(r["sent"] == 1 and r["failed"] == 0 for r in on["sla_reports"].values()), \
        on["sla_reports"]

    # the global view from the sensors node: every node's stages, classes, frames
    mesh = res["mesh"]
    assert mesh["view_from"] == "sensors" and mesh["view_complete"], mesh
    view = mesh["cluster_sla"]
    assert view["members"] == 3 and view["nodes_reporting"] == 3
    by_node: dict[str, set[str]] = {n: set() for n in NODE_STAGES}
    for row in view["stages"]:
        for b in row["breakdown"]:
            assert b["frames"] > 0 and not b["stale"], (row, b)
            by_node[b["node"]].add(row["stage"])
    assert by_node == NODE_STAGES, by_node
    classes = {(r["sla_class"], r["modality"]): r for r in view["classes"]}
    for key, nodes in {("voice", "audio"): {"sensors", "edge"},
                       ("video", "video"): {"sensors", "edge"},
                       ("lidar", "point_cloud"): {"sensors", "edge"},
                       ("best-effort", "tensor"): {"core"}}.items():
        row = classes[key]
        assert {b["node"] for b in row["breakdown"]} == nodes and row["frames"] > 0, row
        assert not row["partial"], row
    assert classes[("voice", "audio")]["target_p99_ms"] == 120.0  # the policy's objective
    # mmmeshctl cluster sla's table is printed after the comparison
    assert "mesh OFF" in out and "mesh ON" in out
    assert "global SLA view from sensors: 3 of 3 members reporting, 3 with sketches" in out

    # nothing left behind
    netns, procs = _leftovers(f"mmp{os.getpid()}-", str(run_dir))
    assert not netns and not procs, (netns, procs)


@pytest.mark.privileged
@pytest.mark.timeout(90)
def test_sigterm_with_the_mesh_up_removes_everything(run_dir: Path) -> None:
    from testkit.privileged import require_privileged

    require_privileged()
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.pipeline.cli", "--mesh", "--duration", "20",
         "--out", str(run_dir / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=ROOT, env={**os.environ, "TMPDIR": str(run_dir)})
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the sensors run with the mesh up
        line = proc.stderr.readline()
        lines.append(line)
        if "phase 1/2" in line or not line:
            break
    assert any("mesh up" in x for x in lines), lines
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    netns, procs = _leftovers(f"mmp{proc.pid}-", str(run_dir))
    assert not netns and not procs, (netns, procs)
