"""How the API answers errors: the one JSON error body, how each exception
becomes one, and the error responses each route declares in OpenAPI.

    PolicyError         422 invalid_policy     errors: [[field, message], ...]
    UnrealizableError   422 unrealizable       errors: [[field, message], ...]
    ConflictError       409 conflict           base_version, current_version
    MeshManagedError    409 mesh_managed       mesh_version (a node-local apply under a mesh policy)
    NotFoundError       404 not_found
    DataplaneError      503 dataplane          (logged)
    StoreCorruptError   500 store              (logged)
    other MeshError     500 internal           (logged)
    a malformed request 422 invalid_request    errors: [[field, message], ...]
    other HTTP errors   their status, a code from _HTTP_CODES (405 method_not_allowed, ...)

A missing or wrong token (401), a body over the limit (413) and anything
unexpected (500) are answered before or around FastAPI, by qosd/api/guard.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmmesh.errors import DataplaneError, MeshError, PolicyError, field_path

from ..errors import (
    ConflictError,
    MeshManagedError,
    NotFoundError,
    StoreCorruptError,
    UnrealizableError,
)
from ..model import MAX_BODY_BYTES

log = logging.getLogger(__name__)


class ErrorBody(BaseModel):
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


# --------------------------------------------------------------------------
# What the routes declare (OpenAPI ``responses=``)
# --------------------------------------------------------------------------
Responses = dict[int | str, dict[str, Any]]


def _declare(status: int, description: str) -> Responses:
    return {status: {"model": ErrorBody, "description": description}}


E401 = _declare(401, "missing or wrong bearer token")
E404 = _declare(404, "no such policy or version")
E409 = _declare(409, "base_version is not the current version")
E413 = _declare(413, f"request body over {MAX_BODY_BYTES} bytes")
E422 = _declare(422, "invalid request or policy; errors lists [field, message]")
E500 = _declare(500, "internal error (logged)")
E503 = _declare(503, "the dataplane failed; the last good policy is kept")


# --------------------------------------------------------------------------
# Exception handlers
# --------------------------------------------------------------------------
def error_response(status: int, error: str, message: str,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """An :class:`ErrorBody` as a response."""
    body: dict[str, Any] = {"error": error, "message": message}
    body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers)


def _pairs(errors: Sequence[tuple[str, str]]) -> list[list[str]]:
    return [[str(loc), str(msg)] for loc, msg in errors]


async def _on_policy_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PolicyError)
    return error_response(422, "invalid_policy", str(exc), errors=_pairs(exc.errors))


async def _on_unrealizable(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnrealizableError)
    return error_response(422, "unrealizable", str(exc), errors=_pairs(exc.errors))


async def _on_conflict(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ConflictError)
    return error_response(409, "conflict", str(exc), base_version=exc.base_version,
                          current_version=exc.current_version)


async def _on_mesh_managed(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MeshManagedError)
    return error_response(409, "mesh_managed", str(exc), mesh_version=exc.mesh_version)


async def _on_not_found(_: Request, exc: Exception) -> JSONResponse:
    return error_response(404, "not_found", str(exc))


async def _on_dataplane(_: Request, exc: Exception) -> JSONResponse:
    log.error("dataplane error: %s", exc)
    return error_response(503, "dataplane", str(exc))


async def _on_store(_: Request, exc: Exception) -> JSONResponse:
    log.error("policy store error: %s", exc)
    return error_response(500, "store", str(exc))


async def _on_mesh_error(request: Request, exc: Exception) -> JSONResponse:
    # a MeshError nobody mapped: ours, on purpose, but not the client's fault
    log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(500, "internal", str(exc))


async def _on_invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors: list[list[str]] = []
    for e in exc.errors():
        loc = field_path(e.get("loc", ()))
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif e.get("type") == "missing":
            msg = "required field is missing"
        errors.append([loc, msg])
    body = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in errors)
    return error_response(422, "invalid_request", f"invalid request: {body}", errors=errors)


_HTTP_CODES = {
    400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
    413: "too_large", 415: "unsupported_media_type",
}


async def _on_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. not UTF-8)
        msg = f"invalid request body: {exc.detail}"
        return error_response(422, "invalid_request", msg, errors=[["body", str(exc.detail)]])
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(exc.status_code, code, str(exc.detail),
                          headers=dict(exc.headers) if exc.headers else None)


Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]

# requests FastAPI refuses before any route runs: every app needs these
REQUEST_HANDLERS: list[tuple[type[Exception], Handler]] = [
    (RequestValidationError, _on_invalid_request),
    (StarletteHTTPException, _on_http),
]
# what the admin routes' service calls raise (looked up along each exception's MRO)
SERVICE_HANDLERS: list[tuple[type[Exception], Handler]] = [
    (PolicyError, _on_policy_error),
    (UnrealizableError, _on_unrealizable),
    (ConflictError, _on_conflict),
    (MeshManagedError, _on_mesh_managed),
    (NotFoundError, _on_not_found),
    (DataplaneError, _on_dataplane),
    (StoreCorruptError, _on_store),
    (MeshError, _on_mesh_error),
]


def install_handlers(app: FastAPI, handlers: Sequence[tuple[type[Exception], Handler]]) -> None:
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)
