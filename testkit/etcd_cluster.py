"""A real etcd cluster for tests: Debian's ``etcd`` (scripts/bootstrap.sh), three
members by default, on loopback or inside a network namespace.

    with EtcdCluster(tmp_path) as etcd:               # 3 members on 127.0.0.1, free ports
        etcd.endpoints                                # ["127.0.0.1:41231", ...]
        i = etcd.leader(); etcd.kill(i); etcd.start(i)
        etcd.stop_all(); etcd.start_all()
        etcd.compact()                                # up to the current revision
        etcd.ctl("get", "--prefix", "/mmmesh/")      # etcdctl against the cluster

Each member has its own data directory under ``root`` and its own ports
(client and peer); peers talk over plain HTTP on the namespace's 127.0.0.1,
clients over ``host`` (TLS with client certificates when ``certs`` is given:
a CA and an ``etcd.pem``/``etcd.key`` issued by mmmeshctl.certs).  Timers
are short (heartbeat 50 ms, election 500 ms) so a killed leader is replaced
within a second; a benchmark that loads the machine passes etcd's own defaults
(``heartbeat_ms=100, election_ms=1000``) so its members do not hold elections
when the CPUs are busy.  Everything is killed and removed on exit, also when
start-up or the test fails.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Self

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    def __init__(self, root: Path, n: int = 3, *, host: str = "127.0.0.1",
                 netns: str | None = None, certs: Path | None = None,
                 ports: list[int] | None = None, heartbeat_ms: int = 50,
                 election_ms: int = 500) -> None:
        self.root, self.n, self.host, self.netns, self.certs = root, n, host, netns, certs
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        if ports is None:
            ports = free_ports(2 * n) if netns is None else [23790 + i for i in range(2 * n)]
        self.client_ports, self.peer_ports = ports[:n], ports[n:]
        self.names = [f"m{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        scheme = "https" if certs else "http"
        self.urls = [f"{scheme}://{host}:{p}" for p in self.client_ports]
        self.endpoints = [f"{host}:{p}" for p in self.client_ports]
        self._initial = ",".join(f"{nm}=http://127.0.0.1:{p}"
                                 for nm, p in zip(self.names, self.peer_ports, strict=True))

    # -- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> Self:
        with contextlib.ExitStack() as undo:  # stopped and removed if start-up fails
            undo.callback(self.close)
            self.start_all()
            undo.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _argv(self, i: int, state: str) -> list[str]:
        argv = [ETCD, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
                "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", self._initial, "--initial-cluster-state", state,
                "--initial-cluster-token", f"mmmesh-{self.root.name}",
                "--heartbeat-interval", str(self.heartbeat_ms),
                "--election-timeout", str(self.election_ms),
                "--logger", "zap", "--log-level", "warn"]
        if self.certs is not None:
            argv += ["--cert-file", str(self.certs / "etcd.pem"),
                     "--key-file", str(self.certs / "etcd.key"),
                     "--trusted-ca-file", str(self.certs / "ca.pem"), "--client-cert-auth"]
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + argv

    def start(self, i: int) -> None:
        if self.running(i):
            return
        data = self.root / self.names[i]
        state = "existing" if data.exists() else "new"
        log = open(self.root / f"{self.names[i]}.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[i] = subprocess.Popen(self._argv(i, state), stdout=log,
                                         stderr=subprocess.STDOUT)
        log.close()

    def start_all(self, timeout: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            self.start(i)
        self.wait_healthy(timeout)

    def running(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def stop_all(self) -> None:
        for i in range(self.n):
            self.kill(i)

    def close(self) -> None:
        self.stop_all()
        for nm in self.names:
            shutil.rmtree(self.root / nm, ignore_errors=True)

    # -- etcdctl ----------------------------------------------------------------------
    def ctl(self, *args: str, endpoints: list[str] | None = None,
            timeout: float = 10.0) -> str:
        argv = [ETCDCTL, "--endpoints", ",".join(endpoints or self.live_urls()),
                "--dial-timeout", "2s", "--command-timeout", f"{int(timeout)}s"]
        if self.certs is not None:
            argv += ["--cacert", str(self.certs / "ca.pem"), "--cert",
                     str(self.certs / "etcd.pem"), "--key", str(self.certs / "etcd.key"),
                     "--insecure-skip-tls-verify"]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        r = subprocess.run([*argv, *args], check=False, capture_output=True, text=True,
                           timeout=timeout + 5, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def live_urls(self) -> list[str]:
        return [u for i, u in enumerate(self.urls) if self.running(i)] or self.urls

    def status(self) -> list[dict[str, Any]]:
        """``etcdctl endpoint status`` of the running members."""
        out = json.loads(self.ctl("endpoint", "status", "-w", "json"))
        return out if isinstance(out, list) else [out]

    def leader(self) -> int:
        """The index of the current leader (waits for one)."""
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(Exception):
                for st in self.status():
                    s = st["Status"]
                    if s["leader"] and s["leader"] == s["header"]["member_id"]:
                        return self.urls.index(st["Endpoint"])
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd: no leader; {self.logs()}")
            time.sleep(0.1)

    def revision(self) -> int:
        return int(self.status()[0]["Status"]["header"]["revision"])

    def compact(self, revision: int | None = None) -> int:
        rev = self.revision() if revision is None else revision
        self.ctl("compaction", "--physical", str(rev))
        return rev

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                self.ctl("endpoint", "health", endpoints=self.live_urls(), timeout=3)
                self.leader()
                return
            except Exception as e:  # noqa: BLE001 (keep the last reason for the message)
                last = str(e)
            time.sleep(0.2)
        raise AssertionError(f"etcd did not become healthy: {last}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {nm}\n" + (self.root / f"{nm}.log").read_text(
            errors="replace")[-1500:] for nm in self.names
            if (self.root / f"{nm}.log").exists())
