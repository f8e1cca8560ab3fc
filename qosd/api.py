"""qosd's admin API: FastAPI over a unix socket (mode 0600) and, optionally, TCP.

    GET  /healthz                       200 {"ok": true} | 503 {"ok": false}   (never needs a token)
    GET  /readyz                        200 {"ok": true} | 503 {"ok": false}
    GET  /v1/policy                     the current policy (404 when there is none yet)
    POST /v1/policy/validate            {"yaml"} -> {"valid": true, "policy"} | 422
    PUT  /v1/policy                     {"yaml", "base_version", "author"} -> {"version", "reconcile"}
    POST /v1/policy/diff                {"yaml"} -> {"diff", "changed"}
    GET  /v1/policy/history             {"versions": [...]}, newest first
    GET  /v1/policy/versions/{version}  one stored version, like GET /v1/policy
    POST /v1/policy/rollback            {"to_version", "base_version", "author"} -> like PUT
    GET  /v1/status                     the service's status()
    GET  /v1/flows/top?n=20             {"flows": [...]}, busiest first

Errors are JSON ``{"error": <code>, "message": str, ...}`` and map as
qosd/model.py says (PolicyError/UnrealizableError 422, ConflictError 409,
NotFoundError 404, DataplaneError 503); a malformed request is 422
``invalid_request`` with ``errors`` [[field, message], ...]; a missing or
wrong token 401 ``unauthorized``; a body over the size limit 413; anything
unexpected 500 ``{"error": "internal"}``, logged with its traceback.

When ``token`` is given (the TCP listener), every endpoint but /healthz needs
``Authorization: Bearer <token>``.  The service is synchronous: every call
runs in a worker thread.  ``python -m qosd.api --openapi FILE`` writes the
OpenAPI document (docs/api/openapi.json is checked in and kept equal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import socket
import stat
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Security
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmmesh._errors import DataplaneError, MeshError, PolicyError
from mmmesh.policy import Policy
from mmmesh.slareport import SlaAccepted, SlaReport, SlaView

from .errors import ConflictError, NotFoundError, StoreCorruptError, UnrealizableError
from .model import FlowRow, PolicyVersion, ReconcileResult, Service

__all__ = [
    "API_VERSION",
    "MAX_BODY_BYTES",
    "MAX_YAML_BYTES",
    "ApiServer",
    "bind_tcp",
    "bind_uds",
    "create_app",
    "openapi_document",
    "serve",
    "serve_tcp",
    "serve_uds",
    "write_openapi",
]

log = logging.getLogger("qosd.api")

API_VERSION = "1"
MAX_YAML_BYTES = 1 << 20  # a policy document, UTF-8
# A JSON body holding the largest policy: even fully \u-escaped it stays below this.
MAX_BODY_BYTES = 6 * MAX_YAML_BYTES + 64 * 1024
MAX_VERSION = 2**53 - 1  # exact in JSON numbers everywhere
MAX_AUTHOR = 256

Asgi = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                 Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
def _utf8_size(text: str) -> str:
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > MAX_YAML_BYTES:
        raise ValueError(f"the policy is {n} bytes; at most {MAX_YAML_BYTES} bytes (1 MiB)")
    return text


PolicyYaml = Annotated[
    str,
    Field(max_length=MAX_YAML_BYTES, description="the policy as YAML text (at most 1 MiB)"),
    AfterValidator(_utf8_size),
]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION, description="a policy version number")]
BaseVersion = Annotated[
    int | None,
    Field(
        ge=0,
        le=MAX_VERSION,
        description="the version this edit is based on (0 = no policy yet); the change is "
        "refused with 409 when the current version differs.  null: no check",
    ),
]
Author = Annotated[
    str | None, Field(max_length=MAX_AUTHOR, description="who makes the change (recorded)")
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # true is not 1


EXAMPLE_POLICY = """\
apiVersion: mmmesh/v1
link: {device: eth0, rate: 1gbit}
classes:
  - {name: voice, id: 11, match: {modalities: [audio]}, rate: 1.2mbit, weight: 3, priority: 1}
  - {name: video, id: 12, match: {modalities: [video]}, rate: 150mbit, weight: 7, priority: 2}
  - {name: best-effort, id: 14, rate: 20mbit}
default_class: best-effort
"""


class YamlBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"yaml": EXAMPLE_POLICY}]})

    yaml: PolicyYaml


class ApplyBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"yaml": EXAMPLE_POLICY, "base_version": None, "author": "alice"},
    ]})

    yaml: PolicyYaml
    base_version: BaseVersion = None
    author: Author = None


class RollbackBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"to_version": 1, "base_version": None, "author": "alice"},
    ]})

    to_version: Version
    base_version: BaseVersion = None
    author: Author = None


class _Response(BaseModel):
    pass


class VersionInfo(_Response):
    version: int
    created_at: float = Field(description="unix seconds")
    author: str | None
    note: str | None
    sha256: str = Field(description="of the canonical YAML text (UTF-8)")


class PolicyDocument(VersionInfo):
    policy: Policy
    yaml: str = Field(description="canonical YAML of the policy")


class ValidateResult(_Response):
    valid: Literal[True]
    policy: Policy


class Reconcile(_Response):
    ok: bool
    version: int = Field(description="policy version now in the kernel (last good on failure)")
    started_at: float
    duration_s: float
    trigger: str = Field(description='"apply" | "rollback" | "resync" | "startup"')
    repaired: list[str] = Field(description="drift found and fixed")
    error: str | None


class ApplyResult(_Response):
    version: int
    reconcile: Reconcile


class DiffResult(_Response):
    diff: str = Field(description="unified diff of the canonical YAML, current -> proposed")
    changed: bool


class History(_Response):
    versions: list[VersionInfo] = Field(description="newest first")


class Status(_Response):
    model_config = ConfigDict(extra="allow")

    node: str
    policy_version: int = Field(description="0 when there is no policy yet")
    uplinks: dict[str, dict[str, Any]]
    last_reconcile: Reconcile | None
    store_problems: list[str]
    started_at: float
    adopted: bool
    sla: SlaView | None = None


class Flow(_Response):
    src: str
    dst: str
    sport: int
    dport: int
    proto: str
    class_name: str | None
    class_id: int
    modality: str | None
    packets: int
    bytes: int
    idle_s: float = Field(description="seconds since the last packet")
    rate_bps: float = Field(description="bit/s between the last two samples; 0 on the first")


class TopFlows(_Response):
    flows: list[Flow]


class Health(_Response):
    ok: bool


class ErrorBody(_Response):
    error: str = Field(
        description="invalid_policy | unrealizable | invalid_request | conflict | not_found"
        " | unauthorized | dataplane | too_large | store | internal | ..."
    )
    message: str
    errors: list[Annotated[list[str], Field(min_length=2, max_length=2)]] | None = Field(
        default=None, description="[field, message] pairs (422)"
    )
    base_version: int | None = Field(default=None, description="409 only")
    current_version: int | None = Field(default=None, description="409 only")


Responses = dict[int | str, dict[str, Any]]


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


_E401: Responses = {401: _err("missing or wrong bearer token")}
_E404: Responses = {404: _err("no such policy or version")}
_E409: Responses = {409: _err("base_version is not the current version")}
_E422: Responses = {422: _err("invalid request or policy; errors lists [field, message]")}
_E503: Responses = {503: _err("the dataplane failed; the last good policy is kept")}
_E500: Responses = {500: _err("internal error (logged)")}
_E413: Responses = {413: _err(f"request body over {MAX_BODY_BYTES} bytes")}


# --------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------
def _info(pv: PolicyVersion) -> VersionInfo:
    return VersionInfo(
        version=pv.version, created_at=pv.created_at, author=pv.author, note=pv.note,
        sha256=pv.sha256,
    )


def _document(pv: PolicyVersion) -> PolicyDocument:
    return PolicyDocument(
        version=pv.version, created_at=pv.created_at, author=pv.author, note=pv.note,
        sha256=pv.sha256, policy=pv.policy, yaml=pv.text,
    )


def _reconcile(res: ReconcileResult | dict[str, Any]) -> Reconcile:
    data = dataclasses.asdict(res) if dataclasses.is_dataclass(res) else dict(res)
    return Reconcile.model_validate(data)


def _applied(result: tuple[PolicyVersion, ReconcileResult]) -> ApplyResult:
    pv, res = result
    return ApplyResult(version=pv.version, reconcile=_reconcile(res))


def _flow(row: FlowRow | dict[str, Any]) -> Flow:
    data = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(row)
    return Flow.model_validate(data)


def _loc(parts: Sequence[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------
def _error(status: int, error: str, message: str, headers: dict[str, str] | None = None,
           **extra: Any) -> JSONResponse:
    body: dict[str, Any] = {"error": error, "message": message}
    body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers)


def _pairs(errors: Sequence[tuple[str, str]]) -> list[list[str]]:
    return [[str(loc), str(msg)] for loc, msg in errors]


async def _on_policy_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PolicyError)
    return _error(422, "invalid_policy", str(exc), errors=_pairs(exc.errors))


async def _on_unrealizable(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnrealizableError)
    return _error(422, "unrealizable", str(exc), errors=_pairs(exc.errors))


async def _on_conflict(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ConflictError)
    return _error(409, "conflict", str(exc), base_version=exc.base_version,
                  current_version=exc.current_version)


async def _on_not_found(_: Request, exc: Exception) -> JSONResponse:
    return _error(404, "not_found", str(exc))


async def _on_dataplane(_: Request, exc: Exception) -> JSONResponse:
    log.error("dataplane error: %s", exc)
    return _error(503, "dataplane", str(exc))


async def _on_store(_: Request, exc: Exception) -> JSONResponse:
    log.error("policy store error: %s", exc)
    return _error(500, "store", str(exc))


async def _on_mesh_error(request: Request, exc: Exception) -> JSONResponse:
    # a MeshError nobody mapped: ours, on purpose, but not the client's fault
    log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return _error(500, "internal", str(exc))


async def _on_invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors: list[list[str]] = []
    for e in exc.errors():
        loc = _loc(e.get("loc", ()))
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif e.get("type") == "missing":
            msg = "required field is missing"
        errors.append([loc, msg])
    body = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in errors)
    return _error(422, "invalid_request", f"invalid request: {body}", errors=errors)


_HTTP_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "too_large", 415: "unsupported_media_type",
}


async def _on_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. not UTF-8)
        msg = f"invalid request body: {exc.detail}"
        return _error(422, "invalid_request", msg, errors=[["body", str(exc.detail)]])
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return _error(exc.status_code, code, str(exc.detail),
                  headers=dict(exc.headers) if exc.headers else None)


# --------------------------------------------------------------------------
# ASGI middleware
# --------------------------------------------------------------------------
async def _send_json(send: Callable[[MutableMapping[str, Any]], Awaitable[None]], status: int,
                     body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": data})


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """Outermost own layer: bearer token, body size limit, and the 500 of last resort."""

    def __init__(self, app: Asgi, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token is not None else None

    def _authorized(self, scope: MutableMapping[str, Any]) -> bool:
        if self.token is None or scope.get("path") == "/healthz":
            return True
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, cred = given.partition(b" ")
        if scheme.lower() != b"bearer":
            cred = b""
        # constant time in the token's content (not its length, which is no secret)
        return hmac.compare_digest(cred.strip(), self.token)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_json(send, 401, {"error": "unauthorized",
                                         "message": "missing or wrong bearer token"},
                             [(b"www-authenticate", b"Bearer")])
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > MAX_BODY_BYTES
                except ValueError:
                    too_big = False
                if too_big:
                    await _send_json(send, 413, _too_large())
                    return
        seen = 0
        started = False
        answered = False  # we sent the 413 ourselves; the app's answer is dropped

        async def limited_receive() -> Any:
            nonlocal seen, answered
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    # answer now: the app may turn the exception into a 400 of its own
                    if not started and not answered:
                        answered = True
                        await _send_json(send, 413, _too_large())
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not answered:
                raise
        except Exception:
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if started or answered:
                raise
            await _send_json(send, 500, {"error": "internal",
                                         "message": "internal error; see the qosd log"})


def _too_large() -> dict[str, Any]:
    return {"error": "too_large", "message": f"request body over {MAX_BODY_BYTES} bytes"}


# --------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------
_bearer = HTTPBearer(auto_error=False, description="needed on TCP; the unix socket needs none")


async def _documents_bearer(
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> None:
    """Declares bearer auth in the OpenAPI document; _Guard enforces it."""


def create_app(service: Service, *, token: str | None = None) -> FastAPI:
    """The admin API over ``service``; with ``token``, all but /healthz need it."""
    if token is not None and not token:
        raise ValueError("an empty token would let anybody in; pass None for no token")
    app = FastAPI(
        title="qosd admin API",
        version=API_VERSION,
        description=(
            "Local admin API of qosd, mmmesh's node daemon: SLA policy versions "
            "(validate, apply, diff, history, rollback), status and the busiest flows.  "
            "Served on a unix socket (mode 0600) and optionally on TCP with a bearer token."
        ),
        generate_unique_id_function=lambda route: route.name,
    )
    app.state.service = service

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_documents_bearer)],
                   responses={**_E401, **_E500})

    @v1.get("/policy", response_model=PolicyDocument, responses={**_E404},
            summary="the current policy", tags=["policy"])
    async def get_policy() -> PolicyDocument:
        pv = await run_in_threadpool(service.policy)
        if pv is None:
            raise NotFoundError("no policy has been applied yet")
        return _document(pv)

    @v1.put("/policy", response_model=ApplyResult, responses={**_E409, **_E413, **_E422, **_E503},
            summary="apply a policy as a new version", tags=["policy"])
    async def put_policy(body: ApplyBody) -> ApplyResult:
        result = await run_in_threadpool(service.apply, body.yaml, body.base_version, body.author)
        return _applied(result)

    @v1.post("/policy/validate", response_model=ValidateResult, responses={**_E413, **_E422},
             summary="check a policy without applying it", tags=["policy"])
    async def validate_policy(body: YamlBody) -> ValidateResult:
        policy = await run_in_threadpool(service.validate, body.yaml)
        return ValidateResult(valid=True, policy=policy)

    @v1.post("/policy/diff", response_model=DiffResult, responses={**_E413, **_E422},
             summary="diff the current policy against a proposed one", tags=["policy"])
    async def diff_policy(body: YamlBody) -> DiffResult:
        diff = await run_in_threadpool(service.diff, body.yaml)
        return DiffResult(diff=diff, changed=bool(diff))

    @v1.get("/policy/history", response_model=History, summary="stored versions, newest first",
            tags=["policy"])
    async def policy_history() -> History:
        versions = await run_in_threadpool(service.history)
        return History(versions=[_info(pv) for pv in versions])

    @v1.get("/policy/versions/{version}", response_model=PolicyDocument,
            responses={**_E404, **_E422}, summary="one stored version", tags=["policy"])
    async def get_version(version: Annotated[int, PathParam(ge=1, le=MAX_VERSION)]) -> PolicyDocument:
        versions = await run_in_threadpool(service.history)
        for pv in versions:
            if pv.version == version:
                return _document(pv)
        raise NotFoundError(f"no policy version {version}")

    @v1.post("/policy/rollback", response_model=ApplyResult,
             responses={**_E404, **_E409, **_E413, **_E422, **_E503},
             summary="apply an earlier version again, as a new version", tags=["policy"])
    async def rollback_policy(body: RollbackBody) -> ApplyResult:
        result = await run_in_threadpool(service.rollback, body.to_version, body.base_version,
                                         body.author)
        return _applied(result)

    @v1.get("/status", response_model=Status, summary="node, policy version, uplinks",
            tags=["status"])
    async def get_status() -> Status:
        data = await run_in_threadpool(service.status)
        return Status.model_validate(data)

    @v1.get("/flows/top", response_model=TopFlows, responses={**_E422},
            summary="the busiest flows", tags=["status"])
    async def top_flows(n: Annotated[int, Query(ge=1, le=1000, description="how many")] = 20,
                        ) -> TopFlows:
        rows = await run_in_threadpool(service.top_flows, n)
        return TopFlows(flows=[_flow(r) for r in rows])

    @v1.post("/sla", response_model=SlaAccepted, responses={**_E413, **_E422},
             summary="a sidecar's SLA measurements for its last window", tags=["sla"])
    async def post_sla(body: SlaReport) -> SlaAccepted:
        n = await run_in_threadpool(service.report_sla, body.model_dump(mode="json"))
        return SlaAccepted(accepted=n)

    @v1.get("/sla", response_model=SlaView, summary="latest SLA windows: per sidecar, per stage "
            "(replicas merged), per class (node-wide)",
            tags=["sla"])
    async def get_sla() -> SlaView:
        return SlaView.model_validate(await run_in_threadpool(service.sla))

    app.include_router(v1)

    async def _probe(check: Callable[[], bool], what: str) -> JSONResponse:
        try:
            ok = bool(await run_in_threadpool(check))
        except Exception:
            log.exception("%s check failed", what)
            ok = False
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    probe: Responses = {200: {"model": Health},
                        503: {"model": Health, "description": "not ok"}}

    @app.get("/healthz", response_model=Health, responses=probe,
             summary="liveness; never needs a token", tags=["health"])
    async def healthz() -> JSONResponse:
        return await _probe(service.healthy, "health")

    @app.get("/readyz", response_model=Health, responses={**probe, **_E401},
             dependencies=[Depends(_documents_bearer)],
             summary="readiness: dataplane loaded and a policy reconciled", tags=["health"])
    async def readyz() -> JSONResponse:
        return await _probe(service.ready, "readiness")

    handlers: list[tuple[type[Exception], Any]] = [
        (PolicyError, _on_policy_error),
        (UnrealizableError, _on_unrealizable),
        (ConflictError, _on_conflict),
        (NotFoundError, _on_not_found),
        (DataplaneError, _on_dataplane),
        (StoreCorruptError, _on_store),
        (MeshError, _on_mesh_error),
        (RequestValidationError, _on_invalid_request),
        (StarletteHTTPException, _on_http),
    ]
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(_Guard, token=token)
    return app


def create_sla_app(service: Service) -> FastAPI:
    """The report-only API for sidecars: ``POST /v1/sla`` and ``/healthz``.

    Served on its own unix socket (mode 0666 by default) so that model pods
    can report without being able to touch policies: the admin socket stays
    root-only."""
    app = FastAPI(title="qosd SLA report API", version=API_VERSION,
                  generate_unique_id_function=lambda route: route.name,
                  docs_url=None, redoc_url=None)

    @app.post("/v1/sla", response_model=SlaAccepted, responses={**_E413, **_E422},
              summary="a sidecar's SLA measurements for its last window", tags=["sla"])
    async def post_sla(body: SlaReport) -> SlaAccepted:
        n = await run_in_threadpool(service.report_sla, body.model_dump(mode="json"))
        return SlaAccepted(accepted=n)

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        return Health(ok=True)

    for exc_type, handler in [(RequestValidationError, _on_invalid_request),
                              (StarletteHTTPException, _on_http)]:
        app.add_exception_handler(exc_type, handler)
    app.add_middleware(_Guard, token=None)
    return app


# --------------------------------------------------------------------------
# OpenAPI document
# --------------------------------------------------------------------------
class _NoService:
    """Stands in for the service when only the OpenAPI document is wanted."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(f"_NoService.{name} called: this app only describes the API")


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the admin API."""
    return create_app(_NoService()).openapi()


def openapi_text() -> str:
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"


def write_openapi(path: str | os.PathLike[str]) -> None:
    """Writes the OpenAPI document (JSON) to ``path`` atomically."""
    target = Path(path)
    data = openapi_text().encode()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------
class ApiServer(uvicorn.Server):
    """A uvicorn server on sockets bound before it starts.

    ``await server.serve()`` runs it; ``server.should_exit = True`` (or
    :meth:`stop`) ends it.  It leaves signals to its owner (the daemon) and
    removes its unix socket file when it ends.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket],
                 uds_path: str | None = None) -> None:
        super().__init__(config)
        self.sockets = sockets
        self.uds_path = uds_path
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str | tuple[str, int]:
        """The unix socket path, or (host, port) for TCP (the real port when 0 was asked)."""
        if self.uds_path is not None:
            return self.uds_path
        name = self.sockets[0].getsockname()
        return (name[0], name[1])

    @property
    def port(self) -> int:
        addr = self.address
        if isinstance(addr, str):
            raise AttributeError("a unix socket server has no port")  # noqa: TRY004
        return addr[1]

    @contextlib.contextmanager
    def capture_signals(self) -> Any:  # the daemon owns the signals
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().serve(sockets=sockets if sockets is not None else self.sockets)
        finally:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._remove_socket_file()

    def _remove_socket_file(self) -> None:
        if self.uds_path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.uds_path).st_mode):
                os.unlink(self.uds_path)

    async def wait_started(self, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.started:
            if self._task is not None and self._task.done():
                self._task.result()  # raises what made it fail
                raise RuntimeError("the API server stopped before it started")
            if loop.time() > deadline:
                raise TimeoutError("the API server did not start")
            await asyncio.sleep(0.01)

    def start_thread(self, timeout: float = 10.0) -> threading.Thread:
        """Runs the server in a daemon thread (own event loop); returns once it serves."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as e:
                errors.append(e)
                log.exception("API server thread failed")

        t = threading.Thread(target=run, name=f"qosd-api-{self.address}", daemon=True)
        self._thread = t
        t.start()
        waited = 0.0
        while not self.started:
            if errors:
                raise RuntimeError("the API server failed to start") from errors[0]
            if not t.is_alive():
                raise RuntimeError("the API server stopped before it started")
            if waited > timeout:
                raise TimeoutError("the API server did not start")
            threading.Event().wait(0.01)
            waited += 0.01
        return t

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the server to exit; waits for its thread when it runs in one."""
        self.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    async def stop_async(self) -> None:
        self.should_exit = True
        if self._task is not None:
            await self._task


def _config(app: Any, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        lifespan="off",  # the service's life is the daemon's business
        log_config=None,  # keep the daemon's logging setup
        log_level=log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=5,
        proxy_headers=False,
    )


def bind_uds(app: Any, path: str | os.PathLike[str], *, mode: int = 0o600,
             log_level: str = "warning") -> ApiServer:
    """Binds a unix socket at ``path`` (mode ``mode`` before it listens) for ``app``.

    A stale socket file is replaced; a live one (something answers) or any
    other kind of file is an error.  The parent directory is created (0755)
    when missing.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o755, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise OSError(f"{path}: another process is serving on this socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # nobody can connect before listen(): the mode is in place first
        os.chmod(path, mode)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return ApiServer(_config(app, log_level), [sock], uds_path=path)


def bind_tcp(app: Any, host: str, port: int, *, log_level: str = "warning") -> ApiServer:
    """Binds TCP ``host``:``port`` (0 = an ephemeral port, see ``server.port``)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return ApiServer(_config(app, log_level), [sock])


async def _start(server: ApiServer) -> ApiServer:
    server._task = asyncio.get_running_loop().create_task(server.serve())
    await server.wait_started()
    return server


async def serve_uds(app: Any, path: str | os.PathLike[str], **kw: Any) -> ApiServer:
    """Binds (0600) and starts serving ``app`` on a unix socket in the running loop.

    Returns once it accepts requests; stop it with ``should_exit = True`` or
    ``await server.stop_async()``.
    """
    return await _start(bind_uds(app, path, **kw))


async def serve_tcp(app: Any, host: str, port: int, **kw: Any) -> ApiServer:
    """Like :func:`serve_uds`, on TCP."""
    return await _start(bind_tcp(app, host, port, **kw))


def split_hostport(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8470"``, ``"[::1]:8470"`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def serve(app: Any, *, uds: str | None, tcp: str | None,
                app_tcp: Any | None = None) -> list[ApiServer]:
    """Starts the listeners asked for: ``uds`` (a path) with ``app``, ``tcp``
    ("host:port") with ``app_tcp`` (build that one with the token; defaults to
    ``app``).  Returns the running servers."""
    servers: list[ApiServer] = []
    try:
        if uds is not None:
            servers.append(await serve_uds(app, uds))
        if tcp is not None:
            host, port = split_hostport(tcp)
            servers.append(await serve_tcp(app_tcp if app_tcp is not None else app,
                                           host, port))
    except BaseException:
        for s in servers:
            await s.stop_async()
        raise
    return servers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qosd.api", description=__doc__.splitlines()[0])
    parser.add_argument("--openapi", metavar="FILE", required=True,
                        help="write the OpenAPI document (JSON) to FILE ('-' = stdout)")
    args = parser.parse_args(argv)
    if args.openapi == "-":
        sys.stdout.write(openapi_text())
    else:
        write_openapi(args.openapi)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
