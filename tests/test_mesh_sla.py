"""The global SLA view across real qosd processes (issue 9, item 3): three
nodes in network namespaces (tests/netns_mesh.py), each told a different
voice window by a "sidecar" (a report on its admin socket, with a real
DDSketch); every node's ``GET /v1/cluster/sla`` must converge to the same
view: frames summed over the three, attainment frame-weighted, the global
p99 that of the union of all samples (merged sketches, never averaged
percentiles), the per-node breakdown; ``mmmeshctl cluster sla`` shows it.
A node that is killed leaves every view once it is declared dead."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmmesh.slasketch import encode_sketch, new_sketch
from tests.conftest import require_privileged
from tests.netns_mesh import VENV_BIN, Mesh, MeshNode

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(240)]

RNG = np.random.default_rng(11)
# node i's voice latencies: three different ranges; the global tail is node 2's
SAMPLES = [RNG.uniform(5, 15, 600), RNG.uniform(20, 30, 300), RNG.uniform(80, 120, 100)]
MISSES = [0, 3, 40]


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


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(3, tmp_path_factory.mktemp("meshsla")) as m:
        m.wait_converged(30)
        yield m


def test_every_node_converges_to_the_same_global_view(mesh: Mesh) -> None:
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


def test_a_dead_node_leaves_every_view(mesh: Mesh) -> None:
    nodes = mesh.nodes[:3]
    for i, node in enumerate(nodes):
        report(node, i)
    nodes[2].kill()
    deadline = time.monotonic() + 60
    left: dict[str, Any] = {}
    while time.monotonic() < deadline and len(left) < 2:
        for i, node in enumerate(nodes[:2]):
            report(node, i)
            row = voice(node)
            if row and {b["node"] for b in row["breakdown"]} == {nodes[0].name, nodes[1].name}:
                left[node.name] = row
        time.sleep(1)
    assert len(left) == 2, {n.name: voice(n) for n in nodes[:2]}
    for row in left.values():
        assert row["frames"] == 900
