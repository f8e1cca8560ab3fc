"""The two FastAPI apps over one service: the admin API (:func:`create_app`)
and the report-only SLA API for sidecars (:func:`create_sla_app`).  Both take
``POST /v1/sla`` through the one route :func:`_add_sla_report` adds.

Routes call the synchronous service in a worker thread; what it raises is
answered by qosd/api/errors.py, and qosd/api/guard.py wraps each app.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from mmmesh.sla.report import SlaAccepted, SlaReport, SlaView

from ..errors import NotFoundError
from ..identity import ADMIN, ReportRefused, Sender, peer_of
from ..model import Service
from .cluster import cluster_routes
from .cluster_policy import add_cluster_policy_routes
from .cluster_sla import add_cluster_sla_route
from .errors import (
    E401,
    E404,
    E409,
    E413,
    E422,
    E500,
    E503,
    REQUEST_HANDLERS,
    SERVICE_HANDLERS,
    ErrorBody,
    Responses,
    error_response,
    install_handlers,
)
from .guard import Guard, documents_bearer
from .models import (
    MAX_VERSION,
    ApplyBody,
    ApplyResult,
    DiffResult,
    Flow,
    Health,
    History,
    PolicyDocument,
    RollbackBody,
    Status,
    TopFlows,
    ValidateResult,
    VersionInfo,
    YamlBody,
)

log = logging.getLogger(__name__)

API_VERSION = "1"


E403: Responses = {403: {"model": ErrorBody, "description": "this sender may not report (that "
                          "stage); the message says why (sla_reporters in qosd.yaml)"}}
E429: Responses = {429: {"model": ErrorBody, "description": "rate or quota of this sender "
                          "(sla_limits); Retry-After says when to try again"}}


async def _on_report_refused(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ReportRefused)
    headers = None
    if exc.retry_after is not None:
        headers = {"retry-after": str(max(1, round(exc.retry_after)))}
    extra: dict[str, Any] = {}
    if exc.status == 422:  # "reports[0].frames: ..." (the API's own 422s name body.<field>)
        where, sep, why = str(exc).partition(": ")
        extra["errors"] = [[f"body.{where}" if sep else "body", why or where]]
    return error_response(exc.status, exc.code, str(exc), headers=headers, **extra)


def _add_sla_report(router: APIRouter, service: Service, *, trusted: bool) -> None:
    """Adds ``POST /sla`` (a sidecar's report) to ``router``: the one handler of
    it, for the admin API (``trusted``: the sender is the admin socket) and the
    report-only socket (the sender comes from the connection's credentials,
    which the transport puts in the scope; none: 403).  The sender is known,
    and refused when it may report nothing, before the body is validated.
    The app needs :data:`SLA_HANDLERS` installed."""

    async def sender(request: Request) -> Sender:
        if trusted:
            return ADMIN
        peer = peer_of(request.scope)
        if peer is None:
            raise ReportRefused(403, "no_peer_credentials", "this connection carries no peer "
                                "credentials: reports are taken on qosd's unix socket only")
        return await run_in_threadpool(service.sla_sender, peer)

    @router.post("/sla", response_model=SlaAccepted, responses={**E403, **E413, **E422, **E429},
                 summary="a sidecar's SLA measurements for its last window", tags=["sla"])
    async def post_sla(body: SlaReport, who: Sender = Depends(sender)) -> SlaAccepted:  # noqa: B008
        # (a default, not Annotated: a local function cannot be named in a string annotation)
        return SlaAccepted(accepted=await run_in_threadpool(service.report_sla, body, who))


SLA_HANDLERS = [(ReportRefused, _on_report_refused)]


def _policy_routes(v1: APIRouter, service: Service) -> None:
    """``/policy...``: read, validate, apply, diff, history, rollback."""

    @v1.get("/policy", response_model=PolicyDocument, responses={**E404},
            summary="the current policy", tags=["policy"])
    async def get_policy() -> PolicyDocument:
        pv = await run_in_threadpool(service.policy)
        if pv is None:
            raise NotFoundError("no policy has been applied yet")
        return PolicyDocument.of(pv)

    @v1.put("/policy", response_model=ApplyResult, responses={**E409, **E413, **E422, **E503},
            summary="apply a policy as a new version", tags=["policy"])
    async def put_policy(body: ApplyBody) -> ApplyResult:
        result = await run_in_threadpool(service.apply, body.yaml, body.base_version, body.author)
        return ApplyResult.of(result)

    @v1.post("/policy/validate", response_model=ValidateResult, responses={**E413, **E422},
             summary="check a policy without applying it", tags=["policy"])
    async def validate_policy(body: YamlBody) -> ValidateResult:
        policy = await run_in_threadpool(service.validate, body.yaml)
        return ValidateResult(valid=True, policy=policy)

    @v1.post("/policy/diff", response_model=DiffResult, responses={**E413, **E422},
             summary="diff the current policy against a proposed one", tags=["policy"])
    async def diff_policy(body: YamlBody) -> DiffResult:
        diff = await run_in_threadpool(service.diff, body.yaml)
        return DiffResult(diff=diff, changed=bool(diff))

    @v1.get("/policy/history", response_model=History, summary="stored versions, newest first",
            tags=["policy"])
    async def policy_history() -> History:
        versions = await run_in_threadpool(service.history)
        return History(versions=[VersionInfo.of(pv) for pv in versions])

    @v1.get("/policy/versions/{version}", response_model=PolicyDocument,
            responses={**E404, **E422}, summary="one stored version", tags=["policy"])
    async def get_version(version: Annotated[int, PathParam(ge=1, le=MAX_VERSION)],
                          ) -> PolicyDocument:
        versions = await run_in_threadpool(service.history)
        for pv in versions:
            if pv.version == version:
                return PolicyDocument.of(pv)
        raise NotFoundError(f"no policy version {version}")

    @v1.post("/policy/rollback", response_model=ApplyResult,
             responses={**E404, **E409, **E413, **E422, **E503},
             summary="apply an earlier version again, as a new version", tags=["policy"])
    async def rollback_policy(body: RollbackBody) -> ApplyResult:
        result = await run_in_threadpool(service.rollback, body.to_version, body.base_version,
                                         body.author)
        return ApplyResult.of(result)


def _status_routes(v1: APIRouter, service: Service) -> None:
    """``/status``, ``/flows/top`` and the SLA board (``/sla``, both methods)."""

    @v1.get("/status", response_model=Status, summary="node, policy version, uplinks",
            tags=["status"])
    async def get_status() -> Status:
        data = await run_in_threadpool(service.status)
        return Status.model_validate(data)

    @v1.get("/flows/top", response_model=TopFlows, responses={**E422},
            summary="the busiest flows", tags=["status"])
    async def top_flows(n: Annotated[int, Query(ge=1, le=1000, description="how many")] = 20,
                        ) -> TopFlows:
        rows = await run_in_threadpool(service.top_flows, n)
        return TopFlows(flows=[Flow.of(r) for r in rows])

    _add_sla_report(v1, service, trusted=True)

    @v1.get("/sla", response_model=SlaView, summary="latest SLA windows: per sidecar, per stage "
            "(replicas merged), per class (node-wide)",
            tags=["sla"])
    async def get_sla() -> SlaView:
        return SlaView.model_validate(await run_in_threadpool(service.sla))

    @v1.get("/sla/explain", responses={**E404}, tags=["sla"],
            summary="the SLA controller: per class measured vs objective, parameters vs "
            "the policy's, the last decisions and why (docs/controller.md)")
    async def sla_explain() -> dict[str, Any]:
        explain = getattr(service, "sla_explain", None)
        data = await run_in_threadpool(explain) if explain is not None else None
        if data is None:
            raise NotFoundError("the SLA controller has no policy yet")
        return data  # type: ignore[no-any-return]


def _health_routes(app: FastAPI, service: Service) -> None:
    """``/healthz`` (never needs a token) and ``/readyz``: 200 or 503 ``{"ok"}``."""

    async def probe(check: Callable[[], bool], what: str) -> JSONResponse:
        try:
            ok = bool(await run_in_threadpool(check))
        except Exception:
            log.exception("%s check failed", what)
            ok = False
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    answers: Responses = {200: {"model": Health},
                          503: {"model": Health, "description": "not ok"}}

    @app.get("/healthz", response_model=Health, responses=answers,
             summary="liveness; never needs a token", tags=["health"])
    async def healthz() -> JSONResponse:
        return await probe(service.healthy, "health")

    @app.get("/readyz", response_model=Health, responses={**answers, **E401},
             dependencies=[Depends(documents_bearer)],
             summary="readiness: dataplane loaded and a policy reconciled", tags=["health"])
    async def readyz() -> JSONResponse:
        return await probe(service.ready, "readiness")


def create_app(service: Service, *, token: str | None = None) -> FastAPI:
    """The admin API over ``service``; with ``token``, all but /healthz need it."""
    if token is not None and not token:
        raise ValueError("an empty token would let anybody in; pass None for no token")
    app = FastAPI(
        title="qosd admin API",
        version=API_VERSION,
        description=(
            "Local admin API of qosd, mmmesh's node daemon: SLA policy versions "
            "(validate, apply, diff, history, rollback), status, the busiest flows and "
            "the sidecars' SLA reports.  "
            "Served on a unix socket (mode 0600) and optionally on TCP with a bearer token."
        ),
        generate_unique_id_function=lambda route: route.name,
    )
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(documents_bearer)],
                   responses={**E401, **E500})
    _policy_routes(v1, service)
    _status_routes(v1, service)
    add_cluster_sla_route(v1, service)
    cluster_routes(v1, service)
    add_cluster_policy_routes(v1, service)
    app.include_router(v1)
    _health_routes(app, service)
    install_handlers(app, [*SLA_HANDLERS, *SERVICE_HANDLERS, *REQUEST_HANDLERS])
    app.add_middleware(Guard, token=token)
    return app


def create_sla_app(service: Service) -> FastAPI:
    """The report-only API for sidecars: ``POST /v1/sla`` and ``GET /healthz``
    (and ``GET /openapi.json`` describing them).

    Served on its own unix socket (mode 0666 by default) so that model pods
    can report without being able to touch policies: the admin socket stays
    root-only."""
    app = FastAPI(title="qosd SLA report API", version=API_VERSION,
                  generate_unique_id_function=lambda route: route.name,
                  docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1")
    _add_sla_report(v1, service, trusted=False)
    app.include_router(v1)

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        return Health(ok=True)

    install_handlers(app, [*SLA_HANDLERS, *REQUEST_HANDLERS])
    app.add_middleware(Guard, token=None)
    return app
