"""qosd as a real process on a netns node, driven through its admin API and
mmmeshctl, checked against the kernel (maps, HTB classes via netlink)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.privileged

from testkit.qosd_node import EXAMPLE, ROOT, VENV_BIN, Node, policy_yaml


def dataplane(node: Node) -> Any:
    from mmmesh.dataplane import Dataplane

    return Dataplane("a0", node.ns)


def htb(node: Node) -> dict[int, Any]:
    return dataplane(node).htb_classes()  # type: ignore[no-any-return]


def kernel_policy_version(node: Node) -> int:
    return dataplane(node).policy_version()  # type: ignore[no-any-return]


def scrape_metric(node: Node, name: str) -> float | None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    addr = yaml.safe_load(node.cfg.read_text())["metrics_addr"]
    body = httpx.get(f"http://{addr}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def test_apply_validate_conflict_rollback(node: Node, tmp_path: Path) -> None:
    node.start()
    assert stat.S_IMODE(node.sock.stat().st_mode) == 0o600
    f1 = tmp_path / "p1.yaml"
    f1.write_text(policy_yaml())
    r = node.ctl("policy", "apply", "-f", str(f1))
    assert r.returncode == 0, r.stderr
    assert kernel_policy_version(node) == 1
    classes = htb(node)
    assert EXAMPLE.class_named("lidar").classid in classes

    # an invalid policy is refused whole: nothing changes
    bad = tmp_path / "bad.yaml"
    bad.write_text(policy_yaml().replace("rate: 80mbit", "rate: 80MB"))
    r = node.ctl("policy", "apply", "-f", str(bad))
    assert r.returncode == 3 and "rate" in r.stderr
    unrealizable = tmp_path / "nodev.yaml"
    unrealizable.write_text(policy_yaml(dev="nosuch0"))
    r = node.ctl("policy", "apply", "-f", str(unrealizable))
    assert r.returncode == 3 and "nosuch0" in r.stderr
    assert kernel_policy_version(node) == 1 and htb(node) .keys() == classes.keys()

    # two writers from the same base: one wins, one conflicts
    v2 = policy_yaml(drop="lidar")
    v3 = policy_yaml(voice_rate="3mbit")
    first = node.put_policy(v2, base=1)
    second = node.put_policy(v3, base=1)
    assert first.status_code == 200, first.text
    assert second.status_code == 409 and second.json()["current_version"] == 2
    assert EXAMPLE.class_named("lidar").classid not in htb(node)
    assert kernel_policy_version(node) == 2

    # rollback restores the old kernel state (as a new version)
    r = node.ctl("policy", "rollback", "--to", "1")
    assert r.returncode == 0, r.stderr
    assert EXAMPLE.class_named("lidar").classid in htb(node)
    assert kernel_policy_version(node) == 3
    hist = node.get("/v1/policy/history").json()["versions"]
    assert [h["version"] for h in hist][:3] == [3, 2, 1]
    st = node.get("/v1/status").json()
    assert st["policy_version"] == 3 and st["last_reconcile"]["ok"]


def test_drift_is_repaired(node: Node, tmp_path: Path) -> None:
    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    assert scrape_metric(node, "mmmesh_drift_repairs_total") == 0  # nothing repaired yet
    from mmmesh.dataplane._netlink import HTB_PARENT, Netlink

    video = EXAMPLE.class_named("video").classid
    with Netlink(node.ns) as n:
        idx = n.ifindex("a0")
        for q in n.ipr.get_qdiscs(index=idx):
            if q["parent"] == video:
                n.ipr.tc("del", index=idx, handle=q["handle"], parent=video)
        n.ipr.tc("del-class", index=idx, handle=video, parent=HTB_PARENT)
    assert video not in htb(node)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and video not in htb(node):
        time.sleep(0.2)
    assert video in htb(node), node.log()
    st = node.get("/v1/status").json()
    assert st["last_reconcile"]["trigger"] == "resync"
    assert any("missing" in r for r in st["last_reconcile"]["repaired"])

    # a rate changed by hand is drift too
    voice = EXAMPLE.class_named("voice")
    with Netlink(node.ns) as n:
        n.ipr.tc("replace-class", "htb", n.ifindex("a0"), voice.classid, parent=HTB_PARENT,
                 rate="50mbit", ceil="500mbit", prio=voice.priority, quantum=voice.quantum)
    assert htb(node)[voice.classid].rate_Bps == 50_000_000 // 8
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and \
            htb(node)[voice.classid].rate_Bps != int(voice.rate) // 8:
        time.sleep(0.2)
    assert htb(node)[voice.classid].rate_Bps == int(voice.rate) // 8, node.log()
    # the metric counts what was really repaired: the deleted class, then the rate
    repairs = scrape_metric(node, "mmmesh_drift_repairs_total")
    assert repairs is not None and repairs >= 2, repairs



def test_tcp_api_needs_the_token(node: Node) -> None:
    import httpx

    node.start()
    url = f"http://{node.tcp}"
    assert httpx.get(f"{url}/v1/status", timeout=10).status_code == 401
    bad = httpx.get(f"{url}/v1/status", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401
    ok = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {node.token}"},
                   timeout=10)
    assert ok.status_code == 200


def test_corrupt_state_keeps_last_good_policy(node: Node) -> None:
    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    assert node.put_policy(policy_yaml(drop="lidar")).status_code == 200
    node.stop()
    state = node.dir / "state"
    (state / "current.json").write_text("{ this is not json")
    node.start()
    body = node.get("/v1/policy").json()
    assert body["version"] == 2
    st = node.get("/v1/status").json()
    assert st["store_problems"], st
    assert any(p.name.startswith("current.json.corrupt") for p in state.iterdir())


FLOOD = r"""
import socket, sys, time
sys.path.insert(0, {root!r})
from mmmesh.wire import Header, encode_header
voice = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(600):  # until the sink listens (a busy host starts it late)
    try:
        lidar = socket.create_connection(("10.78.0.2", 7100), timeout=5)
        break
    except OSError:
        time.sleep(0.1)
lidar.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
# ONE header for the whole LiDAR stream: every later segment is a continuation,
# classified only through the flow table (a cleared table would make them best effort)
lidar.sendall(encode_header(Header(modality=5, payload_len=1 << 29)))
end = time.time() + {secs}
i = 0
while time.time() < end:
    voice.sendto(encode_header(Header(modality=4, stream_id=1, sequence=i)), ("10.78.0.2", 7000))
    if i % 10 == 0:
        lidar.sendall(b"p" * 20000)
    i += 1
    time.sleep(0.01)
"""

SINK = r"""
import socket, threading, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("10.78.0.2", 7100)); srv.listen(1)
c, _ = srv.accept()
end = time.time() + {secs}
c.settimeout(1)
while time.time() < end:
    try:
        if not c.recv(65536): break
    except socket.timeout:
        pass
"""


def test_kill_9_keeps_classifying_and_restart_adopts(node: Node) -> None:
    """qosd killed with -9 under traffic: classification goes on without it, and
    the restarted qosd adopts the pinned dataplane with its flow table: the
    LiDAR stream's header went out before the kill, and its continuation
    segments after the restart are still LiDAR (flow hits), not best effort."""
    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    dp = dataplane(node)
    before = dp.status().programs
    lidar = EXAMPLE.class_named("lidar").id
    voice = EXAMPLE.class_named("voice").id
    # the traffic runs until the test ends it (a restart under load takes tens of
    # seconds; a flow that ended would leave the table with its FIN)
    secs = 600
    sink = subprocess.Popen(["ip", "netns", "exec", node.peer_ns, sys.executable, "-c",
                             SINK.format(secs=secs + 4)])
    gen = subprocess.Popen(["ip", "netns", "exec", node.ns, sys.executable, "-c",
                            FLOOD.format(root=str(ROOT), secs=secs)])

    def counts() -> tuple[int, int, int]:
        eg = dp.stats().counters["egress"]
        return (eg.classes.get(voice, (0, 0))[0], eg.classes.get(lidar, (0, 0))[0],
                eg.reasons["flow_hit"])

    def lidar_flow() -> Any:
        found = [f for f in dp.flows() if f.dport == 7100 and f.direction == "egress"]
        return found[0] if len(found) == 1 else None

    def until(cond: Any, what: str, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while not cond():
            assert gen.poll() is None and sink.poll() is None, "the traffic stopped"
            assert time.monotonic() < deadline, f"not within {seconds:.0f} s: {what}"
            time.sleep(0.1)

    try:
        until(lambda: lidar_flow() is not None and counts()[0] > 50, "traffic under qosd")
        node.stop(signal.SIGKILL)  # no goodbye: the dataplane must not notice
        v1, l1, hits1 = counts()
        f1 = lidar_flow()
        assert f1 is not None and f1.class_id == lidar and hits1 > 0
        # classification goes on without qosd, the LiDAR continuations too (flow table)
        until(lambda: counts()[0] > v1 + 50 and counts()[1] > l1, "classified without qosd")
        v2, _, _ = counts()
        node.start()
        after = dp.status().programs
        assert {d: p["prog_id"] for d, p in after.items()} == \
               {d: p["prog_id"] for d, p in before.items()}
        st = node.get("/v1/status").json()
        assert st["adopted"] is True and st["policy_version"] == 1
        _, l3, hits3 = counts()
        until(lambda: counts()[0] > v2 and counts()[1] > l3 and counts()[2] > hits3,
              "classified after the restart")
        # the same flow entry, still counting: adoption kept the table
        f4 = lidar_flow()
        assert f4 is not None and f4.class_id == lidar and f4.packets > f1.packets
    finally:
        for proc in (gen, sink):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def test_cleanup_removes_everything(node: Node) -> None:
    from mmmesh.dataplane._netlink import Netlink

    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    node.stop()
    r = subprocess.run([str(VENV_BIN / "qosd"), "--config", str(node.cfg), "--cleanup"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not dataplane(node).loaded()
    with Netlink(node.ns) as n:
        idx = n.ifindex("a0")
        assert n.bpf_filters(idx) == {} and n.root_qdisc(idx)[0] != "htb"


def test_metrics_endpoint_reads_the_dataplane(node: Node) -> None:
    import httpx

    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    addr = yaml.safe_load(node.cfg.read_text())["metrics_addr"]
    body = httpx.get(f"http://{addr}/metrics", timeout=10).text
    assert "mmmesh_policy_version 1.0" in body
    assert 'mmmesh_dataplane_up{iface="a0"} 1.0' in body
    assert 'mmmesh_dataplane_policy_version{iface="a0"} 1.0' in body
    assert 'mmmesh_htb_class_bytes_total{class="voice",iface="a0"}' in body


def test_systemd_notify_ready_and_watchdog(node: Node, tmp_path: Path) -> None:
    """Type=notify: READY=1 once serving, WATCHDOG=1 at half WATCHDOG_USEC."""
    path = str(tmp_path / "notify.sock")
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind(path)
    recv.settimeout(20)
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    log = open(node.dir / "qosd.log", "ab")
    node.proc = subprocess.Popen([str(VENV_BIN / "qosd"), "--config", str(node.cfg)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        msgs: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum("WATCHDOG=1" in m for m in msgs) < 2:
            msgs.append(recv.recv(4096).decode())
        assert any(m.startswith("READY=1") for m in msgs), msgs
        assert sum("WATCHDOG=1" in m for m in msgs) >= 2, msgs
        ready = next(m for m in msgs if m.startswith("READY=1"))
        assert node.sock.exists()  # READY is sent only once the API listens
        assert f"MAINPID={node.proc.pid}" in ready
    finally:
        node.stop()
        recv.close()


def test_sla_socket_takes_reports_but_no_policy(node: Node, tmp_path: Path) -> None:
    """Sidecars (non-root model pods) report on a 0666 socket that cannot
    change policies; the admin socket stays 0600."""
    import httpx

    node.start()
    sla_sock = tmp_path / "run" / "sla.sock"
    assert stat.S_IMODE(sla_sock.stat().st_mode) == 0o666
    assert stat.S_IMODE(node.sock.stat().st_mode) == 0o600
    body = {"stage": "audio-frontend", "reports": [
        {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": 10,
         "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0}]}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sla_sock)), base_url="http://q",
                      timeout=10) as c:
        assert c.post("/v1/sla", json=body).status_code == 200
        assert c.put("/v1/policy", json={"yaml": policy_yaml()}).status_code in (404, 405)
        assert c.get("/v1/status").status_code == 404
    st = node.get("/v1/status").json()
    assert st["sla"]["instances"][0]["stage"] == "audio-frontend"


def test_sidecar_replicas_are_merged_node_wide(node: Node, tmp_path: Path) -> None:
    """Three real SLA recorders (two replicas of "fusion", one "decoder")
    report to the real qosd: replicas are kept apart, merged per stage with
    the true quantiles of all their frames (DDSketch merge), and per class
    node-wide; ``mmmeshctl status`` shows both views."""
    import asyncio

    import numpy as np

    from sidecar.config import SidecarConfig
    from sidecar.contract import SlaSample
    from sidecar.sla import SlaRecorder

    node.start()
    sla_sock = tmp_path / "run" / "sla.sock"

    def recorder(stage: str, instance: str) -> SlaRecorder:
        return SlaRecorder(SidecarConfig.model_validate({
            "stage": stage, "instance": instance,
            "runner": {"kind": "python", "target": "examples.x:y"},
            "qosd": {"socket": str(sla_sock), "report_interval_s": 60}}))

    def feed(rec: SlaRecorder, stage: str, e2e_ms: np.ndarray, missed_every: int) -> None:
        for i, v in enumerate(e2e_ms):
            rec.record(SlaSample(stage=stage, sla_class="video", modality="video",
                                 queue_ns=100_000, service_ns=1_000_000, e2e_ns=int(v * 1e6),
                                 deadline_missed=i % missed_every == 0, dropped=False,
                                 error=False))

    rng = np.random.default_rng(7)
    fast = rng.uniform(5, 15, 900)  # replica 1: 5-15 ms
    slow = rng.uniform(40, 60, 100)  # replica 2: 40-60 ms, the tail of the merged stage
    recs = [recorder("fusion", "fusion-a"), recorder("fusion", "fusion-b"),
            recorder("decoder", "decoder-a")]
    feed(recs[0], "fusion", fast, 100)
    feed(recs[1], "fusion", slow, 10)
    feed(recs[2], "decoder", rng.uniform(20, 30, 500), 1000)

    def look() -> tuple[dict[str, Any], str]:
        return node.get("/v1/sla").json(), node.ctl("status", check=True).stdout

    async def report() -> tuple[list[bool], tuple[dict[str, Any], str]]:
        for r in recs:
            await r.start()
        try:
            sent = [await r.report_now() for r in recs]
            return sent, await asyncio.to_thread(look)  # before stop(): it reports once more
        finally:
            for r in recs:
                await r.stop()

    sent, (sla, out) = asyncio.run(report())
    assert sent == [True, True, True]
    assert sorted((r["stage"], r["instance"]) for r in sla["instances"]) == [
        ("decoder", "decoder-a"), ("fusion", "fusion-a"), ("fusion", "fusion-b")]
    fusion = next(r for r in sla["stages"] if r["stage"] == "fusion")
    assert fusion["sources"] == 2 and fusion["frames"] == 1000
    assert fusion["deadline_misses"] == 9 + 10
    assert abs(fusion["attainment"] - (1000 - 19) / 1000) < 1e-6
    union = np.concatenate([fast, slow])
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        true = float(np.quantile(union, q))
        assert abs(fusion["e2e_ms"][name] - true) <= 0.03 * true, (name, fusion["e2e_ms"], true)
    # not an average of the replicas' p99s (that would be ~35 ms)
    assert fusion["e2e_ms"]["p99"] > 55
    video = next(r for r in sla["classes"] if r["sla_class"] == "video")
    assert video["sources"] == 3 and video["frames"] == 1500 and video.get("stage") is None
    assert "replicas merged" in out and "node-wide" in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("fusion"))
    assert row.split()[3] == "2" and row.split()[4] == "1000", row
    # the final windows of the stopped recorders (idle) replaced the busy ones
    later = node.get("/v1/sla").json()
    assert [(r["stage"], r["frames"]) for r in later["stages"]] == [("decoder", 0),
                                                                    ("fusion", 0)]
