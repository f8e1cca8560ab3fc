"""qosd's Prometheus metrics (qosd/metrics/).

Privileged part: a veth pair between two fresh namespaces, the dataplane up
on one end, real MMH voice frames (UDP), non-mesh frames and one MMH video TCP
stream sent through it; a scrape must show them in the classifier counters,
the HTB class counters, the reason counters and the flow table; the reasons
must partition the packets (their sum is the class counters' sum and the
device's own count of what it sent); promtool must find nothing to lint.  A
target with no dataplane scrapes as ``mmmesh_dataplane_up 0``.  The rest
(the collectors over a fake dataplane and a real SLA board, qosd's own
metrics, the HTTP exporter on loopback) runs unprivileged.  The dashboard
and the alert rules are tests/system/qosd/test_prometheus_scrape.py's."""

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
from qosd.metrics import (
    CLASSIFIER_EVENTS,
    DATAPLANE_METRICS,
    PARTITION_REASONS,
    PROCESS_METRICS,
    QOSD_METRICS,
    SLA_METRICS,
    QosdMetrics,
    Target,
    exported_names,
    make_registry,
    serve_metrics,
)
from qosd.model import ReconcileResult
from testkit.metrics_support import (
    FakeDataplane,
    board_with,
    fake_dataplanes,
    promtool_check_metrics,
)
from testkit.privileged import require_privileged, veth_pair

ROOT = Path(__file__).resolve().parents[3]

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
    assert value(s, "mmmesh_classifier_events_total", **eg, event="flow_new") >= 1
    assert value(s, "mmmesh_classifier_events_total", **eg, event="dscp_rewrite") >= 40
    for fam, label, want in (("mmmesh_classifier_packets_total", "reason", PARTITION_REASONS),
                             ("mmmesh_classifier_events_total", "event", CLASSIFIER_EVENTS)):
        assert {dict(lab)[label] for n, lab in s if n == fam} == set(want), fam
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


def _netns_tx_packets(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", dev], check=True,
                         capture_output=True, text=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["packets"])


def _egress_sums(s: Samples) -> tuple[float, float]:
    """(sum over reason, sum over class) of a0's egress counters."""
    def total(name: str) -> float:
        return sum(v for (n, lab), v in s.items() if n == name
                   and ("iface", "a0") in lab and ("direction", "egress") in lab)
    return total("mmmesh_classifier_packets_total"), \
        total("mmmesh_classifier_class_packets_total")


def test_reasons_partition_the_packets(dataplane: dict[str, Any]) -> None:
    """The sum over ``reason`` is every packet the classifier saw: it equals
    the sum over classes and, for what is sent meanwhile, the device's own
    count of packets it sent (nothing is dropped at 500 mbit)."""
    ns = dataplane["ns"]
    registry, _ = make_registry([Target("a0", ns, dataplane["names"])], process=False)

    def steady() -> tuple[Any, int]:
        """A scrape and the device's count with no packet sent in between (the
        netns sends a packet of its own now and then: ARP, IPv6 ND)."""
        for _ in range(50):
            tx = _netns_tx_packets(ns, "a0")
            got = scrape(registry)
            if _netns_tx_packets(ns, "a0") == tx:
                return got, tx
            time.sleep(0.05)
        raise AssertionError("a0 never stood still for a scrape")

    before, tx0 = steady()
    by_reason0, by_class0 = _egress_sums(before)
    assert by_reason0 == by_class0 > 0
    send = ("import socket\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for i in range(25):\n    u.sendto(b'x' * 100, ('10.77.0.2', 7001))\n")
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", send], check=True,
                   timeout=30)
    after, tx1 = steady()
    by_reason1, by_class1 = _egress_sums(after)
    assert by_reason1 == by_class1
    assert by_reason1 - by_reason0 == tx1 - tx0 >= 25
    # the events are not in it: counting them too would double-count
    events = sum(v for (n, lab), v in after.items() if n == "mmmesh_classifier_events_total"
                 and ("direction", "egress") in lab)
    assert events > 0


def test_real_scrape_passes_promtool(dataplane: dict[str, Any]) -> None:
    registry, qm = make_registry([Target("a0", dataplane["ns"], dataplane["names"])],
                                 sla_board=board_with(0.9), node="n1", resync_interval_s=10)
    assert qm is not None
    qm.observe_reconcile(ReconcileResult(ok=True, version=7, started_at=time.time(),
                                         duration_s=0.05, trigger="startup"))
    promtool_check_metrics(generate_latest(registry).decode())


def test_flow_table_count_in_many_batches(dataplane: dict[str, Any]) -> None:
    """More entries than one batch holds: the count and the per-class split stay exact."""
    from mmmesh import abi
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._bpf import count_by_next_key, count_map_entries
    from mmmesh.dataplane._maps import Maps

    dp = Dataplane("a0", dataplane["ns"])
    maps = Maps.open_pinned(dp.pin_dir)
    keys = []
    try:
        fm = maps.flows
        ksz, vsz = ctypes.sizeof(abi.FlowKey), ctypes.sizeof(abi.FlowInfo)
        off = abi.FlowInfo.class_id.offset
        before, by_before = count_map_entries(fm.fd, ksz, vsz, fm.max_entries, off)
        assert by_before is not None
        for i in range(300):
            k = abi.FlowKey(sport=socket.htons(20000 + i), dport=socket.htons(9), proto=6)
            k.saddr[10:16] = [0xFF, 0xFF, 10, 201, i >> 8, i & 0xFF]
            fm.update(k, abi.FlowInfo(packets=1, class_id=13 if i % 3 else 12))
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
# the collectors over a fake dataplane and a real SLA board (unprivileged)
# --------------------------------------------------------------------------
def test_fake_dataplane_reasons_events_and_htb() -> None:
    targets, opener = fake_dataplanes(FakeDataplane("eth0", version=3, flows=1000),
                                      FakeDataplane("eth1", up=False))
    registry, _ = make_registry(targets, dataplane=opener, process=False)
    s = scrape(registry)
    eg = {"iface": "eth0", "direction": "egress"}
    reasons = {dict(lab)["reason"]: v for (n, lab), v in s.items()
               if n == "mmmesh_classifier_packets_total" and ("iface", "eth0") in lab
               and ("direction", "egress") in lab}
    classes = sum(v for (n, lab), v in s.items()
                  if n == "mmmesh_classifier_class_packets_total" and ("direction", "egress") in lab)
    assert set(reasons) == set(PARTITION_REASONS) and sum(reasons.values()) == classes == 500
    assert value(s, "mmmesh_classifier_events_total", **eg, event="clamped") == 10
    assert value(s, "mmmesh_dataplane_policy_version", iface="eth0") == 3
    assert value(s, "mmmesh_class_flows", iface="eth0", **{"class": "video"}) == 500
    assert value(s, "mmmesh_htb_class_drops_total", iface="eth0", **{"class": "video"}) == 2
    assert not any(dict(lab).get("class") == "64" for _, lab in s)  # no 1:40 parent
    assert value(s, "mmmesh_dataplane_up", iface="eth1") == 0
    assert not any(("iface", "eth1") in lab for n, lab in s if n != "mmmesh_dataplane_up")


def test_sla_board_per_class_and_modality_without_instances() -> None:
    board = board_with(0.9)
    board.refused("rate_limited")
    board.refused("rate_limited")
    board.refused("not_allowed")
    registry, _ = make_registry([], sla_board=board, process=False)
    s = scrape(registry)
    voice = {"class": "voice", "modality": "audio"}
    # two stages (two senders' windows) merge into one row: no instance or stage label
    assert value(s, "mmmesh_sla_attainment_ratio", **voice) == pytest.approx(0.9)
    assert value(s, "mmmesh_sla_window_frames", **voice) == 200
    assert value(s, "mmmesh_sla_window_deadline_misses", **voice) == 20
    assert value(s, "mmmesh_sla_window_sources", **voice) == 2
    assert value(s, "mmmesh_sla_attainment_ratio", **{"class": "video",
                                                       "modality": "video"}) == 1
    p99 = value(s, "mmmesh_sla_e2e_latency_seconds", **voice, percentile="p99")
    assert p99 == pytest.approx(0.099, rel=0.02)  # 1..100 ms, from the merged sketch
    assert value(s, "mmmesh_sla_e2e_latency_seconds", **voice, percentile="p50") == \
        pytest.approx(0.050, rel=0.04)
    for n, lab in s:
        if n in SLA_METRICS and n.startswith("mmmesh_sla_") and "board" not in n \
                and "reports" not in n:
            assert {k for k, _ in lab} <= {"class", "modality", "percentile"}, (n, lab)
    assert value(s, "mmmesh_sla_board_rows") == 3
    assert value(s, "mmmesh_sla_board_senders") == 1  # the admin socket speaks for all
    assert value(s, "mmmesh_sla_board_bytes") > 3 * 1500
    assert value(s, "mmmesh_sla_reports_accepted_total") == 3
    assert value(s, "mmmesh_sla_reports_refused_total", code="rate_limited") == 2
    assert value(s, "mmmesh_sla_reports_refused_total", code="not_allowed") == 1
    # every other code has its series at 0 (so increase() sees a first refusal)
    from qosd.identity import REFUSAL_CODES

    for code in set(REFUSAL_CODES) - {"rate_limited", "not_allowed"}:
        assert value(s, "mmmesh_sla_reports_refused_total", code=code) == 0, code
    assert value(s, "mmmesh_sla_board_evictions_total", cause="own") == 0
    assert value(s, "mmmesh_sla_board_evictions_total", cause="expired") == 0
    assert value(s, "mmmesh_sla_board_skipped_reads_total") == 0
    # a board whose windows all went stale: the class series go, the counters stay
    stale = board_with(0.5, now=time.time() - 120)
    s = scrape(make_registry([], sla_board=stale, process=False)[0])
    assert value(s, "mmmesh_sla_attainment_ratio", **voice) is None
    assert value(s, "mmmesh_sla_board_rows") == 3


def test_a_failing_board_does_not_break_the_scrape() -> None:
    class Broken:
        def view(self, now: float | None = None) -> dict[str, Any]:
            raise RuntimeError("boom")

        def stats(self) -> dict[str, Any]:
            return {"rows": 1}

    s = scrape(make_registry([], sla_board=Broken(), process=False)[0])
    assert value(s, "mmmesh_sla_board_rows") == 1
    assert "mmmesh_policy_version" in names_in(s)


def test_full_fake_scrape_passes_promtool() -> None:
    targets, opener = fake_dataplanes(FakeDataplane("eth0", flows=10))
    board = board_with(0.95)
    board.refused("sender_quota")  # refusal codes appear with the first one
    registry, qm = make_registry(targets, dataplane=opener, sla_board=board,
                                 node="node-a", resync_interval_s=10)
    assert qm is not None
    qm.observe_reconcile(ReconcileResult(ok=True, version=1, started_at=time.time(),
                                         duration_s=0.1, trigger="startup"))
    text = generate_latest(registry).decode()
    promtool_check_metrics(text)
    # every name the tables promise is in it (histograms by their _count)
    got = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for spec in (DATAPLANE_METRICS, SLA_METRICS, QOSD_METRICS):
        for name, (kind, _, _) in spec.items():
            assert (name + "_count" if kind == "histogram" else name) in got, name
    assert set(PROCESS_METRICS) <= got
    assert {n for n in got if n.startswith("mmmesh_")} <= exported_names()


# --------------------------------------------------------------------------
# qosd's own metrics
# --------------------------------------------------------------------------
def test_qosd_metrics_observations() -> None:
    registry = CollectorRegistry()
    t0 = time.time()
    qm = QosdMetrics(registry, node="node-a", resync_interval_s=7.5)
    s = scrape(registry)
    for trig in ("apply", "rollback", "resync", "startup", "restore", "adapt", "cluster"):
        assert value(s, "mmmesh_reconciles_total", trigger=trig) == 0
    for res in ("adopted", "loaded", "replaced"):
        assert value(s, "mmmesh_adoptions_total", result=res) == 0
    assert value(s, "mmmesh_resync_interval_seconds") == 7.5
    assert value(s, "mmmesh_resync_last_run_timestamp_seconds") >= t0  # start = first beat

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
    assert value(s, "mmmesh_reconcile_last_duration_seconds") == 2.0
    assert value(s, "mmmesh_reconcile_last_success_timestamp_seconds") == pytest.approx(now + 0.3)
    # the heartbeat moves on every resync pass, also one that repaired nothing
    qm.resync_ran(now + 60)
    assert value(scrape(registry), "mmmesh_resync_last_run_timestamp_seconds") == now + 60
    want = {n + "_count" if kind == "histogram" else n for n, (kind, _, _) in QOSD_METRICS.items()}
    assert want <= names_in(s)


def test_build_info_and_process_metrics() -> None:
    import importlib.metadata
    import platform

    from mmmesh import abi

    registry, _ = make_registry([], node="node-a")
    s = scrape(registry)
    (labels,) = [dict(lab) for n, lab in s if n == "mmmesh_build_info"]
    assert labels["version"] == importlib.metadata.version("mmmesh")
    assert labels["abi"] == str(abi.ABI_VERSION)
    assert re.fullmatch(r"[0-9a-f]{16}", labels["bpf_build"])
    assert labels["python"] == platform.python_version() and labels["node"] == "node-a"
    assert value(s, "mmmesh_build_info", **labels) == 1
    assert value(s, "process_resident_memory_bytes") > 10e6
    assert 3 <= value(s, "process_open_fds") <= value(s, "process_max_fds")  # type: ignore[operator]
    assert value(scrape(make_registry([], process=False)[0]), "process_open_fds") is None


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
    with serve_metrics(registry, ":0") as srv:  # no host: loopback, not every address
        assert srv.host == "127.0.0.1"


def test_daemon_wires_board_build_info_and_heartbeat() -> None:
    """qosd/daemon.py registers the board's collector, names the node, and
    beats after every resync pass (the daemon itself runs in tests/system/qosd/test_qosd.py)."""
    import inspect

    from qosd import daemon

    src = inspect.getsource(daemon.run)
    assert "SlaBoardCollector(node.board)" in src
    assert "node=cfg.node_name" in src and "resync_interval_s=cfg.resync_interval_s" in src
    loop = src[src.index("async def resync_loop"):src.index("async def flush_logs")]
    assert loop.index("applier.resync") < loop.index("resync_ran()") < loop.index("except Exc")
