"""The mesh with real processes: 5 qosd, one per network namespace, on a bridge
(testkit/netns_mesh.py), real gRPC with mutual TLS, short protocol timers
(``netns_mesh.PROTOCOL``: probe 0.5 s; with 5 members the suspicion timeout is
2.5 s at k = 3 confirmations and at most 10 s).

One mesh serves the module; each test leaves it converged (or restores it)
for the next, and runs alone too.  Views are read from every node's
``GET /v1/cluster/members``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosd.mesh.membership.core import Config
from testkit.netns_mesh import PORT, PROTOCOL, ROOT, VENV_BIN, Mesh, MeshNode
from testkit.privileged import require_privileged

pytestmark = pytest.mark.privileged

N = 5
CFG = Config(**PROTOCOL)  # type: ignore[arg-type]
# a crash is dead everywhere within the Lifeguard maximum, plus a probe round
# to be first suspected, plus the gossip of the death (docs/cluster.md)
DETECT_BOUND_S = CFG.suspicion_max_s(N) + 2 * CFG.probe_interval_s + 1.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(N, tmp_path_factory.mktemp("mesh")) as m:
        m.wait_converged(30)
        yield m


def deaths_declared(mesh: Mesh) -> int:
    return sum(n.get("/v1/cluster/members")["stats"]["deaths_declared"] for n in mesh.running())


def healthy(mesh: Mesh) -> None:
    """Every node runs and every node sees all alive (restarting what a test left down)."""
    for node in mesh.nodes[:N]:
        if not node.running:
            node.start()
            node.wait_ready()
    mesh.wait_converged(40, mesh.names)


def test_join_and_full_membership(mesh: Mesh) -> None:
    healthy(mesh)
    for node in mesh.nodes[:N]:
        doc = node.get("/v1/cluster/members")
        assert doc["node"] == node.name and doc["addr"] == node.addr
        assert [m["node"] for m in doc["members"]] == mesh.names
        assert all(m["state"] == "alive" and m["addr"] == f"{mesh.subnet}.{i + 1}:{PORT}"
                   for i, m in enumerate(doc["members"]))
        assert doc["traffic"]["dropped"]["impersonation"] == 0
    # the seeds were a DNS name with three A records: every joiner resolved all three
    log = mesh.nodes[4].log()
    assert "joining through " + ", ".join(f"{mesh.subnet}.{i}:{PORT}" for i in (1, 2, 3)) in log
    # qosd exports the membership to Prometheus
    fetch = (f"import urllib.request; print(urllib.request.urlopen("
             f"'http://{mesh.nodes[0].ip}:9464/metrics', timeout=10).read().decode())")
    scrape = subprocess.run(
        ["ip", "netns", "exec", mesh.nodes[0].ns, "python3", "-c", fetch],
        capture_output=True, text=True, timeout=30, check=True).stdout
    assert 'mmmesh_cluster_members{state="alive"} 5.0' in scrape
    assert "mmmesh_cluster_probe_rtt_seconds_count" in scrape


def test_kill9_is_suspected_then_dead_everywhere(mesh: Mesh) -> None:
    healthy(mesh)
    victim = mesh.nodes[3]
    others = [n for n in mesh.nodes[:N] if n is not victim]
    t0 = time.monotonic()
    victim.kill()
    seen_suspect: set[str] = set()

    def all_dead() -> bool:
        views = mesh.views(others)
        seen_suspect.update(n for n, v in views.items() if v[victim.name] == "suspect")
        return all(v[victim.name] == "dead" for v in views.values())

    took = mesh.wait(all_dead, DETECT_BOUND_S + 5, "kill -9 detected", every=0.05)
    assert took <= DETECT_BOUND_S, (took, DETECT_BOUND_S)
    assert seen_suspect, "nobody was seen suspecting it first"
    assert time.monotonic() - t0 >= CFG.suspicion_min_s(N) * 0.8  # dead only after a suspicion
    # the rest stays whole
    assert all(v[n.name] == "alive" for v in mesh.views(others).values() for n in others)


def test_sigstop_is_suspected_and_refutes_after_sigcont(mesh: Mesh) -> None:
    healthy(mesh)
    before = deaths_declared(mesh)
    sleeper = mesh.nodes[2]
    others = [n for n in mesh.nodes[:N] if n is not sleeper]
    inc0 = others[0].get("/v1/cluster/members")["members"][2]["incarnation"]
    sleeper.signal(signal.SIGSTOP)
    try:
        mesh.wait(lambda: any(v[sleeper.name] == "suspect" for v in mesh.views(others).values()),
                  CFG.suspicion_min_s(N), "SIGSTOPped node suspected", every=0.05)
    finally:
        sleeper.signal(signal.SIGCONT)
    mesh.wait_converged(CFG.suspicion_max_s(N), mesh.names)
    assert deaths_declared(mesh) == before, "a paused node was declared dead"
    # it refuted: a higher incarnation everywhere
    assert all(m["incarnation"] > inc0 for n in others
               for m in n.get("/v1/cluster/members")["members"] if m["node"] == sleeper.name)


def test_partition_into_halves_and_heal(mesh: Mesh) -> None:
    healthy(mesh)
    left, right = [0, 1], [2, 3, 4]
    names = {i: mesh.nodes[i].name for i in range(N)}
    mesh.partition(left, right)
    try:
        def split() -> bool:
            views = mesh.views()
            return all(views[names[i]][names[j]] == "dead"
                       for side, other in ((left, right), (right, left))
                       for i in side for j in other) and \
                all(views[names[i]][names[j]] == "alive"
                    for side in (left, right) for i in side for j in side)

        mesh.wait(split, 2 * CFG.suspicion_max_s(N) + 5, "each half declares the other dead")
    finally:
        mesh.heal()
    took = mesh.wait_converged(4 * CFG.reconnect_interval_s + 2 * CFG.suspicion_max_s(N))
    assert took < 30


def test_one_percent_loss_no_false_deaths(mesh: Mesh) -> None:
    healthy(mesh)
    before = deaths_declared(mesh)
    mesh.set_loss(0.01)
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            assert all(s != "dead" for v in mesh.views().values() for s in v.values())
            time.sleep(0.5)
    finally:
        mesh.set_loss(0)
    assert deaths_declared(mesh) == before
    mesh.wait_converged(10)


def _outsider(mesh: Mesh, tmp: Path, name: str) -> MeshNode:
    from mmmeshctl.certs import issue_certs

    certs = tmp / f"{name}-ca"
    issue_certs(certs, [name], ca_name="another CA")
    return mesh.add_node(name, certs)


def test_untrusted_certificate_is_refused(mesh: Mesh, tmp_path: Path) -> None:
    healthy(mesh)
    rogue = _outsider(mesh, tmp_path, "rogue")
    try:
        time.sleep(4 * CFG.join_retry_s + 2)  # it tries to join, again and again
        assert rogue.members() == {"rogue": "alive"}  # it met nobody
        for node in mesh.nodes[:N]:
            assert "rogue" not in node.members()
        failures = rogue.get("/v1/cluster/members")["traffic"]["send_failures"]
        assert failures["unidentified"] > 0  # its TLS handshakes with the mesh all failed
    finally:
        rogue.kill()


def test_impersonation_is_dropped(mesh: Mesh, tmp_path: Path) -> None:
    """A member with a valid certificate for node-4 sends packets claiming to be
    node-1 (a Leave of node-1, an accusation of node-2): node-0 drops them and
    counts them; its view of node-1 and node-2 does not move."""
    healthy(mesh)
    target, liar = mesh.nodes[0], mesh.nodes[4]
    before = target.get("/v1/cluster/members")["traffic"]["dropped"]["impersonation"]
    script = (
        "import asyncio, grpc\n"
        "from qosd.mesh.membership.core import Dead, Leave, Packet\n"
        "from qosd.mesh.membership._wire import encode\n"
        "async def main():\n"
        f"    d = '{mesh.certs}/'\n"
        "    r = lambda p: open(d + p, 'rb').read()\n"
        "    creds = grpc.ssl_channel_credentials(r('ca.pem'), r('node-4.key'), r('node-4.pem'))\n"
        f"    async with grpc.aio.secure_channel('{target.addr}', creds, options=[\n"
        "            ('grpc.ssl_target_name_override', 'node-0')]) as ch:\n"
        "        call = ch.unary_unary('/mmmesh.peer.v1.Peer/Gossip')\n"
        f"        pkt = Packet('node-1', '{mesh.nodes[1].addr}', (Leave('node-1', 1000),\n"
        "                     Dead('node-2', 1000, 'node-1')))\n"
        "        for _ in range(3):\n"
        "            try:\n"
        "                await call(encode(pkt), timeout=5)\n"
        "                print('ACCEPTED')\n"
        "            except grpc.aio.AioRpcError as e:\n"
        "                print(e.code().name, e.details())\n"
        "asyncio.run(main())\n")
    out = subprocess.run(["ip", "netns", "exec", liar.ns, str(VENV_BIN / "python"), "-c", script],
                         check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("PERMISSION_DENIED impersonation") == 3, out.stdout
    after = target.get("/v1/cluster/members")["traffic"]["dropped"]["impersonation"]
    assert after == before + 3
    view = target.get("/v1/cluster/members")["members"]
    for m in view:
        if m["node"] in ("node-1", "node-2"):
            assert m["state"] == "alive" and m["incarnation"] < 1000, m


def test_a_node_started_before_its_seeds_joins_once_they_are_up(tmp_path: Path) -> None:
    """The joiner's first identification of each seed fails (nothing listens
    yet); that failure must not be remembered for long (it was cached a
    minute: the node stayed alone for a minute, CI saw it)."""
    require_privileged()
    with Mesh(4, tmp_path / "m", start=False) as m:
        early = m.nodes[3]  # not a seed
        early.start()
        early.wait_ready()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "joining through" not in early.log():
            time.sleep(0.1)
        time.sleep(1.5)  # its joins meet closed ports
        assert early.members() == {early.name: "alive"}
        for node in m.nodes[:3]:
            node.start()
        for node in m.nodes[:3]:
            node.wait_ready()
        took = m.wait_converged(20)
        assert took < 10, took
