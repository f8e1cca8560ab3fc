"""``GET /v1/cluster/sla``: the global SLA view of the mesh
(:mod:`qosd.mesh.slaview.core`), per class and modality over every node, with
the per-node breakdown.

The route takes the view from the service it is given, through one method
(:class:`ClusterSlaProvider`)::

    service.cluster_sla(nodes: bool) -> dict | None

which returns ``SlaView.snapshot(now, targets, nodes=nodes)`` (taken under
whatever lock the peer host keeps), or None while the peers are configured
but not running.  A service without that method (peers not built or not
enabled) or answering None gets ``503 {"error": "peers_not_enabled"}``, so
the route works before and after the transport is wired.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from .errors import E422, ErrorBody, Responses, error_response

__all__ = ["ClusterSlaProvider", "ClusterSlaRow", "ClusterSlaView", "NodeSla",
           "add_cluster_sla_route"]

E503_PEERS: Responses = {503: {"model": ErrorBody, "description": "peers not enabled on this "
                               "node (error peers_not_enabled): no global view to show"}}

Ms = Annotated[float | None, Field(description="ms; null when no node sent a sketch (or "
                                               "quantile) for it")]


class ClusterSlaProvider(Protocol):
    """What the route asks of the service (optional: no method means 503)."""

    def cluster_sla(self, nodes: bool = True) -> dict[str, Any] | None:
        """The global view (``SlaView.snapshot``), None when peers are off."""
        ...


class NodeSla(BaseModel):
    """One node's latest window of a row."""

    node: str
    seq: int = Field(description="the node's publication number (last writer wins)")
    frames: int
    deadline_misses: int
    attainment: float = Field(description="1 - deadline_misses / frames (1.0 without frames)")
    p99_ms: Ms
    quantiles: Literal["sketch", "digest"] | None = Field(
        description="where p99_ms comes from: the node's sketch (merged into the row), or "
                    "only its digest (the row is partial)")
    window_s: float
    age_s: float = Field(description="how old the window is now")
    sketch_age_s: float | None = Field(description="how old the sketch used is")
    stale: bool = Field(description="older than stale_windows x max(window, digest "
                                    "interval): listed, not merged")


class ClusterSlaRow(BaseModel):
    """One (class, modality), or (stage, class, modality), over every node."""

    stage: str | None = Field(default=None, description="absent in the class rows")
    sla_class: str
    modality: str
    frames: int = Field(description="sum over the nodes reporting (not stale)")
    deadline_misses: int
    attainment: float = Field(description="1 - deadline_misses / frames (1.0 without frames)")
    window_s: float
    p50_ms: Ms
    p99_ms: Ms = Field(description="from the sum of the nodes' DDSketches (never an average "
                                   "of percentiles), over sketch_nodes of the nodes")
    p999_ms: Ms
    p99_range_ms: list[float] | None = Field(
        description="[lowest, highest] p99 of the parts (the merged sketch, and each node "
                    "known by its digest only): the p99 of them all lies within")
    target_p99_ms: float | None = Field(description="the class's p99 objective, if any")
    meets_target: bool | None = Field(description="p99_ms <= target_p99_ms (null: unknown)")
    nodes: int = Field(description="nodes reporting this row (not stale)")
    sketch_nodes: int = Field(description="of which with a sketch fresh enough")
    sketch_frames: int = Field(description="frames the merged sketch holds")
    partial: bool = Field(description="some node reporting has no sketch in the quantiles")
    stale_nodes: int
    breakdown: list[NodeSla] | None = Field(default=None,
                                            description="per node, by node id (?nodes=true)")


class ClusterSlaView(BaseModel):
    """The body of ``GET /v1/cluster/sla``."""

    node: str = Field(description="the node that answers (every node merges the same way)")
    members: int = Field(description="cluster size as this node last saw it")
    nodes_known: int
    nodes_reporting: int = Field(description="nodes with at least one window not stale")
    nodes_with_sketches: int
    classes: list[ClusterSlaRow] = Field(description="per (class, modality), sorted")
    stages: list[ClusterSlaRow] = Field(description="per (stage, class, modality), sorted")
    counters: dict[str, int] = Field(description="the view's counters (published, received, "
                                                 "accepted, older, malformed, from_gone, ...)")


def add_cluster_sla_route(v1: APIRouter, service: object) -> None:
    """Adds ``GET /cluster/sla`` to ``v1`` over ``service`` (a
    :class:`ClusterSlaProvider`, or anything else: then 503)."""

    @v1.get("/cluster/sla", response_model=ClusterSlaView, responses={**E422, **E503_PEERS},
            summary="the global SLA view: per class over every node, with the per-node "
                    "breakdown", tags=["cluster"])
    async def get_cluster_sla(
        nodes: Annotated[bool, Query(description="include each row's per-node "
                                                 "breakdown")] = True,
    ) -> Any:
        provider = getattr(service, "cluster_sla", None)
        view = None if provider is None else await run_in_threadpool(provider, nodes)
        if view is None:
            return _peers_not_enabled()
        return ClusterSlaView.model_validate(view)


def _peers_not_enabled() -> JSONResponse:
    return error_response(503, "peers_not_enabled", "peers not enabled: this node is not part "
                          "of a mesh (peers in qosd.yaml), so there is no global SLA view; "
                          "GET /v1/sla has this node's")
