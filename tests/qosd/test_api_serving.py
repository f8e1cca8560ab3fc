"""qosd's API as published and served: the public names of qosd.api, the
OpenAPI document (checked in, and fuzzed with schemathesis), unix and TCP
listeners, and the report-only SLA app of sla.sock."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from qosd import api
from qosd.api.openapi import main as openapi_main
from testkit.qosd_fake import (
    POLICY_A,
    POLICY_B,
    ROOT,
    TOKEN,
    StoreService,
    as_service,
    put,
    with_peer,
)

OPENAPI = ROOT / "docs" / "api" / "openapi.json"


@pytest.fixture
def service(tmp_path: Path) -> StoreService:
    return StoreService(tmp_path / "state")


# --------------------------------------------------------------------------
# OpenAPI
# --------------------------------------------------------------------------
def test_openapi_document_is_checked_in() -> None:
    assert OPENAPI.exists(), "run: python -m qosd.api --openapi docs/api/openapi.json"
    assert OPENAPI.read_text() == api.openapi_text(), (
        "docs/api/openapi.json is stale; run: python -m qosd.api --openapi docs/api/openapi.json"
    )


def test_openapi_describes_the_api(service: StoreService, tmp_path: Path) -> None:
    doc = TestClient(api.create_app(as_service(service))).get("/openapi.json").json()
    assert doc == api.openapi_document()
    assert set(doc["paths"]) == {
        "/v1/policy", "/v1/policy/validate", "/v1/policy/diff", "/v1/policy/history",
        "/v1/policy/versions/{version}", "/v1/policy/rollback", "/v1/status",
        "/v1/flows/top", "/v1/sla", "/v1/sla/explain", "/healthz", "/readyz",
        "/v1/cluster/members",  # qosd/api/cluster.py
        "/v1/cluster/sla",  # qosd/api/cluster_sla.py
        "/v1/cluster/policy", "/v1/cluster/rollout",  # qosd/api/cluster_policy.py
    }
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # our 422 body is documented instead
    assert schemas["ApplyBody"]["additionalProperties"] is False
    assert schemas["ApplyBody"]["properties"]["yaml"]["maxLength"] == api.MAX_YAML_BYTES
    put_op = doc["paths"]["/v1/policy"]["put"]
    assert {"200", "401", "409", "413", "422", "503"} <= set(put_op["responses"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    out = tmp_path / "sub" / "openapi.json"
    api.write_openapi(out)
    assert json.loads(out.read_text()) == doc
    assert openapi_main(["--openapi", str(out)]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["openapi.json"]  # no temp files left


def test_schemathesis_fuzz(tmp_path: Path) -> None:
    """Fuzz every operation (valid and invalid inputs): never a 500, responses
    match the schema, and the policy version only moves on a 2xx PUT/rollback."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.result import Ok
    from schemathesis.openapi import from_asgi
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    service = StoreService(tmp_path / "state")
    app = api.create_app(service)
    seed = TestClient(app)
    assert put(seed, POLICY_A).status_code == 200
    assert put(seed, POLICY_B).status_code == 200
    schema = from_asgi("/openapi.json", app)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    moves: list[tuple[str, int]] = []
    count = 0

    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # every operation of the document loads
        operation = result.ok()
        strategies = [
            *((3, st) for st in schema.get_strategies_from_examples(operation)),  # documented
            (20, operation.as_strategy(generation_mode=GenerationMode.POSITIVE)),
            (20, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)),
        ]
        for examples, strategy in strategies:

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case: Any) -> None:
                nonlocal count
                before = service.store.version
                response = case.call_and_validate(checks=checks)
                count += 1
                after = service.store.version
                if after != before:
                    key = f"{case.method.upper()} {case.path}"
                    assert key in ("PUT /v1/policy", "POST /v1/policy/rollback"), key
                    assert 200 <= response.status_code < 300, (key, response.status_code)
                    moves.append((key, after))
                elif case.method.upper() in ("PUT", "POST") and response.status_code < 300 \
                        and case.path in ("/v1/policy", "/v1/policy/rollback"):
                    pytest.fail(f"{case.path} answered {response.status_code} but the "
                                "version did not move")

            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                pass
    assert count > 100
    # every move was a 2xx PUT/rollback, one version each, and nothing else moved it
    assert [v for _, v in moves] == list(range(3, 3 + len(moves)))
    assert service.store.version == 2 + len(moves)
    assert {"PUT /v1/policy", "POST /v1/policy/rollback"} <= {key for key, _ in moves}


# --------------------------------------------------------------------------
# Serving on sockets
# --------------------------------------------------------------------------
def test_uds_server_mode_0600_and_cleanup(tmp_path: Path, service: StoreService) -> None:
    path = tmp_path / "run" / "qosd.sock"
    # a stale socket file from a crashed daemon is replaced
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    server = api.bind_uds(api.create_app(service), path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert server.address == str(path)
    server.start_thread()
    try:
        # a second daemon must not steal a live socket
        with pytest.raises(OSError, match="another process"):
            api.bind_uds(api.create_app(service), path)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)),
                          base_url="http://qosd") as c:
            assert c.get("/healthz").json() == {"ok": True}
            assert c.put("/v1/policy", json={"yaml": POLICY_A}).json()["version"] == 1
    finally:
        server.stop()
    assert not path.exists()
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(FileExistsError):
        api.bind_uds(api.create_app(service), regular)


def test_async_serve_uds_and_tcp(tmp_path: Path, service: StoreService) -> None:
    path = tmp_path / "qosd.sock"

    async def main() -> None:
        servers = await api.serve(api.create_app(service), uds=str(path), tcp="127.0.0.1:0",
                                  app_tcp=api.create_app(service, token=TOKEN))
        _, tcp = servers
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        port = tcp.port
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)),
                                     base_url="http://qosd") as c:
            assert (await c.get("/v1/status")).status_code == 200
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/v1/status")).status_code == 401
            r = await c.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
        for s in servers:
            await s.stop_async()
        assert not path.exists()

    asyncio.run(asyncio.wait_for(main(), 30))


# --------------------------------------------------------------------------
# The public face
# --------------------------------------------------------------------------
def test_public_names() -> None:
    assert api.__all__ == [
        "API_VERSION", "MAX_BODY_BYTES", "MAX_YAML_BYTES", "ApiServer", "bind_tcp", "bind_uds",
        "create_app", "create_sla_app", "openapi_document", "openapi_text", "serve",
        "serve_tcp", "serve_uds", "write_openapi",
    ]
    star: dict[str, Any] = {}
    exec("from qosd.api import *", star)  # every listed name resolves, and nothing else comes
    assert sorted(set(star) - {"__builtins__"}) == sorted(api.__all__)


def test_python_m_qosd_api_writes_the_document(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "openapi.json"
    subprocess.run([sys.executable, "-m", "qosd.api", "--openapi", str(out)], check=True,
                   cwd=ROOT, timeout=120)
    assert out.read_text() == api.openapi_text()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644


# --------------------------------------------------------------------------
# The report-only SLA app (sla.sock)
# --------------------------------------------------------------------------
SLA_BODY = {"stage": "audio-frontend", "instance": "pod-1", "reports": [
    {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": 500,
     "deadline_misses": 2, "drops": 0, "errors": 0, "attainment": 0.996}]}


def test_sla_report_route_is_one(service: StoreService) -> None:
    """POST /v1/sla is the same route in both apps; the admin API only adds its token
    (401) and the 500 every admin route declares."""
    admin = api.create_app(as_service(service)).openapi()["paths"]["/v1/sla"]["post"]
    sla = api.create_sla_app(service).openapi()["paths"]["/v1/sla"]["post"]
    assert admin.pop("security") == [{"HTTPBearer": []}] and "security" not in sla
    assert set(admin["responses"]) - set(sla["responses"]) == {"401", "500"}
    admin["responses"] = {k: v for k, v in admin["responses"].items() if k not in ("401", "500")}
    assert admin == sla
    assert sla["operationId"] == "post_sla"
    assert set(sla["responses"]) == {"200", "403", "413", "422", "429"}


def test_sla_app_takes_reports_and_nothing_else(service: StoreService) -> None:
    app = api.create_sla_app(as_service(service))
    r = TestClient(app).post("/v1/sla", json=SLA_BODY)  # no peer credentials: who is it?
    assert r.status_code == 403 and r.json()["error"] == "no_peer_credentials"
    c = TestClient(with_peer(app))  # as qosd's unix-socket server gives them (root here)
    r = c.post("/v1/sla", json=SLA_BODY)
    assert (r.status_code, r.json()) == (200, {"accepted": 1})
    [got] = service.sla_reports  # the validated model reached the service
    assert got.stage == "audio-frontend" and got.reports[0].frames == 500
    assert c.get("/healthz").json() == {"ok": True}
    assert c.get("/v1/sla").status_code == 405  # reading the board is the admin socket's
    for method, path in [("GET", "/v1/policy"), ("PUT", "/v1/policy"), ("GET", "/v1/status"),
                         ("POST", "/v1/policy/rollback"), ("GET", "/readyz")]:
        r = c.request(method, path, json={"yaml": POLICY_A})
        assert r.status_code == 404 and r.json()["error"] == "not_found", (method, path)
    assert "apply" not in service.calls and "status" not in service.calls
    bad = c.post("/v1/sla", json={**SLA_BODY, "stage": ""})
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_request"
    assert bad.json()["errors"][0][0] == "body.stage"
    huge = b'{"stage": "' + b"x" * (api.MAX_BODY_BYTES + 1) + b'"}'
    r = c.post("/v1/sla", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    assert len(service.sla_reports) == 1


def test_sla_socket_is_0666_and_serves_reports(tmp_path: Path, service: StoreService) -> None:
    path = tmp_path / "sla.sock"
    server = api.bind_uds(api.create_sla_app(as_service(service)), path, mode=0o666)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    server.start_thread()
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)),
                          base_url="http://qosd") as c:
            assert c.post("/v1/sla", json=SLA_BODY).json() == {"accepted": 1}
            assert c.get("/v1/policy").status_code == 404
    finally:
        server.stop()
    assert not path.exists()
    assert [r.instance for r in service.sla_reports] == ["pod-1"]


# --------------------------------------------------------------------------
# Addresses: what qosd.config accepts is what api.serve can listen on
# --------------------------------------------------------------------------
def test_tcp_addresses() -> None:
    from qosd.config import QosdConfig

    for good in ("127.0.0.1:8470", "[::1]:8470", "localhost:1"):
        assert QosdConfig(api_tcp=good, metrics_addr=good).api_tcp == good
    assert QosdConfig(api_tcp="").api_tcp is None
    for bad in ("8470", ":8470", "host:", "host:99999", "host:x", "::1:8470", "host:0"):
        with pytest.raises(ValueError, match="api_tcp"):
            QosdConfig(api_tcp=bad)
        with pytest.raises(ValueError, match="metrics_addr"):
            QosdConfig(metrics_addr=bad)


def test_serve_refuses_a_bad_tcp_address(tmp_path: Path, service: StoreService) -> None:
    path = tmp_path / "qosd.sock"

    async def main() -> None:
        with pytest.raises(ValueError, match="api_tcp 'nonsense'"):
            await api.serve(api.create_app(as_service(service)), uds=str(path), tcp="nonsense")
        assert not path.exists()  # the unix listener it had started is stopped again

    asyncio.run(asyncio.wait_for(main(), 30))
