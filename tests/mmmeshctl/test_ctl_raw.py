"""mmmeshctl against scripted servers (raw HTTP answers on a unix socket), and
its parts on their own: what --server hands to http.client, the SLA tables
against qosd's schema, the pydantic-free option values against typer's."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import mmmeshctl as ctl
from mmmeshctl import _client, _fast
from mmmeshctl import render as _render
from testkit.ctl_cases import ENV
from testkit.qosd_fake import POLICY_A


class RawServer:
    """A unix socket that answers every connection with ``answer`` (raw bytes), then closes."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.path, self.answer = path, answer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data)
                c.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


def http(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def ask(tmp_path: Path, answer: bytes, *args: str) -> tuple[Result, list[bytes]]:
    """``mmmeshctl --socket S ARGS`` against a RawServer at S: the result, and the
    requests the server read (each up to the end of its headers, at least)."""
    srv = RawServer(tmp_path / "raw.sock", answer)
    try:
        res = CliRunner().invoke(ctl.app, ["--socket", str(srv.path), *args], env=ENV)
    finally:
        srv.close()
    return res, srv.requests


# --------------------------------------------------------------------------
# Answers qosd would not give
# --------------------------------------------------------------------------
@pytest.mark.parametrize(("answer", "code", "message"), [
    (b"", 5, "cannot reach qosd at unix socket"),  # closed without an answer
    (b"SSH-2.0-OpenSSH\r\n", 5, "cannot reach qosd at unix socket"),  # not HTTP
    (http("200 OK", b'{"a": 1}')[:-3], 5, "cannot reach qosd at unix socket"),  # cut short
    (http("200 OK", b"hello"), 1, "error: qosd sent a non-JSON answer (200)"),
    (http("502 Bad Gateway", b"no qosd\r\n"), 1, "error: qosd answered HTTP 502: no qosd"),
    (http("404 Not Found", b'{"error": "not_found", "message": "gone"}'), 6,
     "mmmeshctl: error: gone"),
    (http("401 Unauthorized", b'{"error": "unauthorized", "message": "no"}'), 7,
     "authentication failed"),
])
def test_broken_answers(tmp_path: Path, answer: bytes, code: int, message: str) -> None:
    res, _ = ask(tmp_path, answer, "--timeout", "5", "status")
    assert res.exit_code == code, res.output
    assert message in res.stderr, res.stderr
    assert res.stdout == ""


def test_answer_before_the_body_was_read(tmp_path: Path) -> None:
    """A server that answers 401 after the headers and closes without reading a
    1 MiB body: the client shows that answer (exit 7), not the broken pipe (5)."""
    big = tmp_path / "big.yaml"
    big.write_text(POLICY_A + ("#" * 1023 + "\n") * 1024)
    res, requests = ask(tmp_path, http("401 Unauthorized",
                                       b'{"error": "unauthorized", "message": "no"}'),
                        "policy", "apply", "-f", str(big))
    assert (res.exit_code, res.stdout) == (ctl.EXIT.AUTH, ""), res.stderr
    assert "authentication failed" in res.stderr
    assert len(requests[0]) < 1 << 20  # the body was cut short


def test_request_on_the_wire(tmp_path: Path) -> None:
    policy = tmp_path / "a.yaml"
    policy.write_text(POLICY_A)
    res, requests = ask(
        tmp_path, http("200 OK", b'{"version": 7, "reconcile": {"ok": true, "duration_s": 0.05}}'),
        "policy", "apply", "-f", str(policy), "--author", "zoë")
    assert (res.exit_code, res.stdout) == (0, "policy applied: version 7 (reconciled in 50 ms)\n")
    head = requests[0].partition(b"\r\n\r\n")[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "PUT /v1/policy HTTP/1.1"
    assert "Content-Type: application/json" in lines and "User-Agent: mmmeshctl/1" in lines
    assert not any(ln.lower().startswith("authorization") for ln in lines)


# --------------------------------------------------------------------------
# The parts on their own
# --------------------------------------------------------------------------
@pytest.mark.parametrize(("server", "host", "port", "prefix"), [
    ("node1", "node1", 80, ""),
    ("http://node1:8470/qosd/", "node1", 8470, "/qosd"),
    ("HTTPS://node1", "node1", 443, ""),
    ("http://[::1]:8470", "::1", 8470, ""),  # http.client wants it without brackets
    ("[fe80::1]", "fe80::1", 80, ""),
    ("http://user@10.0.0.1:0", "10.0.0.1", 0, ""),  # credentials are not used
])
def test_server_address(server: str, host: str, port: int, prefix: str) -> None:
    """What --server hands to http.client (the connection is not opened)."""
    conn, got_prefix = _client.Conn(server=server)._connection()
    assert (conn.host, conn.port, got_prefix) == (host, port, prefix)
    assert type(conn).__name__ == ("HTTPSConnection" if port == 443 else "HTTPConnection")


def test_status_sla_tables(tmp_path: Path) -> None:
    """The SLA tables of ``status`` from a ``sla`` object built with qosd's own schema."""
    from mmmesh.sla.report import Quantiles, SlaMerged, SlaView

    window: dict[str, Any] = {
        "sla_class": "voice", "modality": "audio", "sources": 2, "window_s": 5.0,
        "frames": 1000, "deadline_misses": 12, "drops": 3, "errors": 1, "attainment": 0.988,
        "e2e_ms": Quantiles(p50=1.3, p90=2.0, p99=7.5, max=9.0),
        "received_at": time.time() - 7200}
    view = SlaView(instances=[], stages=[SlaMerged(stage="audio-frontend", **window)],
                   classes=[SlaMerged(**{**window, "sources": 3, "e2e_ms": None})])
    status = {"node": "node-a", "policy_version": 1, "sla": view.model_dump(mode="json")}
    res, _ = ask(tmp_path, http("200 OK", json.dumps(status).encode()), "status")
    assert res.exit_code == 0, res.output
    lines = [ln.split() for ln in res.stdout.splitlines()]
    stages = lines.index(["STAGE", "CLASS", "MODALITY", "SIDECARS", "FRAMES", "IN", "DEADLINE",
                          "MISSES", "DROPS", "ERRORS", "E2E", "P50", "E2E", "P99", "AGE"])
    assert lines[stages + 1] == ["audio-frontend", "voice", "audio", "2", "1000", "98.8%", "12",
                                 "3", "1", "1.3", "ms", "7.5", "ms", "2.0h"]
    classes = lines.index(["CLASS", "MODALITY", "WINDOWS", "FRAMES", "IN", "DEADLINE", "MISSES",
                           "DROPS", "ERRORS", "E2E", "P50", "E2E", "P99", "AGE"])
    assert lines[classes + 1] == ["voice", "audio", "3", "1000", "98.8%", "12", "3", "1", "-",
                                  "-", "2.0h"]
    assert lines[stages - 1][:4] == ["SLA", "attainment", "per", "stage"]
    assert lines[classes - 1][:4] == ["SLA", "per", "class,", "node-wide"]


def test_sla_columns_are_the_schemas() -> None:
    """Every field the SLA tables read is a field of mmmesh/sla/report.py's SlaMerged."""
    from mmmesh.sla.report import Quantiles, SlaMerged

    for _, field in _render.SLA_COLUMNS:
        name, _, quantile = field.partition(".")
        assert name in SlaMerged.model_fields, field
        if quantile:
            assert SlaMerged.model_fields[name].annotation == Quantiles | None, field
            assert quantile in Quantiles.model_fields, field
    assert len(_render.SLA_COLUMNS) == 12


def test_fast_option_values_are_typers(tmp_path: Path) -> None:
    """Every option value the pydantic-free path takes comes out as typer's own coercion."""
    import typer.main
    from typer._click import Context
    from typer._click.exceptions import BadParameter
    from typer._coercion import build_runtime_param

    samples: list[Any] = ["0", "1", "7", "007", "+5", "-1", "-0", "1000", "1001", " 5", "5 ",
                          "1_000", "1.0", "1.5", ".5", "5.", "0.1", "0.05", "1e3", "inf",
                          "nan", "0x10", "\u0663", "", "x", "table", "json", "yaml", "JSON",
                          "xml", "-", "/run/x.sock", True, False, 3, 3.5]

    def outcome(rp: Any, value: Any, param: Any, ctx: Any) -> Any:
        try:
            out = rp.coerce(value, param=param, ctx=ctx)
        except BadParameter as e:
            return ("error", e.format_message())
        return (type(out), out)

    root = typer.main.get_command(ctl.app)
    todo: list[Any] = [root]
    checked = 0
    while todo:
        cmd = todo.pop()
        todo.extend(getattr(cmd, "commands", {}).values())
        ctx = Context(cmd, info_name=cmd.name)
        params = cmd.get_params(ctx)
        _fast.fast_params(params)
        for p in params:
            fast = getattr(p, "_runtime_param", None)
            if not isinstance(fast, _fast.FastRuntimeParam):
                continue
            slow = build_runtime_param(p.type_descriptor)
            for v in samples:
                assert outcome(fast, v, p, ctx) == outcome(slow, v, p, ctx), (cmd.name, p.name, v)
            checked += 1
    # --socket --server --token --timeout, 8 commands' options, --help everywhere, ...
    assert checked >= 30
