"""One VM's share of the pipeline demo on the Vagrant testbed (vagrant/pipeline.sh
runs it on each VM, as root, with the venv's python).

The demo (``mmmesh-demo --pipeline``, :mod:`demo.pipeline.run`) runs its
stages in three network namespaces of one machine; here each VM is a node:

    node1 (sensors)  camera, mic, LiDAR (+ the background video flood) --eth1-->
    node2 (edge)     vision / audio / LiDAR encoders (sidecars)        --eth1-->
    node3 (core)     fusion -> decoder (sidecars) -> the results collector

What is reused, unchanged: the stage configs (``examples/pipeline/config/``
through ``load_stage_configs``, each as ``_stage_data`` hands it to a child:
reporting its SLA window to a qosd), the processes (``pipeline_procs``:
``sidecar_child``, ``sensors_child``, ``collector_child``,
``flood_sink_child``, and ``traffic.flood_sender``, started with the
testbed's ``Child``, which runs a function in a forked process and hands back
its result), the policy (``pipeline_policy``), the attainment
(``_attainment``) and the table (``pipeline_cli.format_table``).  The glue,
because the demo starts every process from one parent on one machine:

* the plan: one wall-clock instant ``--at`` given to every VM, from which each
  derives the same start, stop and end as the demo's ``run_phase`` (the VMs'
  clocks must agree: NTP; a latency crosses the sensors' and the core's clocks);
* the addresses: the configs' fusion address (the demo's core, 10.202.2.2) is
  replaced by the core VM's, the sensors send to the edge VM's;
* each role prints one JSON line, ``report`` puts the three together;
* the SLA windows go to each VM's own qosd (``sla_socket`` of its qosd.yaml);
* the policy goes to every node through ``mmmeshctl policy apply --cluster``
  (each qosd puts it on its own ``mesh_link``), not ``Dataplane.up``.

Commands::

    pipeline_node.py apply-policy --rate 300mbit        # on one node: mesh-wide
    pipeline_node.py run --role core --at EPOCH --sensors IP --edge IP --core IP ...
    pipeline_node.py report --rate ... < the three roles' JSON lines

The node's qosd.yaml is ``$MMMESH_QOSD_CONFIG`` or /etc/mmmesh/qosd.yaml.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from demo.pipeline import procs
from demo.pipeline import run as demo
from demo.testbed import Child

ROLES = ("sensors", "edge", "core")
WARMUP_S, DRAIN_S = 0.7, 1.0  # as PipelineConfig: the flood's head start, the drain


def log(msg: str) -> None:
    print(f"[pipeline_node] {msg}", file=sys.stderr, flush=True)


def qosd_config() -> dict[str, Any]:
    """This node's qosd.yaml (node name, sockets, mesh link) as written by provision.sh."""
    import yaml

    path = os.environ.get("MMMESH_QOSD_CONFIG") or "/etc/mmmesh/qosd.yaml"
    data = yaml.safe_load(Path(path).read_text()) or {}
    return {"node": data.get("node_name") or os.uname().nodename,
            "api_socket": data.get("api_socket") or "/run/mmmesh/qosd.sock",
            "sla_socket": data.get("sla_socket"),
            "device": ((data.get("mesh_link") or {}).get("device")
                       or (data.get("uplinks") or [None])[0])}


def qosd_get(sock: str, path: str, timeout: float = 5.0) -> Any:
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://qosd",
                      timeout=timeout) as c:
        r = c.get(path)
    r.raise_for_status()
    return r.json()


# --------------------------------------------------------------------------
# apply-policy
# --------------------------------------------------------------------------
def cmd_apply_policy(a: argparse.Namespace) -> int:
    """The demo's policy at --rate, rolled out to every node (each qosd applies
    it to its own mesh_link device); mmmeshctl's exit code."""
    q = qosd_config()
    policy = demo.pipeline_policy(a.policy, q["device"] or "eth1", a.rate)
    ctl = Path(sys.executable).parent / "mmmeshctl"
    argv = [str(ctl), "--socket", q["api_socket"], "policy", "apply", "-f", "-", "--cluster",
            "--timeout", str(a.timeout), "--author", "vagrant/pipeline.sh"]
    log(f"{q['node']}: mmmeshctl policy apply --cluster: the demo's policy at {a.rate_text}")
    return subprocess.run(argv, input=policy.to_yaml(), text=True, check=False).returncode


# --------------------------------------------------------------------------
# run: one role
# --------------------------------------------------------------------------
def plan(a: argparse.Namespace) -> dict[str, float]:
    """The same instants on every VM, as the demo's run_phase derives them."""
    t0 = a.at
    start = t0 + (WARMUP_S if a.flood > 0 else 0.0)
    stop = start + a.duration
    return {"t0": t0, "start": start, "stop": stop, "end": stop + DRAIN_S}


def stage_data(cfg: Any, node: str, sla_socket: str | None, core_ip: str) -> dict[str, Any]:
    """A stage's config as the demo hands it to its child (its SLA window to
    this node's qosd), with fusion at the core VM's address."""
    data = demo._stage_data(cfg, node, sla_socket)
    for out in data.get("outputs") or []:
        host, _, port = out["address"].rpartition(":")
        if host == demo.CORE_ADDR:
            out["address"] = f"{core_ip}:{port}"
    return data


def class_counts(sock: str, device: str | None) -> dict[str, dict[str, int]]:
    """Packets, bytes and HTB drops per class on ``device``, as qosd reads them."""
    try:
        st = qosd_get(sock, "/v1/status")["uplinks"].get(device or "", {})
    except Exception as e:  # noqa: BLE001  (the table just leaves the line out)
        log(f"qosd status: {e}")
        return {}
    return {name: {"packets": c["egress_packets"], "bytes": c["egress_bytes"],
                   "htb_drops": (c.get("htb") or {}).get("drops", 0)}
            for name, c in (st.get("classes") or {}).items()}


def cmd_run(a: argparse.Namespace) -> int:
    from mmmesh.policy import Rate

    from demo.pipeline import onnx_models as make_onnx

    q = qosd_config()
    node, sla = q["node"], q["sla_socket"]
    t = plan(a)
    wait = t["end"] - time.time() + 30.0
    kids: list[Child] = []
    out: dict[str, Any] = {"role": a.role, "node": node}
    log(f"{a.role} on {node}: starts at {time.strftime('%H:%M:%S', time.localtime(t['start']))},"
        f" {a.duration:g} s, SLA windows to {sla or 'no qosd'}")
    try:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mmmesh-pipeline-") as models:
            make_onnx.ensure(models)
            cfgs = demo.load_stage_configs(Path(models))
            if a.role == "core":
                col = Child(None, "results", procs.collector_child,
                            f"127.0.0.1:{demo.RESULTS_PORT}", t["end"] + 0.5)
                kids.append(col)
                col.wait_ready(15.0)
                stages = {}
                for name in ("decoder.yaml", "fusion.yaml"):
                    stages[name] = Child(None, name.removesuffix(".yaml"), procs.sidecar_child,
                                         stage_data(cfgs[name], node, sla, a.core),
                                         t["end"] + 0.25, name == "fusion.yaml")
                    kids.append(stages[name])
                for c in stages.values():
                    c.wait_ready(30.0)
                out["slack_s"] = t["t0"] - time.time()
                res = {k.removesuffix(".yaml"): c.result(wait) for k, c in stages.items()}
                rows = col.result(wait)["rows"]
                out["samples"] = res["fusion"].pop("samples")
                out["results"] = demo._results_summary(rows)
                out["stages"] = _stage_summary(res)
            elif a.role == "edge":
                stages = {}
                for name in demo.EDGE_STAGES:
                    stages[name] = Child(None, name.removesuffix(".yaml"), procs.sidecar_child,
                                         stage_data(cfgs[name], node, sla, a.core), t["end"])
                    kids.append(stages[name])
                if a.flood > 0:
                    sink = Child(None, "flood-sink", procs.flood_sink_child, demo.FLOOD_PORT,
                                 t["end"])
                    kids.append(sink)
                    sink.wait_ready(10.0)
                for c in stages.values():
                    c.wait_ready(30.0)
                out["slack_s"] = t["t0"] - time.time()
                res = {k.removesuffix(".yaml"): c.result(wait) for k, c in stages.items()}
                out["stages"] = _stage_summary(res)
            else:  # sensors
                from demo.streams import TrafficSpec
                from demo.traffic import flood_sender

                before = class_counts(q["api_socket"], q["device"])
                flood = None
                if a.flood > 0:
                    spec = TrafficSpec(link_bps=a.rate, flood_factor=a.flood)
                    flood = Child(None, "flood", flood_sender, a.edge, demo.FLOOD_PORT, spec,
                                  t["t0"], t["stop"])
                    kids.append(flood)
                    flood.wait_ready(10.0)
                targets = {m: f"{a.edge}:{int(cfgs[v[0]].listen.tcp.rpartition(':')[2])}"
                           for m, v in procs.MODALITIES.items()}
                sspec = procs.SourceSpec(deadlines_ms=tuple(
                    (m, v[2]) for m, v in procs.MODALITIES.items()))
                sensors = Child(None, "sensors", procs.sensors_child, targets, sspec, t["start"],
                                t["stop"], sla, node)
                kids.append(sensors)
                sensors.wait_ready(30.0)
                out["slack_s"] = t["t0"] - time.time()
                src = sensors.result(wait)
                out["sla_reports"] = src.pop("sla_reports", None)
                out["sensors"] = src
                if flood is not None:
                    f = flood.result(wait)
                    secs = f.get("seconds") or 1.0
                    out["flood"] = {"factor": a.flood,
                                    "mbit_s": f.get("bytes", 0) * 8 / secs / 1e6,
                                    "sent_ok": f.get("sent_ok"),
                                    "send_errors": f.get("send_errors")}
                after = class_counts(q["api_socket"], q["device"])
                out["classes"] = {n: {k: v - before.get(n, {}).get(k, 0) for k, v in c.items()}
                                  for n, c in after.items()}
                out["rate"] = str(Rate(a.rate))
    finally:
        for c in kids:
            c.stop()
    if out.get("slack_s", 0) < 0:
        log(f"{a.role}: ready {-out['slack_s']:.1f} s after the start: raise --lead")
    print(json.dumps(out, separators=(",", ":")), flush=True)
    return 0


def _stage_summary(res: dict[str, Any]) -> dict[str, Any]:
    return {k: {"clean": v["clean"], "counters": v["counters"],
                "sla_reports": v.get("sla_reports")} for k, v in res.items()}


# --------------------------------------------------------------------------
# report: the three roles' outputs together
# --------------------------------------------------------------------------
def cmd_report(a: argparse.Namespace) -> int:
    from demo.pipeline.cli import format_table
    from mmmesh.policy import Rate

    got: dict[str, dict[str, Any]] = {}
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("{"):
            doc = json.loads(line)
            got[doc["role"]] = doc
    missing = [r for r in ROLES if r not in got]
    if missing:
        print(f"pipeline: no result from {', '.join(missing)}", file=sys.stderr)
        return 1
    src, core = got["sensors"]["sensors"], got["core"]
    deadlines = {m: v[2] for m, v in procs.MODALITIES.items()}
    produced = {m: st["produced"] for m, st in src.items() if m in procs.MODALITIES}
    phase = {"modalities": demo._attainment(core["samples"], produced, deadlines),
             "results": core["results"], "classes": got["sensors"].get("classes")}
    if got["sensors"].get("flood"):
        phase["flood"] = got["sensors"]["flood"]
    results = {"config": {"rate": str(Rate(a.rate)), "duration": a.duration,
                          "flood_factor": a.flood, "deadlines_ms": deadlines},
               "phases": {"on": phase}}
    print(format_table(results))
    print()
    print("nodes: " + ", ".join(f"{got[r]['node']} ({r}, ready {got[r].get('slack_s', 0):.1f} s "
                                f"before the start)" for r in ROLES))
    sent = [f"{got[r]['node']}/{name} {rep['sent']}/{rep['failed']}"
            for r in ROLES for name, rep in _reports(got[r]).items()]
    print("SLA windows sent to each node's qosd (sent/failed): "
          + (", ".join(sent) or "none (the demo's processes do not report)"))
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "roles": got}, indent=1))
    if a.wait_view > 0:
        senders = sorted({got[r]["node"] for r in ROLES if any(
            rep["sent"] for rep in _reports(got[r]).values())})
        _wait_view(senders, a.wait_view)
    return 0


def _reports(doc: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per process of a role: the SLA windows it sent to its qosd."""
    out = {}
    if doc.get("sla_reports"):
        out["sensors"] = doc["sla_reports"]
    for name, st in (doc.get("stages") or {}).items():
        if st.get("sla_reports"):
            out[name] = st["sla_reports"]
    return out


def _wait_view(nodes: list[str], timeout: float) -> None:
    """Until this node's global SLA view has every node that sent windows, each
    with its sketches (no partial row), and counts them as reporting; after
    ``timeout``, says so."""
    if not nodes:
        log("no process sent SLA windows: the global SLA view stays empty")
        return
    sock = qosd_config()["api_socket"]
    t0 = time.monotonic()
    have: set[str] = set()
    while time.monotonic() - t0 < timeout:
        try:
            view = qosd_get(sock, "/v1/cluster/sla?nodes=true")
            have = {b["node"] for r in view.get("stages") or [] for b in r.get("breakdown") or []}
            rows = (view.get("stages") or []) + (view.get("classes") or [])
            # the census (who reports) is aggregated as a record of its own and may
            # come a round after the classes' (docs/cluster.md "Global SLA view")
            counted = int(view.get("nodes_reporting") or 0) >= len(nodes)
            if set(nodes) <= have and counted and not any(r.get("partial") for r in rows):
                log(f"global SLA view complete after {time.monotonic() - t0:.1f} s "
                    f"({', '.join(nodes)})")
                return
        except Exception as e:  # noqa: BLE001  (qosd busy or peers not enabled: retry)
            log(f"cluster sla: {e}")
        time.sleep(0.5)
    log(f"global SLA view: after {timeout:g} s it has {sorted(have)} of {nodes} "
        "(shown as it is)")


# --------------------------------------------------------------------------
def _rate(text: str) -> int:
    from mmmesh.policy import Rate

    return int(Rate(text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pipeline_node.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--rate", default="300mbit", help="the sensors' uplink rate")
        sp.add_argument("--duration", type=float, default=8.0, help="seconds the sensors run")
        sp.add_argument("--flood", type=float, default=0.5, help="video flood x the rate (0: none)")

    sp = sub.add_parser("apply-policy", help="the demo's policy, mesh-wide")
    sp.add_argument("--rate", default="300mbit")
    sp.add_argument("--policy", default=None, help="policy YAML (default examples/policy.yaml)")
    sp.add_argument("--timeout", type=float, default=90.0)
    sp = sub.add_parser("run", help="one role's processes; one JSON line on stdout")
    common(sp)
    sp.add_argument("--role", choices=ROLES, required=True)
    sp.add_argument("--at", type=float, required=True, help="wall-clock start (epoch seconds)")
    for r in ROLES:
        sp.add_argument(f"--{r}", required=True, metavar="IP", help=f"the {r} VM's address")
    sp = sub.add_parser("report", help="the table from the roles' JSON lines on stdin")
    common(sp)
    sp.add_argument("--wait-view", type=float, default=45.0, metavar="SECONDS",
                    help="wait this long for the global SLA view (0: don't)")
    sp.add_argument("--json", default=None, help="also write everything to this file")
    a = p.parse_args(argv)
    a.rate_text = a.rate
    a.rate = _rate(a.rate)
    if getattr(a, "duration", 1.0) <= 0 or not math.isfinite(getattr(a, "duration", 1.0)):
        p.error("--duration must be > 0")
    return {"apply-policy": cmd_apply_policy, "run": cmd_run, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
