"""Who sent an SLA report (qosd/identity.py) and what it may report
(qosd/sla/reporters.py): cgroup paths of every runtime, /proc read safely, the
rules and their default, the report route's answers (403/422/429), and
processes put in real cgroups.  Real qosd processes under hostile local
senders: tests/system/qosd/test_report_hostile.py."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from qosd import api
from qosd.config import QosdConfig
from qosd.daemon import build_controller, build_node, build_service, open_store
from qosd.identity import Peer, ReportRefused, SenderResolver, cgroup_path, sender_of_cgroup
from qosd.sla.board import SlaBoard
from qosd.sla.quota import SlaLimits
from qosd.sla.reporters import DEFAULT_REPORTERS, ReporterRule, authorize
from testkit.cgroups import (
    cgroup2_root,  # noqa: F401
    cgroups,
    process,
)
from testkit.qosd_fake import with_peer

CID = "3f" * 32
UID = "6f1c2e4a-8d3b-4c1e-9a7f-0b2d4e6f8a1c"
UID_ = UID.replace("-", "_")
POD = f"pod:{UID}/{CID}"

CGROUPS: list[tuple[str | None, str, str]] = [
    # Kubernetes: containerd, CRI-O, docker; systemd and cgroupfs drivers; QoS classes
    ((f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope"), "pod", POD),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", "pod", POD),
    ((f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"docker-{CID}.scope"), "pod", POD),
    (f"/kubepods/burstable/pod{UID}/{CID}", "pod", POD),
    (f"/kubepods/pod{UID}/crio-{CID}", "pod", POD),
    (f"/kubepods/besteffort/pod{UID}/{CID}/nested/inside", "pod", POD),
    ((f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"), "pod", POD),
    (f"/kubepods/burstable/pod{UID}", "pod", f"pod:{UID}/-"),
    (f"/kubepods/burstable/pod{UID}/crio-conmon-{CID}.scope", "pod", f"pod:{UID}/-"),
    # seen from inside another cgroup namespace (below an ancestor only root made)
    ((f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope"), "pod", POD),
    ("/../mmmesh-sidecar@asr.service", "unit", "unit:mmmesh-sidecar@asr.service"),
    # systemd system services (and what they delegate below themselves)
    ("/system.slice/mmmesh-sidecar@asr.service", "unit", "unit:mmmesh-sidecar@asr.service"),
    ("/system.slice/system-mmmesh\\x2dsidecar.slice/mmmesh-sidecar@asr.service", "unit",
     "unit:mmmesh-sidecar@asr.service"),
    ("/system.slice/mmmesh-sidecar@asr.service/delegated/sub", "unit",
     "unit:mmmesh-sidecar@asr.service"),
    ("/mmmesh.slice/mmmesh-sidecar@a\\x2db.service", "unit",
     "unit:mmmesh-sidecar@a\\x2db.service"),
    # what a local user can make (a delegated subtree holds cgroups of any name)
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/mmmesh-sidecar@asr.service",
     "process", ("uid:1000:/user.slice/user-1000.slice/user@1000.service/app.slice/"
     "mmmesh-sidecar@asr.service")),
    (f"/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod{UID}/{CID}",
     "process", (f"uid:1000:/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/"
     f"pod{UID}/{CID}")),
    ("/user.slice/user-1000.slice/session-3.scope", "process",
     "uid:1000:/user.slice/user-1000.slice/session-3.scope"),
    (f"/kubepods/burstable/odd/pod{UID}/{CID}", "process",
     f"uid:1000:/kubepods/burstable/odd/pod{UID}/{CID}"),
    (f"/system.slice/docker-{CID}.scope", "process", f"uid:1000:/system.slice/docker-{CID}.scope"),
    ("/init.scope", "process", "uid:1000:/init.scope"),
    ("/", "process", "uid:1000:/"),
    (None, "process", "uid:1000:?"),
]


@pytest.mark.parametrize(("cgroup", "kind", "key"), CGROUPS)
def test_identity_from_the_cgroup_path(cgroup: str | None, kind: str, key: str) -> None:
    s = sender_of_cgroup(Peer(42, 1000, 1000), cgroup)
    assert (s.kind, s.key, s.uid, s.pid) == (kind, key, 1000, 42)


def test_unit_instance_and_cgroup_file() -> None:
    unit = sender_of_cgroup(Peer(1, 0, 0), "/mmmesh.slice/mmmesh-sidecar@a\\x2db.service")
    assert unit.unit_instance == "a-b"
    hybrid = "12:pids:/x\n1:name=systemd:/user.slice/v1\n0::/system.slice/a.service\n"
    assert cgroup_path(hybrid) == "/system.slice/a.service"
    assert cgroup_path("1:name=systemd:/system.slice/b.service\n2:cpu:/\n") == \
        "/system.slice/b.service"
    assert cgroup_path("3:cpu,cpuacct:/\n") is None


# --------------------------------------------------------------------------
# /proc
# --------------------------------------------------------------------------
def fake_proc(root: Path, pid: int, uid: int, cgroup: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\n")
    (d / "cgroup").write_text(f"0::{cgroup}\n")


def test_resolver_reads_proc_safely_and_caches(tmp_path: Path) -> None:
    clock = [0.0]
    r = SenderResolver(tmp_path, ttl_s=2.0, max_entries=2, clock=lambda: clock[0])
    fake_proc(tmp_path, 10, 998, "/system.slice/mmmesh-sidecar@asr.service")
    assert r.resolve(Peer(10, 998, 998)).key == "unit:mmmesh-sidecar@asr.service"
    fake_proc(tmp_path, 10, 998, "/user.slice/x.scope")  # moved: seen once the entry expires
    assert r.resolve(Peer(10, 998, 998)).kind == "unit" and r.reads == 1
    clock[0] = 2.5
    assert r.resolve(Peer(10, 998, 998)).key == "uid:998:/user.slice/x.scope" and r.reads == 2
    cases = [(Peer(0, 1000, 1000), "sender_unknown", "hostPID"),  # another pid namespace
             (Peer(11, 1000, 1000), "sender_gone", "gone"),
             (Peer(10, 1000, 1000), "sender_changed", "uid 998")]  # reused pid, other user
    for peer, code, text in cases:
        with pytest.raises(ReportRefused) as exc:
            r.resolve(peer)
        assert (exc.value.status, exc.value.code) == (403, code) and text in str(exc.value)
    for pid in range(20, 30):  # the cache stays bounded
        fake_proc(tmp_path, pid, 1, "/")
        r.resolve(Peer(pid, 1, 1))
    assert len(r._cache) == 2


def test_resolver_on_this_process() -> None:
    me = SenderResolver().resolve(Peer(os.getpid(), os.getuid(), os.getgid()))
    assert me.uid == os.getuid() and me.cgroup is not None


# --------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------
def test_default_rules() -> None:
    sidecar = sender_of_cgroup(Peer(5, 998, 998), "/system.slice/mmmesh-sidecar@asr.service")
    pod = sender_of_cgroup(Peer(6, 1000, 1000), CGROUPS[0][0])
    root = sender_of_cgroup(Peer(7, 0, 0), "/user.slice/user-0.slice/session-1.scope")
    user = sender_of_cgroup(Peer(8, 1000, 1000), "/user.slice/user-1000.slice/session-3.scope")
    fake = sender_of_cgroup(Peer(9, 1000, 1000), CGROUPS[15][0])  # a user's own unit
    other = sender_of_cgroup(Peer(10, 0, 0), "/system.slice/sshd.service")
    allowed = [(sidecar, "asr"), (pod, "anything"), (root, "anything"), (other, "x")]
    for s, stage in allowed:
        authorize(DEFAULT_REPORTERS, s, stage)  # root may (uid 0), even in another unit
    for s, stage, code in [(sidecar, "tts", "stage_not_allowed"), (user, "asr", "not_allowed"),
                           (fake, "asr", "not_allowed"),
                           (sender_of_cgroup(Peer(1, 5, 5), "/system.slice/sshd.service"), "x",
                            "not_allowed")]:
        with pytest.raises(ReportRefused) as exc:
            authorize(DEFAULT_REPORTERS, s, stage)
        assert (exc.value.status, exc.value.code) == (403, code), (s, stage)
        assert s.key in str(exc.value)


def test_rules_from_qosd_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "qosd.yaml"
    cfg.write_text(yaml.safe_dump({"sla_reporters": [
        {"pod": "*", "stages": ["asr", "fusion-*"]},
        {"uid": [1000, 1001], "cgroup": "/user.slice/user-1000.slice/*", "stages": ["dev-*"]},
        {"unit": "model@*.service", "stages": ["{instance}-pre", "{instance}"]},
    ], "sla_limits": {"sender_rows": 8, "board_bytes": 1 << 22}}))
    monkeypatch.setenv("MMMESH_QOSD_CONFIG", str(cfg))
    c = QosdConfig()
    assert c.sla_limits.sender_rows == 8 and c.sla_limits.sender_rate == 2.0
    pod = sender_of_cgroup(Peer(6, 1000, 1000), CGROUPS[3][0])
    authorize(c.sla_reporters, pod, "fusion-2")
    dev = sender_of_cgroup(Peer(6, 1000, 1000), "/user.slice/user-1000.slice/session-3.scope")
    authorize(c.sla_reporters, dev, "dev-x")
    unit = sender_of_cgroup(Peer(6, 7, 7), "/system.slice/model@a[*].service")
    authorize(c.sla_reporters, unit, "a[*]-pre")  # the instance is literal, not a glob
    for s, stage in [(pod, "tts"), (dev, "asr"), (unit, "ab-pre"), (unit, "b")]:
        with pytest.raises(ReportRefused):
            authorize(c.sla_reporters, s, stage)
    monkeypatch.setenv("MMMESH_QOSD_CONFIG", str(tmp_path / "absent.yaml"))
    assert QosdConfig().sla_reporters == list(DEFAULT_REPORTERS)
    with pytest.raises(ValueError, match="at least one of uid, unit, pod, cgroup"):
        ReporterRule(stages=["*"])
    with pytest.raises(ValueError, match="stages"):
        ReporterRule(uid=0, stages=[])


# --------------------------------------------------------------------------
# The report route
# --------------------------------------------------------------------------
def report(stage: str, frames: Any = 10, instance: str | None = "r-1") -> dict[str, Any]:
    return {"stage": stage, "instance": instance, "reports": [
        {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": frames,
         "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0}]}




def sla_client(tmp_path: Path, pid: int, uid: int, **limits: Any
               ) -> tuple[TestClient, Any, SlaBoard]:
    """The report socket's app over qosd's own parts (qosd/daemon.py builds them);
    the board, to read what it kept."""
    cfg = QosdConfig(state_dir=tmp_path / "s", api_socket=tmp_path / "a.sock", sla_socket=None,
                     metrics_addr=None, sla_limits=SlaLimits(**limits))
    node = build_node(cfg, open_store(cfg))
    svc = build_service(cfg, node, build_controller(cfg, node))
    return (TestClient(with_peer(api.create_sla_app(svc), pid=pid, uid=uid, gid=uid)), svc,
            node.board)


def test_route_answers_who_may_report_what(tmp_path: Path) -> None:
    with process(65534) as nobody:
        c, svc, board = sla_client(tmp_path, nobody.pid, 65534)
        r = c.post("/v1/sla", json=report("asr"))
        assert r.status_code == 403 and r.json()["error"] == "not_allowed"
        assert "uid:65534:" in r.json()["message"] and "sla_reporters" in r.json()["message"]
        # checked before the body: even a malformed one gets the 403
        assert c.post("/v1/sla", json={"stage": ""}).status_code == 403
    assert svc.sla()["instances"] == [] and board.stats()["refused:not_allowed"] == 2
    c, svc, board = sla_client(tmp_path, os.getpid(), 65534)  # credentials not this process's
    assert c.post("/v1/sla", json=report("asr")).json()["error"] == "sender_changed"
    assert board.stats()["refused:sender_changed"] == 1


def test_route_bounds_and_rates(tmp_path: Path) -> None:
    c, svc, _ = sla_client(tmp_path, os.getpid(), os.getuid(), sender_burst=3, sender_rate=0.5)
    for frames, field in [(10**400, "body.reports[0].frames"), (-1, "body.reports[0].frames"),
                          (10**12 + 1, "body.reports[0].frames")]:
        r = c.post("/v1/sla", json=report("asr", frames))
        assert r.status_code == 422 and r.json()["errors"][0][0] == field, r.text
    r = c.post("/v1/sla", content=b'{"stage": "a", "reports": [{"frames": 1' + b"0" * 5000
               + b"}]}", headers={"content-type": "application/json"})
    assert r.status_code == 422  # more digits than Python parses: still not a 500
    for _ in range(3):
        assert c.post("/v1/sla", json=report("asr")).status_code == 200
    r = c.post("/v1/sla", json=report("asr"))
    assert (r.status_code, r.json()["error"], r.headers["retry-after"]) == (
        429, "rate_limited", "2")
    (row,) = svc.sla()["instances"]
    assert row["instance"] == "r-1" and row["sender"].startswith("uid:0:")  # root names it






def unique_paths() -> tuple[str, str, str]:
    uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex * 2
    return (f"/kubepods/burstable/pod{uid}/{cid}",
            f"/mmtest-{os.getpid()}.slice/mmmesh-sidecar@asr.service",
            f"/mmtest-{os.getpid()}.slice/user-1000.slice/user@1000.service/kubepods/pod{uid}")


def test_processes_in_real_cgroups(tmp_path: Path) -> None:
    """A pod's and a unit's process, put where the kubelet and systemd put
    them, are told apart by qosd from their credentials alone; a user's
    look-alike pod is not a pod."""
    pod_path, unit_path, fake_path = unique_paths()
    with cgroups(pod_path, unit_path, fake_path) as dirs:
        r = SenderResolver()
        with process(1000, dirs[pod_path]) as p1, process(998, dirs[unit_path]) as p2, \
                process(1000, dirs[fake_path]) as p3:
            pod = r.resolve(Peer(p1.pid, 1000, 1000))
            unit = r.resolve(Peer(p2.pid, 998, 998))
            fake = r.resolve(Peer(p3.pid, 1000, 1000))
    assert pod.kind == "pod" and pod.key == f"pod:{pod_path.split('/')[3][3:]}/" \
        f"{pod_path.split('/')[4]}"
    assert (unit.kind, unit.unit, unit.unit_instance) == (
        "unit", "mmmesh-sidecar@asr.service", "asr")
    assert fake.kind == "process" and fake.cgroup == fake_path
