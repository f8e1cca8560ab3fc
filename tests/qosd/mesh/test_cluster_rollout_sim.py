"""Mesh-wide policy rollout on whole meshes: real membership and rollout
cores on the virtual clock (qosd.mesh.rollout.core.simulation), each node's host
faked in-process (it localises and validates the policy, takes ``apply_s`` to
realise it, and fetches texts from its peers' cores).  The scripted,
input-by-input tests of the core are in tests/qosd/mesh/test_cluster_rollout.py."""

from __future__ import annotations

import os
import time

import pytest

from qosd.mesh.membership.core import AppBroadcast, Packet
from qosd.mesh.rollout.core import MeshVersion
from qosd.mesh.rollout.core.simulation import RolloutSimulation
from testkit.rollout_cases import POLICY, SLOW_LINK, SMALL, SMALLER, announce, report


def mesh(n: int, seed: int = 1, **kw: object) -> RolloutSimulation:
    rs = RolloutSimulation(n, seed=seed, **kw)  # type: ignore[arg-type]
    rs.form()
    rs.sim.run_until(rs.sim.now + 5)  # the joins' gossip settles
    return rs


def settle(rs: RolloutSimulation, v: MeshVersion, within: float,
           nodes: list[int] | None = None) -> float:
    """Run until ``v`` is applied (or NACKed) and fully reported everywhere;
    returns how long that took."""
    t0 = rs.sim.now
    end = rs.sim.run_while(lambda: not rs.converged(v, nodes), t0 + within, step=0.05)
    assert rs.converged(v, nodes), f"{v} did not converge within {within}s"
    return end - t0


def states(rs: RolloutSimulation, i: int, v: MeshVersion | None = None) -> dict[str, str]:
    return {r.node: r.state for r in rs.rollouts[i].table(v).rows}


def test_a_rollout_reaches_every_member_and_every_table() -> None:
    rs = mesh(20)
    ann = rs.propose(5, POLICY, author="alice")
    took = settle(rs, ann.version, 10)
    assert took < 3.0
    assert rs.applied == [ann.version] * 20
    for i in range(20):
        t = rs.rollouts[i].table()
        assert t.complete and t.count("acked") == 20 and t.version == ann.version
        assert t.as_dict()["author"] == "alice"
    assert sum(r.stats.realise_requests for r in rs.rollouts) == 20  # once each
    assert sum(r.stats.fetch_failures for r in rs.rollouts) == 0


def test_a_node_whose_link_is_too_slow_nacks_and_keeps_its_version() -> None:
    rs = mesh(12, links={3: SLOW_LINK})
    v1 = rs.propose(0, SMALL).version  # 153.2 Mbit/s of guarantees: fits 200mbit
    settle(rs, v1, 10)
    v2 = rs.propose(7, POLICY).version  # 253.2 Mbit/s: node-3 cannot
    settle(rs, v2, 10)
    assert rs.applied[3] == v1 and all(rs.applied[i] == v2 for i in range(12) if i != 3)
    for i in range(12):
        t = rs.rollouts[i].table()
        row = {r.node: r for r in t.rows}["node-3"]
        assert (row.state, row.applied) == ("nacked", v1), i
        assert "exceeds the link rate 200mbit" in row.reason
        assert t.count("acked") == 11 and t.complete
    realised = [(i, v, ok) for _, i, v, ok, _ in rs.realised if i == 3]
    assert realised == [(3, v1, True), (3, v2, False)]  # tried once: a NACK is final
    v3 = rs.propose(3, SMALLER).version  # a later good version is tried again
    settle(rs, v3, 10)
    assert rs.applied == [v3] * 12 and states(rs, 0)["node-3"] == "acked"


def test_concurrent_applies_on_two_nodes_converge_to_the_higher_version() -> None:
    rs = mesh(16)
    a = rs.propose(2, SMALL)
    b = rs.propose(11, SMALLER)  # the same instant: both take counter 1
    assert a.version == MeshVersion(1, "node-2") and b.version == MeshVersion(1, "node-11")
    winner = max(a.version, b.version)  # "node-2" > "node-11" as strings
    assert winner == a.version
    settle(rs, winner, 15)
    assert rs.applied == [winner] * 16
    lost = rs.rollouts[11].table(b.version)
    assert lost.superseded_by == winner and lost.complete
    assert {r.state for r in lost.rows} <= {"superseded", "acked", "nacked"}
    assert all(r.desired is not None and r.desired.version == winner for r in rs.rollouts)
    # never half-applied: each node ends on the winner, whatever it ran in between
    for i in range(16):
        seen = [v for _, j, v, ok, _ in rs.realised if j == i and ok]
        assert seen[-1] == winner and set(seen) <= {a.version, b.version}


def test_a_node_dead_during_the_rollout_gets_the_version_when_it_returns() -> None:
    rs = mesh(10)
    v1 = rs.propose(0, SMALL).version
    settle(rs, v1, 10)
    rs.crash(4)
    v2 = rs.propose(1, POLICY).version
    live = [i for i in range(10) if i != 4]
    settle(rs, v2, 40, live)  # complete only once node-4 is dead everywhere (gone)
    assert rs.applied[4] == v1 and all(states(rs, i)["node-4"] == "gone" for i in live)
    rs.restart(4)  # a new process: the store says v1
    t0 = rs.sim.now

    def acked_everywhere() -> bool:
        return all(states(rs, i).get("node-4") == "acked" for i in range(10))

    rs.sim.run_while(lambda: not acked_everywhere(), t0 + 30, step=0.1)
    assert rs.applied[4] == v2 and acked_everywhere()
    assert rs.sim.now - t0 < 10  # back alive (refuted) and acked
    assert rs.rollouts[4].stats.fetches <= 1  # the join's push-pull brought the text


def test_both_sides_of_a_partition_apply_then_the_winner_wins_everywhere() -> None:
    rs = mesh(10)
    left, right = list(range(5)), list(range(5, 10))
    rs.sim.partition([left, right])
    rs.sim.run_until(rs.sim.now + 40)  # each side declares the other dead
    x = rs.propose(1, SMALL).version  # 1@node-1
    y1 = rs.propose(8, SMALLER).version  # 1@node-8
    rs.sim.run_until(rs.sim.now + 1)
    y = rs.propose(8, POLICY).version  # 2@node-8: the right side applied twice
    settle(rs, x, 10, left)
    settle(rs, y, 10, right)
    assert (x, y1, y) == (MeshVersion(1, "node-1"), MeshVersion(1, "node-8"),
                          MeshVersion(2, "node-8"))
    rs.sim.heal()
    took = settle(rs, y, 90)
    assert rs.applied == [y] * 10 and took < 60
    assert all(rs.rollouts[i].table(x).superseded_by == y for i in range(10))


def test_a_rollout_under_one_percent_loss() -> None:
    rs = mesh(30, seed=3, loss=0.01)
    ann = rs.propose(17, POLICY)
    settle(rs, ann.version, 30)
    assert rs.applied == [ann.version] * 30 and rs.sim.dropped > 0


def test_hostile_packets_in_a_mesh_are_dropped_and_counted_everywhere() -> None:
    rs = mesh(8)
    bad = Packet("node-6", rs.sim.addrs[6], (
        AppBroadcast("node-6", "policy", 10**9, b"\x00garbage"),
        AppBroadcast("node-6", "ack/node-2", 10**9, report("node-2", MeshVersion(9, "node-2"),
                                                           POLICY).payload),
        AppBroadcast("node-6", "policy", 10**9 + 1, announce("node-5", 99).payload)))
    rs.sim.at(rs.sim.now, lambda: rs.sim._dispatch(0, rs.sim.nodes[0].handle(bad, rs.sim.now)))
    rs.sim.run_until(rs.sim.now + 5)
    # node-0 got all three; it gossiped on the two that were left once the later
    # "policy" replaced the first in its queue (one item per origin and key)
    assert rs.rollouts[0].stats.dropped == {"malformed": 1, "impersonation": 2}
    for i in range(1, 8):
        want = {} if i == 6 else {"impersonation": 2}  # no member hears its own gossip
        assert rs.rollouts[i].stats.dropped == want, i
    for r in rs.rollouts:
        assert r.desired is None and r.reports() == {}
    ann = rs.propose(3, SMALL)
    settle(rs, ann.version, 10)  # and the mesh still works


def test_time_to_all_ack_at_100_members() -> None:
    rs = RolloutSimulation(100, seed=1)
    rs.form(settle=60, join_rate=40)
    rs.sim.run_until(rs.sim.now + 10)
    t0 = rs.sim.now
    wall = time.perf_counter()
    ann = rs.propose(5, POLICY)
    v = ann.version
    rs.sim.run_while(lambda: not all(a == v for a in rs.applied), t0 + 30, step=0.05)
    applied = max(t for t, _, w, _, _ in rs.realised if w == v) - t0
    origin = rs.sim.run_while(lambda: not rs.answered(5, v), t0 + 60, step=0.05) - t0
    every = settle(rs, v, 60) + origin
    print(f"\n100 members: applied everywhere {applied:.2f}s, origin's table {origin:.2f}s, "
          f"every table {every:.2f}s (virtual; apply 0.1s); wall {time.perf_counter() - wall:.1f}s")
    assert applied < 3.0 and origin < 3.5 and every < 15.0


@pytest.mark.skipif(not os.environ.get("MMMESH_ROLLOUT_1000"),
                    reason="~10 min; set MMMESH_ROLLOUT_1000=1 (docs/cluster.md figures)")
@pytest.mark.timeout(1800)
def test_time_to_all_ack_at_1000_members() -> None:
    rs = RolloutSimulation(1000, seed=1)
    rs.form(settle=300, join_rate=40)
    rs.sim.run_until(rs.sim.now + 10)
    t0 = rs.sim.now
    v = rs.propose(5, POLICY).version
    rs.sim.run_while(lambda: not all(a == v for a in rs.applied), t0 + 60, step=0.25)
    applied = sorted(t - t0 for t, _, w, _, _ in rs.realised if w == v)
    origin = rs.sim.run_while(lambda: not rs.answered(5, v), t0 + 120, step=0.25) - t0
    every = settle(rs, v, 300) + origin
    print(f"\n1000 members: applied p50 {applied[500]:.2f}s p99 {applied[990]:.2f}s all "
          f"{applied[-1]:.2f}s, origin's table {origin:.2f}s, every table {every:.2f}s")
    assert applied[-1] < 15 and origin < 20
