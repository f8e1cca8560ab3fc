"""The Grafana dashboard (docs/grafana/mmmesh-dashboard.json) and the alert
rules (docs/grafana/mmmesh-alerts.yaml), checked statically and against a
real Prometheus.

Statically: every query uses names qosd, the sidecars or (soon) the cluster
export; every query on qosd's metrics is filtered by the node variable and
keeps ``instance`` unless it is a worst-node stat.  Then a real Prometheus
(Debian's 2.42, a plain binary with a config of our own) scrapes three
in-process qosd registries on loopback, each with a fake dataplane and a real
SLA board, as ``node-a``, ``node-b`` and ``node-c`` (and one sidecar's
registry with frames of known latency): node-b's flow table is
nearly full and its kernel holds another version than its qosd, node-c runs
an older policy, has a device without a dataplane and a heartbeat that stopped
ten minutes ago.  Every dashboard query must evaluate; the per-node panels
must return one series per node and the worst-node stats must point at the
bad ones (where the old queries summed or averaged them away); the alert
rules, loaded by the same Prometheus, must go pending for them.
``promtool test rules`` runs the rules' own cases.  About 10 s.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from qosd.metrics import (
    PROCESS_METRICS,
    MetricsServer,
    QosdMetrics,
    exported_names,
    make_registry,
    serve_metrics,
)
from qosd.model import ReconcileResult
from sidecar.contract import SlaSample
from sidecar.sla.prometheus import SlaCollector
from sidecar.sla.windows import SlaWindows
from tests.metrics_support import FakeDataplane, board_with, fake_dataplanes, prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "docs" / "grafana"
DASHBOARD = GRAFANA / "mmmesh-dashboard.json"
ALERTS = GRAFANA / "mmmesh-alerts.yaml"
# What the dashboard may use besides qosd's own names: the sidecars' (checked
# against their collector) and the cluster's, not exported yet (qosd/peers/).
SIDECAR_METRICS = {"mmmesh_stage_latency_seconds"}
FUTURE_METRICS = {"mmmesh_cluster_members", "mmmesh_cluster_suspicions_total",
                  "mmmesh_cluster_refutations_total", "mmmesh_cluster_gossip_bytes_total",
                  "mmmesh_cluster_probe_rtt_seconds", "mmmesh_rollout_state"}


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str) or k == "query" and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def panel(dash: dict[str, Any], title: str) -> dict[str, Any]:
    (p,) = [p for p in panels(dash) if p["title"] == title]
    return p


def test_dashboard_uses_only_exported_metrics() -> None:
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    tvars = {v["name"]: v for v in dash["templating"]["list"]}
    assert tvars["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"instance", "iface", "class", "stage"} <= set(tvars)
    ps = panels(dash)
    for p in ps:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        assert p["description"], p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))

    used: set[str] = set()
    for e in _exprs(dash):
        used |= set(re.findall(r"(?:mmmesh|process)_[a-z0-9_]+", e))
    exported = exported_names() | set(PROCESS_METRICS)
    sidecar = {f.name for f in SlaCollector(None).describe()}  # type: ignore[arg-type]
    assert SIDECAR_METRICS <= sidecar
    unknown = set()
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in exported or base in SIDECAR_METRICS or base in FUTURE_METRICS:
            continue
        unknown.add(name)
    assert not unknown, f"dashboard uses metrics nobody exports: {sorted(unknown)}"
    assert not (FUTURE_METRICS & exported), "exported now: take it out of FUTURE_METRICS"
    # what the brief asks to see
    for want in ("mmmesh_htb_class_bytes_total", "mmmesh_classifier_class_bytes_total",
                 "mmmesh_htb_class_drops_total", "mmmesh_htb_class_backlog_bytes",
                 "mmmesh_classifier_packets_total", "mmmesh_classifier_events_total",
                 "mmmesh_flows", "mmmesh_dataplane_policy_version",
                 "mmmesh_sla_attainment_ratio", "mmmesh_resync_last_run_timestamp_seconds",
                 "mmmesh_build_info", "process_resident_memory_bytes", "process_open_fds",
                 "mmmesh_stage_latency_seconds_bucket", "mmmesh_cluster_members"):
        assert want in used, want


def test_dashboard_is_per_node() -> None:
    """Every query on qosd's metrics is filtered by the node variable, and
    what is not a worst-node stat (or a mesh-wide line) keeps ``instance``."""
    dash = dashboard()
    node = {v["name"]: v for v in dash["templating"]["list"]}["instance"]
    assert node["includeAll"] and node["multi"] and node["allValue"] == ".*"
    assert "mmmesh_build_info" in node["definition"]
    qosd_names = exported_names() | set(PROCESS_METRICS) | FUTURE_METRICS
    for p in panels(dash):
        for t in p["targets"]:
            expr = t["expr"]
            for sel in re.findall(r"((?:mmmesh|process)_[a-z0-9_]+)(\{[^}]*\})?", expr):
                name, labels = sel
                if re.sub(r"_(bucket|sum|count)$", "", name) in SIDECAR_METRICS:
                    continue
                if name == "mmmesh_build_info" and " and on (instance) " in expr:
                    continue  # the join that keeps process_* of qosd only
                assert name in qosd_names and 'instance=~"$instance"' in labels, \
                    (p["title"], expr)
            sidecars_only = "mmmesh_stage_" in expr  # per stage: their instance is a pod
            per_node = p["type"] != "stat" and not t["legendFormat"].startswith("mesh") \
                and not sidecars_only
            if per_node:
                assert re.search(r"by \([^)]*instance", expr) or "on (instance)" in expr, \
                    (p["title"], expr)
                assert "{{instance}}" in t["legendFormat"] or t.get("format") == "table", \
                    (p["title"], t["legendFormat"])


def test_dashboard_worst_node_stats_and_panels() -> None:
    dash = dashboard()
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels(dash)}
    version = exprs["Policy version: oldest / newest node"]
    assert any(e.startswith("min(mmmesh_policy_version") for e in version)
    assert any(e.startswith("max(mmmesh_policy_version") for e in version)
    assert exprs["Flow table fill: fullest node"][0].startswith("max(mmmesh_flows{")
    assert "/ mmmesh_flows_capacity" in exprs["Flow table fill: fullest node"][0]
    assert "mmmesh_resync_interval_seconds" in exprs["Stale heartbeats"][0]
    assert exprs["SLA attainment: worst node and class"][0].startswith("min(")
    # the reasons panel is the partition only; events have their own
    reasons = exprs["Classifier packets by reason"][0]
    assert "mmmesh_classifier_packets_total" in reasons and "reason=~" not in reasons
    assert "GSO" in panel(dash, "Classifier packets by reason")["description"]
    assert "mmmesh_classifier_events_total" in exprs["Classifier events"][0]
    # the stage latency: one panel per kind, never mixed
    lat = [p for p in panels(dash) if "mmmesh_stage_latency_seconds_bucket" in json.dumps(p)]
    assert sorted(re.search(r'kind="(\w+)"', p["targets"][0]["expr"]).group(1)  # type: ignore[union-attr]
                  for p in lat) == ["e2e", "queue", "service"]
    for p in lat:
        assert "histogram_quantile(0.99" in p["targets"][0]["expr"]
        assert "sidecar" in p["description"]
    # reconcile duration: the last one, and a mean that is not NaN when nothing ran
    dur = exprs["Reconcile duration"]
    assert dur[0].startswith("max by (instance) (mmmesh_reconcile_last_duration_seconds")
    assert "_sum" in dur[1] and "_count" in dur[1] and dur[1].endswith("> 0)")
    assert "increase(" not in dur[1]  # extrapolated: a few reconciles came out 5 % off
    assert ">= 20)" in dur[2]
    # the Mesh row and its placeholder
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows[-1] == "Mesh"
    mesh = dash["panels"][[p["title"] for p in dash["panels"]].index("Mesh") + 1:]
    assert len(mesh) == 1 and "placeholder" in mesh[0]["title"].lower()


# --------------------------------------------------------------------------
# the alert rules
# --------------------------------------------------------------------------
def test_alert_rules_check_and_unit_tests() -> None:
    promtool = prometheus_tool("promtool")
    for args in (["check", "rules", ALERTS.name], ["test", "rules", "mmmesh-alerts.test.yaml"]):
        r = subprocess.run([promtool, *args], cwd=GRAFANA, capture_output=True, text=True,
                           timeout=60, check=False)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    names = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert "MmmeshQosdHeartbeatStale" in names


# --------------------------------------------------------------------------
# a real Prometheus scraping three nodes
# --------------------------------------------------------------------------
@dataclass
class Node:
    """One in-process qosd endpoint."""

    name: str
    metrics: QosdMetrics
    server: MetricsServer


@dataclass
class Mesh:
    url: str
    nodes: dict[str, Node]

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] in ("vector", "scalar"), expr
        res = body["data"]["result"]
        return res if body["data"]["resultType"] == "vector" else [{"metric": {}, "value": res}]

    def scalar(self, expr: str) -> float:
        (r,) = self.query(expr)
        return float(r["value"][1])

    def by_instance(self, expr: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.query(expr):
            out[r["metric"]["instance"]] = float(r["value"][1])
        return out


def grafana(expr: str, instance: str = ".*") -> str:
    """A dashboard query as Grafana sends it with All selected (or one node)."""
    return (expr.replace("$__rate_interval", "5s").replace("$instance", instance)
            .replace("$iface", ".*").replace("$class", ".*").replace("$stage", ".*"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, ok: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


class _Frames(Collector):
    """Records 20 frames of stage asr into ``windows`` on every scrape (so the
    sidecar's histograms grow between scrapes): 0.3 ms queued, 4 ms in the
    runner, 40 ms end to end."""

    def __init__(self, windows: SlaWindows) -> None:
        self.windows = windows

    def collect(self) -> Iterable[Metric]:
        for _ in range(20):
            self.windows.record(SlaSample(stage="asr", sla_class="voice", modality="audio",
                                          queue_ns=300_000, service_ns=4_000_000,
                                          e2e_ns=40_000_000, deadline_missed=False))
        return []


def _sidecar() -> MetricsServer:
    registry, windows = CollectorRegistry(), SlaWindows()
    registry.register(_Frames(windows))  # collected first
    registry.register(SlaCollector(windows))
    return serve_metrics(registry, "127.0.0.1:0")


def _node(name: str, dps: list[FakeDataplane], version: int, attainment: float,
          heartbeat_age_s: float) -> Node:
    targets, opener = fake_dataplanes(*dps)
    registry, qm = make_registry(targets, dataplane=opener, sla_board=board_with(attainment),
                                 node=name, resync_interval_s=10)
    assert qm is not None
    qm.observe_reconcile(ReconcileResult(ok=True, version=version, started_at=time.time(),
                                         duration_s=0.05, trigger="startup"))
    qm.resync_ran(time.time() - heartbeat_age_s)
    return Node(name, qm, serve_metrics(registry, "127.0.0.1:0"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    binary = prometheus_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    nodes: dict[str, Node] = {}
    proc: subprocess.Popen[bytes] | None = None
    sidecar = _sidecar()
    try:
        for node in (
            _node("node-a", [FakeDataplane("eth0", version=5, flows=10)], 5, 0.99, 0),
            # a nearly full flow table; its kernel holds version 4, its qosd says 5
            _node("node-b", [FakeDataplane("eth0", version=4, flows=65000)], 5, 0.80, 0),
            # lags a version behind, a device without dataplane, a stuck resync loop
            _node("node-c", [FakeDataplane("eth0", version=4, flows=100),
                             FakeDataplane("eth1", up=False)], 4, 0.97, 600),
        ):
            nodes[node.name] = node
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            # instance = the node's name, as the Kubernetes relabelling in
            # docs/operations.md does
            "scrape_configs": [{"job_name": "mmmesh-qosd", "static_configs": [
                {"targets": [f"127.0.0.1:{n.server.port}"], "labels": {"instance": n.name}}
                for n in nodes.values()]},
                {"job_name": "mmmesh-sidecar", "static_configs": [
                    {"targets": [f"127.0.0.1:{sidecar.port}"], "labels": {"instance": "asr-0"}}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        log = (tmp / "prometheus.log").open("wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        m = Mesh(f"http://127.0.0.1:{port}", nodes)

        def ready() -> bool:
            assert proc is not None and proc.poll() is None, (tmp / "prometheus.log").read_text()
            with urllib.request.urlopen(f"{m.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)

        _wait("Prometheus to start", ready)
        # enough scrapes of every node for rate() over 5 s
        _wait("4 scrapes of each node", lambda: len(m.query(
            "count_over_time(mmmesh_build_info[1m]) >= 4")) == 3)
        yield m
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for node in nodes.values():
            node.server.shutdown()
        sidecar.shutdown()


def _targets(kinds: tuple[str, ...] = ("timeseries", "table", "stat")
             ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for p in panels(dashboard()):
        if p["type"] in kinds:
            for t in p["targets"]:
                yield p, t


def test_every_dashboard_query_evaluates_without_nan(mesh: Mesh) -> None:
    for p, t in _targets():
        for r in mesh.query(grafana(t["expr"])):
            assert not math.isnan(float(r["value"][1])), (p["title"], t["expr"], r)


def test_per_node_panels_return_one_series_per_node(mesh: Mesh) -> None:
    nodes = set(mesh.nodes)
    for p, t in _targets(("timeseries", "table")):
        expr = t["expr"]
        if t["legendFormat"].startswith("mesh") or "mmmesh_stage_" in expr \
                or any(f in expr for f in FUTURE_METRICS):
            continue
        res = mesh.query(grafana(expr))
        got = {r["metric"].get("instance") for r in res}
        if "_duration_seconds_" in expr or "increase(mmmesh_reconcile" in expr \
                or "refused_total" in expr:
            assert got <= nodes, (p["title"], expr, got)  # only where something happened
        else:
            assert got == nodes, (p["title"], expr, got)  # one node is never summed away
    # one node selected: only its series
    htb = panel(dashboard(), "HTB throughput per class")["targets"][0]["expr"]
    res = mesh.query(grafana(htb, instance="node-b"))
    assert res and {r["metric"]["instance"] for r in res} == {"node-b"}
    assert {r["metric"]["class"] for r in res} == {"control", "voice", "video", "lidar",
                                                    "best-effort"}


def test_stage_latency_panels_keep_the_kinds_apart(mesh: Mesh) -> None:
    """One panel per kind, each p99 in its own kind's bucket (the old panel
    took one quantile over the three kinds: here the e2e one, hiding queue
    and service)."""
    want = {"queue": (0.00025, 0.0005), "service": (0.0025, 0.005), "e2e": (0.03, 0.05)}
    for kind, (lo, hi) in want.items():
        (t,) = panel(dashboard(), f"Stage latency p99: {kind}")["targets"]
        (r,) = mesh.query(grafana(t["expr"]))
        assert r["metric"] == {"stage": "asr", "class": "voice"}
        assert lo < float(r["value"][1]) <= hi, (kind, r)


def _stat(title: str, legend: str | None = None) -> str:
    p = panel(dashboard(), title)
    (t,) = [t for t in p["targets"] if legend is None or t["legendFormat"] == legend]
    return grafana(t["expr"])


def test_worst_node_stats_find_the_bad_nodes(mesh: Mesh) -> None:
    assert mesh.scalar(_stat("Nodes reporting")) == 3
    assert mesh.scalar(_stat("Dataplanes down")) == 1  # node-c eth1
    title = "Policy version: oldest / newest node"
    assert mesh.scalar(_stat(title, "oldest")) == 4
    assert mesh.scalar(_stat(title, "newest")) == 5
    assert mesh.scalar(_stat(title, "behind")) == 1  # node-c
    assert mesh.scalar(_stat(title, "kernel != qosd")) == 1  # node-b eth0
    # the old "max(mmmesh_policy_version)" said 5: nothing to see
    assert mesh.scalar("max(mmmesh_policy_version)") == 5
    fill = mesh.scalar(_stat("Flow table fill: fullest node"))
    assert fill == pytest.approx(65000 / 65536)
    # the old sum/sum averaged node-b's full table away
    assert mesh.scalar("sum(mmmesh_flows) / sum(mmmesh_flows_capacity)") < 0.34
    assert mesh.scalar(_stat("Stale heartbeats", "stale")) == 1  # node-c
    assert mesh.scalar(_stat("Stale heartbeats", "oldest (s)")) >= 600
    assert mesh.scalar(_stat("SLA attainment: worst node and class")) == pytest.approx(0.80)
    assert mesh.scalar(_stat("HTB drops/s: worst node")) > 0
    assert mesh.scalar(_stat("Reconcile errors (1h): worst node")) == 0
    # the per-node policy panel shows who lags
    qosd_version = panel(dashboard(), "Policy version per node")["targets"][0]["expr"]
    assert mesh.by_instance(grafana(qosd_version)) == {"node-a": 5, "node-b": 5, "node-c": 4}
    heartbeat = panel(dashboard(), "Heartbeat age")["targets"][0]["expr"]
    ages = mesh.by_instance(grafana(heartbeat))
    assert ages["node-c"] >= 600 and ages["node-a"] < 60


def test_reconcile_duration_has_a_value_when_few_ran(mesh: Mesh) -> None:
    """Steady state: the last duration per node, no mean (nothing ran in the
    window), no NaN; one reconcile later: the mean is that reconcile."""
    last, mean, p99 = (grafana(t["expr"]) for t in
                       panel(dashboard(), "Reconcile duration")["targets"])
    assert mesh.by_instance(last) == {n: pytest.approx(0.05) for n in mesh.nodes}
    assert mesh.query(p99) == []  # fewer than 20 reconciles: no made-up quantile
    # the old query: NaN in steady state
    old = mesh.query("histogram_quantile(0.99, sum by (le) "
                     "(rate(mmmesh_reconcile_duration_seconds_bucket[5s])))")
    assert old and math.isnan(float(old[0]["value"][1]))
    mesh.nodes["node-a"].metrics.observe_reconcile(ReconcileResult(
        ok=True, version=5, started_at=time.time(), duration_s=0.8, trigger="resync",
        repaired=("htb 1:b",)))
    _wait("the reconcile to be scraped", lambda: mesh.by_instance(last).get("node-a") == 0.8)
    _wait("the mean to appear", lambda: "node-a" in mesh.by_instance(mean))
    assert mesh.by_instance(mean)["node-a"] == pytest.approx(0.8)


def test_alert_rules_go_pending_for_the_bad_nodes(mesh: Mesh) -> None:
    want = {("MmmeshQosdHeartbeatStale", "node-c", ""),
            ("MmmeshDataplaneDown", "node-c", "eth1"),
            ("MmmeshPolicyVersionLagging", "node-c", ""),
            ("MmmeshKernelPolicyDiffers", "node-b", "eth0"),
            ("MmmeshFlowTableNearlyFull", "node-b", "eth0"),
            ("MmmeshSlaAttainmentLow", "node-b", "")}

    def alerts() -> set[tuple[str, str, str]]:
        return {(r["metric"]["alertname"], r["metric"]["instance"],
                 r["metric"].get("iface", "")) for r in mesh.query("ALERTS")}

    _wait("the alerts", lambda: want <= alerts())
    assert alerts() == want  # nothing about the healthy node, or the healthy parts
    assert all(r["metric"]["alertstate"] == "pending" for r in mesh.query("ALERTS"))
