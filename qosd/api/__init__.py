"""qosd's HTTP APIs: the admin API and the report-only SLA API (FastAPI).

Which socket serves what (qosd/daemon.py sets them up from qosd/config.py):

    api_socket  unix, mode 0600 (root only)   create_app: every endpoint below
    api_tcp     TCP, optional                 create_app(token=...): the same, and every
                                              endpoint but /healthz needs
                                              ``Authorization: Bearer <token>``
    sla_socket  unix, mode 0666 (sla.sock)    create_sla_app: only POST /v1/sla, so model
                                              pods can report but not touch policies
                                              (besides: GET /healthz, always ok, and
                                              GET /openapi.json of that one route)

The admin API:

    GET  /healthz                       200 {"ok": true} | 503 {"ok": false}   (never needs a token)
    GET  /readyz                        200 {"ok": true} | 503 {"ok": false}
    GET  /v1/policy                     the current policy (404 when there is none yet)
    POST /v1/policy/validate            {"yaml"} -> {"valid": true, "policy"} | 422
    PUT  /v1/policy                     {"yaml", "base_version", "author"}
                                        -> {"version", "reconcile"}
    POST /v1/policy/diff                {"yaml"} -> {"diff", "changed"}
    GET  /v1/policy/history             {"versions": [...]}, newest first
    GET  /v1/policy/versions/{version}  one stored version, like GET /v1/policy
    POST /v1/policy/rollback            {"to_version", "base_version", "author"} -> like PUT
    GET  /v1/status                     the service's status()
    GET  /v1/flows/top?n=20             {"flows": [...]}, busiest first
    POST /v1/sla                        a sidecar's window (mmmesh.sla.report.SlaReport)
                                        -> {"accepted": n}
    GET  /v1/sla                        {"instances", "stages", "classes"}: the latest windows
                                        per sidecar, per stage, per class (SlaView)
    GET  /openapi.json, /docs           this API's OpenAPI document and its browser view

Errors are JSON ``{"error": <code>, "message": str, ...}`` and map as
qosd/api/errors.py lists (PolicyError/UnrealizableError 422, ConflictError
409, NotFoundError 404, DataplaneError 503); a malformed request is 422
``invalid_request`` with ``errors`` [[field, message], ...]; a missing or
wrong token 401 ``unauthorized``; a body over the size limit 413; anything
unexpected 500 ``{"error": "internal"}``, logged with its traceback.

The service is synchronous: every call runs in a worker thread.
``python -m qosd.api --openapi FILE`` writes the OpenAPI document
(docs/api/openapi.json is checked in and kept equal).

The modules, one role each:

    models.py   request/response bodies, size limits, conversions from qosd/model.py
    errors.py   the error body, exception -> response, the error responses routes declare
    guard.py    the ASGI layer: bearer token, body size limit, last-resort 500
    app.py      the two apps and their routes
    openapi.py  the OpenAPI document and ``python -m qosd.api``
    serve.py    qosd's HTTP/1.1 server on listening sockets (unix, TCP): a connection
                cap per listener, graceful stop
    http11.py   one connection of it: h11, deadlines, size limits, and on unix sockets
                the client's SO_PEERCRED in ``scope["extensions"]["mmmesh.peer"]``
"""

from __future__ import annotations

from qosd.httpd.serve import ApiServer, bind_tcp, bind_uds, serve, serve_tcp, serve_uds

from ..model import MAX_BODY_BYTES, MAX_YAML_BYTES
from .app import API_VERSION, create_app, create_sla_app
from .openapi import openapi_document, openapi_text, write_openapi

__all__ = [
    "API_VERSION",
    "MAX_BODY_BYTES",
    "MAX_YAML_BYTES",
    "ApiServer",
    "bind_tcp",
    "bind_uds",
    "create_app",
    "create_sla_app",
    "openapi_document",
    "openapi_text",
    "serve",
    "serve_tcp",
    "serve_uds",
    "write_openapi",
]
