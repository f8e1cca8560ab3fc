"""A hostile local client for qosd's sockets (stdlib only: tests and bench/api_flood.py
run it as an unprivileged user, ``setpriv --reuid=65534 ...``).

    python3 hostile_flood.py SOCKET --connections 2000 --seconds 12

Tries to hold ``--connections`` connections open at once, each a request
that never finishes: a request line, then one header line every
``--trickle`` seconds (slowloris), so no deadline between two bytes ever
fires.  A connection the server closes (or answers) is replaced at once; a
connect() refused because the listen backlog is full is retried 10 ms later.
Prints a JSON summary: connections made, connects refused, answers read
(by status), the most held at once.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time

HEAD = b"POST /v1/sla HTTP/1.1\r\nhost: qosd\r\ncontent-type: application/json\r\n"


def flood(path: str, connections: int, seconds: float, trickle: float) -> dict[str, object]:
    sel = selectors.DefaultSelector()
    held: dict[socket.socket, float] = {}  # socket -> when its next header byte goes
    connected = refused = max_held = 0
    answers: dict[str, int] = {}
    end = time.monotonic() + seconds

    def drop(s: socket.socket) -> None:
        sel.unregister(s)
        held.pop(s, None)
        s.close()

    while time.monotonic() < end:
        while len(held) < connections:  # top up
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
                s.send(HEAD)
            except OSError:  # backlog full (EAGAIN), or gone
                s.close()
                refused += 1
                break
            held[s] = time.monotonic() + trickle
            sel.register(s, selectors.EVENT_READ)
            connected += 1
        max_held = max(max_held, len(held))
        for key, _ in sel.select(timeout=0.01):
            s = held_socket(key.fileobj)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
            answers[status] = answers.get(status, 0) + 1
            drop(s)
        now = time.monotonic()
        for s, due in list(held.items()):
            if now >= due:
                try:
                    s.send(b"x-slow: 1\r\n")
                    held[s] = now + trickle
                except OSError:
                    drop(s)
    for s in list(held):
        drop(s)
    return {"connected": connected, "connect_refused": refused, "max_held": max_held,
            "answers": answers}


def held_socket(obj: object) -> socket.socket:
    assert isinstance(obj, socket.socket)
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--trickle", type=float, default=1.0)
    a = ap.parse_args(argv)
    print(json.dumps(flood(a.socket, a.connections, a.seconds, a.trickle)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
