"""The gossip back end: the peers, the rollout host and the SLA view behind
the :class:`~qosd.store.base.ClusterStore` interface (no change in
behaviour: qosd/mesh/rollout/host.py and qosd/mesh/slaview/host.py do the
work; qosd/store/cluster.py builds them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qosd.mesh.membership.core import State
from qosd.mesh.rollout.core import MeshVersion

if TYPE_CHECKING:
    from qosd.mesh.membership.peers import Peers
    from qosd.mesh.rollout.host import ClusterRollout
    from qosd.mesh.rollout.provider import RolloutProvider
    from qosd.mesh.slaview.host import ClusterSla

__all__ = ["GossipStore"]


class GossipStore:
    backend = "gossip"

    def __init__(self, peers: Peers, rollout_app: ClusterRollout, sla_app: ClusterSla) -> None:
        """``peers`` started; the two applications built on them, started by :meth:`start`."""
        self.peers = peers
        self.rollout_app = rollout_app
        self.sla_app = sla_app

    async def start(self) -> None:
        await self.sla_app.start()  # the global SLA view (section "sla")
        await self.rollout_app.start()  # mesh-wide policy (section "rollout")

    async def stop(self) -> None:
        for app in (self.rollout_app, self.sla_app):
            await app.stop()
        await self.peers.stop()  # a graceful leave: members mark this node left, not dead

    def rollout(self) -> RolloutProvider:
        return self.rollout_app.provider

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        return self.sla_app.snapshot(nodes)

    def sla_breakdown(self, node: str | None) -> dict[str, Any] | None:
        return self.sla_app.breakdown(node)

    def members(self) -> dict[str, Any] | None:
        return None  # the route reads the peers (qosd/api/cluster.py)

    def mesh_desired(self) -> MeshVersion | None:
        desired = self.rollout_app.rollout.desired
        return desired.version if desired is not None else None

    def suspect_share(self) -> float:
        live = [m for m in self.peers.members()
                if str(getattr(m.state, "name", m.state)).lower() in ("alive", "suspect")]
        suspect = sum(1 for m in live if str(getattr(m.state, "name", m.state)).lower()
                      == "suspect")
        return suspect / max(1, len(live))

    def status(self) -> dict[str, Any]:
        members = self.peers.members()
        return {"backend": self.backend, "up": True,
                "members": sum(1 for m in members if m.state == State.ALIVE) + 1}

    def counters(self) -> dict[str, dict[str, int]]:
        return {}  # the peers' own collector has them (mmmesh_cluster_*)
