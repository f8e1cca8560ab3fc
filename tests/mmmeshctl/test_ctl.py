"""mmmeshctl against a real qosd API server (unix socket, or TCP with a token)
serving qosd's API over the in-test StoreService of tests/qosd/test_api.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mmmeshctl as ctl
from mmmesh.policy import parse_policy
from mmmeshctl import _node
from qosd import api
from testkit.ctl_cases import ENV, LOADED
from testkit.qosd_fake import BAD_POLICY, POLICY_A, POLICY_B, UNREALIZABLE, StoreService

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tcp-token-123"


class Node:
    def __init__(self, service: StoreService, address: str) -> None:
        self.service = service
        self.address = address
        self.runner = CliRunner()

    def run(self, *args: str, input: str | None = None, env: dict[str, str | None] | None = None,
            ) -> Result:
        result = self.runner.invoke(ctl.app, [*self.target(), *args], input=input,
                                    env={**ENV, **(env or {})}, prog_name="mmmeshctl")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Result(result.exit_code, result.stdout, result.stderr)

    def target(self) -> list[str]:
        return ["--socket", self.address]


class TcpNode(Node):
    def target(self) -> list[str]:
        return ["--server", self.address]


class Result:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"Result(code={self.code}, out={self.out!r}, err={self.err!r})"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    service = StoreService(tmp_path / "state")
    path = tmp_path / "qosd.sock"
    server = api.bind_uds(api.create_app(service), path)
    server.start_thread()
    try:
        yield Node(service, str(path))
    finally:
        server.stop()


@pytest.fixture
def tcp_node(tmp_path: Path) -> Iterator[TcpNode]:
    service = StoreService(tmp_path / "state")
    server = api.bind_tcp(api.create_app(service, token=TOKEN), "127.0.0.1", 0)
    server.start_thread()
    try:
        yield TcpNode(service, f"http://127.0.0.1:{server.port}")
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
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"description: caf\xe9\n")
    out["latin1"] = str(latin1)
    return out


# --------------------------------------------------------------------------
# Each command
# --------------------------------------------------------------------------
def test_apply_and_get_in_every_format(node: Node, files: dict[str, str]) -> None:
    r = node.run("policy", "apply", "-f", files["a"], "--author", "alice")
    assert r.code == 0, r
    assert r.out.startswith("policy applied: version 1 (reconciled in ")

    r = node.run("policy", "get", "-o", "yaml")
    assert r.code == 0, r
    assert r.out.startswith("# policy version 1, sha256 ")
    assert parse_policy(r.out) == parse_policy(POLICY_A)  # re-appliable as it is

    r = node.run("policy", "get", "-o", "json")
    doc = json.loads(r.out)
    assert doc["version"] == 1 and doc["author"] == "alice"
    assert doc["policy"] == parse_policy(POLICY_A).model_dump(mode="json", by_alias=True)

    r = node.run("policy", "get")  # table
    assert r.code == 0, r
    assert "policy version 1" in r.out and "by alice" in r.out
    for word in ("control", "voice", "video", "lidar", "best-effort", "150mbit", "1.2mbit",
                 "audio", "video,image", "(by id only)", "10.0.99.0/24"):
        assert word in r.out, word

    r = node.run("policy", "get", "--version", "1", "-o", "json")
    assert json.loads(r.out)["version"] == 1


def test_apply_from_stdin_and_default_author(node: Node) -> None:
    r = node.run("policy", "apply", "-f", "-", input=POLICY_A, env={"SUDO_USER": "bob"})
    assert r.code == 0, r
    cur = node.service.store.current()
    assert cur is not None and cur.author is not None and cur.author.startswith("bob@")


def test_diff(node: Node, files: dict[str, str]) -> None:
    r = node.run("policy", "diff", "-f", files["a"])
    assert r.code == 0 and "+++ proposed" in r.out
    node.run("policy", "apply", "-f", files["a"])
    r = node.run("policy", "diff", "-f", files["a"])
    assert (r.code, r.out, r.err) == (0, "", "no changes\n")
    r = node.run("policy", "diff", "-f", files["b"])
    assert r.code == 0
    assert "-  rate: 150mbit" in r.out and "+  rate: 160mbit" in r.out
    assert "--- version 1" in r.out
    assert node.service.store.version == 1


def test_validate(node: Node, files: dict[str, str]) -> None:
    r = node.run("policy", "validate", "-f", files["a"])
    assert r.code == 0, r
    assert "valid: 5 classes (control, voice, video, lidar, best-effort) on eth0 at 1gbit" in r.out
    res = node.runner.invoke(ctl.app, ["--socket", "/nonexistent", "policy", "validate",
                                       "--local", "-f", files["a"]], env=ENV)
    assert res.exit_code == 0, res.output  # no daemon needed
    assert "valid: 5 classes" in res.stdout
    assert node.service.store.version == 0


def test_history_and_rollback(node: Node, files: dict[str, str]) -> None:
    r = node.run("policy", "history")
    assert r.code == 0 and r.err == "no policy versions yet\n"
    node.run("policy", "apply", "-f", files["a"], "--author", "a")
    node.run("policy", "apply", "-f", files["b"], "--author", "b")
    r = node.run("policy", "history")
    assert r.code == 0, r
    lines = r.out.splitlines()
    assert lines[0].split() == ["VERSION", "CREATED", "AUTHOR", "NOTE", "SHA256"]
    assert lines[1].split()[0] == "*2" and lines[2].split()[0] == "1"
    assert json.loads(node.run("policy", "history", "-o", "json").out)["versions"][0][
        "version"] == 2

    r = node.run("policy", "rollback", "--to", "1", "--base-version", "2")
    assert (r.code, r.out) == (0, "rolled back to version 1: now version 3\n"), r
    cur = node.service.store.current()
    assert cur is not None and cur.note == "rollback to 1"
    assert cur.policy == parse_policy(POLICY_A)
    assert "rollback to 1" in node.run("policy", "history").out


def test_status(node: Node, files: dict[str, str]) -> None:
    r = node.run("status")
    assert r.code == 0, r
    assert "node-a" in r.out and "policy version" in r.out and "none" in r.out
    node.run("policy", "apply", "-f", files["a"])
    r = node.run("status")
    assert "ok, apply of version 1" in r.out
    assert "uplink eth0" in r.out and "loaded, flows 3" in r.out
    st = json.loads(node.run("status", "-o", "json").out)
    assert st["policy_version"] == 1 and st["node"] == "node-a"


def test_flows_top_once(node: Node) -> None:
    r = node.run("flows", "top", "--once")
    assert r.code == 0, r
    assert "top flows on this node" in r.out
    lines = [ln for ln in r.out.splitlines() if "10.0." in ln]
    assert len(lines) == 3
    assert "video" in lines[0] and "150.0 Mbit/s" in lines[0] and "10.0.0.2:9000" in lines[0]
    assert "voice" in lines[1] and "1.2 Mbit/s" in lines[1]
    r = node.run("flows", "top", "--once", "-n", "1")
    assert len([ln for ln in r.out.splitlines() if "10.0." in ln]) == 1
    flows = json.loads(node.run("flows", "top", "-o", "json").out)["flows"]
    assert flows[0]["class_name"] == "video" and flows[0]["rate_bps"] == 150e6
    node.service.flows = []
    assert "no flows" in node.run("flows", "top", "--once").out


def test_flows_top_watch_refreshes(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = {"n": 0}

    def two_ticks(interval: float) -> Iterator[None]:
        assert interval == 0.5
        for _ in range(2):
            ticks["n"] += 1
            yield None

    monkeypatch.setattr(_node, "_ticks", two_ticks)
    r = node.run("flows", "top", "--interval", "0.5")
    assert r.code == 0, r
    assert ticks["n"] == 2
    assert node.service.calls.count("top_flows") == 3  # first table + two refreshes
    assert "150.0 Mbit/s" in r.out


# --------------------------------------------------------------------------
# Exit codes
# --------------------------------------------------------------------------
def test_exit_3_rejected_policy(node: Node, files: dict[str, str]) -> None:
    for cmd in ("apply", "validate", "diff"):
        r = node.run("policy", cmd, "-f", files["bad"])
        assert r.code == ctl.EXIT.REJECTED == 3, r
        assert r.err.startswith("mmmeshctl: error: policy rejected: 2 problems\n"), r.err
        assert "  classes[0].rate: '150mbps' is ambiguous" in r.err
        assert "  classes[1].name: " in r.err
        assert r.out == ""
    r = node.run("policy", "validate", "--local", "-f", files["bad"])
    assert r.code == 3 and "classes[0].rate" in r.err
    r = node.run("policy", "apply", "-f", files["unreal"])
    assert r.code == 3
    assert "cannot be applied on this node" in r.err and "link.device: no device" in r.err
    r = node.run("policy", "apply", "-f", files["latin1"])
    assert r.code == 3 and "not UTF-8" in r.err
    assert node.service.store.version == 0


def test_exit_4_conflict(node: Node, files: dict[str, str]) -> None:
    assert node.run("policy", "apply", "-f", files["a"], "--base-version", "0").code == 0
    assert node.run("policy", "apply", "-f", files["b"], "--base-version", "1").code == 0
    r = node.run("policy", "apply", "-f", files["a"], "--base-version", "1")
    assert r.code == ctl.EXIT.CONFLICT == 4, r
    assert "based on version 1, the current version is 2" in r.err
    assert "--base-version 2" in r.err
    r = node.run("policy", "rollback", "--to", "1", "--base-version", "1")
    assert r.code == 4
    assert node.service.store.version == 2


def test_exit_5_unreachable(tmp_path: Path) -> None:
    runner = CliRunner()

    def run(*args: str) -> Result:
        res = runner.invoke(ctl.app, list(args), env=ENV)
        return Result(res.exit_code, res.stdout, res.stderr)

    missing = tmp_path / "nope.sock"
    r = run("--socket", str(missing), "status")
    assert r.code == ctl.EXIT.UNREACHABLE == 5, r
    assert r.err == (f"mmmeshctl: error: no qosd socket at {missing} (is qosd running? set "
                     "--socket/MMMESH_SOCKET, or --server for TCP)\n")
    # a socket file nobody listens on
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    r = run("--socket", str(dead), "policy", "get")
    assert r.code == 5 and "cannot reach qosd at unix socket" in r.err, r
    # a TCP port nobody listens on
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    r = run("--server", f"http://127.0.0.1:{port}", "status")
    assert r.code == 5 and f"cannot reach qosd at http://127.0.0.1:{port}" in r.err, r
    # something that accepts but never answers: a timeout
    hung = tmp_path / "hung.sock"
    h = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    h.bind(str(hung))
    h.listen(8)
    try:
        r = run("--socket", str(hung), "--timeout", "0.3", "status")
        assert r.code == 5 and "did not answer within 0.3s" in r.err, r
    finally:
        h.close()


def test_server_urls(tcp_node: TcpNode) -> None:
    bare = tcp_node.address.removeprefix("http://")
    r = tcp_node.run("--server", bare, "--token", TOKEN, "status", "-o", "json")
    assert r.code == 0 and json.loads(r.out)["node"] == "node-a", r  # http:// assumed
    r = tcp_node.run("--server", tcp_node.address + "/", "--token", TOKEN, "status")
    assert r.code == 0, r
    for bad, why in (("ftp://127.0.0.1:1", "unsupported scheme"), ("http://:8470", "no host"),
                     ("http://127.0.0.1:port", "the port must be a number 0..65535"),
                     ("http://127.0.0.1:65536", "the port must be a number 0..65535"),
                     ("http://node1:", "the port must be a number 0..65535"),
                     ("http://::1:8470", "write an IPv6 address as [address]:port"),
                     ("http://[::1:8470", "Invalid IPv6 URL")):
        r = tcp_node.run("--server", bad, "status")
        assert r.code == ctl.EXIT.USAGE, (bad, r)
        assert r.err.startswith(f"mmmeshctl: error: bad --server URL {bad!r}: ") and why in r.err
    assert tcp_node.service.calls.count("status") == 2


def test_exit_6_not_found(node: Node, files: dict[str, str]) -> None:
    r = node.run("policy", "get")
    assert r.code == ctl.EXIT.NOT_FOUND == 6, r
    assert r.err == "mmmeshctl: error: no policy has been applied yet\n"
    node.run("policy", "apply", "-f", files["a"])
    r = node.run("policy", "get", "--version", "42")
    assert r.code == 6 and "no policy version 42" in r.err
    r = node.run("policy", "rollback", "--to", "42")
    assert r.code == 6
    assert node.service.store.version == 1


def test_exit_7_auth_over_tcp(tcp_node: TcpNode, files: dict[str, str]) -> None:
    r = tcp_node.run("status")
    assert r.code == ctl.EXIT.AUTH == 7, r
    assert "authentication failed" in r.err
    r = tcp_node.run("--token", "wrong", "policy", "apply", "-f", files["a"])
    assert r.code == 7, r
    assert tcp_node.service.store.version == 0
    r = tcp_node.run("--token", TOKEN, "policy", "apply", "-f", files["a"])
    assert r.code == 0, r
    r = tcp_node.run("status", env={"MMMESH_TOKEN": TOKEN})
    assert r.code == 0 and "policy version" in r.out
    r = tcp_node.run("flows", "top", "--once", env={"MMMESH_TOKEN": TOKEN})
    assert r.code == 0 and "top flows on http://127.0.0.1" in r.out


def test_exit_7_socket_permission(node: Node) -> None:
    if os.geteuid() == 0:
        # root ignores the mode: give the socket to another user and run the
        # CLI as root WITHOUT capabilities (it can still read this checkout,
        # wherever it lives), so that connect() meets a real EACCES
        os.chown(node.address, 65534, 65534)
        os.chmod(node.address, 0o600)
        r = subprocess.run(
            ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable,
             "-m", "mmmeshctl", "--socket", node.address, "status"],
            check=False, capture_output=True, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
        assert r.returncode == 7, r
        assert "permission denied" in r.stderr
    else:  # pragma: no cover - non-root run
        assert node.run("status").code == 0


def test_exit_1_dataplane_failure(node: Node, files: dict[str, str]) -> None:
    node.run("policy", "apply", "-f", files["a"])
    node.service.kernel_fails = True
    r = node.run("policy", "apply", "-f", files["b"])
    assert r.code == ctl.EXIT.OTHER == 1, r
    assert "dataplane refused the change (last good policy kept)" in r.err
    assert node.service.store.version == 1


def test_exit_2_usage(node: Node, tmp_path: Path) -> None:
    assert node.run("policy", "apply").code == 2  # no -f
    r = node.run("policy", "apply", "-f", str(tmp_path / "missing.yaml"))
    assert r.code == 2 and "cannot read" in r.err and "No such file" in r.err
    assert node.run("policy", "get", "-o", "xml").code == 2
    assert node.run("policy", "rollback").code == 2  # no --to
    assert node.run("policy", "rollback", "--to", "0").code == 2
    assert node.run("flows", "top", "-n", "0", "--once").code == 2
    assert node.run("bogus").code == 2
    assert node.run("policy", "apply", "-f", str(tmp_path)).code == 2  # a directory
    assert node.service.calls == []  # nothing reached the daemon




def test_commands_load_no_heavy_modules(node: Node, files: dict[str, str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMMESH_SOCKET": node.address}
    env.pop("MMMESH_SERVER", None)
    env.pop("MMMESH_TOKEN", None)

    def loaded(*args: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", LOADED, *args], check=False,
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        assert r.returncode == 0, r
        return list(json.loads(r.stderr.rpartition("LOADED ")[2]))

    for args in (("policy", "apply", "-f", files["a"]), ("status", "-o", "json"),
                 ("policy", "validate", "-f", files["a"]), ("policy", "get", "-o", "yaml"),
                 ("policy", "rollback", "--to", "1"), ("flows", "top", "-o", "json", "-n", "2")):
        assert loaded(*args) == [], args
    # the check sees them when they are there: tables need rich, --local pydantic
    assert "rich" in loaded("status")
    assert "pydantic" in loaded("policy", "validate", "--local", "-f", files["a"])


# --------------------------------------------------------------------------
# The real console entry point
# --------------------------------------------------------------------------
def test_public_face() -> None:
    """mmmeshctl exports the app, the console script's main and the exit codes;
    pyproject.toml's mmmeshctl script names that main."""
    import tomllib

    from mmmeshctl import _app, _exit

    assert ctl.__all__ == ["EXIT", "app", "main"]
    assert (ctl.app, ctl.main, ctl.EXIT) == (_app.app, _app.main, _exit.EXIT)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mmmeshctl"] == "mmmeshctl:main"


def test_console_entry_point(node: Node, files: dict[str, str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMMESH_SOCKET": node.address,
           "COLUMNS": "200"}
    env.pop("MMMESH_TOKEN", None)
    env.pop("MMMESH_SERVER", None)

    def run(*args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mmmeshctl", *args], check=False,
                              capture_output=True, text=True, cwd=ROOT,
                              env={**env, **(extra or {})}, timeout=60)

    r = run("policy", "apply", "-f", files["a"])
    assert (r.returncode, r.stdout.split(":")[0]) == (0, "policy applied"), r
    r = run("policy", "get", "-o", "yaml")
    assert r.returncode == 0 and parse_policy(r.stdout) == parse_policy(POLICY_A)
    r = run("policy", "apply", "-f", files["bad"])
    assert r.returncode == 3 and r.stderr.startswith("mmmeshctl: error: policy rejected")
    r = run("--socket", str(tmp_path / "none.sock"), "status")
    assert r.returncode == 5 and r.stdout == ""
    r = run("--help")
    assert r.returncode == 0 and "Exit codes" in r.stdout and "Examples" in r.stdout
    r = run("policy", "apply", "--help")
    assert r.returncode == 0 and "mmmeshctl policy apply -f examples/policy.yaml" in r.stdout

    # Shell completion.  Left alone, --show-completion asks shellingham for the
    # shell above this process, and a test may run with none above it; typer's
    # switch below makes the option take the shell's name instead.
    named = {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    r = run("--show-completion", "bash", extra=named)
    assert r.returncode == 0, r
    assert "_MMMESHCTL_COMPLETE=complete_bash" in r.stdout
    assert "complete -o default -F _mmmeshctl_completion mmmeshctl" in r.stdout
    r = run("--show-completion", "zsh", extra=named)
    assert r.returncode == 0 and r.stdout.startswith("#compdef mmmeshctl"), r
    # and what the bash script runs on <TAB>
    r = run(extra={"_MMMESHCTL_COMPLETE": "complete_bash", "COMP_WORDS": "mmmeshctl policy ro",
                   "COMP_CWORD": "2"})
    assert (r.returncode, r.stdout) == (0, "rollout\nrollback\n"), r
