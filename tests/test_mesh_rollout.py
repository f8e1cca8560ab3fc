"""Mesh-wide policy rollout across real qosd processes (issue 9, item 4): three
nodes in network namespaces on a bridge (tests/netns_mesh.py), real gRPC with
mutual TLS, each qosd loading the real dataplane on its own ``eth0``.

* ``mmmeshctl policy apply -f p.yaml --cluster`` rolls a version out; every
  member ACKs, every kernel holds it (its policy version in the maps), and
  every node's table says so;
* a node whose own link (qosd.yaml ``mesh_link``) cannot carry the
  guarantees NACKs with the reason and keeps its previous version, while the
  others take the new one; the command says which (exit 3);
* two applies on two nodes at once converge to one version everywhere;
* a node-local apply under a mesh policy is refused (409 mesh_managed).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_privileged
from tests.netns_mesh import VENV_BIN, Mesh, MeshNode

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "policy.yaml"


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


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(3, tmp_path_factory.mktemp("meshroll")) as m:
        m.wait_converged(30)
        yield m


def wait_all(mesh: Mesh, cond: Any, what: str, timeout: float = 60) -> None:
    mesh.wait(lambda: all(cond(n) for n in mesh.nodes[:3]), timeout, what)


def test_a_rollout_is_acked_by_every_member(mesh: Mesh, tmp_path: Path) -> None:
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


def test_a_node_whose_link_cannot_carry_it_nacks(mesh: Mesh, tmp_path: Path) -> None:
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


def test_concurrent_applies_converge_to_one_version(mesh: Mesh, tmp_path: Path) -> None:
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
