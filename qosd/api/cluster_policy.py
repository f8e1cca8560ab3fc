"""``/v1/cluster/...`` policy routes: start a mesh-wide rollout, read its table.

    PUT /v1/cluster/policy            {"yaml", "base_version", "author"}
                                      -> 202 the rollout table of the new mesh version
    GET /v1/cluster/rollout           the rollout table of the desired mesh version
    GET /v1/cluster/rollout?version=12@node-a   ... of that version (it may have lost)

The routes take their provider from the service at each request:
``service.cluster_rollout()`` returns a
:class:`qosd.mesh.rollout.provider.RolloutProvider` (``propose``, ``table``), or
None while this qosd has no peers (then 503 ``peers_not_enabled``).  A
provider that has not exchanged state with any peer yet refuses to propose
(503 ``not_synced``: retry in a few seconds).  docs/cluster.md ("Policy
rollout") says what the table's states mean.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from qosd.mesh.membership.core import ClusterError
from qosd.mesh.rollout.core import NotSynced, RolloutConflict

from ..model import Service
from .errors import E413, E422, ErrorBody, Responses, error_response
from .models import Author, PolicyYaml

__all__ = ["RolloutProviderLike", "add_cluster_policy_routes"]

_VERSION = r"^[1-9][0-9]{0,15}@\S{1,253}$"
MeshVersionText = Annotated[str, Field(
    pattern=_VERSION, max_length=270,
    description='a mesh version, "<counter>@<origin node>", e.g. "12@node-a"')]
BaseMeshVersion = Annotated[str | None, Field(
    pattern=r"^(0|[1-9][0-9]{0,15}@\S{1,253})$", max_length=270,
    description='the mesh version this edit is based on ("0": none yet); refused with 409 '
                "when the desired version differs.  null: no check")]


class ClusterApplyBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"yaml": "apiVersion: mmmesh/v1\nlink: {device: eth0, rate: 1gbit}\nclasses:\n"
                 "  - {name: voice, id: 11, match: {modalities: [audio]}, rate: 1.2mbit}\n"
                 "  - {name: best-effort, id: 14, rate: 20mbit}\n"
                 "default_class: best-effort\n",
         "base_version": None, "author": "alice"}]})

    yaml: PolicyYaml
    base_version: BaseMeshVersion = None
    author: Author = None


class RolloutRow(BaseModel):
    node: str
    state: Literal["pending", "acked", "nacked", "superseded", "gone"]
    member: str = Field(description="ALIVE | SUSPECT | DEAD | LEFT, as this node sees it")
    version: str | None = Field(description="the mesh version the node last reported on")
    applied: str | None = Field(description="the mesh version the node runs")
    reason: str = Field(description="why it NACKed (empty otherwise)")
    time: float | None = Field(description="the node's clock when it reported (unix s)")


class RolloutTableBody(BaseModel):
    node: str = Field(description="the node answering")
    version: str = Field(description="the mesh version this table is about")
    desired: str | None = Field(description="the highest mesh version this node knows")
    superseded_by: str | None = Field(description="set when `version` lost to `desired`")
    sha256: str | None = Field(description="of the version's canonical YAML (when desired)")
    author: str | None
    proposed_at: float | None = Field(description="the origin's clock (unix s)")
    complete: bool = Field(description="every live member answered (or the version lost)")
    live: int = Field(description="members not gone: the denominator")
    counts: dict[str, int] = Field(description="rows per state")
    rows: list[RolloutRow]


class RolloutProviderLike(Protocol):
    """What ``service.cluster_rollout()`` returns (qosd.mesh.rollout.provider.RolloutProvider)."""

    def propose(self, text: str, base_version: str | None = None,
                author: str | None = None) -> dict[str, Any]: ...
    def table(self, version: str | None = None) -> dict[str, Any] | None: ...


def _declare(status: int, description: str) -> Responses:
    return {status: {"model": ErrorBody, "description": description}}


E404_ROLLOUT = _declare(404, "no mesh policy version yet")
E409_ROLLOUT = _declare(409, "base_version is not the desired mesh version")
E503_PEERS = _declare(503, "peers not enabled (peers_not_enabled), or not yet in touch with "
                           "the mesh (not_synced)")


class _Unavailable(Exception):
    pass


def add_cluster_policy_routes(v1: APIRouter, service: Service) -> None:
    """Adds ``PUT /cluster/policy`` and ``GET /cluster/rollout`` to ``v1`` over
    ``service`` (its optional ``cluster_rollout()``; without it: 503)."""

    def provider() -> RolloutProviderLike:
        get = getattr(service, "cluster_rollout", None)
        found = get() if callable(get) else None
        if found is None:
            raise _Unavailable
        return found  # type: ignore[no-any-return]

    def unavailable() -> Any:
        return error_response(503, "peers_not_enabled", "peers not enabled: this qosd is not "
                              "part of a mesh (see docs/cluster.md)")

    @v1.put("/cluster/policy", status_code=202, response_model=RolloutTableBody,
            responses={**E409_ROLLOUT, **E413, **E422, **E503_PEERS},
            summary="roll a policy out to every member of the mesh", tags=["cluster"])
    async def put_cluster_policy(body: ClusterApplyBody) -> Any:
        try:
            p = provider()
            return await run_in_threadpool(p.propose, body.yaml, body.base_version, body.author)
        except _Unavailable:
            return unavailable()
        except RolloutConflict as e:
            return error_response(409, "conflict", str(e))
        except NotSynced as e:
            return error_response(503, "not_synced", str(e))
        except ClusterError as e:
            return error_response(422, "invalid_request", str(e), errors=[["body", str(e)]])

    @v1.get("/cluster/rollout", response_model=RolloutTableBody,
            responses={**E404_ROLLOUT, **E422, **E503_PEERS},
            summary="the rollout table: every member's answer to a mesh version",
            tags=["cluster"])
    async def get_cluster_rollout(
        version: Annotated[MeshVersionText | None, Query(
            description="default: the desired mesh version")] = None,
    ) -> Any:
        try:
            table = await run_in_threadpool(provider().table, version)
        except _Unavailable:
            return unavailable()
        if table is None:
            return error_response(404, "not_found", "no mesh policy version yet "
                                  "(mmmeshctl policy apply --cluster)")
        return table
