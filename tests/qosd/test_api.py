"""qosd's admin API (qosd/api/) over a real PolicyStore, without a kernel:
what each endpoint answers, bad requests, errors, auth.  The fake service is
testkit/qosd_fake.py; OpenAPI, fuzzing, sockets and the report-only app are in
tests/qosd/test_api_serving.py; the end-to-end tests with the real daemon are elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from mmmesh.policy import parse_policy
from qosd import api
from testkit.qosd_fake import (
    BAD_POLICY,
    FLOWS,
    POLICY_A,
    POLICY_B,
    POLICY_C,
    TOKEN,
    UNREALIZABLE,
    StoreService,
    as_service,
    put,
)


@pytest.fixture
def service(tmp_path: Path) -> StoreService:
    return StoreService(tmp_path / "state")


@pytest.fixture
def client(service: StoreService) -> TestClient:
    return TestClient(api.create_app(as_service(service)))


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

    won: list[int] = []

    def writer(i: int) -> None:
        go.wait()
        text = POLICY_A.replace("rate: 150mbit", f"rate: {100 + i}mbit")
        r = put(client, text, base=1, author=f"w{i}")
        with lock:
            codes.append(r.status_code)
            if r.status_code == 200:
                won.append(r.json()["version"])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] + [409] * 7
    # the winner is current; a loser may have taken a number before it lost
    # (numbers are never reused, not necessarily dense): history has 2 versions
    assert service.store.version == won[0] >= 2
    assert [v.version for v in service.store.history()] == [won[0], 1]


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




def test_sla_report_round_trip(client: Any) -> None:
    body: dict[str, Any] = {"stage": "audio-frontend", "reports": [
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
