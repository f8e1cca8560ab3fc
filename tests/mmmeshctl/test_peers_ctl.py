"""``mmmeshctl cluster certs`` (its certificates satisfy qosd's identity rule),
``GET /v1/cluster/members`` and the members table."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from cryptography import x509
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from mmmeshctl import app
from mmmeshctl._cluster import members_table
from qosd import api
from qosd.mesh.membership._identity import load_credentials, node_of_uri, spiffe_id
from qosd.mesh.membership.core import MemberInfo, State


def test_certs_writes_what_the_identity_rule_expects(tmp_path: Path) -> None:
    out = tmp_path / "pki"
    r = CliRunner().invoke(app, ["cluster", "certs", "--out", str(out), "--nodes",
                                 "node-a, ip-10-0-0-1.ec2.internal", "--days", "30"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["ca.pem", "ca.key", "node-a.pem", "node-a.key",
                            "ip-10-0-0-1.ec2.internal.pem", "ip-10-0-0-1.ec2.internal.key"])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir())
    for node in ("node-a", "ip-10-0-0-1.ec2.internal"):
        cert = x509.load_pem_x509_certificate((out / f"{node}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        assert uris == [spiffe_id(node, "mmmesh")] and node_of_uri(uris[0], "mmmesh") == node
        assert san.get_values_for_type(x509.DNSName) == [node]  # the server name peers check
        creds = load_credentials(out / f"{node}.pem", out / f"{node}.key", out / "ca.pem",
                                 "mmmesh", node)
        assert creds.node == node
    # no silent overwrite; bad ids are a usage error
    again = CliRunner().invoke(app, ["cluster", "certs", "--out", str(out), "--nodes", "node-a"])
    assert again.exit_code == 4 and "exist" in again.output
    for bad in ("Node_A", "a,,a", "", "-x"):
        r = CliRunner().invoke(app, ["cluster", "certs", "--out", str(tmp_path / "x"),
                                     "--nodes", bad])
        assert r.exit_code == 2, (bad, r.output)


class _Peers:
    def snapshot(self) -> dict[str, Any]:
        return {
            "node": "node-a", "addr": "10.0.0.1:7946", "now": 100.0, "incarnation": 2,
            "health_score": 1, "stats": {"probes": 5, "deaths_declared": 0},
            "members": [
                MemberInfo("node-b", "10.0.0.2:7946", State.SUSPECT, 4, 98.5, 97.0, 0.0012),
                MemberInfo("node-a", "10.0.0.1:7946", State.ALIVE, 2, 10.0, None, None),
                MemberInfo("node-c", "", State.DEAD, 1, 50.0, None, None)],
            "packets": {"in": 3, "out": 4}, "bytes": {"in": 300, "out": 400},
            "dropped": {"impersonation": 1}, "send_failures": {"deadline": 2},
        }


class _Service:
    peers: Any = None


def test_members_endpoint_and_table() -> None:
    svc = _Service()
    client = TestClient(api.create_app(svc))  # type: ignore[arg-type]
    r = client.get("/v1/cluster/members")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    svc.peers = _Peers()
    doc = client.get("/v1/cluster/members").json()
    assert [m["node"] for m in doc["members"]] == ["node-a", "node-b", "node-c"]
    b = doc["members"][1]
    assert b == {"node": "node-b", "addr": "10.0.0.2:7946", "state": "suspect",
                 "incarnation": 4, "since_s": 1.5, "last_ack_s": 3.0, "rtt_s": 0.0012}
    assert doc["health_score"] == 1 and doc["traffic"]["dropped"] == {"impersonation": 1}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(members_table(doc))
    text = console.export_text()
    assert "node-a (this node)" in text and "1 alive, 1 dead, 1 suspect" in text
    assert "1.2 ms" in text and "3.0 s ago" in text and "health score 1" in text
