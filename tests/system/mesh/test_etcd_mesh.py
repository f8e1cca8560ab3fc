"""The cluster tests of the gossip back end, and etcd's fault tests, on real qosd
processes using the etcd back end (issue 11): three nodes in network
namespaces (testkit/netns_mesh.py, ``backend="etcd"``), a 3-member etcd in the
bridge's namespace with TLS and client certificates.

* the same tests as tests/system/mesh/test_mesh_rollout.py (ACKed by all, a NACK with
  the reason, concurrent applies converge, a node-local apply refused) and
  tests/system/mesh/test_mesh_sla.py (one global view everywhere, a dead node leaves it)
  run here unchanged against etcd: testkit/mesh_cases.py, with this module's ``mesh``;
* the etcd leader is killed (kill -9) while versions roll out: every node
  ends on the same version, each apply is in etcd's history exactly once and
  the counters have no gap;
* etcd stops entirely: every qosd keeps its last good policy in the kernel
  and goes on classifying, reports the store down (status and
  ``mmmesh_cluster_store_up 0``), refuses to propose (503) and node-local
  applies (409); when etcd is back it catches up and ACKs a new version;
* a qosd killed with -9 is gone from every member list and rollout table
  once its lease expires.

Compaction past a watcher's revision is tests/system/mesh/test_etcd_store.py's (the same
node code, without qosd).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.mesh_cases import (
    case_a_dead_node_leaves_every_view,
    case_a_node_whose_link_cannot_carry_it_nacks,
    case_a_rollout_is_acked_by_every_member,
    case_concurrent_applies_converge_to_one_version,
    case_every_node_converges_to_the_same_global_view,
    ctl,
    current,
    kernel_version,
    policy,
)
from testkit.netns_mesh import ETCD_LEASE_TTL_S, VENV_BIN, Mesh, MeshNode
from testkit.privileged import require_privileged

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(3, tmp_path_factory.mktemp("meshetcd"), backend="etcd") as m:
        m.wait_converged(30)
        yield m


# the gossip back end's rollout tests, in their order, against etcd
def test_a_rollout_is_acked_by_every_member(mesh: Mesh, tmp_path: Path) -> None:
    case_a_rollout_is_acked_by_every_member(mesh, tmp_path)


def test_a_node_whose_link_cannot_carry_it_nacks(mesh: Mesh, tmp_path: Path) -> None:
    case_a_node_whose_link_cannot_carry_it_nacks(mesh, tmp_path)


def test_concurrent_applies_converge_to_one_version(mesh: Mesh, tmp_path: Path) -> None:
    case_concurrent_applies_converge_to_one_version(mesh, tmp_path)


def store(node: MeshNode) -> dict[str, Any]:
    return node.get("/v1/status")["cluster"]  # type: ignore[no-any-return]


def history(mesh: Mesh) -> list[tuple[int, str]]:
    """(counter, sha256) of every version in etcd's P/policy/versions/."""
    out = mesh.etcd.ctl("get", "--prefix", "/mmmesh/policy/versions/", "-w", "json")
    kvs = json.loads(out).get("kvs", [])
    import base64

    rows = []
    for kv in kvs:
        rec = json.loads(base64.b64decode(kv["value"]))
        rows.append((rec["d"]["c"], rec["d"]["h"]))
    return sorted(rows)


def metric(node: MeshNode, name: str) -> str:
    code = ("import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("
            f"'http://{node.ip}:9464/metrics', timeout=5).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", node.ns, str(VENV_BIN / "python"), "-c", code],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return "\n".join(line for line in out.splitlines() if line.startswith(name))


def egress_packets(node: MeshNode) -> int:
    up = node.get("/v1/status")["uplinks"]["eth0"]
    return sum(int(c["egress_packets"]) for c in up["classes"].values())


def send_udp(node: MeshNode, to: MeshNode, n: int = 200) -> None:
    code = ("import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"for _ in range({n}): s.sendto(b'x' * 200, ('{to.ip}', 9999))")
    subprocess.run(["ip", "netns", "exec", node.ns, str(VENV_BIN / "python"), "-c", code],
                   check=True, timeout=30)


def wait_all(mesh: Mesh, cond: Any, what: str, timeout: float = 60) -> None:
    mesh.wait(lambda: all(cond(n) for n in mesh.nodes[:3]), timeout, what, every=0.3)


def restore_link(mesh: Mesh) -> None:
    """Undo test_a_node_whose_link_cannot_carry_it_nacks's 100mbit mesh_link."""
    import yaml  # type: ignore[import-untyped]

    node = mesh.nodes[2]
    cfg = yaml.safe_load(node.cfg.read_text())
    if cfg.pop("mesh_link", None) is not None:
        node.cfg.write_text(yaml.safe_dump(cfg))
        node.stop()
        node.start()
        node.wait_ready()
        mesh.wait_converged(40)


def test_the_etcd_leader_killed_during_a_rollout(mesh: Mesh, tmp_path: Path) -> None:
    nodes = mesh.nodes[:3]
    restore_link(mesh)
    wait_all(mesh, lambda n: store(n)["up"], "store up")
    before = {c for c, _ in history(mesh)}
    rates = ["6mbit", "7mbit", "8mbit", "9mbit"]
    results: list[subprocess.CompletedProcess[str]] = []

    def go() -> None:
        for i, rate in enumerate(rates):
            f = tmp_path / f"l{i}.yaml"
            f.write_text(policy(rate))
            results.append(ctl(nodes[i % 2], "policy", "apply", "-f", str(f), "--cluster",
                               "--timeout", "60"))

    t = threading.Thread(target=go)
    t.start()
    # kill -9 the leader as soon as the first version is in etcd: nodes are realising
    # and reporting it, and three more proposals follow through the new leader
    mesh.wait(lambda: len(history(mesh)) > len(before), 60, "the first version", every=0.05)
    leader = mesh.etcd.leader()
    mesh.etcd.kill(leader)
    t.join(240)
    mesh.etcd.start(leader)
    ok = [r for r in results if r.returncode == 0]
    assert len(ok) >= len(rates) - 1, [(r.returncode, r.stdout, r.stderr) for r in results]
    # none lost, none duplicated: every version once, counters without a gap
    rows = [(c, h) for c, h in history(mesh) if c not in before]
    counters = [c for c, _ in rows]
    assert counters == list(range(min(counters), min(counters) + len(counters))), rows
    assert len({h for _, h in rows}) == len(rows), rows
    assert len(rows) >= len(ok)
    last = max(counters)
    # every node on the last version, in its store and its kernel, and ACKed
    wait_all(mesh, lambda n: current(n)["note"].startswith(f"mesh {last}@"), "last version")
    for n in nodes:
        assert kernel_version(n) == current(n)["version"]
    table = nodes[2].get("/v1/cluster/rollout")
    assert table["complete"] and table["counts"]["acked"] == 3, table


def test_etcd_down_keeps_the_last_good_policy(mesh: Mesh, tmp_path: Path) -> None:
    nodes = mesh.nodes[:3]
    wait_all(mesh, lambda n: store(n)["up"], "store up")
    before = {n.name: (current(n)["version"], kernel_version(n)) for n in nodes}
    mesh.etcd.stop_all()
    try:
        wait_all(mesh, lambda n: not store(n)["up"], "store reported down", 30)
        assert metric(nodes[0], "mmmesh_cluster_store_up").endswith("0.0"), \
            metric(nodes[0], "mmmesh_cluster_store_up")
        # the kernel keeps the last good policy and goes on classifying
        sent = egress_packets(nodes[0])
        send_udp(nodes[0], nodes[1])
        assert egress_packets(nodes[0]) >= sent + 200
        for n in nodes:
            assert (current(n)["version"], kernel_version(n)) == before[n.name]
        # no mesh-wide change without the store; no node-local one under a mesh policy
        f = tmp_path / "down.yaml"
        f.write_text(policy("10mbit"))
        r = ctl(nodes[0], "policy", "apply", "-f", str(f), "--cluster", "--timeout", "10")
        assert r.returncode != 0 and "unavailable" in (r.stdout + r.stderr), (r.stdout, r.stderr)
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(nodes[1].sock)),
                          base_url="http://qosd", timeout=10) as c:
            res = c.put("/v1/policy", json={"yaml": policy("2mbit")})
        assert res.status_code == 409 and res.json()["error"] == "mesh_managed", res.text
        assert nodes[2].get("/v1/cluster/rollout")["counts"]["acked"] == 3  # the last table
    finally:
        mesh.etcd.start_all()
    wait_all(mesh, lambda n: store(n)["up"], "store up again", 60)
    assert metric(nodes[0], "mmmesh_cluster_store_up").endswith("1.0")
    r = ctl(nodes[0], "policy", "apply", "-f", str(f), "--cluster", "--timeout", "60")
    assert r.returncode == 0, (r.stdout, r.stderr)
    for n in nodes:
        assert "10mbit" in current(n)["yaml"] or "10000000" in current(n)["yaml"]


# the global SLA view: the same tests as with gossip (the last one kills node-2)
def test_every_node_converges_to_the_same_global_view(mesh: Mesh) -> None:
    case_every_node_converges_to_the_same_global_view(mesh)


def test_a_dead_node_leaves_every_view(mesh: Mesh) -> None:
    case_a_dead_node_leaves_every_view(mesh)


def test_a_killed_qosd_is_gone_when_its_lease_expires(mesh: Mesh) -> None:
    victim = mesh.nodes[2]
    if not victim.running:  # the SLA test killed it: back, then killed again
        victim.start()
        victim.wait_ready()
        mesh.wait_converged(30)
    victim.kill()
    t = mesh.wait(lambda: all(n.members().get(victim.name) == "dead"
                              for n in mesh.nodes[:2]), ETCD_LEASE_TTL_S + 10, "gone")
    assert t <= ETCD_LEASE_TTL_S + 3
    for n in mesh.nodes[:2]:
        rows = {r["node"]: r["state"] for r in n.get("/v1/cluster/rollout")["rows"]}
        assert rows[victim.name] == "gone", rows
        assert n.get("/v1/cluster/members")["backend"] == "etcd"
