"""The mesh tests that run on both back ends (gossip: tests/system/mesh/test_mesh_rollout.py
and test_mesh_sla.py; etcd: test_etcd_mesh.py), as ``case_*`` functions of a
``Mesh``: each module has its own mesh fixture and calls them."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mmmesh.sla.sketch import encode_sketch, new_sketch
from testkit.netns_mesh import VENV_BIN, Mesh, MeshNode

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "policy.yaml"


def policy(voice_rate: str = "1.2mbit") -> str:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["link"] = {"device": "eth0", "rate": "500mbit"}
    for c in data["classes"]:
        if c["name"] == "voice":
            c["rate"] = voice_rate
            c.pop("adapt", None)
    return yaml.safe_dump(data)


def ctl(node: MeshNode, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_BIN / "mmmeshctl"), "--socket", str(node.sock), *args],
                          capture_output=True, text=True, timeout=timeout)


def kernel_version(node: MeshNode) -> int:
    """The policy version in the node's BPF maps (qosd runs under ``ip netns
    exec``, with a bpffs of its own: read through its status)."""
    return int(node.get("/v1/status")["uplinks"]["eth0"]["policy_version"])


def current(node: MeshNode) -> dict[str, Any]:
    return node.get("/v1/policy")  # type: ignore[no-any-return]


def wait_all(mesh: Mesh, cond: Any, what: str, timeout: float = 60) -> None:
    mesh.wait(lambda: all(cond(n) for n in mesh.nodes[:3]), timeout, what)


def case_a_rollout_is_acked_by_every_member(mesh: Mesh, tmp_path: Path) -> None:
    f = tmp_path / "p1.yaml"
    f.write_text(policy())
    r = ctl(mesh.nodes[0], "policy", "apply", "-f", str(f), "--cluster", "--timeout", "60")
    assert r.returncode == 0, (r.stdout, r.stderr, mesh.nodes[1].log())
    assert "ACKed by all 3" in r.stdout + r.stderr
    for node in mesh.nodes[:3]:
        cur = current(node)
        assert cur["note"].startswith("mesh "), cur["note"]
        assert kernel_version(node) == cur["version"]
        rows = {row["node"]: row["state"] for row in node.get("/v1/cluster/rollout")["rows"]}
        assert set(rows.values()) == {"acked"}, rows
    # the same mesh version on every node
    assert len({current(n)["note"] for n in mesh.nodes[:3]}) == 1
    # a node-local change would be undone by the rollout: refused
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(mesh.nodes[1].sock)),
                      base_url="http://qosd", timeout=10) as c:
        res = c.put("/v1/policy", json={"yaml": policy("2mbit")})
    assert res.status_code == 409 and res.json()["error"] == "mesh_managed", res.text


def case_a_node_whose_link_cannot_carry_it_nacks(mesh: Mesh, tmp_path: Path) -> None:
    small = mesh.nodes[2]
    before = current(small)
    # this node's own link is 100 mbit: the example's guarantees (> 250 mbit) do not fit
    cfg = yaml.safe_load(small.cfg.read_text())
    cfg["mesh_link"] = {"rate": "100mbit"}
    small.cfg.write_text(yaml.safe_dump(cfg))
    small.stop()
    small.start()
    small.wait_ready()
    mesh.wait_converged(40)
    f = tmp_path / "p2.yaml"
    f.write_text(policy("3mbit"))
    r = ctl(mesh.nodes[0], "policy", "apply", "-f", str(f), "--cluster", "--timeout", "60")
    assert r.returncode == 3, (r.stdout, r.stderr)
    table = {row["node"]: row for row in mesh.nodes[0].get("/v1/cluster/rollout")["rows"]}
    assert table[small.name]["state"] == "nacked", table
    assert "rate" in (table[small.name].get("reason") or ""), table[small.name]
    assert {table[n.name]["state"] for n in mesh.nodes[:2]} == {"acked"}
    # xDS: the NACKing node keeps its previous version, in the store and the kernel
    assert current(small)["version"] == before["version"]
    assert kernel_version(small) == before["version"]
    for node in mesh.nodes[:2]:
        assert "3mbit" in current(node)["yaml"] or "3000000" in current(node)["yaml"]


def case_concurrent_applies_converge_to_one_version(mesh: Mesh, tmp_path: Path) -> None:
    files = []
    for i, rate in enumerate(("4mbit", "5mbit")):
        f = tmp_path / f"c{i}.yaml"
        f.write_text(policy(rate))
        files.append(f)
    results: list[subprocess.CompletedProcess[str]] = []

    def go(node: MeshNode, f: Path) -> None:
        results.append(ctl(node, "policy", "apply", "-f", str(f), "--cluster",
                           "--timeout", "60"))

    threads = [threading.Thread(target=go, args=(mesh.nodes[i], files[i])) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # every node that can realise it ends on the same mesh version (the higher pair)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        notes = {current(n)["note"] for n in mesh.nodes[:2]}
        if len(notes) == 1:
            break
        time.sleep(0.5)
    assert len(notes) == 1, notes
    desired = {n.get("/v1/cluster/rollout")["version"] for n in mesh.nodes[:3]}
    assert len(desired) == 1, desired
    assert notes == {f"mesh {next(iter(desired))}"} or next(iter(notes)).startswith(
        f"mesh {next(iter(desired))}"), (notes, desired)
    assert sorted(r.returncode for r in results)[0] in (0, 3, 4), \
        [(r.returncode, r.stderr) for r in results]


def report(node: MeshNode, i: int) -> None:
    import httpx

    sk = new_sketch()
    for v in SAMPLES[i]:
        sk.add(float(v))
    frames = len(SAMPLES[i])
    body = {"stage": "asr", "instance": f"asr-{node.name}", "reports": [{
        "sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": frames,
        "deadline_misses": MISSES[i], "drops": 0, "errors": 0,
        "attainment": (frames - MISSES[i]) / frames, "sketch_e2e": encode_sketch(sk)}]}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(node.sock)),
                      base_url="http://qosd", timeout=10) as c:
        r = c.post("/v1/sla", json=body)
    assert r.status_code == 200, r.text


def voice(node: MeshNode) -> dict[str, Any] | None:
    view = node.get("/v1/cluster/sla")
    rows = [r for r in view["classes"] if r["sla_class"] == "voice"]
    return rows[0] if rows else None


def case_every_node_converges_to_the_same_global_view(mesh: Mesh) -> None:
    nodes = mesh.nodes[:3]
    deadline = time.monotonic() + 90
    done: dict[str, Any] = {}
    while time.monotonic() < deadline and len(done) < 3:
        for i, node in enumerate(nodes):  # sidecars report every few seconds
            report(node, i)
        time.sleep(2)
        for node in nodes:
            row = voice(node)
            if row and row["frames"] == 1000 and not row.get("partial"):
                done[node.name] = row
    assert len(done) == 3, {n.name: voice(n) for n in nodes}
    union = np.concatenate(SAMPLES)
    true_p99 = float(np.quantile(union, 0.99))
    averaged = float(np.mean([np.quantile(s, 0.99) for s in SAMPLES]))
    for name, row in done.items():
        assert row["nodes"] == 3, (name, row)
        assert abs(row["attainment"] - (1000 - sum(MISSES)) / 1000) < 1e-6, (name, row)
        assert abs(row["p99_ms"] - true_p99) <= 0.03 * true_p99, (name, row["p99_ms"], true_p99)
        assert abs(row["p99_ms"] - averaged) > 0.1 * true_p99  # not an average of p99s
        per_node = {b["node"]: b["frames"] for b in row["breakdown"]}
        assert per_node == {n.name: len(SAMPLES[i]) for i, n in enumerate(nodes)}, per_node
    # the same view everywhere (counts and quantiles; ages differ by node)
    assert len({(r["frames"], round(r["p99_ms"], 6)) for r in done.values()}) == 1
    out = subprocess.run([str(VENV_BIN / "mmmeshctl"), "--socket", str(nodes[0].sock),
                          "cluster", "sla", "-o", "json"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out)["classes"][0]["frames"] == 1000


def case_a_dead_node_leaves_every_view(mesh: Mesh) -> None:
    nodes = mesh.nodes[:3]
    for i, node in enumerate(nodes):
        report(node, i)
    nodes[2].kill()
    deadline = time.monotonic() + 60
    left: dict[str, Any] = {}
    live = {nodes[0].name, nodes[1].name}
    while time.monotonic() < deadline and len(left) < 2:
        for i, node in enumerate(nodes[:2]):
            report(node, i)
            row = voice(node)
            # the breakdown is asked of the nodes on demand, the totals come with
            # the class's aggregated record: both must have let the dead node go
            # (the record may do so a round after the breakdown)
            if row and {b["node"] for b in row["breakdown"]} == live and row["frames"] == 900:
                left[node.name] = row
        time.sleep(1)
    assert len(left) == 2, {n.name: voice(n) for n in nodes[:2]}


RNG = np.random.default_rng(11)


# node i's voice latencies: three different ranges; the global tail is node 2's
SAMPLES = [RNG.uniform(5, 15, 600), RNG.uniform(20, 30, 300), RNG.uniform(80, 120, 100)]


MISSES = [0, 3, 40]
