"""qosd's Prometheus metrics (qosd/metrics.py) and the Grafana dashboard.

Privileged part: a veth pair between two fresh namespaces, the dataplane up
on one end, real MMH voice frames (UDP), non-mesh frames and one MMH video TCP
stream sent through it; a scrape must show them in the classifier counters,
the HTB class counters, the reason counters and the flow table.  A target with
no dataplane scrapes as ``mmmesh_dataplane_up 0``.  The rest (qosd's own
metrics, the HTTP exporter on loopback, the dashboard's metric names) runs
unprivileged."""

from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmmesh.policy import load_policy, parse_policy
from qosd.model import ReconcileResult
from qosd.metrics import (
    DATAPLANE_METRICS,
    QOSD_METRICS,
    QosdMetrics,
    Target,
    exported_names,
    make_registry,
    serve_metrics,
)
from tests.conftest import require_privileged, veth_pair

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "mmmesh-dashboard.json"
FUTURE_METRICS = {"mmmesh_stage_latency_seconds"}  # sidecar histogram, documented in the panel

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names_in(samples: Samples) -> set[str]:
    return {n for n, _ in samples}


def policy_for(dev: str, rate: str = "500mbit"):  # type: ignore[no-untyped-def]
    data = load_policy(ROOT / "examples" / "policy.yaml").model_dump(mode="json", by_alias=True)
    data["link"] = {"device": dev, "rate": rate}
    return parse_policy(data)


# --------------------------------------------------------------------------
# privileged: a real dataplane with real traffic
# --------------------------------------------------------------------------
LISTENER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.2", 7100)); s.listen(1)
print("ready", flush=True)
s.settimeout(30)
c, _ = s.accept()
while c.recv(65536):
    pass
"""

SENDER = r"""
import socket, sys, time
sys.path.insert(0, {root!r})
from mmmesh.wire import Header, encode_header
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(40):
    u.sendto(encode_header(Header(modality=4, stream_id=1, sequence=i)), ("10.77.0.2", 7000))
for i in range(10):
    u.sendto(b"not a mesh frame", ("10.77.0.2", 7000))
t = socket.create_connection(("10.77.0.2", 7100), timeout=10)
t.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
hdr = encode_header(Header(modality=3, stream_id=2, sequence=0, payload_len=3000))
t.sendall(hdr + b"v" * 3000)
# keep the connection open: a FIN would (rightly) remove the flow from the table
print("sent", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def dataplane() -> Iterator[dict[str, Any]]:
    """Namespaces A and B joined by a0 <-> b0, the dataplane up on a0, traffic sent."""
    require_privileged()
    from mmmesh.dataplane import Dataplane

    listener: subprocess.Popen[str] | None = None
    sender: subprocess.Popen[str] | None = None
    with veth_pair(f"mmm{os.getpid()}", "10.77.0") as (a, b):
        try:
            pol = policy_for("a0")
            Dataplane("a0", a).up(pol, version=7)
            listener = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c",
                                         LISTENER], stdout=subprocess.PIPE, text=True)
            assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
            sender = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c",
                                       SENDER.format(root=str(ROOT))], stdout=subprocess.PIPE,
                                      text=True)
            assert sender.stdout is not None and sender.stdout.readline().strip() == "sent"
            yield {"ns": a, "peer_ns": b, "policy": pol,
                   "names": {c.id: c.name for c in pol.classes}}
        finally:
            for proc in (sender, listener):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()


def test_scrape_shows_real_traffic(dataplane: dict[str, Any]) -> None:
    ns, names = dataplane["ns"], dataplane["names"]
    registry, _ = make_registry(lambda: [Target("a0", ns, names)])
    s = scrape(registry)

    assert value(s, "mmmesh_dataplane_up", iface="a0") == 1
    assert value(s, "mmmesh_dataplane_policy_version", iface="a0") == 7
    # the 40 voice frames: BPF class counters and the HTB leaf 1:b
    eg = {"iface": "a0", "direction": "egress"}
    assert value(s, "mmmesh_classifier_class_packets_total", **eg, **{"class": "voice"}) >= 40
    assert value(s, "mmmesh_classifier_class_bytes_total", **eg, **{"class": "voice"}) >= 40 * 40
    assert value(s, "mmmesh_htb_class_packets_total", iface="a0", **{"class": "voice"}) >= 40
    assert value(s, "mmmesh_htb_class_bytes_total", iface="a0", **{"class": "voice"}) >= 40 * 40
    # non-mesh frames (and the TCP handshake) are best effort
    assert value(s, "mmmesh_classifier_class_packets_total", **eg,
                 **{"class": "best-effort"}) >= 10
    # reasons
    assert value(s, "mmmesh_classifier_packets_total", **eg, reason="parsed") >= 41
    assert value(s, "mmmesh_classifier_packets_total", **eg, reason="not_mesh") >= 10
    assert value(s, "mmmesh_classifier_packets_total", **eg, reason="malformed") == 0
    assert value(s, "mmmesh_classifier_packets_total", **eg, reason="flow_new") >= 1
    assert value(s, "mmmesh_classifier_packets_total", iface="a0", direction="ingress",
                 reason="parsed") is not None
    # every policy class has its series even at 0, HTB too; no drops at 500 mbit
    for cname in names.values():
        assert value(s, "mmmesh_classifier_class_packets_total", **eg, **{"class": cname}) \
            is not None, cname
        assert value(s, "mmmesh_htb_class_drops_total", iface="a0", **{"class": cname}) == 0
        assert value(s, "mmmesh_htb_class_backlog_bytes", iface="a0", **{"class": cname}) == 0
        assert value(s, "mmmesh_htb_class_queue_packets", iface="a0", **{"class": cname}) == 0
        assert value(s, "mmmesh_htb_class_overlimits_total", iface="a0",
                     **{"class": cname}) is not None
    assert not any(lab and dict(lab).get("class") == "64" for _, lab in s)  # no 1:40 parent
    # the TCP video stream was learnt in the flow table
    assert value(s, "mmmesh_flows", iface="a0") >= 1
    assert value(s, "mmmesh_class_flows", iface="a0", **{"class": "video"}) >= 1
    assert value(s, "mmmesh_flows_capacity", iface="a0") == 65536
    # the list of exported names is the truth
    assert {n for n in DATAPLANE_METRICS} <= names_in(s)


def test_flow_table_count_in_many_batches(dataplane: dict[str, Any]) -> None:
    """More entries than one batch holds: the count and the per-class split stay exact."""
    from mmmesh import _abi
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._bpf import count_by_next_key, count_map_entries
    from mmmesh.dataplane._maps import Maps

    dp = Dataplane("a0", dataplane["ns"])
    maps = Maps.open_pinned(dp.pin_dir)
    keys = []
    try:
        fm = maps.flows
        ksz, vsz = ctypes.sizeof(_abi.FlowKey), ctypes.sizeof(_abi.FlowInfo)
        off = _abi.FlowInfo.class_id.offset
        before, by_before = count_map_entries(fm.fd, ksz, vsz, fm.max_entries, off)
        assert by_before is not None
        for i in range(300):
            k = _abi.FlowKey(sport=socket.htons(20000 + i), dport=socket.htons(9), proto=6)
            k.saddr[10:16] = [0xFF, 0xFF, 10, 201, i >> 8, i & 0xFF]
            fm.update(k, _abi.FlowInfo(packets=1, class_id=13 if i % 3 else 12))
            keys.append(k)
        for chunk in (7, 64, 4096):
            n, by = count_map_entries(fm.fd, ksz, vsz, fm.max_entries, off, chunk=chunk)
            assert n == before + 300, chunk
            assert by is not None
            assert by[13] - by_before[13] == 200 and by[12] - by_before[12] == 100
        assert count_by_next_key(fm.fd, ksz, fm.max_entries) == before + 300
        assert maps.flow_census().count == before + 300
        assert len(dp.flows()) == before + 300

        registry, _ = make_registry([Target("a0", dataplane["ns"], dataplane["names"])])
        s = scrape(registry)
        assert value(s, "mmmesh_flows", iface="a0") == before + 300
        assert value(s, "mmmesh_class_flows", iface="a0", **{"class": "lidar"}) == \
            by_before[13] + 200
    finally:
        for k in keys:
            maps.flows.delete(k)
        maps.close()


def test_missing_dataplane_scrapes_as_down(dataplane: dict[str, Any]) -> None:
    ghost_ns = f"mmm{os.getpid()}-ghost"
    targets = [
        Target("a0", dataplane["ns"], dataplane["names"]),  # the real one still scrapes
        Target("b0", dataplane["peer_ns"], {}),  # device there, no dataplane on it
        Target("nope0", None, {}),  # no such device
        Target("gone0", ghost_ns, {}),  # no such netns: must not be created
    ]
    registry, _ = make_registry(lambda: targets)
    s = scrape(registry)
    assert value(s, "mmmesh_dataplane_up", iface="a0") == 1
    for iface in ("b0", "nope0", "gone0"):
        assert value(s, "mmmesh_dataplane_up", iface=iface) == 0, iface
        assert value(s, "mmmesh_flows", iface=iface) is None
    assert not os.path.exists(f"/var/run/netns/{ghost_ns}")
    # b0 has the kernel's default root qdisc: no HTB series for it
    assert not any(n.startswith("mmmesh_htb_") and ("iface", "b0") in lab for n, lab in s)


def test_targets_callable_failing_does_not_break_the_scrape() -> None:
    def boom() -> list[Target]:
        raise RuntimeError("store is gone")

    registry, qm = make_registry(boom)
    assert qm is not None
    s = scrape(registry)
    assert "mmmesh_reconciles_total" in names_in(s)
    assert not any(n == "mmmesh_dataplane_up" for n, _ in s)


def test_no_dataplane_unprivileged_is_down_not_an_error() -> None:
    registry, qm = make_registry([Target(f"mmm{os.getpid()}x0", None, {1: "x"})],
                                 qosd_metrics=False)
    assert qm is None
    s = scrape(registry)
    assert value(s, "mmmesh_dataplane_up", iface=f"mmm{os.getpid()}x0") == 0


# --------------------------------------------------------------------------
# qosd's own metrics
# --------------------------------------------------------------------------
def test_qosd_metrics_observations() -> None:
    registry = CollectorRegistry()
    qm = QosdMetrics(registry)
    s = scrape(registry)
    for trig in ("apply", "rollback", "resync", "startup", "restore"):  # at 0 from the start
        assert value(s, "mmmesh_reconciles_total", trigger=trig) == 0
    for res in ("adopted", "loaded", "replaced"):
        assert value(s, "mmmesh_adoptions_total", result=res) == 0

    now = time.time()
    qm.adoption("adopted")
    qm.observe_reconcile(ReconcileResult(ok=True, version=3, started_at=now, duration_s=0.02,
                                         trigger="startup", repaired=("htb 1:b", "filter")))
    qm.observe_reconcile(ReconcileResult(ok=True, version=4, started_at=now, duration_s=0.3,
                                         trigger="apply"))
    qm.observe_reconcile(ReconcileResult(ok=False, version=4, started_at=now + 1, duration_s=2.0,
                                         trigger="apply", error="netlink: EBUSY"))
    with pytest.raises(ValueError):
        qm.adoption("stolen")

    s = scrape(registry)
    assert value(s, "mmmesh_policy_version") == 4
    assert value(s, "mmmesh_reconciles_total", trigger="apply") == 2
    assert value(s, "mmmesh_reconciles_total", trigger="startup") == 1
    assert value(s, "mmmesh_reconcile_errors_total") == 1
    assert value(s, "mmmesh_drift_repairs_total") == 2
    assert value(s, "mmmesh_adoptions_total", result="adopted") == 1
    assert value(s, "mmmesh_reconcile_duration_seconds_count") == 3
    assert value(s, "mmmesh_reconcile_duration_seconds_sum") == pytest.approx(2.32)
    assert value(s, "mmmesh_reconcile_duration_seconds_bucket", le="0.025") == 1
    assert value(s, "mmmesh_reconcile_duration_seconds_bucket", le="0.5") == 2
    assert value(s, "mmmesh_reconcile_last_success_timestamp_seconds") == pytest.approx(now + 0.3)
    want = {n + "_count" if kind == "histogram" else n for n, (kind, _, _) in QOSD_METRICS.items()}
    assert want <= names_in(s)


def test_serve_metrics_on_loopback() -> None:
    registry, qm = make_registry([])
    assert qm is not None
    qm.set_policy_version(9)
    with serve_metrics(registry, "127.0.0.1:0") as srv:
        assert srv.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
            body = r.read().decode()
    assert "mmmesh_policy_version 9.0" in body
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=2)


# --------------------------------------------------------------------------
# the Grafana dashboard
# --------------------------------------------------------------------------
def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            elif k == "query" and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def test_dashboard_uses_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    tvars = {v["name"]: v for v in dash["templating"]["list"]}
    assert tvars["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"iface", "class"} <= set(tvars)
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))

    used: set[str] = set()
    for e in _exprs(dash):
        used |= set(re.findall(r"mmmesh_[a-z0-9_]+", e))
    exported = exported_names()
    unknown = set()
    for name in used:
        if name in exported:
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base in FUTURE_METRICS:
            continue
        unknown.add(name)
    assert not unknown, f"dashboard uses metrics nobody exports: {sorted(unknown)}"
    # what the brief asks to see
    for want in ("mmmesh_htb_class_bytes_total", "mmmesh_classifier_class_bytes_total",
                 "mmmesh_htb_class_drops_total", "mmmesh_htb_class_backlog_bytes",
                 "mmmesh_classifier_packets_total", "mmmesh_flows",
                 "mmmesh_dataplane_policy_version", "mmmesh_stage_latency_seconds_bucket"):
        assert want in used, want
    latency = [p for p in panels if "mmmesh_stage_latency_seconds_bucket" in json.dumps(p)]
    assert len(latency) == 1 and "sidecars report" in latency[0]["description"]
    assert "histogram_quantile(0.99" in latency[0]["targets"][0]["expr"]
    reasons = next(p for p in panels if p["title"] == "Classifier reasons")["targets"][0]["expr"]
    for r in ("parsed", "flow_hit", "not_mesh", "malformed", "clamped"):
        assert r in reasons
