"""The etcd back end without qosd: the client (qosd.store.etcd.client) and the node
(qosd.store.cluster.EtcdNode) against a real 3-member etcd on loopback
(testkit/etcd_cluster.py), with "lightweight" nodes whose realiser answers at
once, as bench/etcd_rollout.py runs them.

* the generated etcd code is fresh, and the client's calls work (CAS, leases,
  watches, compaction);
* proposals are compare-and-swap transactions: a stale base is a conflict,
  versions are numbered without gaps, the history is bounded;
* compaction past a watcher's revision makes it list everything again, and
  it ends on the latest version (no lost update);
* a node that stops renewing its lease is gone (dead) once it expires; one
  that stops gracefully is gone (left) at once;
* the ``cluster:`` section's checks and the store's metrics.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mmmesh.policy import parse_policy
from qosd.mesh.rollout.core import NO_VERSION, MeshVersion, RolloutConflict
from qosd.store.cluster import EtcdNode, StoreCollector
from qosd.store.etcd.client import (
    Compacted,
    EtcdClient,
    EtcdConfig,
    cmp_version,
    op_put,
    op_range,
)
from qosd.store.etcd.keys import HISTORY, Layout
from testkit.etcd_cluster import ETCD, EtcdCluster

ROOT = Path(__file__).resolve().parents[3]
T = TypeVar("T")
POLICY = parse_policy((ROOT / "examples" / "policy.yaml").read_text()).to_yaml()
pytestmark = pytest.mark.timeout(120)


class Loop:
    """An event loop in a thread: the nodes live there, the test calls in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Light:
    """A lightweight node: it runs whatever it is told at once."""

    def __init__(self, name: str, etcd: EtcdCluster, prefix: str, ttl: int = 2) -> None:
        self.applied: MeshVersion | None = None
        self.realised: list[MeshVersion] = []

        def realise(v: MeshVersion, text: str, author: str) -> tuple[bool, str]:
            self.applied = v
            self.realised.append(v)
            return True, ""

        self.node = EtcdNode(name, EtcdClient(EtcdConfig(tuple(etcd.endpoints))), Layout(prefix),
                             realiser=realise, applied=lambda: self.applied, lease_ttl_s=ttl,
                             watch_sla=False)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    if not Path(ETCD).exists():
        pytest.fail("etcd is not installed (scripts/bootstrap.sh installs etcd-server)")
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def wait(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def start(loop: Loop, nodes: list[Light]) -> None:
    for n in nodes:
        loop.run(n.node.start())
    wait(lambda: all(n.node.up for n in nodes), 10, "every node watching")


def test_generated_code_is_fresh() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_etcd_proto.py"), "--check"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from qosd.store.etcd.client.pb import rpc_pb2

    services = set(rpc_pb2.DESCRIPTOR.services_by_name)
    assert {"KV", "Watch", "Lease", "Cluster", "Maintenance", "Auth"} <= services
    assert rpc_pb2.DESCRIPTOR.package == "etcdserverpb"  # etcd's method names on the wire


def test_client_cas_lease_watch_compaction(etcd: EtcdCluster, loop: Loop) -> None:
    async def go() -> None:
        async with EtcdClient(EtcdConfig(tuple(etcd.endpoints))) as c:
            rev = await c.put(b"/c/a", b"1")
            first = await c.txn([cmp_version(b"/c/new", 0)], [op_put(b"/c/new", b"x")],
                                [op_range(b"/c/new")])
            again = await c.txn([cmp_version(b"/c/new", 0)], [op_put(b"/c/new", b"y")],
                                [op_range(b"/c/new")])
            assert first.succeeded and not again.succeeded
            assert again.ranges[0][0].value == b"x"
            lease = await c.lease_grant(5)
            await c.put(b"/c/leased", b"v", lease)
            assert await c.lease_keepalive(lease) > 0
            w = await c.watch([b"/c/"], rev + 1)
            seen = [e.kv.key for e in (await w.next(5))[1]]
            assert seen[0] == b"/c/new"
            w.cancel()
            await c.lease_revoke(lease)
            assert (await c.get(b"/c/leased"))[1] is None
            top = await c.put(b"/c/b", b"2")
            await c.compact(top)
            w = await c.watch([b"/c/"], rev + 1)
            with pytest.raises(Compacted):
                await w.next(5)
            w.cancel()
            with pytest.raises(Compacted):
                await c.range_prefix(b"/c/", revision=rev)

    loop.run(go())


def test_proposals_are_compare_and_swap(etcd: EtcdCluster, loop: Loop) -> None:
    a, b = Light("a", etcd, "/cas/"), Light("b", etcd, "/cas/")
    start(loop, [a, b])
    t = loop.run(a.node.propose(POLICY, NO_VERSION, "alice"))
    v1 = t.version
    assert v1 == MeshVersion(1, "a") and t.count("pending") == 2
    with pytest.raises(RolloutConflict):  # based on "no version yet": stale
        loop.run(b.node.propose(POLICY, NO_VERSION, "bob"))
    assert loop.run(b.node.propose(POLICY, v1, "bob")).version == MeshVersion(2, "b")

    async def race() -> list[Any]:  # two edits on the same base: one wins, one is refused
        return list(await asyncio.gather(a.node.propose(POLICY, MeshVersion(2, "b"), "a"),
                                    b.node.propose(POLICY, MeshVersion(2, "b"), "b"),
                                    return_exceptions=True))

    outcome = loop.run(race())
    assert sorted(type(o).__name__ for o in outcome) == ["RolloutConflict", "RolloutTable"]
    for _ in range(HISTORY + 5):  # no base: always the next counter
        loop.run(a.node.propose(POLICY, None, "a"))
    last = loop.run(a.node.table()).version
    assert last is not None and last.counter == 3 + HISTORY + 5
    kept = etcd.ctl("get", "--prefix", "/cas/policy/versions/", "--keys-only").split()
    assert len(kept) == HISTORY
    wait(lambda: a.applied == last and b.applied == last, 10, "both on the last version")
    wait(lambda: loop.run(a.node.table()).complete, 10, "the table complete")
    for n in (a, b):
        loop.run(n.node.stop())


def test_compaction_past_a_watchers_revision_relists(etcd: EtcdCluster, loop: Loop) -> None:
    a, late = Light("a", etcd, "/cmp/"), Light("late", etcd, "/cmp/", ttl=30)
    start(loop, [a, late])
    loop.run(a.node.propose(POLICY, None, "a"))
    wait(lambda: late.applied is not None, 10, "late on version 1")
    loop.run(late.node.stop(leave=False))  # away: its watch ends at this revision
    seen = late.node.mirror.revision
    for _ in range(3):
        loop.run(a.node.propose(POLICY, None, "a"))
    etcd.compact()  # past the late node's revision
    relists = late.node.counters.get("relists_compacted", 0)
    loop.run(late.node.start())  # watches again from `seen` + 1: compacted
    wait(lambda: late.applied == MeshVersion(4, "a"), 15, "late on the latest version")
    assert late.node.counters["relists_compacted"] == relists + 1
    assert late.node.mirror.revision > seen
    # it skipped what it missed (2 and 3), and never realised anything twice
    assert late.realised == [MeshVersion(1, "a"), MeshVersion(4, "a")]
    for n in (a, late):
        loop.run(n.node.stop())


def test_a_lease_that_expires_marks_the_node_gone(etcd: EtcdCluster, loop: Loop) -> None:
    a, dead, left = (Light(n, etcd, "/lease/") for n in ("a", "dead", "left"))
    start(loop, [a, dead, left])
    wait(lambda: len(a.node.mirror.members) == 3, 5, "three members")

    def state(node: str) -> str | None:
        infos = a.node.mirror.member_infos(time.monotonic(), time.time())
        return next((m.state.name for m in infos if m.node == node), None)

    loop.run(left.node.stop(leave=True))  # graceful: gone at once, as left
    assert wait(lambda: state("left") == "LEFT", 2, "left") < 1
    loop.run(dead.node.stop(leave=False))  # as a kill -9: the lease runs out (ttl 2 s)
    took = wait(lambda: state("dead") == "DEAD", 10, "dead")
    assert 0.5 < took < 2 + 2.5, took
    loop.run(a.node.propose(POLICY, None, "a"))
    wait(lambda: loop.run(a.node.table()).complete, 10, "table complete")
    rows = {r.node: r.state for r in loop.run(a.node.table()).rows}
    assert rows == {"a": "acked", "dead": "gone", "left": "gone"}
    loop.run(a.node.stop())


def test_the_cluster_section() -> None:
    from pydantic import ValidationError

    from qosd.config import QosdConfig

    ok = QosdConfig.model_validate(
        {"cluster": {"backend": "etcd", "etcd": {"endpoints": ["etcd:2379"]}}})
    assert ok.cluster is not None and ok.cluster.etcd is not None
    assert ok.cluster.etcd.prefix == "/mmmesh/" and ok.cluster.etcd.lease_ttl_s == 10
    bad: list[dict[str, Any]] = [
        {"backend": "etcd"},  # no etcd section
        {"backend": "etcd", "etcd": {"endpoints": []}},
        {"backend": "etcd", "etcd": {"endpoints": ["etcd"]}},  # no port
        {"backend": "etcd", "etcd": {"endpoints": ["etcd:2379"], "cert_file": "/c.pem"}},
        {"backend": "zookeeper"},
    ]
    for section in bad:
        with pytest.raises(ValidationError):
            QosdConfig.model_validate({"cluster": section})
    with pytest.raises(ValidationError, match="peers"):
        QosdConfig.model_validate({
            "cluster": {"backend": "etcd", "etcd": {"endpoints": ["etcd:2379"]}},
            "peers": {"listen": "10.0.0.1:7946", "cert_file": "/c", "key_file": "/k",
                      "ca_file": "/ca"}})


def test_the_store_collector() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    class Fake:
        backend = "etcd"

        def status(self) -> dict[str, Any]:
            return {"up": False}

        def counters(self) -> dict[str, dict[str, int]]:
            return {"operations": {"relists_compacted": 2}, "requests": {"put": 5},
                    "failures": {"Unavailable": 1}}

    reg = CollectorRegistry()
    reg.register(StoreCollector(Fake()))
    text = generate_latest(reg).decode()
    assert 'mmmesh_cluster_store_up{backend="etcd"} 0.0' in text
    assert 'mmmesh_cluster_store_operations_total{op="relists_compacted"} 2.0' in text
    assert 'mmmesh_cluster_store_requests_total{kind="put"} 5.0' in text
    assert 'mmmesh_cluster_store_request_failures_total{error="Unavailable"} 1.0' in text
