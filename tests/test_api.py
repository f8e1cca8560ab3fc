"""qosd's admin API (qosd/api.py) over a real PolicyStore, without a kernel.

``StoreService`` implements the Service protocol of qosd/model.py on a real
:class:`qosd.store.PolicyStore` in tmp_path; "the kernel" is a no-op that can
be told to fail.  The end-to-end tests with the real daemon are elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import hashlib
import json
import logging
import os
import socket
import stat
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from mmmesh._errors import DataplaneError
from mmmesh.policy import Policy, parse_policy
from qosd import api
from qosd.errors import UnrealizableError
from qosd.model import FlowRow, PolicyVersion, ReconcileResult, Service
from qosd.slaboard import SlaBoard
from qosd.store import PolicyStore

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "policy.yaml"
OPENAPI = ROOT / "docs" / "api" / "openapi.json"

POLICY_A = EXAMPLE.read_text()
POLICY_B = POLICY_A.replace("rate: 150mbit", "rate: 160mbit")
POLICY_C = POLICY_A.replace("rate: 80mbit", "rate: 90mbit")
assert POLICY_A != POLICY_B != POLICY_C

BAD_POLICY = """\
apiVersion: mmmesh/v1
link: {device: eth0, rate: 1gbit}
classes:
  - {name: video, id: 1, rate: 150mbps}
  - {name: Voice, id: 2, rate: 1mbit}
default_class: best-effort
"""

UNREALIZABLE = POLICY_A.replace("device: eth0", "device: nosuch0")

FLOWS = [
    FlowRow(src="10.0.0.1", dst="10.0.0.2", sport=40000, dport=9000, proto="tcp",
            class_name="video", class_id=12, modality="video", packets=1000,
            bytes=1_500_000, idle_s=0.01, rate_bps=150e6),
    FlowRow(src="10.0.0.1", dst="10.0.0.3", sport=40001, dport=9001, proto="tcp",
            class_name="voice", class_id=11, modality="audio", packets=100,
            bytes=15_000, idle_s=0.02, rate_bps=1.2e6),
    FlowRow(src="10.0.99.7", dst="10.0.0.3", sport=40002, dport=9002, proto="tcp",
            class_name=None, class_id=0, modality=None, packets=3,
            bytes=180, idle_s=5.0, rate_bps=0.0),
]


class StoreService:
    """The Service protocol over a real PolicyStore; a pretend kernel."""

    devices = frozenset({"eth0", "lo"})

    def __init__(self, state_dir: Path) -> None:
        self.store = PolicyStore(state_dir)
        self.started_at = time.time()
        self.last: ReconcileResult | None = None
        self.kernel_fails = False  # next apply/rollback raises DataplaneError
        self.explode: str | None = None  # method name that raises RuntimeError
        self.flows = list(FLOWS)
        self.calls: list[str] = []
        self.sla_board = SlaBoard()  # the real one: the fake is only the dataplane

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.explode == name:
            raise RuntimeError(f"bug in {name}")

    def policy(self) -> PolicyVersion | None:
        self._enter("policy")
        return self.store.current()

    def validate(self, text: str) -> Policy:
        self._enter("validate")
        pol = parse_policy(text)
        if pol.link.device not in self.devices:
            raise UnrealizableError([("link.device", f"no device {pol.link.device!r} here")])
        return pol

    def _reconcile(self, pol: Policy, trigger: str) -> None:
        if self.kernel_fails:
            raise DataplaneError(f"{trigger}: the kernel said no (pretend)")

    def _result(self, pv: PolicyVersion, trigger: str) -> ReconcileResult:
        self.last = ReconcileResult(ok=True, version=pv.version, started_at=time.time(),
                                    duration_s=0.001, trigger=trigger)
        return self.last

    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        self._enter("apply")
        pol = self.validate(text)
        self._reconcile(pol, "apply")
        pv = self.store.commit(pol, base_version=base_version, author=author)
        return pv, self._result(pv, "apply")

    def diff(self, text: str) -> str:
        self._enter("diff")
        new = parse_policy(text).to_yaml()
        cur = self.store.current()
        old = cur.text if cur else ""
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"version {cur.version}" if cur else "none", tofile="proposed"))

    def history(self) -> list[PolicyVersion]:
        self._enter("history")
        return self.store.history()

    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        self._enter("rollback")
        self._reconcile(self.store.get(to_version).policy, "rollback")
        pv = self.store.rollback(to_version, base_version=base_version, author=author)
        return pv, self._result(pv, "rollback")

    def status(self) -> dict[str, Any]:
        self._enter("status")
        cur = self.store.current()
        return {
            "node": "node-a",
            "policy_version": cur.version if cur else 0,
            "uplinks": {cur.policy.link.device: {"loaded": True, "flows": len(self.flows)}}
            if cur else {},
            "last_reconcile": dataclasses.asdict(self.last) if self.last else None,
            "store_problems": list(self.store.problems),
            "started_at": self.started_at,
            "adopted": False,
        }

    def top_flows(self, n: int = 20) -> list[FlowRow]:
        self._enter("top_flows")
        return sorted(self.flows, key=lambda r: r.rate_bps, reverse=True)[:n]

    def report_sla(self, report: dict[str, Any]) -> int:
        self._enter("report_sla")
        return self.sla_board.report(report)

    def sla(self) -> dict[str, list[dict[str, Any]]]:
        self._enter("sla")
        return self.sla_board.view()

    def healthy(self) -> bool:
        self._enter("healthy")
        return True

    def ready(self) -> bool:
        self._enter("ready")
        return self.store.current() is not None


def _is_service(obj: Service) -> Service:  # mypy: StoreService fits the protocol
    return obj


@pytest.fixture
def service(tmp_path: Path) -> StoreService:
    return StoreService(tmp_path / "state")


@pytest.fixture
def client(service: StoreService) -> TestClient:
    return TestClient(api.create_app(_is_service(service)))


def put(client: TestClient, text: str, base: int | None = None, **kw: Any) -> httpx.Response:
    return client.put("/v1/policy", json={"yaml": text, "base_version": base, **kw})


# --------------------------------------------------------------------------
# Happy paths
# --------------------------------------------------------------------------
def test_health_and_readiness(client: TestClient) -> None:
    r = client.get("/healthz")
    assert (r.status_code, r.json()) == (200, {"ok": True})
    r = client.get("/readyz")
    assert (r.status_code, r.json()) == (503, {"ok": False})
    assert put(client, POLICY_A).status_code == 200
    r = client.get("/readyz")
    assert (r.status_code, r.json()) == (200, {"ok": True})


def test_probe_that_raises_is_503(client: TestClient, service: StoreService) -> None:
    service.explode = "healthy"
    r = client.get("/healthz")
    assert (r.status_code, r.json()) == (503, {"ok": False})


def test_apply_then_get(client: TestClient) -> None:
    r = client.get("/v1/policy")
    assert r.status_code == 404
    assert r.json()["error"] == "not_found"

    r = put(client, POLICY_A, base=0, author="alice")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 1
    rec = body["reconcile"]
    assert rec["ok"] is True and rec["version"] == 1 and rec["trigger"] == "apply"
    assert set(rec) == {"ok", "version", "started_at", "duration_s", "trigger", "repaired",
                        "error"}

    r = client.get("/v1/policy")
    assert r.status_code == 200
    doc = r.json()
    pol = parse_policy(POLICY_A)
    assert doc["version"] == 1
    assert doc["author"] == "alice" and doc["note"] is None
    assert doc["yaml"] == pol.to_yaml()
    assert doc["sha256"] == hashlib.sha256(doc["yaml"].encode()).hexdigest()
    assert doc["policy"] == pol.model_dump(mode="json", by_alias=True)
    assert doc["policy"]["apiVersion"] == "mmmesh/v1"
    assert isinstance(doc["created_at"], float)
    assert parse_policy(doc["policy"]) == pol  # the JSON form reads back


def test_validate(client: TestClient, service: StoreService) -> None:
    r = client.post("/v1/policy/validate", json={"yaml": POLICY_A})
    assert r.status_code == 200
    assert r.json()["valid"] is True
    assert r.json()["policy"] == parse_policy(POLICY_A).model_dump(mode="json", by_alias=True)
    assert service.store.version == 0  # changes nothing


def test_invalid_policy_is_422_with_field_names(client: TestClient,
                                                service: StoreService) -> None:
    for r in (client.post("/v1/policy/validate", json={"yaml": BAD_POLICY}),
              put(client, BAD_POLICY),
              client.post("/v1/policy/diff", json={"yaml": BAD_POLICY})):
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error"] == "invalid_policy"
        fields = {f for f, _ in body["errors"]}
        assert {"classes[0].rate", "classes[1].name"} <= fields, fields
        assert "ambiguous" in dict(body["errors"])["classes[0].rate"]
        assert body["message"].startswith("invalid policy:")
    assert service.store.version == 0


def test_yaml_syntax_and_empty_policy(client: TestClient) -> None:
    r = client.post("/v1/policy/validate", json={"yaml": "classes: [\n"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_policy"
    assert "invalid YAML" in r.json()["errors"][0][1]
    r = client.post("/v1/policy/validate", json={"yaml": ""})
    assert r.status_code == 422 and r.json()["error"] == "invalid_policy"


def test_unrealizable_is_422(client: TestClient, service: StoreService) -> None:
    r = put(client, UNREALIZABLE)
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "unrealizable"
    assert body["errors"] == [["link.device", "no device 'nosuch0' here"]]
    assert service.store.version == 0


def test_diff(client: TestClient) -> None:
    r = client.post("/v1/policy/diff", json={"yaml": POLICY_A})
    assert r.status_code == 200
    assert r.json()["changed"] is True
    assert r.json()["diff"].startswith("--- none\n+++ proposed\n")
    put(client, POLICY_A)
    r = client.post("/v1/policy/diff", json={"yaml": POLICY_A})
    assert r.json() == {"diff": "", "changed": False}
    r = client.post("/v1/policy/diff", json={"yaml": POLICY_B})
    d = r.json()
    assert d["changed"] is True
    assert "-  rate: 150mbit\n" in d["diff"] and "+  rate: 160mbit\n" in d["diff"]


def test_history_versions_and_rollback(client: TestClient, service: StoreService) -> None:
    assert client.get("/v1/policy/history").json() == {"versions": []}
    put(client, POLICY_A, author="a")
    put(client, POLICY_B, author="b")
    hist = client.get("/v1/policy/history").json()["versions"]
    assert [v["version"] for v in hist] == [2, 1]
    assert [v["author"] for v in hist] == ["b", "a"]
    assert set(hist[0]) == {"version", "created_at", "author", "note", "sha256"}

    r = client.get("/v1/policy/versions/1")
    assert r.status_code == 200
    assert r.json()["yaml"] == parse_policy(POLICY_A).to_yaml()
    assert client.get("/v1/policy/versions/1").json() == {
        **client.get("/v1/policy/versions/1").json()}
    r = client.get("/v1/policy/versions/7")
    assert r.status_code == 404 and r.json() == {"error": "not_found",
                                                 "message": "no policy version 7"}
    for bad in ("0", "-1", "abc", "1.5", str(2**64)):
        r = client.get(f"/v1/policy/versions/{bad}")
        assert r.status_code == 422, bad
        assert r.json()["error"] == "invalid_request"

    r = client.post("/v1/policy/rollback", json={"to_version": 1, "base_version": 2,
                                                 "author": "ops"})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 3
    assert r.json()["reconcile"]["trigger"] == "rollback"
    cur = client.get("/v1/policy").json()
    assert cur["version"] == 3 and cur["note"] == "rollback to 1" and cur["author"] == "ops"
    assert cur["sha256"] == hist[1]["sha256"]

    r = client.post("/v1/policy/rollback", json={"to_version": 99})
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.post("/v1/policy/rollback", json={"to_version": 2, "base_version": 2})
    assert r.status_code == 409
    assert r.json()["base_version"] == 2 and r.json()["current_version"] == 3
    assert service.store.version == 3


def test_conflict_between_two_writers(tmp_path: Path, service: StoreService) -> None:
    put(TestClient(api.create_app(service)), POLICY_A)
    # two clients (two API processes, even) on the same store directory
    alice = TestClient(api.create_app(service))
    bob = TestClient(api.create_app(StoreService(tmp_path / "state")))
    base_a = alice.get("/v1/policy").json()["version"]
    base_b = bob.get("/v1/policy").json()["version"]
    assert base_a == base_b == 1
    r = put(alice, POLICY_B, base=base_a, author="alice")
    assert r.status_code == 200 and r.json()["version"] == 2
    r = put(bob, POLICY_C, base=base_b, author="bob")
    assert r.status_code == 409
    assert r.json() == {
        "error": "conflict",
        "message": "policy changed: your edit is based on version 1, the current version is 2",
        "base_version": 1,
        "current_version": 2,
    }
    assert service.store.version == 2
    assert service.store.current().author == "alice"  # type: ignore[union-attr]


def test_concurrent_writers_exactly_one_wins(client: TestClient,
                                             service: StoreService) -> None:
    put(client, POLICY_A)
    codes: list[int] = []
    lock = threading.Lock()
    go = threading.Barrier(8)

    def writer(i: int) -> None:
        go.wait()
        text = POLICY_A.replace("rate: 150mbit", f"rate: {100 + i}mbit")
        r = put(client, text, base=1, author=f"w{i}")
        with lock:
            codes.append(r.status_code)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] + [409] * 7
    assert service.store.version == 2


def test_status_and_flows(client: TestClient) -> None:
    r = client.get("/v1/status")
    assert r.status_code == 200
    st = r.json()
    assert st["node"] == "node-a" and st["policy_version"] == 0 and st["last_reconcile"] is None
    put(client, POLICY_A)
    st = client.get("/v1/status").json()
    assert st["policy_version"] == 1 and st["last_reconcile"]["version"] == 1
    assert st["uplinks"] == {"eth0": {"loaded": True, "flows": 3}}

    r = client.get("/v1/flows/top")
    assert r.status_code == 200
    flows = r.json()["flows"]
    assert [f["class_name"] for f in flows] == ["video", "voice", None]
    assert flows[0] == dataclasses.asdict(FLOWS[0])
    assert len(client.get("/v1/flows/top", params={"n": 1}).json()["flows"]) == 1
    for bad in ("0", "1001", "x", "-5"):
        r = client.get("/v1/flows/top", params={"n": bad})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", bad
        assert r.json()["errors"][0][0] == "query.n"


# --------------------------------------------------------------------------
# Bad requests: 4xx, never 500
# --------------------------------------------------------------------------
def test_malformed_requests(client: TestClient, service: StoreService) -> None:
    cases: list[tuple[str, str, Any]] = [
        ("PUT", "/v1/policy", {"yaml": POLICY_A, "extra": 1}),
        ("PUT", "/v1/policy", {}),
        ("PUT", "/v1/policy", {"yaml": 5}),
        ("PUT", "/v1/policy", {"yaml": POLICY_A, "base_version": -1}),
        ("PUT", "/v1/policy", {"yaml": POLICY_A, "base_version": "one"}),
        ("PUT", "/v1/policy", {"yaml": POLICY_A, "author": "x" * 257}),
        ("PUT", "/v1/policy", [POLICY_A]),
        ("PUT", "/v1/policy", None),
        ("POST", "/v1/policy/validate", {"text": POLICY_A}),
        ("POST", "/v1/policy/diff", {"yaml": None}),
        ("POST", "/v1/policy/rollback", {"to_version": 0}),
        ("POST", "/v1/policy/rollback", {"to_version": True}),
        ("POST", "/v1/policy/rollback", {"version": 1}),
    ]
    for method, path, body in cases:
        r = client.request(method, path, json=body)
        assert r.status_code == 422, (method, path, body, r.text)
        b = r.json()
        assert b["error"] == "invalid_request" and b["errors"], b
    r = client.put("/v1/policy", json={"yaml": POLICY_A, "extra": 1})
    assert ["body.extra", "unknown field"] in r.json()["errors"]
    r = client.put("/v1/policy", json={})
    assert ["body.yaml", "required field is missing"] in r.json()["errors"]
    r = client.put("/v1/policy", content=b"{not json", headers={"content-type":
                                                                 "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r = client.put("/v1/policy", content=b"\xff\xfe", headers={"content-type":
                                                                "application/json"})
    assert r.status_code == 422
    r = client.put("/v1/policy", content=b'{"yaml": "\xff\x80"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r = client.delete("/v1/policy")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert service.store.version == 0
    assert "apply" not in service.calls  # refused before reaching the service


def test_size_limits(client: TestClient, service: StoreService) -> None:
    big = "# " + "x" * api.MAX_YAML_BYTES + "\n" + POLICY_A
    r = put(client, big)
    assert r.status_code == 422 and r.json()["errors"][0][0] == "body.yaml"
    # characters under the limit, UTF-8 bytes over it
    wide = "# " + "é" * (api.MAX_YAML_BYTES // 2 + 10) + "\n" + POLICY_A
    r = client.post("/v1/policy/validate", json={"yaml": wide})
    assert r.status_code == 422 and "1 MiB" in r.json()["errors"][0][1]
    # just under the limit is fine
    ok = "# " + "x" * (api.MAX_YAML_BYTES - len(POLICY_A.encode()) - 10) + "\n" + POLICY_A
    assert client.post("/v1/policy/validate", json={"yaml": ok}).status_code == 200
    # a body over the transport limit never reaches the JSON parser
    huge = b'{"yaml": "' + b"x" * (api.MAX_BODY_BYTES + 1) + b'"}'
    r = client.put("/v1/policy", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"

    def chunks() -> Any:
        for _ in range(api.MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536

    r = client.put("/v1/policy", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert service.store.version == 0


def test_dataplane_error_is_503_and_store_unchanged(client: TestClient,
                                                   service: StoreService) -> None:
    put(client, POLICY_A)
    service.kernel_fails = True
    r = put(client, POLICY_B)
    assert r.status_code == 503
    assert r.json() == {"error": "dataplane", "message": "apply: the kernel said no (pretend)"}
    r = client.post("/v1/policy/rollback", json={"to_version": 1})
    assert r.status_code == 503
    assert service.store.version == 1


def test_unexpected_error_is_500_and_logged(client: TestClient, service: StoreService,
                                            caplog: pytest.LogCaptureFixture) -> None:
    service.explode = "status"
    with caplog.at_level(logging.ERROR, logger="qosd.api"):
        r = client.get("/v1/status")
    assert r.status_code == 500
    assert r.json()["error"] == "internal"
    assert "bug in status" not in r.text  # no internals to the client
    assert any("bug in status" in (rec.exc_text or "") for rec in caplog.records)
    # a service returning garbage is a 500 too, not a crash
    service.explode = None
    service.flows = [{"nonsense": True}]  # type: ignore[list-item]
    with caplog.at_level(logging.ERROR, logger="qosd.api"):
        assert client.get("/v1/flows/top").status_code == 500


# --------------------------------------------------------------------------
# Auth
# --------------------------------------------------------------------------
TOKEN = "s3cret-token"


def test_token_required_except_healthz(service: StoreService) -> None:
    with pytest.raises(ValueError):
        api.create_app(service, token="")
    c = TestClient(api.create_app(service, token=TOKEN))
    assert c.get("/healthz").status_code == 200
    protected = [("GET", "/readyz"), ("GET", "/v1/policy"), ("GET", "/v1/status"),
                 ("GET", "/v1/flows/top"), ("GET", "/v1/policy/history"),
                 ("GET", "/openapi.json"), ("GET", "/docs"),
                 ("PUT", "/v1/policy"), ("POST", "/v1/policy/rollback")]
    auth: str | bytes | None
    for auth in (None, "Bearer wrong", f"Basic {TOKEN}", "Bearer", f"Bearer {TOKEN}x",
                 f"bearer {TOKEN[:-1]}", "Bearer s3cret-tokén".encode()):
        headers = {"Authorization": auth} if auth else {}
        for method, path in protected:
            r = c.request(method, path, headers=headers, json={"yaml": POLICY_A})
            assert r.status_code == 401, (auth, path)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"] == "unauthorized"
    assert service.store.version == 0
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert c.get("/v1/status", headers=ok).status_code == 200
    assert c.get("/v1/policy", headers=ok).status_code == 404
    assert c.put("/v1/policy", headers=ok, json={"yaml": POLICY_A}).status_code == 200
    assert c.get("/readyz", headers=ok).status_code == 200
    assert c.get("/v1/status", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    # no token configured: nothing needed (the unix socket)
    assert TestClient(api.create_app(service)).get("/v1/status").status_code == 200


# --------------------------------------------------------------------------
# OpenAPI
# --------------------------------------------------------------------------
def test_openapi_document_is_checked_in() -> None:
    assert OPENAPI.exists(), "run: python -m qosd.api --openapi docs/api/openapi.json"
    assert OPENAPI.read_text() == api.openapi_text(), (
        "docs/api/openapi.json is stale; run: python -m qosd.api --openapi docs/api/openapi.json"
    )


def test_openapi_describes_the_api(client: TestClient, tmp_path: Path) -> None:
    doc = client.get("/openapi.json").json()
    assert doc == api.openapi_document()
    assert set(doc["paths"]) == {
        "/v1/policy", "/v1/policy/validate", "/v1/policy/diff", "/v1/policy/history",
        "/v1/policy/versions/{version}", "/v1/policy/rollback", "/v1/status",
        "/v1/flows/top", "/v1/sla", "/healthz", "/readyz",
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
    assert api.main(["--openapi", str(out)]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["openapi.json"]  # no temp files left


def test_schemathesis_fuzz(tmp_path: Path) -> None:
    """Fuzz every operation (valid and invalid inputs): never a 500, responses
    match the schema, and the policy version only moves on a 2xx PUT/rollback."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
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


def test_split_hostport() -> None:
    assert api.split_hostport("127.0.0.1:8470") == ("127.0.0.1", 8470)
    assert api.split_hostport("[::1]:80") == ("::1", 80)
    for bad in ("8470", ":80", "host:", "host:99999", "host:x"):
        with pytest.raises(ValueError):
            api.split_hostport(bad)


def test_sla_report_round_trip(client: Any) -> None:
    body = {"stage": "audio-frontend", "reports": [
        {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": 500,
         "deadline_misses": 2, "drops": 0, "errors": 0, "attainment": 0.996,
         "e2e_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 9.0}}]}
    r = client.post("/v1/sla", json=body)
    assert r.status_code == 200 and r.json() == {"accepted": 1}
    got = client.get("/v1/sla").json()
    assert got["instances"][0]["stage"] == "audio-frontend"
    assert got["instances"][0]["attainment"] == 0.996
    assert got["stages"][0]["sources"] == 1 and got["stages"][0]["frames"] == 500
    assert got["classes"][0]["sla_class"] == "voice" and "stage" not in got["classes"][0] or \
        got["classes"][0]["stage"] is None
    bad = client.post("/v1/sla", json={**body, "reports": [{**body["reports"][0],
                                                             "attainment": 1.5}]})
    assert bad.status_code == 422 and "attainment" in bad.text
