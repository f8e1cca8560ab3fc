"""``GET /v1/cluster/sla``: the global SLA view of the mesh
(:mod:`qosd.mesh.slaview.core`), per class and modality over every node, and
on demand the per-node breakdown.

The route takes the view from the service it is given, through two methods
(:class:`ClusterSlaProvider`)::

    service.cluster_sla(nodes: bool) -> dict | None
    service.cluster_sla_breakdown(node: str | None) -> dict | None   (optional)

The first returns the aggregated view this node holds (per class, whatever
the fleet's size); the second asks each node (``node``: that one) for its
own part, now: ``?nodes=true`` and ``?node=X`` use it, and each row's
``breakdown`` lists the nodes' windows of that row.  A service without the
second (a view that holds every node itself) answers ``?nodes=true`` from
the first.  A service without the first, or answering None, gets ``503
{"error": "peers_not_enabled"}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from .errors import E422, ErrorBody, Responses, error_response

__all__ = ["ClusterSlaProvider", "ClusterSlaRow", "ClusterSlaView", "NodeSla",
           "add_cluster_sla_route", "with_breakdown"]

E503_PEERS: Responses = {503: {"model": ErrorBody, "description": "peers not enabled on this "
                               "node (error peers_not_enabled): no global view to show"}}

Ms = Annotated[float | None, Field(description="ms; null when no node sent a sketch (or "
                                               "quantile) for it")]


class ClusterSlaProvider(Protocol):
    """What the route asks of the service (optional: no method means 503)."""

    def cluster_sla(self, nodes: bool = True) -> dict[str, Any] | None:
        """The global view (``SlaTree.snapshot``), None when peers are off."""
        ...

    def cluster_sla_breakdown(self, node: str | None = None) -> dict[str, Any] | None:
        """Each node's part, asked now (``ClusterStore.sla_breakdown``)."""
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
    merged_in: dict[str, Any] | None = Field(
        default=None, description="the record that merged this window: {aggregator, epoch} "
                                  "(the node's own answer, on demand)")
    answered: bool = Field(
        default=True, description="false: the node (still a member) did not answer now; "
                                  "its last answer, aged and stale")


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
    age_s: float | None = Field(default=None, description="how old the newest window "
                                                          "merged is now")
    oldest_age_s: float | None = Field(default=None, description="how old the oldest window "
                                                                 "merged is now")
    stale: bool | None = Field(default=None, description="the record is older than "
                                                          "stale_windows: nothing of it is used")
    epoch: int | None = Field(default=None, description="the record's round (its root's count)")
    aggregator: str | None = Field(default=None, description="the member that published "
                                                             "the record (the class's root)")
    record_age_s: float | None = Field(default=None, description="since this node got it")
    breakdown: list[NodeSla] | None = Field(
        default=None, description="per node, by node id (?nodes=true: each node asked now; "
                                  "?node=X: that node's)")


class ClusterSlaView(BaseModel):
    """The body of ``GET /v1/cluster/sla``."""

    node: str = Field(description="the node that answers (every node merges the same way)")
    members: int = Field(description="cluster size as this node last saw it")
    nodes_known: int
    nodes_reporting: int = Field(description="nodes with at least one window not stale")
    nodes_with_sketches: int
    classes: list[ClusterSlaRow] = Field(description="per (class, modality), sorted")
    stages: list[ClusterSlaRow] = Field(description="per (stage, class, modality), sorted")
    counters: dict[str, int] = Field(description="the view's counters (sampled, accepted, "
                                                 "older, late, malformed, published, ...)")
    aggregation: dict[str, Any] | None = Field(
        default=None, description="how this node takes part: round, fan-out, per tree its "
                                  "depth, roles, root, record age")
    traffic: dict[str, int] | None = Field(default=None,
                                           description="the trees' messages in and out")
    breakdown_nodes: dict[str, Any] | None = Field(
        default=None, description="with a breakdown: nodes asked, answered, truncated")


def add_cluster_sla_route(v1: APIRouter, service: object) -> None:
    """Adds ``GET /cluster/sla`` to ``v1`` over ``service`` (a
    :class:`ClusterSlaProvider`, or anything else: then 503)."""

    @v1.get("/cluster/sla", response_model=ClusterSlaView, responses={**E422, **E503_PEERS},
            summary="the global SLA view: per class over every node, and on demand each "
                    "node's part", tags=["cluster"])
    async def get_cluster_sla(
        nodes: Annotated[bool, Query(description="include each row's per-node breakdown "
                                                 "(every node asked now, at most 64)")] = True,
        node: Annotated[str | None, Query(min_length=1, max_length=253,
                                          description="only this node's part (asked of it "
                                                      "now)")] = None,
    ) -> Any:
        provider = getattr(service, "cluster_sla", None)
        ask = getattr(service, "cluster_sla_breakdown", None)
        if provider is None:
            return _peers_not_enabled()
        if ask is None or not (nodes or node):
            view = await run_in_threadpool(provider, nodes)
            if view is None:
                return _peers_not_enabled()
            return ClusterSlaView.model_validate(view)
        view = await run_in_threadpool(provider, False)
        parts = await run_in_threadpool(ask, node)
        if view is None:
            return _peers_not_enabled()
        return ClusterSlaView.model_validate(with_breakdown(view, parts or {}))


def with_breakdown(view: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    """``view`` with each row's breakdown made of the nodes' own rows
    (``ClusterStore.sla_breakdown``), in node order."""
    by_row: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for node, rows in sorted((parts.get("nodes") or {}).items()):
        for r in rows:
            key = (r.get("stage"), r.get("sla_class"), r.get("modality"))
            by_row.setdefault(key, []).append(
                {k: v for k, v in r.items() if k not in ("stage", "sla_class", "modality")}
                | {"node": node})
    out = dict(view)
    for part in ("classes", "stages"):
        out[part] = [{**row, "breakdown": by_row.get(
            (row.get("stage"), row.get("sla_class"), row.get("modality")), [])}
            for row in view.get(part) or []]
    out["breakdown_nodes"] = {k: parts.get(k) for k in ("asked", "answered", "truncated")}
    return out


def _peers_not_enabled() -> JSONResponse:
    return error_response(503, "peers_not_enabled", "peers not enabled: this node is not part "
                          "of a mesh (peers in qosd.yaml), so there is no global SLA view; "
                          "GET /v1/sla has this node's")
