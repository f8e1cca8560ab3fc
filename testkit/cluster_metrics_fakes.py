"""What the mesh's collectors read, for metrics tests without a mesh:
:class:`FakePeers` (``Peers.snapshot()`` for qosd/metrics/peers.py, advancing
like a running node's at every scrape), and real rollout cores (a
``RolloutSimulation`` on the virtual clock) and real SLA views wrapped as
qosd's applications for qosd/metrics/cluster_apps.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from qosd.mesh.membership._rtt import BUCKETS
from qosd.mesh.membership.core import MemberInfo, State
from qosd.mesh.rollout.core import LinkOverride
from qosd.mesh.slaview.core import SlaView, SlaViewConfig
from qosd.metrics.cluster_apps import ClusterAppsCollector
from qosd.metrics.peers import CORE_COUNTERS, PeersCollector

T = TypeVar("T")


class FakePeers:
    """``snapshot()`` of a node whose view has ``states`` (node -> state; this
    node is the first); each call is one more second of a running node:
    probes, RTTs (``rtt_s`` each), gossip bytes and ``dropped`` go up."""

    def __init__(self, states: dict[str, State], *, health: int = 0, cert_days: float = 300,
                 rtt_s: float = 0.0004, dropped: dict[str, int] | None = None) -> None:
        self.states = states
        self.health = health
        self.not_after = time.time() + cert_days * 86400
        self.rtt_s = rtt_s
        self.dropped = dict(dropped or {})
        self.calls = 0

    def on_loop(self, fn: Callable[[], T]) -> T:
        return fn()

    def snapshot(self) -> dict[str, Any]:
        self.calls += 1
        n = self.calls
        bounds = (*BUCKETS, float("inf"))
        first = next(i for i, le in enumerate(bounds) if self.rtt_s <= le)
        cumulative = [(le, 2 * n if i >= first else 0) for i, le in enumerate(bounds)]
        names = list(self.states)
        return {
            "node": names[0], "addr": f"{names[0]}:7946", "now": float(n),
            "incarnation": 1, "health_score": self.health,
            "members": [MemberInfo(m, f"{m}:7946", s, 1, 0.0, None, None)
                        for m, s in self.states.items()],
            "stats": {k: n * (i + 1) for i, k in enumerate(CORE_COUNTERS)},
            "queued_broadcasts": 0,
            "packets": {"in": 10 * n, "out": 11 * n}, "bytes": {"in": 900 * n, "out": 1000 * n},
            "dropped": {k: v * n for k, v in self.dropped.items()},
            "send_failures": {},
            "rate_limited_peers": 0, "channels": len(names) - 1,
            "rtt": (cumulative, 2 * n * self.rtt_s, 2 * n),
            "cert_not_after": self.not_after,
        }


def rollout_apps(n: int = 3, nack: tuple[int, ...] = (), policy: str | None = None,
                 propose: bool = True) -> list[Any]:
    """``n`` real rollout cores after node 0 rolled out ``policy`` (default
    examples/policy.yaml: 253 Mbit/s of guarantees) and every node answered
    (without ``propose``: a formed mesh that never rolled anything out); the
    nodes in ``nack`` have a 100 Mbit/s link, so they NACK and stay behind.
    Each wrapped as qosd's ClusterRollout is (``rollout``, ``peers``)."""
    from pathlib import Path

    from qosd.mesh.rollout.core.simulation import RolloutSimulation

    text = policy or (Path(__file__).resolve().parent.parent / "examples" / "policy.yaml"
                      ).read_text()
    rs = RolloutSimulation(n, seed=3, links={i: LinkOverride(None, 100_000_000) for i in nack})
    rs.form()
    rs.sim.run_until(rs.sim.now + 5)
    if propose:
        v = rs.propose(0, text).version
        rs.sim.run_while(lambda: not rs.converged(v), rs.sim.now + 30, step=0.25)
        assert rs.converged(v), "the simulated rollout did not settle"
    loop = SimpleNamespace(on_loop=lambda fn: fn())
    return [SimpleNamespace(rollout=core, peers=loop) for core in rs.rollouts]


def sla_app(board: Any, node: str = "node-a", members: int = 3,
            targets: dict[str, float] | None = None) -> Any:
    """A real SlaView holding ``board``'s windows, as qosd's ClusterSla is."""
    view = SlaView(node, SlaViewConfig())
    view.local_windows(board.view(), 0.0, wall=time.time(), members=members)
    return SimpleNamespace(view=view, snapshot=lambda nodes=True: view.snapshot(
        1.0, targets if targets is not None else {"voice": 120.0}, nodes=nodes))


def cluster_collectors(peers: FakePeers, rollout: Any = None, sla: Any = None
                       ) -> tuple[PeersCollector, ClusterAppsCollector]:
    """The two collectors qosd registers with a ``peers:`` section."""
    return PeersCollector(peers), ClusterAppsCollector(rollout, sla)
