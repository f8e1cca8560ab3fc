"""The cluster store: one interface in qosd, two back ends.

    gossip   the peers (qosd/mesh/membership) carry the rollout and the SLA view (its
             per-class aggregation trees): nothing to install (docs/cluster.md)
    etcd     etcd holds the mesh's policy versions, every node's report, its SLA
             windows and the per-class aggregates under leased keys (etcd/)

The API's facade (qosd/service.py) and the SLA controller only see
:class:`ClusterStore`; the routes' JSON shapes are the same whichever back
end answers.  Both back ends realise a mesh version through
qosd/mesh/rollout/realise.py.
"""

from __future__ import annotations

from typing import Any, Protocol

from qosd.mesh.rollout.core import MeshVersion

__all__ = ["ClusterStore"]


class ClusterStore(Protocol):
    backend: str
    """"gossip" or "etcd"."""

    async def start(self) -> None:
        """Starts on qosd's event loop (never waits for the store to answer)."""

    async def stop(self) -> None:
        """Leaves the mesh gracefully (members see this node left, not failed)."""

    def rollout(self) -> Any:
        """``propose(text, base_version, author)`` / ``table(version)``: the
        provider of PUT /v1/cluster/policy and GET /v1/cluster/rollout."""

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        """The global SLA view (GET /v1/cluster/sla): per class the aggregate
        of every node's windows this node holds (O(classes) whatever the
        fleet).  ``nodes``: each row's ``breakdown`` lists the record(s) the
        row comes from, as this node holds them (one part, named by the member
        or key that published it: its ``age_s`` and ``stale`` are what the SLA
        controller's staleness guard reads); never asks another node."""

    def sla_breakdown(self, node: str | None) -> dict[str, Any] | None:
        """The per-node breakdown, asked on demand: each node's own part of
        the view (``node``: that one; None: every member, up to a bound).
        ``{"nodes": {node: [rows]}, "asked", "answered", "truncated"}``."""

    def members(self) -> dict[str, Any] | None:
        """The body of GET /v1/cluster/members; None: the route reads the
        peers (the gossip back end's membership, which the facade is given)."""

    def mesh_desired(self) -> MeshVersion | None:
        """The mesh version this node should run (node-local applies are refused)."""

    def suspect_share(self) -> float:
        """The share of the live members (alive or suspect) that are suspected,
        0 .. 1, for the SLA controller's input (etcd: 0, it suspects nobody)."""

    def status(self) -> dict[str, Any]:
        """``{"backend", "up", ...}``: the ``cluster`` part of GET /v1/status."""

    def counters(self) -> dict[str, dict[str, int]]:
        """For metrics: ``operations``, ``requests`` and ``failures`` by name."""
