"""The gossip back end: today's peers, rollout host and SLA view behind the
:class:`~qosd.store.base.ClusterStore` interface (no change in
behaviour: qosd/mesh/rollout/host.py and qosd/mesh/slaview/host.py do the work)."""

from __future__ import annotations

from typing import Any

from qosd.mesh.membership.core import State
from qosd.mesh.rollout.core import MeshVersion

__all__ = ["GossipStore"]


class GossipStore:
    backend = "gossip"

    def __init__(self, peers: Any, service: Any) -> None:
        self.peers = peers
        self.service = service
        self.rollout_app: Any = None
        self.sla_app: Any = None

    async def start(self) -> None:
        from qosd.mesh.rollout.host import ClusterRollout  # mesh-wide policy (section "rollout")
        from qosd.mesh.slaview.host import ClusterSla  # the global SLA view (section "sla")

        svc = self.service
        self.sla_app = svc.cluster_sla_app = ClusterSla(self.peers, svc.sla_board,
                                                        svc.p99_targets)
        await self.sla_app.start()
        self.rollout_app = svc.cluster_rollout_app = ClusterRollout(self.peers, svc)
        await self.rollout_app.start()

    async def stop(self) -> None:
        for app in (self.rollout_app, self.sla_app):
            if app is not None:
                await app.stop()
        await self.peers.stop()  # a graceful leave: members mark this node left, not dead

    def rollout(self) -> Any:
        return self.rollout_app.provider if self.rollout_app is not None else None

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        return self.sla_app.snapshot(nodes) if self.sla_app is not None else None

    def members(self) -> dict[str, Any] | None:
        return None  # the route reads service.peers (qosd/api/cluster.py)

    def mesh_desired(self) -> MeshVersion | None:
        desired = self.rollout_app.rollout.desired if self.rollout_app is not None else None
        return desired.version if desired is not None else None

    def status(self) -> dict[str, Any]:
        members = self.peers.members()
        return {"backend": self.backend, "up": True,
                "members": sum(1 for m in members if m.state == State.ALIVE) + 1}

    def counters(self) -> dict[str, dict[str, int]]:
        return {}  # the peers' own collector has them (mmmesh_cluster_*)
