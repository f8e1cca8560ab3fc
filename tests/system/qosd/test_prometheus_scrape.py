"""The Grafana dashboard (docs/grafana/mmmesh-dashboard.json) and the alert
rules (docs/grafana/mmmesh-alerts.yaml), checked statically and against a
real Prometheus.

Statically: every query uses names qosd (its mesh's too) or the sidecars
export; every query on qosd's metrics is filtered by the node variable and
keeps ``instance`` unless it is a worst-node stat.  Then a real Prometheus
(Debian's 2.42, a plain binary with a config of our own;
testkit/prometheus_support.py) scrapes three in-process qosd registries on
loopback, each with a fake dataplane, a real SLA board and the mesh's
collectors (fake peers, real rollout cores and SLA views), as ``node-a``,
``node-b`` and ``node-c`` (and one sidecar's registry with frames of known
latency): node-b's flow table is nearly full and its kernel holds another
version than its qosd, node-c runs an older policy, has a device without a
dataplane and a heartbeat that stopped ten minutes ago.  In the mesh every
node sees a fourth member dead, node-c also sees node-b suspect, node-a's
peer certificate expires in 10 days, node-b's local health is 4 and node-c
NACKed the mesh policy (its link is too small) and probes slowly.  Every dashboard query must evaluate; the per-node panels
must return one series per node and the worst-node stats must point at the
bad ones (where the old queries summed or averaged them away); the alert
rules, loaded by the same Prometheus, must go pending for them.
``promtool test rules`` runs the rules' own cases.  About 10 s.
"""


from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from qosd.mesh.membership.core import State
from qosd.metrics import PROCESS_METRICS, exported_names
from qosd.model import ReconcileResult
from sidecar.sla.prometheus import SlaCollector
from testkit.cluster_metrics_fakes import FakePeers, rollout_apps
from testkit.metrics_support import FakeDataplane, prometheus_tool
from testkit.prometheus_support import (
    ALERTS,
    GRAFANA,
    Mesh,
    dashboard,
    exprs,
    grafana,
    node,
    panel,
    panels,
    running_prometheus,
    stat_query,
    targets,
    wait,
)

# What the dashboard may use besides qosd's own names: the sidecars' (checked
# against their collector).
SIDECAR_METRICS = {"mmmesh_stage_latency_seconds"}
# What issue 9 asks the Mesh row to show.
MESH_ROW_METRICS = (
    "mmmesh_cluster_members", "mmmesh_cluster_suspicions_total",
    "mmmesh_cluster_refutations_total", "mmmesh_cluster_deaths_declared_total",
    "mmmesh_cluster_bytes_total", "mmmesh_cluster_probe_rtt_seconds_bucket",
    "mmmesh_cluster_dropped_packets_total", "mmmesh_cluster_cert_expiry_timestamp_seconds",
    "mmmesh_rollout_behind", "mmmesh_rollout_members", "mmmesh_rollout_desired_info",
    "mmmesh_rollout_applied_info", "mmmesh_cluster_sla_attainment_ratio",
    "mmmesh_cluster_sla_p99_seconds", "mmmesh_cluster_sla_nodes_reporting")


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
    for e in exprs(dash):
        used |= set(re.findall(r"(?:mmmesh|process)_[a-z0-9_]+", e))
    exported = exported_names() | set(PROCESS_METRICS)
    sidecar = {f.name for f in SlaCollector(None).describe()}  # type: ignore[arg-type]
    assert SIDECAR_METRICS <= sidecar
    unknown = set()
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in exported or base in SIDECAR_METRICS:
            continue
        unknown.add(name)
    assert not unknown, f"dashboard uses metrics nobody exports: {sorted(unknown)}"
    # what the brief asks to see
    for want in ("mmmesh_htb_class_bytes_total", "mmmesh_classifier_class_bytes_total",
                 "mmmesh_htb_class_drops_total", "mmmesh_htb_class_backlog_bytes",
                 "mmmesh_classifier_packets_total", "mmmesh_classifier_events_total",
                 "mmmesh_flows", "mmmesh_dataplane_policy_version",
                 "mmmesh_sla_attainment_ratio", "mmmesh_resync_last_run_timestamp_seconds",
                 "mmmesh_build_info", "process_resident_memory_bytes", "process_open_fds",
                 "mmmesh_stage_latency_seconds_bucket", *MESH_ROW_METRICS):
        assert want in used, want


def test_dashboard_is_per_node() -> None:
    """Every query on qosd's metrics is filtered by the node variable, and
    what is not a worst-node stat (or a mesh-wide line) keeps ``instance``."""
    dash = dashboard()
    node = {v["name"]: v for v in dash["templating"]["list"]}["instance"]
    assert node["includeAll"] and node["multi"] and node["allValue"] == ".*"
    assert "mmmesh_build_info" in node["definition"]
    qosd_names = exported_names() | set(PROCESS_METRICS)
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
    qs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels(dash)}
    version = qs["Mesh policy version: oldest / newest node"]
    assert any(e.startswith("min(mmmesh_policy_mesh_counter") for e in version)
    assert any(e.startswith("max(mmmesh_policy_mesh_counter") for e in version)
    assert qs["Flow table fill: fullest node"][0].startswith("max(mmmesh_flows{")
    assert "/ mmmesh_flows_capacity" in qs["Flow table fill: fullest node"][0]
    assert "mmmesh_resync_interval_seconds" in qs["Stale heartbeats"][0]
    assert qs["SLA attainment: worst node and class"][0].startswith("min(")
    # the reasons panel is the partition only; events have their own
    reasons = qs["Classifier packets by reason"][0]
    assert "mmmesh_classifier_packets_total" in reasons and "reason=~" not in reasons
    assert "GSO" in panel(dash, "Classifier packets by reason")["description"]
    assert "mmmesh_classifier_events_total" in qs["Classifier events"][0]
    # the stage latency: one panel per kind, never mixed
    lat = [p for p in panels(dash) if "mmmesh_stage_latency_seconds_bucket" in json.dumps(p)]
    assert sorted(re.search(r'kind="(\w+)"', p["targets"][0]["expr"]).group(1)  # type: ignore[union-attr]
                  for p in lat) == ["e2e", "queue", "service"]
    for p in lat:
        assert "histogram_quantile(0.99" in p["targets"][0]["expr"]
        assert "sidecar" in p["description"]
    # reconcile duration: the last one, and a mean that is not NaN when nothing ran
    dur = qs["Reconcile duration"]
    assert dur[0].startswith("max by (instance) (mmmesh_reconcile_last_duration_seconds")
    assert "_sum" in dur[1] and "_count" in dur[1] and dur[1].endswith("> 0)")
    assert "increase(" not in dur[1]  # extrapolated: a few reconciles came out 5 % off
    assert ">= 20)" in dur[2]
    # the Mesh row: membership, gossip, probes, drops, certificates, rollout, global view
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows[-1] == "Mesh"
    mesh = dash["panels"][[p["title"] for p in dash["panels"]].index("Mesh") + 1:]
    text = json.dumps(mesh)
    for want in MESH_ROW_METRICS:
        assert want in text, want
    assert not any("placeholder" in p["title"].lower() for p in mesh)
    alive = qs["Members alive: fewest / most views"]
    assert alive[0].startswith("min(sum by (instance)") and alive[1].startswith("max(")
    assert "histogram_quantile(0.99" in qs["Probe RTT p99 per node"][0]
    assert qs["Probe RTT p99 per node"][0].endswith("> 0)")  # nothing, not NaN, without probes


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
def _views() -> dict[str, dict[str, State]]:
    """Each node's membership: node-d dead everywhere, node-b suspect to node-c."""
    base = {"node-a": State.ALIVE, "node-b": State.ALIVE, "node-c": State.ALIVE,
            "node-d": State.DEAD}
    return {n: {n: State.ALIVE, **{k: v for k, v in base.items() if k != n}}
            for n in ("node-a", "node-b")} | {
        "node-c": {"node-c": State.ALIVE, **base, "node-b": State.SUSPECT}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    views = _views()
    apps = rollout_apps(3, nack=(2,))  # node-c's link cannot carry the mesh policy
    nodes = [
        node("node-a", [FakeDataplane("eth0", version=5, flows=10)], 5, 0.99, 0,
             FakePeers(views["node-a"], cert_days=10, dropped={"rate_limited": 1}), apps[0],
             mesh_version="3@node-a"),
        # a nearly full flow table; a longer history (its store says 9 for the mesh's
        # 3@node-a) and its kernel holds version 4
        node("node-b", [FakeDataplane("eth0", version=4, flows=65000)], 9, 0.80, 0,
             FakePeers(views["node-b"], health=4, dropped={"malformed": 1}), apps[1],
             mesh_version="3@node-a"),
        # lags a mesh version behind, a device without dataplane, a stuck resync loop
        node("node-c", [FakeDataplane("eth0", version=4, flows=100),
                        FakeDataplane("eth1", up=False)], 4, 0.97, 600,
             FakePeers(views["node-c"], rtt_s=0.02, dropped={"too_large": 1}), apps[2],
             mesh_version="2@node-a", text="policy B"),
    ]
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), nodes) as m:
        yield m


def test_every_dashboard_query_evaluates_without_nan(mesh: Mesh) -> None:
    for p, t in targets():
        for r in mesh.query(grafana(t["expr"])):
            assert not math.isnan(float(r["value"][1])), (p["title"], t["expr"], r)


def test_per_node_panels_return_one_series_per_node(mesh: Mesh) -> None:
    nodes = set(mesh.nodes)
    for p, t in targets(("timeseries", "table")):
        expr = t["expr"]
        if t["legendFormat"].startswith("mesh") or "mmmesh_stage_" in expr:
            continue
        res = mesh.query(grafana(expr))
        got = {r["metric"].get("instance") for r in res}
        if "_duration_seconds_" in expr or "increase(mmmesh_reconcile" in expr \
                or "refused_total" in expr or "send_failures_total" in expr \
                or "mmmesh_rollout_applied_info" in expr:
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


def test_worst_node_stats_find_the_bad_nodes(mesh: Mesh) -> None:
    assert mesh.scalar(stat_query("Nodes reporting")) == 3
    assert mesh.scalar(stat_query("Dataplanes down")) == 1  # node-c eth1
    title = "Mesh policy version: oldest / newest node"
    assert mesh.scalar(stat_query(title, "oldest")) == 2
    assert mesh.scalar(stat_query(title, "newest")) == 3
    assert mesh.scalar(stat_query(title, "behind")) == 1  # node-c
    assert mesh.scalar(stat_query(title, "policies")) == 2  # node-c's text differs
    assert mesh.scalar(stat_query(title, "kernel != qosd")) == 1  # node-b eth0
    # the old comparison of store numbers across nodes: node-a runs the newest
    # mesh version under its own number 5 and would "lag" node-b's 9
    old = mesh.query("mmmesh_policy_version < on() group_left() max(mmmesh_policy_version)")
    assert {r["metric"]["instance"] for r in old} == {"node-a", "node-c"}
    fill = mesh.scalar(stat_query("Flow table fill: fullest node"))
    assert fill == pytest.approx(65000 / 65536)
    # the old sum/sum averaged node-b's full table away
    assert mesh.scalar("sum(mmmesh_flows) / sum(mmmesh_flows_capacity)") < 0.34
    assert mesh.scalar(stat_query("Stale heartbeats", "stale")) == 1  # node-c
    assert mesh.scalar(stat_query("Stale heartbeats", "oldest (s)")) >= 600
    assert mesh.scalar(stat_query("SLA attainment: worst node and class")) == pytest.approx(0.80)
    assert mesh.scalar(stat_query("HTB drops/s: worst node")) > 0
    assert mesh.scalar(stat_query("Reconcile errors (1h): worst node")) == 0
    # the per-node policy panel shows who lags
    qosd_version = panel(dashboard(), "Policy version per node")["targets"][0]["expr"]
    assert mesh.by_instance(grafana(qosd_version)) == {"node-a": 5, "node-b": 9, "node-c": 4}
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
    wait("the reconcile to be scraped", lambda: mesh.by_instance(last).get("node-a") == 0.8)
    wait("the mean to appear", lambda: "node-a" in mesh.by_instance(mean))
    assert mesh.by_instance(mean)["node-a"] == pytest.approx(0.8)


def test_alert_rules_go_pending_for_the_bad_nodes(mesh: Mesh) -> None:
    want = {("MmmeshMeshMemberDead", "", ""),  # node-d, in every view: one alert, no instance
            ("MmmeshPeerCertificateExpiring", "node-a", ""),
            ("MmmeshMeshHealthDegraded", "node-b", ""),
            ("MmmeshRolloutBehind", "node-c", ""),
            ("MmmeshQosdHeartbeatStale", "node-c", ""),
            ("MmmeshDataplaneDown", "node-c", "eth1"),
            ("MmmeshPolicyVersionLagging", "node-c", ""),
            ("MmmeshKernelPolicyDiffers", "node-b", "eth0"),
            ("MmmeshFlowTableNearlyFull", "node-b", "eth0"),
            ("MmmeshSlaAttainmentLow", "node-b", "")}

    def alerts() -> set[tuple[str, str, str]]:
        return {(r["metric"]["alertname"], r["metric"].get("instance", ""),
                 r["metric"].get("iface", "")) for r in mesh.query("ALERTS")}

    wait("the alerts", lambda: want <= alerts())
    assert alerts() == want  # nothing about the healthy node, or the healthy parts
    assert all(r["metric"]["alertstate"] == "pending" for r in mesh.query("ALERTS"))


def test_mesh_row_finds_the_bad_nodes(mesh: Mesh) -> None:
    title = "Members alive: fewest / most views"
    assert mesh.scalar(stat_query(title, "fewest")) == 2  # node-c holds node-b suspect
    assert mesh.scalar(stat_query(title, "most")) == 3
    assert mesh.scalar(stat_query(title, "disagree")) == 1
    worst = "Dead / suspect members: worst view"
    assert mesh.scalar(stat_query(worst, "dead")) == 1  # node-d
    assert mesh.scalar(stat_query(worst, "suspect")) == 1
    assert mesh.scalar(stat_query("Local health: worst node")) == 4  # node-b
    behind = "Nodes behind the mesh policy"
    assert mesh.scalar(stat_query(behind, "behind")) == 1  # node-c NACKed
    assert mesh.scalar(stat_query(behind, "nacked")) == 1
    assert mesh.scalar(stat_query(behind, "pending")) == 0
    assert 9.9 < mesh.scalar(stat_query("Peer certificate: soonest expiry")) <= 10  # node-a
    assert mesh.scalar(stat_query("Global SLA attainment: worst class")) == \
        pytest.approx(0.80)  # node-b's view (each view here holds its own node's board)
    # per node: who sees what, who probes slowly, who runs which mesh version
    members = panel(dashboard(), "Members by state, per node's view")["targets"][0]["expr"]
    alive = {r["metric"]["instance"]: float(r["value"][1]) for r in mesh.query(grafana(members))
             if r["metric"]["state"] == "alive"}
    assert alive == {"node-a": 3, "node-b": 3, "node-c": 2}
    rtt = mesh.by_instance(grafana(panel(dashboard(), "Probe RTT p99 per node")
                                   ["targets"][0]["expr"]))
    assert 0.01 < rtt["node-c"] <= 0.025 and rtt["node-a"] <= 0.0005, rtt
    gossip = panel(dashboard(), "Gossip traffic per node")["targets"][0]["expr"]
    assert {(r["metric"]["instance"], r["metric"]["direction"]) for r in mesh.query(
        grafana(gossip)) if float(r["value"][1]) > 0} == {
        (n, d) for n in mesh.nodes for d in ("in", "out")}
    desired, applied, behind_q = (grafana(t["expr"]) for t in
                                  panel(dashboard(), "Mesh policy rollout per node")["targets"])
    versions = {r["metric"]["version"] for r in mesh.query(desired)}
    assert len(versions) == 1 and versions.pop().endswith("@node-0")  # one mesh version
    assert {r["metric"]["instance"] for r in mesh.query(applied)} == {"node-a", "node-b"}
    assert mesh.by_instance(behind_q) == {"node-a": 0, "node-b": 0, "node-c": 1}
