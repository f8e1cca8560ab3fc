"""``/v1/cluster/members``: how this node sees the mesh (qosd/mesh/membership).

Answered on the event loop from one snapshot of the membership core; 404
``not_found`` when qosd runs without a ``peers:`` section.  With the etcd back
end (qosd/store) the service answers ``cluster_members()`` in the same
shape: the nodes with a live lease, and those gone recently (``dead``, or
``left`` after a graceful stop).  Times are
seconds before the answer (``since_s``: in this state; ``last_ack_s``: this
node's last direct ack from the member), ``rtt_s`` the smoothed probe round
trip (None before the first direct ack).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..errors import NotFoundError
from ..model import Service
from .errors import E404

__all__ = ["ClusterMembers", "Member", "cluster_routes"]

StateName = Literal["alive", "suspect", "dead", "left"]


class Member(BaseModel):
    node: str
    addr: str = Field(description="where it takes packets ('' for a tombstone never met)")
    state: StateName
    incarnation: int
    since_s: float = Field(description="seconds in this state")
    last_ack_s: float | None = Field(description="seconds since this node's last direct ack")
    rtt_s: float | None = Field(description="smoothed probe round trip, seconds")


class ClusterMembers(BaseModel):
    node: str = Field(description="this node's id")
    addr: str
    incarnation: int
    health_score: int = Field(description="Lifeguard local health: 0 healthy .. 7")
    members: list[Member] = Field(description="every member known, this node included")
    stats: dict[str, int] = Field(description="the core's counters (probes, suspicions, "
                                  "refutations, deaths_declared, ...)")
    traffic: dict[str, dict[str, int]] = Field(
        description="packets and bytes by direction, dropped packets and send failures by "
        "reason (etcd: requests by kind, failures by error)")
    backend: Literal["gossip", "etcd"] = Field(
        default="gossip", description="the cluster store (etcd: members are the nodes with "
        "a live lease; incarnation is their member key's creation revision)")
    store: dict[str, Any] | None = Field(default=None, description="the store's status "
                                         "(etcd: up, revision, lease...)")

    @classmethod
    def of(cls, snap: dict[str, Any]) -> ClusterMembers:
        now = snap["now"]
        members = [Member(node=m.node, addr=m.addr, state=m.state.name.lower(),
                          incarnation=m.incarnation, since_s=round(now - m.since, 3),
                          last_ack_s=None if m.last_ack is None else round(now - m.last_ack, 3),
                          rtt_s=m.rtt_s)
                   for m in sorted(snap["members"], key=lambda m: m.node)]
        return cls(node=snap["node"], addr=snap["addr"], incarnation=snap["incarnation"],
                   health_score=snap["health_score"], members=members, stats=snap["stats"],
                   traffic={k: dict(snap[k]) for k in ("packets", "bytes", "dropped",
                                                       "send_failures")})


def cluster_routes(v1: APIRouter, service: Service) -> None:
    """Adds ``GET /cluster/members`` to ``v1``."""

    @v1.get("/cluster/members", response_model=ClusterMembers, responses={**E404},
            summary="the mesh as this node sees it: members, states, incarnations, RTT",
            tags=["cluster"])
    async def cluster_members() -> ClusterMembers:
        other = getattr(service, "cluster_members", None)  # a back end other than gossip
        body = await run_in_threadpool(other) if callable(other) else None
        if body is not None:
            return ClusterMembers.model_validate(body)
        peers = getattr(service, "peers", None)
        if peers is None:
            raise NotFoundError("this qosd is not in a mesh (qosd.yaml has no peers: section)")
        return ClusterMembers.of(peers.snapshot())
