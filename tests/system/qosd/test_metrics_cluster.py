"""The mesh's Prometheus metrics: the membership's (qosd/metrics/peers.py),
the rollout's and the global SLA view's (qosd/metrics/cluster_apps.py), and
the tables that list them (qosd/metrics/_cluster.py, which
``exported_names()`` reads).

Unprivileged: each collector over fakes and real cores (a simulated rollout
with a NACK, a real SlaView) exports exactly its table, the values the cores
hold, nothing without peers, and passes promtool.  Privileged: three real
qosd in network namespaces (testkit/netns_mesh.py) after a mesh-wide rollout
and an SLA report: every ``mmmesh_cluster_*`` / ``mmmesh_rollout_*`` sample
of their /metrics is a name the tables promise, and every table's names are
there.  The dashboard and alert rules are tests/system/qosd/test_prometheus_scrape.py's."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qosd.mesh.membership.core import State
from qosd.metrics import exported_names
from qosd.metrics._cluster import cluster_specs
from qosd.metrics._spec import Spec
from qosd.metrics.cluster_apps import CLUSTER_SLA_METRICS, ROLLOUT_METRICS, ClusterAppsCollector
from testkit.cluster_metrics_fakes import (
    FakePeers,
    cluster_collectors,
    rollout_apps,
    sla_app,
)
from testkit.metrics_support import board_with, promtool_check_metrics

ROOT = Path(__file__).resolve().parents[3]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ALIVE3 = {"node-0": State.ALIVE, "node-1": State.ALIVE, "node-2": State.ALIVE}


def scrape_text(*collectors: Any) -> str:
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    return generate_latest(registry).decode()


def samples(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) of every family in an exposition."""
    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, labels)
    return out


def check_table(text: str, spec: Spec) -> None:
    """The exposition's families of ``spec``'s prefix are exactly ``spec``'s
    (type and labels; families without samples have no labels to compare)."""
    got = families(text)
    assert set(spec) <= set(got), set(spec) - set(got)
    for name, (kind, labels, _) in spec.items():
        assert got[name][0] == kind, name
        assert got[name][1] in (set(labels), set()), (name, got[name][1])


# --------------------------------------------------------------------------
# unprivileged
# --------------------------------------------------------------------------
def test_the_peers_collector_exports_its_table() -> None:
    peers = FakePeers({**ALIVE3, "node-3": State.DEAD}, dropped={"impersonation": 1})
    text = scrape_text(cluster_collectors(peers)[0])
    spec = cluster_specs()["peers"]
    check_table(text, spec)
    assert set(families(text)) == set(spec)  # and nothing else
    s = samples(text)
    assert s[("mmmesh_cluster_members", frozenset({("state", "dead")}))] == 1
    assert s[("mmmesh_cluster_dropped_packets_total",
              frozenset({("reason", "impersonation")}))] == 1


def test_rollout_metrics_come_from_the_core() -> None:
    """A rollout from node 0 that node 2 NACKs: every table says 2 acked and 1
    nacked; node 2 is behind and runs no mesh version, node 0 is on it."""
    apps = rollout_apps(3, nack=(2,))
    on = samples(scrape_text(ClusterAppsCollector(rollout=apps[0], sla=None)))
    nacker = samples(scrape_text(ClusterAppsCollector(rollout=apps[2], sla=None)))
    version = str(apps[0].rollout.desired.version)
    for s in (on, nacker):
        assert s[("mmmesh_rollout_desired_info", frozenset({("version", version)}))] == 1
        counts = {dict(lab)["state"]: v for (n, lab), v in s.items()
                  if n == "mmmesh_rollout_members"}
        assert counts == {"pending": 0, "acked": 2, "nacked": 1, "superseded": 0, "gone": 0}
    assert on[("mmmesh_rollout_behind", frozenset())] == 0
    assert on[("mmmesh_rollout_applied_info", frozenset({("version", version)}))] == 1
    assert on[("mmmesh_rollout_proposals_total", frozenset())] == 1
    assert nacker[("mmmesh_rollout_behind", frozenset())] == 1
    assert not any(n == "mmmesh_rollout_applied_info" for n, _ in nacker)
    assert nacker[("mmmesh_rollout_nacks_total", frozenset())] == 1


def test_no_mesh_version_no_rollout_table() -> None:
    """Before any mesh-wide apply every member would be 'pending': nothing is
    (a rollout-stuck alert must not fire on a mesh that never rolled out)."""
    app = rollout_apps(3, propose=False)[1]
    s = samples(scrape_text(ClusterAppsCollector(rollout=app, sla=None)))
    assert {v for (n, _), v in s.items() if n == "mmmesh_rollout_members"} == {0}
    assert s[("mmmesh_rollout_behind", frozenset())] == 0
    assert not any(n == "mmmesh_rollout_desired_info" for n, _ in s)


def test_the_global_view_per_class_without_instances() -> None:
    s = samples(scrape_text(ClusterAppsCollector(rollout=None, sla=sla_app(board_with(0.9)))))
    voice = frozenset({("class", "voice"), ("modality", "audio")})
    assert s[("mmmesh_cluster_sla_attainment_ratio", voice)] == pytest.approx(0.9)
    assert s[("mmmesh_cluster_sla_frames", voice)] == 200
    assert s[("mmmesh_cluster_sla_p99_seconds", voice)] == pytest.approx(0.099, rel=0.02)
    assert s[("mmmesh_cluster_sla_nodes_reporting", frozenset())] == 1
    assert s[("mmmesh_cluster_sla_digests_published_total", frozenset())] == 1
    # a class without a sketch anywhere has no p99 series, never a made-up one
    video = frozenset({("class", "video"), ("modality", "video")})
    assert ("mmmesh_cluster_sla_p99_seconds", video) not in s
    assert s[("mmmesh_cluster_sla_frames", video)] == 100
    results = {dict(lab)["result"] for (n, lab), _ in s.items()
               if n == "mmmesh_cluster_sla_publications_received_total"}
    assert results == {"accepted", "older", "malformed", "from_gone"}


def test_without_peers_only_descriptions_and_a_broken_app_does_not_break_it() -> None:
    c = ClusterAppsCollector(rollout=None, sla=None)
    assert not samples(scrape_text(c))
    assert {f.name for f in c.describe()} >= {"mmmesh_rollout_members",
                                              "mmmesh_cluster_sla_attainment_ratio"}

    class Broken:
        def snapshot(self, nodes: bool = True) -> dict[str, Any]:
            raise RuntimeError("boom")

    s = samples(scrape_text(ClusterAppsCollector(rollout=rollout_apps(3)[0], sla=Broken())))
    assert s[("mmmesh_rollout_behind", frozenset())] == 0  # the rollout's still there


def test_a_full_cluster_scrape_passes_promtool_and_exported_names_knows_it() -> None:
    peers, apps = cluster_collectors(FakePeers(ALIVE3, dropped={"rate_limited": 2}),
                                     rollout_apps(3, nack=(1,))[0], sla_app(board_with(0.95)))
    text = scrape_text(peers, apps)
    promtool_check_metrics(text)
    check_table(text, {**ROLLOUT_METRICS, **CLUSTER_SLA_METRICS})
    got = {name for name, _ in samples(text)}
    assert got <= exported_names()
    assert not got & exported_names(cluster=False)  # the node-only list has none of them
    assert set(cluster_specs()) == {"peers", "rollout", "cluster_sla"}


def test_daemon_registers_the_apps_collector() -> None:
    import inspect

    from qosd import daemon

    src = inspect.getsource(daemon.run)
    assert "registry.register(ClusterAppsCollector(cluster.rollout_app, cluster.sla_app))" in src


# --------------------------------------------------------------------------
# privileged: three real qosd
# --------------------------------------------------------------------------
def _metrics_of(node: Any) -> str:
    url = f"http://{node.ip}:9464/metrics"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    return subprocess.run(["ip", "netns", "exec", node.ns, "python3", "-c", code],
                          capture_output=True, text=True, timeout=30, check=True).stdout


VOICE_FRAMES = ("mmmesh_cluster_sla_frames", frozenset({("class", "voice"),
                                                      ("modality", "audio")}))


@pytest.mark.privileged
@pytest.mark.timeout(240)
def test_real_qosd_export_what_the_tables_say(tmp_path: Path) -> None:
    from testkit.privileged import require_privileged

    require_privileged()
    from testkit.mesh_cases import report
    from testkit.netns_mesh import VENV_BIN, Mesh

    with Mesh(3, tmp_path / "m") as mesh:
        mesh.wait_converged(30)
        pol = yaml.safe_load((ROOT / "examples" / "policy.yaml").read_text())
        pol["link"] = {"device": "eth0", "rate": "500mbit"}
        f = tmp_path / "p.yaml"
        f.write_text(yaml.safe_dump(pol))
        r = subprocess.run([str(VENV_BIN / "mmmeshctl"), "--socket", str(mesh.nodes[0].sock),
                            "policy", "apply", "-f", str(f), "--cluster", "--timeout", "90"],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, (r.stdout, r.stderr)
        for i, node in enumerate(mesh.nodes):
            report(node, i)

        def every_table_there() -> bool:
            for i, node in enumerate(mesh.nodes):
                report(node, i)  # the windows stay fresh
            texts = [_metrics_of(n) for n in mesh.nodes]
            # every node's windows in every view (one node's alone come first)
            return all("mmmesh_cluster_sla_p99_seconds{" in t
                       and 'mmmesh_rollout_members{state="acked"} 3.0' in t
                       and samples(t).get(VOICE_FRAMES) == 1000 for t in texts)

        mesh.wait(every_table_there, 60, "the rollout and the global view in every /metrics",
                  every=1.0)
        text = _metrics_of(mesh.nodes[1])
    got = {name for name, _ in samples(text)}
    # (mmmesh_cluster_store_*: qosd/store's own collector, not the mesh's tables)
    mesh_names = {n for n in got if n.startswith(("mmmesh_cluster_", "mmmesh_rollout_"))
                  and not n.startswith("mmmesh_cluster_store_")}
    assert mesh_names <= exported_names(), mesh_names - exported_names()
    for spec in cluster_specs().values():
        check_table(text, spec)
    s = samples(text)
    assert s[("mmmesh_cluster_members", frozenset({("state", "alive")}))] == 3
    assert s[("mmmesh_rollout_behind", frozenset())] == 0
    assert s[VOICE_FRAMES] == 1000
    assert s[("mmmesh_cluster_cert_expiry_timestamp_seconds", frozenset())] > time.time()
