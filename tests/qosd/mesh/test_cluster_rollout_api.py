"""The rollout's API and CLI: ``PUT /v1/cluster/policy``, ``GET
/v1/cluster/rollout`` (qosd/api/cluster_policy.py) and ``mmmeshctl policy
apply --cluster`` / ``mmmeshctl policy rollout`` (mmmeshctl/_cluster_policy.py),
over a qosd API server whose service has a rollout provider: a real
``RolloutProvider`` around a real core, its gossip faked, its peers' answers
scripted (they arrive one batch per table read)."""

from __future__ import annotations

import json
import random
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

import mmmeshctl as ctl
from mmmesh.policy import parse_policy
from mmmeshctl import _cluster_policy
from qosd import api
from qosd.mesh.membership.core import AppStateReceived, Event
from qosd.mesh.rollout.core import (
    Action,
    MeshVersion,
    Realise,
    Rollout,
)
from qosd.mesh.rollout.provider import RolloutProvider, locked
from testkit.qosd_fake import StoreService, as_service
from testkit.rollout_cases import POLICY, SMALL, FakeGossip, announce, report

V1 = MeshVersion(1, "node-a")
CANON = parse_policy(POLICY).to_yaml()


class Provider(RolloutProvider):
    """A real provider; Realise succeeds at once; each table read first feeds
    the core the next scripted batch of peer events."""

    def __init__(self, steps: list[list[Event]], synced: bool = True) -> None:
        self.gossip = FakeGossip("node-a", ("node-b", "node-c", "node-d"))
        core = Rollout(self.gossip, random.Random(1))
        if synced:
            core.on_events([AppStateReceived("node-d", b'{"v":1}', True)], 0.0)
        super().__init__(core, locked(threading.Lock()), self._host, clock=lambda: 1.0)
        self.steps = steps

    def _host(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Realise):
                self._host(self.rollout.on_realised(a.version, True, "", 1.0))

    def table(self, version: str | None = None) -> dict[str, Any] | None:
        if self.steps:
            self.rollout.on_events(self.steps.pop(0), 2.0)
        return super().table(version)


class MeshService(StoreService):
    def __init__(self, state_dir: Path, provider: Provider | None) -> None:
        super().__init__(state_dir)
        self.provider = provider

    def cluster_rollout(self) -> Provider | None:
        return self.provider


def acks(*nodes: str, text: str = CANON) -> list[Event]:
    return [report(n, V1, text) for n in nodes]


# --------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------
def test_put_starts_a_rollout_and_get_reads_its_table(tmp_path: Path) -> None:
    provider = Provider([[], acks("node-b", "node-c")])
    client = TestClient(api.create_app(as_service(MeshService(tmp_path, provider))))
    r = client.get("/v1/cluster/rollout")
    assert (r.status_code, r.json()["error"]) == (404, "not_found")
    r = client.put("/v1/cluster/policy", json={"yaml": POLICY, "author": "alice"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert (body["version"], body["author"], body["node"]) == ("1@node-a", "alice", "node-a")
    assert body["counts"]["pending"] == 4  # (its own realisation starts after the answer)
    assert not body["complete"] and body["live"] == 4
    assert provider.gossip.sent[0].key == "policy"
    client.get("/v1/cluster/rollout", params={"version": "1@node-a"})
    t = client.get("/v1/cluster/rollout").json()
    assert t["counts"]["acked"] == 3 and {r["node"]: r["state"] for r in t["rows"]} == {
        "node-a": "acked", "node-b": "acked", "node-c": "acked", "node-d": "pending"}
    assert client.get("/v1/cluster/rollout", params={"version": "7"}).status_code == 422


def test_put_errors(tmp_path: Path) -> None:
    provider = Provider([])
    client = TestClient(api.create_app(as_service(MeshService(tmp_path, provider))))
    r = client.put("/v1/cluster/policy", json={"yaml": "apiVersion: mmmesh/v1\n"})
    assert (r.status_code, r.json()["error"]) == (422, "invalid_policy")
    assert client.put("/v1/cluster/policy", json={"yaml": POLICY}).status_code == 202
    r = client.put("/v1/cluster/policy", json={"yaml": SMALL, "base_version": "0"})
    assert (r.status_code, r.json()["error"]) == (409, "conflict")
    assert "1@node-a" in r.json()["message"]
    r = client.put("/v1/cluster/policy", json={"yaml": SMALL, "base_version": "1@node-a"})
    assert (r.status_code, r.json()["version"]) == (202, "2@node-a")
    r = client.put("/v1/cluster/policy", json={"yaml": SMALL, "base_version": 2})
    assert (r.status_code, r.json()["error"]) == (422, "invalid_request")
    lonely = MeshService(tmp_path / "b", Provider([], synced=False))
    r = TestClient(api.create_app(as_service(lonely))).put("/v1/cluster/policy",
                                                           json={"yaml": POLICY})
    assert (r.status_code, r.json()["error"]) == (503, "not_synced")


class NoPeers(StoreService):
    cluster_rollout = None  # type: ignore[assignment]  # a service built without it


@pytest.mark.parametrize("service", ["none", "no-method"])
def test_without_peers_the_routes_say_so(tmp_path: Path, service: str) -> None:
    svc = MeshService(tmp_path, None) if service == "none" else NoPeers(tmp_path)
    client = TestClient(api.create_app(as_service(svc)))
    for r in (client.put("/v1/cluster/policy", json={"yaml": POLICY}),
              client.get("/v1/cluster/rollout")):
        assert (r.status_code, r.json()["error"]) == (503, "peers_not_enabled")
        assert "peers not enabled" in r.json()["message"]


# --------------------------------------------------------------------------
# mmmeshctl
# --------------------------------------------------------------------------
class Node:
    def __init__(self, service: MeshService, path: str) -> None:
        self.service, self.path, self.runner = service, path, CliRunner()

    def run(self, *args: str) -> tuple[int, str, str]:
        env = {"COLUMNS": "200", "MMMESH_SERVER": None, "MMMESH_TOKEN": None,
               "MMMESH_TIMEOUT": None}
        r = self.runner.invoke(ctl.app, ["--socket", self.path, *args], env=env,
                               prog_name="mmmeshctl")
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(_cluster_policy, "_sleep", lambda s: None)
    monkeypatch.setattr(_cluster_policy, "POLL_S", 0.0)
    (tmp_path / "p.yaml").write_text(POLICY)
    servers: list[Any] = []

    def start(provider: Provider | None) -> Node:
        service = MeshService(tmp_path / f"state{len(servers)}", provider)
        path = tmp_path / f"qosd{len(servers)}.sock"
        server = api.bind_uds(api.create_app(as_service(service)), path)
        server.start_thread()
        servers.append(server)
        return Node(service, str(path))

    yield start
    for s in servers:
        s.stop()


def test_apply_cluster_waits_for_every_ack(serve: Any, tmp_path: Path) -> None:
    node = serve(Provider([acks("node-b"), [], acks("node-c", "node-d")]))
    code, out, err = node.run("policy", "apply", "-f", str(tmp_path / "p.yaml"), "--cluster",
                              "--author", "alice")
    assert code == 0, (out, err)
    assert "mesh version 1@node-a" in out and "by alice" in out and out.count("ACK") == 4
    assert "4 acked of 4 live members" in out
    assert "mesh version 1@node-a: rolling out to 4 members" in err
    assert "ACKed by all 4 live members" in err
    code, out, _ = node.run("policy", "rollout", "-o", "json")
    assert code == 0 and json.loads(out)["counts"]["acked"] == 4
    code, out, _ = node.run("policy", "rollout", "--version", "1@node-a")
    assert code == 0 and "NODE" in out and "node-d" in out


def test_apply_cluster_exit_codes(serve: Any, tmp_path: Path) -> None:
    f = str(tmp_path / "p.yaml")
    why = "classes: sum of guaranteed rates 253.2mbit exceeds the link rate 200mbit"
    nack: list[Event] = [report("node-c", V1, CANON, ok=False, reason=why)]
    node = serve(Provider([acks("node-b", "node-d") + nack]))
    code, out, err = node.run("policy", "apply", "-f", f, "--cluster")
    assert code == 3 and "NACK" in out and "exceeds the link rate 200mbit" in out
    assert "1 of 4 members NACKed it" in err
    newer: list[Event] = [announce("node-z", 1, SMALL)]  # 1@node-z > 1@node-a: ours lost
    node = serve(Provider([newer]))
    code, out, err = node.run("policy", "apply", "-f", f, "--cluster")
    assert code == 4 and "superseded by 1@node-z" in out and "superseded by 1@node-z" in err
    node = serve(Provider([]))
    code, out, err = node.run("policy", "apply", "-f", f, "--cluster", "--timeout", "0.2")
    assert code == 5 and "3 of 4 members have not answered" in err and "pending" in out
    assert node.run("policy", "apply", "-f", f, "--cluster", "--base-version", "1")[0] == 2


def test_rollout_without_a_version_or_without_peers(serve: Any) -> None:
    code, _, err = serve(Provider([])).run("policy", "rollout")
    assert code == 6 and "no mesh policy version yet" in err
    code, _, err = serve(None).run("policy", "rollout")
    assert code == 1 and "peers not enabled" in err
