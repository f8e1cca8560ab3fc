"""A local process that reports to qosd's sla.sock, for tests/qosd/test_report_identity.py
(stdlib only: it runs as an unprivileged user).

    python sla_sender.py SOCKET ACTION [--cgroup DIR] [--uid N] [--count N] [--body JSON]

Started as root, it first moves itself into the cgroup ``--cgroup`` (a
directory of the cgroup v2 hierarchy: a pod's or a unit's, as the kubelet or
systemd would have put it there), then drops to ``--uid`` (gid the same, no
supplementary groups), then does ACTION over one keep-alive connection:

    post     POST --body once
    flood    POST --count reports under invented stages (batch-<i>) and instance
             names, class "bulk", huge counts and attainment 0
    padded   POST --count reports of stage --stage whose sketch carries an
             unknown protobuf field of --pad bytes

and prints a JSON summary: {"uid", "cgroup", "status": {code: n}, "last": body}.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import socket
import sys
from typing import Any


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("qosd", timeout=30)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(self.path)
        self.sock = s


def window(cls: str, frames: int, attainment: float, sketch: str | None = None
           ) -> dict[str, Any]:
    return {"sla_class": cls, "modality": "audio", "window_s": 5.0, "frames": frames,
            "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": attainment,
            "sketch_e2e": sketch}


def padded(sketch: str, size: int) -> str:
    """``sketch`` with an unknown length-delimited field 15 of ``size`` bytes."""
    n, varint = size, b""
    while True:
        varint += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            break
    raw = base64.b64decode(sketch) + bytes([(15 << 3) | 2]) + varint + b"\0" * size
    return base64.b64encode(raw).decode()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("action", choices=["post", "flood", "padded"])
    ap.add_argument("--cgroup")
    ap.add_argument("--uid", type=int)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--body")
    ap.add_argument("--stage", default="batch-x")
    ap.add_argument("--sketch")
    ap.add_argument("--pad", type=int, default=90_000)
    a = ap.parse_args()
    if a.cgroup:
        with open(os.path.join(a.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if a.uid is not None:
        os.setgroups([])
        os.setgid(a.uid)
        os.setuid(a.uid)
    if a.action == "post":
        bodies = [json.loads(a.body)] * a.count
    elif a.action == "flood":
        bodies = [{"stage": f"batch-{i}", "instance": f"invented-{i}",
                   "reports": [window("bulk", 10**12, 0.0)]} for i in range(a.count)]
    else:
        big = padded(a.sketch, a.pad)
        bodies = [{"stage": a.stage, "instance": "padded",
                   "reports": [window(f"pad{i}", 100, 1.0, big)]} for i in range(a.count)]
    conn = UnixConnection(a.socket)
    status: dict[str, int] = {}
    last = None
    for b in bodies:
        conn.request("POST", "/v1/sla", body=json.dumps(b),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        last = json.loads(r.read() or b"null")
        status[str(r.status)] = status.get(str(r.status), 0) + 1
        if r.getheader("connection", "").lower() == "close":
            conn.close()
            conn = UnixConnection(a.socket)
    conn.close()
    with open("/proc/self/cgroup") as f:
        cg = f.read().strip().splitlines()
    json.dump({"uid": os.getuid(), "cgroup": cg[-1] if cg else None, "status": status,
               "last": last}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
