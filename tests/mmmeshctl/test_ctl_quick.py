"""mmmeshctl's quick path (``_quick.py``: ``policy apply`` on the unix socket
without typer) against the typer command: the command lines it takes, and
for each of them the same exit code, stdout, stderr and request as typer's;
everything else left to typer; run without importing typer or http.client."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import mmmeshctl as ctl
from mmmeshctl import _quick
from qosd import api
from testkit.ctl_cases import ENV
from testkit.qosd_fake import BAD_POLICY, POLICY_A, POLICY_B, UNREALIZABLE, StoreService

ROOT = Path(__file__).resolve().parents[2]
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("MMMESH_")}


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[str]:
    service = StoreService(tmp_path / "state")
    path = tmp_path / "qosd.sock"
    server = api.bind_uds(api.create_app(service), path)
    server.start_thread()
    try:
        yield str(path)
    finally:
        server.stop()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, text in (("a", POLICY_A), ("b", POLICY_B), ("bad", BAD_POLICY),
                       ("unreal", UNREALIZABLE)):
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        out[name] = str(p)
    (tmp_path / "latin1.yaml").write_bytes(b"description: caf\xe9\n")
    out["latin1"] = str(tmp_path / "latin1.yaml")
    out["missing"] = str(tmp_path / "missing.yaml")
    return out


def test_the_command_lines_it_takes() -> None:
    env: dict[str, str] = {}
    d = "/run/mmmesh/qosd.sock"
    assert _quick.parse(["policy", "apply", "-f", "p.yaml"], env) == (d, 30.0, "p.yaml", None,
                                                                       None)
    assert _quick.parse(["--socket", "/s", "--timeout=2.5", "policy", "apply", "--filename=p",
                         "--author", "zoë", "--base-version", "3"], env) == \
        ("/s", 2.5, "p", 3, "zoë")
    assert _quick.parse(["policy", "apply", "-f", "-"], env) == (d, 30.0, "-", None, None)
    assert _quick.parse(["policy", "apply", "-f", "p"], {"MMMESH_SOCKET": "/e",
                                                         "MMMESH_TIMEOUT": "4"}) == \
        ("/e", 4.0, "p", None, None)
    assert _quick.parse(["--socket", "/c", "policy", "apply", "-f", "p"],
                        {"MMMESH_SOCKET": "/e"})[0] == "/c"  # type: ignore[index]
    assert _quick.parse(["policy", "apply", "-f", "p"], {"MMMESH_SOCKET": ""})[0] == d  # type: ignore[index]
    for argv, e in (
            (["policy", "apply", "-f", "p", "--cluster"], {}),
            (["policy", "apply", "-f", "p", "--timeout", "3"], {}),
            (["policy", "apply", "--help"], {}), (["--help"], {}),
            (["policy", "apply", "-f", "p", "-h"], {}),
            (["policy", "apply"], {}), (["policy", "apply", "-f"], {}),
            (["policy", "apply", "-f", "p", "-f", "q"], {}),
            (["policy", "apply", "-fp"], {}), (["policy", "apply", "-f", "-x"], {}),
            (["policy", "apply", "-f", "p", "extra"], {}),
            (["policy", "apply", "-f", "p", "--base-version", "-1"], {}),
            (["policy", "apply", "-f", "p", "--base-version", "x"], {}),
            (["--timeout", "0.05", "policy", "apply", "-f", "p"], {}),
            (["--timeout", "1e3", "policy", "apply", "-f", "p"], {}),
            (["policy", "apply", "-f", "p"], {"MMMESH_TIMEOUT": "soon"}),
            (["--server", "http://n:1", "policy", "apply", "-f", "p"], {}),
            (["policy", "apply", "-f", "p"], {"MMMESH_SERVER": "http://n:1"}),
            (["policy", "apply", "-f", "p"], {"MMMESH_TOKEN": "t"}),
            (["policy", "apply", "-f", "p"], {"_MMMESHCTL_COMPLETE": "complete_bash"}),
            (["policy", "validate", "-f", "p"], {}), (["status"], {}), ([], {}),
            (["--socket", "/s", "policy", "--help"], {}), (["policy", "rollout"], {})):
        assert _quick.parse(argv, e) is None, argv


def _quick_run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                assert _quick.run(argv, {})
            except SystemExit as e:
                code = int(e.code or 0)
            except typer.Exit as e:  # (typer is loaded in this process: fail() raises its Exit)
                code = e.exit_code
    finally:
        sys.stdin = old_stdin
    return code, out.getvalue(), err.getvalue()


def _typer_run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    r = CliRunner().invoke(ctl.app, argv, input=stdin, env=ENV, prog_name="mmmeshctl")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def _same_modulo_version(a: tuple[int, str, str], b: tuple[int, str, str]) -> bool:
    """Equal, but for the version number and the reconcile time in
    'policy applied: version N (reconciled in M ms)' (each run adds one)."""
    import re

    def norm(t: tuple[int, str, str]) -> tuple[int, str, str]:
        return (t[0], re.sub(r"version \d+ \(reconciled in \d+ ms\)", "version V (M ms)", t[1]),
                t[2])

    return norm(a) == norm(b)


def test_it_does_what_the_typer_command_does(sock: str, files: dict[str, str],
                                             tmp_path: Path) -> None:
    cases: list[tuple[list[str], str]] = [
        (["policy", "apply", "-f", files["a"]], ""),
        (["policy", "apply", "-f", files["b"], "--author", "zoë@host"], ""),
        (["policy", "apply", "--filename", files["a"], "--base-version", "0"], ""),  # conflict
        (["policy", "apply", "-f", files["bad"]], ""),  # rejected: 3
        (["policy", "apply", "-f", files["unreal"]], ""),
        (["policy", "apply", "-f", files["latin1"]], ""),  # not UTF-8: 3
        (["policy", "apply", "-f", files["missing"]], ""),  # unreadable: 2
        (["policy", "apply", "-f", "-"], POLICY_B),  # stdin
    ]
    for argv, stdin in cases:
        full = ["--socket", sock, *argv]
        assert _quick.parse(full, {}) is not None, argv
        got, want = _quick_run(full, stdin), _typer_run(full, stdin)
        assert _same_modulo_version(got, want), (argv, got, want)
    # unreachable: no socket, a dead socket, a socket that never answers
    dead = tmp_path / "dead.sock"
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    hung = tmp_path / "hung.sock"
    h = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    h.bind(str(hung))
    h.listen(8)
    try:
        for target in (str(tmp_path / "none.sock"), str(dead), str(hung)):
            full = ["--socket", target, "--timeout", "0.3", "policy", "apply", "-f", files["a"]]
            got, want = _quick_run(full), _typer_run(full)
            assert got == want and got[0] == 5, (target, got, want)
    finally:
        h.close()


def test_the_console_runs_it_without_typer_or_http_client(sock: str,
                                                          files: dict[str, str]) -> None:
    code = ("import json, sys\n"
            "import mmmeshctl\n"
            "try:\n"
            "    mmmeshctl.main()\n"
            "finally:\n"
            "    print('\\nLOADED ' + json.dumps(sorted(m for m in sys.modules if m in "
            "('typer', 'click', 'http.client', 'email.parser', 'rich', 'pydantic'))), "
            "file=sys.stderr)\n")
    env = {**CLEAN, "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> tuple[int, str, list[str]]:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=60, check=False)
        return r.returncode, r.stdout, json.loads(r.stderr.rpartition("LOADED ")[2])

    rc, out, loaded = run("--socket", sock, "policy", "apply", "-f", files["a"])
    assert rc == 0 and out.startswith("policy applied: version ") and loaded == [], (out, loaded)
    rc, _, loaded = run("--socket", sock, "policy", "apply", "-f", files["bad"])
    assert rc == 3 and loaded == []
    # anything else is typer's, as before
    rc, _, loaded = run("--socket", sock, "policy", "apply", "-f", files["a"], "--help")
    assert rc == 0 and "typer" in loaded
