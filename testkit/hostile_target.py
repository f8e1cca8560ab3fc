"""A real qosd process to attack, and what the attacks need around it (used by
tests/system/qosd/test_api_limits.py and bench/api_flood.py).

:class:`Target` starts ``qosd`` from this checkout with a temporary config
(no policy, no netns: the API is what is attacked) in a directory an
unprivileged user can reach, under a descriptor limit like the unit's
(``prlimit --nofile``), optionally with a systemd notify socket and
``WATCHDOG_USEC``.  :class:`Sampler` reads its descriptor count and RSS from
/proc every 50 ms.  :func:`start_flood` runs testkit/hostile_flood.py as
uid/gid 65534; :func:`ordinary_requests` sends complete requests from many
threads at once; :func:`request` is one request on a fresh connection.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
FLOODER = ROOT / "testkit" / "hostile_flood.py"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SLA_REPORT = json.dumps({"stage": "flood-check", "reports": [
    {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": 10,
     "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0}]}).encode()


def request(path: Path, method: str = "GET", target: str = "/v1/status", body: bytes = b"",
            timeout: float = 10.0) -> int:
    """One request on a new unix connection; the status (0: no answer).  A
    blocking connect waits up to ``timeout`` for room in the listen backlog."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)  # bounds connect() too
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.connect(str(path))
        head = (f"{method} {target} HTTP/1.1\r\nhost: qosd\r\nconnection: close\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
        s.sendall(head.encode() + body)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                return 0
            data += chunk
        return int(data.split(b" ", 2)[1])
    except OSError:
        return 0
    finally:
        s.close()


def ordinary_requests(path: Path, n: int, *, target: str = "/v1/sla",
                      body: bytes = SLA_REPORT, timeout: float = 30.0) -> list[tuple[int, float]]:
    """``n`` complete POSTs at once (one thread each): (status, seconds) per request."""

    def one(_: int) -> tuple[int, float]:
        t0 = time.monotonic()
        return request(path, "POST", target, body, timeout), time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def start_flood(path: Path, connections: int, seconds: float) -> subprocess.Popen[bytes]:
    """testkit/hostile_flood.py as uid/gid 65534; its JSON summary on stdout."""
    return subprocess.Popen([*NOBODY, "/usr/bin/python3", str(FLOODER), str(path),
                             "--connections", str(connections), "--seconds", str(seconds)],
                            stdout=subprocess.PIPE)


@dataclass
class Target:
    """A running qosd (see the module doc); :meth:`stop` ends it and removes its directory."""

    dir: Path
    proc: subprocess.Popen[bytes]
    notify: socket.socket | None
    notified: list[str] = field(default_factory=list)

    @property
    def api_socket(self) -> Path:
        return self.dir / "run" / "qosd.sock"

    @property
    def sla_socket(self) -> Path:
        return self.dir / "run" / "sla.sock"

    @property
    def log(self) -> Path:
        return self.dir / "qosd.log"

    @classmethod
    def start(cls, *, nofile: int = 1024, watchdog_usec: int | None = None,
              source: Path | None = None) -> Target:
        """``source``: a tree with other ``qosd`` and ``mmmesh`` packages to run
        instead of this checkout's (an earlier revision, for a baseline)."""
        d = Path(tempfile.mkdtemp(prefix="mmq-flood-"))
        d.chmod(0o755)  # the unprivileged flooder must reach sla.sock
        cfg = d / "qosd.yaml"
        cfg.write_text(f"node_name: flood\nstate_dir: {d / 'state'}\n"
                       f"api_socket: {d / 'run' / 'qosd.sock'}\n"
                       f"sla_socket: {d / 'run' / 'sla.sock'}\nmetrics_addr: ''\n")
        env = dict(os.environ)
        notify = None
        if watchdog_usec is not None:
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            notify.bind(str(d / "notify.sock"))
            env.update(NOTIFY_SOCKET=str(d / "notify.sock"), WATCHDOG_USEC=str(watchdog_usec))
        qosd = [str(VENV_BIN / "qosd")]
        if source is not None:
            qosd = [str(VENV_BIN / "python"), "-m", "qosd.daemon"]
            env["PYTHONPATH"] = str(source)
        with open(d / "qosd.log", "ab") as log:
            proc = subprocess.Popen(
                ["prlimit", f"--nofile={nofile}:{nofile}", "--", *qosd,
                 "--config", str(cfg), "--log-level", "INFO"],
                stdout=log, stderr=subprocess.STDOUT, cwd=source or ROOT, env=env)
        target = cls(d, proc, notify)
        if notify is not None:
            threading.Thread(target=target._read_notify, daemon=True).start()
        deadline = time.monotonic() + 60
        while request(target.api_socket, timeout=2) != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = target.log.read_text()[-2000:]
                target.stop()
                raise RuntimeError(f"qosd did not come up: {tail}")
            time.sleep(0.1)
        return target

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_kib(self, key: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def cpu_s(self) -> float:
        """User + system CPU seconds qosd has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_lines(self) -> int:
        return len(self.log.read_bytes().splitlines())

    def notifications(self) -> list[str]:
        """What qosd sent to the notify socket since the last call."""
        out, self.notified[:] = list(self.notified), []
        return out

    def _read_notify(self) -> None:
        # systemd reads its notify socket at once; a full queue (10 datagrams) would block
        # qosd's sd_notify, so read it the same way
        assert self.notify is not None
        while True:
            try:
                data = self.notify.recv(4096)
            except OSError:
                return
            if not data:  # shut down
                return
            self.notified.append(data.decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.notify is not None:
            self.notify.shutdown(socket.SHUT_RDWR)  # ends the reading thread
            self.notify.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Sampler:
    """The target's descriptor count and RSS every ``period`` seconds, in a thread."""

    target: Target
    period: float = 0.05
    fds: list[int] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(self.period):
                try:
                    self.fds.append(self.target.fds())
                    self.rss_kib.append(self.target.rss_kib())
                except (OSError, KeyError):
                    return

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            stop.set()
            t.join(5)
