"""A real Prometheus scraping in-process qosd nodes, and the dashboard's
queries as Grafana sends them (tests/system/qosd/test_prometheus_scrape.py).

:func:`running_prometheus` starts Debian's ``prometheus`` binary with a
config of its own (1 s scrapes and rule evaluation, the alert rules loaded)
over the :class:`Node` endpoints and one sidecar's; :class:`Mesh` queries it.
:func:`node` builds one qosd registry: a fake dataplane, a real SLA board,
qosd's own metrics and, with ``peers``, the mesh's collectors over fakes and
real cores (testkit/cluster_metrics_fakes.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
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

from qosd.metrics import MetricsServer, QosdMetrics, make_registry, serve_metrics
from qosd.model import ReconcileResult
from sidecar.contract import SlaSample
from sidecar.sla.prometheus import SlaCollector
from sidecar.sla.windows import SlaWindows
from testkit.cluster_metrics_fakes import FakePeers, cluster_collectors, sla_app
from testkit.metrics_support import FakeDataplane, board_with, fake_dataplanes, prometheus_tool

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "docs" / "grafana"
DASHBOARD = GRAFANA / "mmmesh-dashboard.json"
ALERTS = GRAFANA / "mmmesh-alerts.yaml"


# --------------------------------------------------------------------------
# the dashboard
# --------------------------------------------------------------------------
def exprs(node: Any) -> Iterator[str]:
    """Every query string in a dashboard (targets and variables)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str) or k == "query" and isinstance(v, str):
                yield v
            else:
                yield from exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from exprs(v)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def panel(dash: dict[str, Any], title: str) -> dict[str, Any]:
    (p,) = [p for p in panels(dash) if p["title"] == title]
    return p


def targets(kinds: tuple[str, ...] = ("timeseries", "table", "stat")
            ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for p in panels(dashboard()):
        if p["type"] in kinds:
            for t in p["targets"]:
                yield p, t


def grafana(expr: str, instance: str = ".*") -> str:
    """A dashboard query as Grafana sends it with All selected (or one node)."""
    return (expr.replace("$__rate_interval", "5s").replace("$instance", instance)
            .replace("$iface", ".*").replace("$class", ".*").replace("$stage", ".*"))


def stat_query(title: str, legend: str | None = None) -> str:
    """The query of a panel's target (the one with ``legend``), as Grafana sends it."""
    p = panel(dashboard(), title)
    (t,) = [t for t in p["targets"] if legend is None or t["legendFormat"] == legend]
    return grafana(t["expr"])


# --------------------------------------------------------------------------
# the nodes and Prometheus
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(what: str, ok: Any, timeout: float = 20.0) -> None:
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


def sidecar() -> MetricsServer:
    registry, windows = CollectorRegistry(), SlaWindows()
    registry.register(_Frames(windows))  # collected first
    registry.register(SlaCollector(windows))
    return serve_metrics(registry, "127.0.0.1:0")


@dataclasses.dataclass(frozen=True)
class FakeVersion:
    """What the node's store holds: its own number, the note (``mesh 3@node-a``), the text."""

    version: int
    note: str | None
    text: str


class FakeStore:
    def __init__(self, current: FakeVersion | None) -> None:
        self._current = current

    def current(self) -> FakeVersion | None:
        return self._current


def node(name: str, dps: list[FakeDataplane], version: int, attainment: float,
         heartbeat_age_s: float, peers: FakePeers | None = None, rollout: Any = None,
         mesh_version: str | None = None, text: str = "policy A") -> Node:
    """A qosd registry served on loopback; with ``peers`` a member of a mesh
    (its global SLA view holds its own board; ``rollout``: its rollout app);
    its store runs local ``version`` (with ``mesh_version``: realising it)."""
    targets_, opener = fake_dataplanes(*dps)
    board = board_with(attainment)
    store = FakeStore(FakeVersion(version, f"mesh {mesh_version}" if mesh_version else None,
                                  text))
    registry, qm = make_registry(targets_, dataplane=opener, sla_board=board,
                                 node=name, resync_interval_s=10, policy=store)
    assert qm is not None
    qm.observe_reconcile(ReconcileResult(ok=True, version=version, started_at=time.time(),
                                         duration_s=0.05, trigger="startup"))
    qm.resync_ran(time.time() - heartbeat_age_s)
    if peers is not None:
        for c in cluster_collectors(peers, rollout, sla_app(board, name)):
            registry.register(c)
    return Node(name, qm, serve_metrics(registry, "127.0.0.1:0"))


@contextlib.contextmanager
def running_prometheus(tmp: Path, nodes: list[Node]) -> Iterator[Mesh]:
    """Prometheus scraping ``nodes`` (job mmmesh-qosd, instance = the node's
    name, as docs/operations.md's relabelling does) and a sidecar (asr-0),
    with the alert rules, once it has scraped every node four times; stops
    it and the endpoints afterwards."""
    binary = prometheus_tool("prometheus")
    proc: subprocess.Popen[bytes] | None = None
    side = sidecar()
    try:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "mmmesh-qosd", "static_configs": [
                {"targets": [f"127.0.0.1:{n.server.port}"], "labels": {"instance": n.name}}
                for n in nodes]},
                {"job_name": "mmmesh-sidecar", "static_configs": [
                    {"targets": [f"127.0.0.1:{side.port}"], "labels": {"instance": "asr-0"}}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = (tmp / "prometheus.log").open("wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        m = Mesh(f"http://127.0.0.1:{port}", {n.name: n for n in nodes})

        def ready() -> bool:
            assert proc is not None and proc.poll() is None, (tmp / "prometheus.log").read_text()
            with urllib.request.urlopen(f"{m.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)

        wait("Prometheus to start", ready)
        # enough scrapes of every node for rate() over 5 s
        wait("4 scrapes of each node", lambda: len(m.query(
            "count_over_time(mmmesh_build_info[1m]) >= 4")) == len(nodes))
        yield m
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for n in nodes:
            n.server.shutdown()
        side.shutdown()
