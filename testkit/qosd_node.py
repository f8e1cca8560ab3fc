"""A real qosd on a netns node, for the system tests: the node's files, its
admin API (unix socket and TCP + token), mmmeshctl against it.

``node_on(tmp_path)`` makes one behind a veth pair (``testkit.privileged``);
tests/system/qosd/conftest.py has it as the ``node`` fixture."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmmesh.policy import load_policy, parse_policy
from testkit.privileged import require_privileged, veth_pair

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
EXAMPLE = load_policy(ROOT / "examples" / "policy.yaml")


def policy_yaml(dev: str = "a0", *, drop: str | None = None, voice_rate: str | None = None,
                rate: str = "500mbit") -> str:
    data = EXAMPLE.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": dev, "rate": rate}
    data["classes"] = [c for c in data["classes"] if c["name"] != drop]
    for c in data["classes"]:
        if voice_rate and c["name"] == "voice":
            c["rate"] = voice_rate
    return parse_policy(data).to_yaml()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    ns: str
    peer_ns: str
    dir: Path
    cfg: Path
    sock: Path
    tcp: str
    token: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """Starts qosd (``env``: extra environment, e.g. MMMESH_FAILPOINTS) and,
        with ``wait``, returns once its admin API answers."""
        log = open(self.dir / "qosd.log", "ab")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "qosd"), "--config", str(self.cfg), "--log-level", "INFO"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
        )
        if not wait:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"qosd exited {self.proc.returncode}: {self.log()}")
            if self.sock.exists():
                try:
                    if self.get("/readyz").status_code in (200, 503):
                        return
                except Exception:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"qosd did not come up: {self.log()}")

    def log(self) -> str:
        p = self.dir / "qosd.log"
        return p.read_text()[-3000:] if p.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self):  # type: ignore[no-untyped-def]
        import httpx

        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)),
                            base_url="http://qosd", timeout=60)

    def get(self, path: str):  # type: ignore[no-untyped-def]
        with self.client() as c:
            return c.get(path)

    def put_policy(self, text: str, base: int | None = None):  # type: ignore[no-untyped-def]
        with self.client() as c:
            return c.put("/v1/policy", json={"yaml": text, "base_version": base})

    def ctl(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(VENV_BIN / "mmmeshctl"), "--socket", str(self.sock), *args],
                              capture_output=True, text=True, timeout=120, check=check)


@contextmanager
def node_on(tmp_path: Path) -> Iterator[Node]:
    """A qosd node (not started) in a fresh namespace pair; killed and removed after."""
    require_privileged()
    with veth_pair(f"mmq{os.getpid() % 100000}", "10.78.0") as (a, b):
        state = tmp_path / "state"
        sock = tmp_path / "run" / "qosd.sock"
        tcp = f"127.0.0.1:{free_port()}"
        cfg = tmp_path / "qosd.yaml"
        cfg.write_text(yaml.safe_dump({
            "node_name": "node-a", "netns": a, "state_dir": str(state),
            "api_socket": str(sock), "api_tcp": tcp, "api_token": "s3cret",
            "sla_socket": str(tmp_path / "run" / "sla.sock"),
            "metrics_addr": f"127.0.0.1:{free_port()}", "resync_interval_s": 1.0,
        }))
        n = Node(a, b, tmp_path, cfg, sock, tcp, "s3cret")
        try:
            yield n
        finally:
            n.stop(signal.SIGKILL)
