"""Raw HTTP/1.1 clients that misbehave on purpose, a tiny ASGI app to point
them at, and a qosd API server around it in a thread (tests/system/qosd/test_api_limits.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmmesh.net import listen_unix
from qosd.httpd.http11 import Limits
from qosd.httpd.serve import ApiServer

FAST = Limits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5,
              write_timeout_s=0.5, max_header_bytes=16 * 1024, max_body_bytes=1000)
GET = b"GET /echo HTTP/1.1\r\nhost: q\r\n\r\n"


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """``/echo``: the scope (and the body's length) as JSON; ``/big``: 8 MiB;
    ``/slow?S``: answers after S seconds."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(float(scope["query_string"] or 0))
    if scope["path"] == "/big":
        data = b"x" * (8 << 20)
    else:
        data = json.dumps({**{k: v for k, v in scope.items() if k not in ("headers", "raw_path",
                                                                          "query_string")},
                           "raw_path": scope["raw_path"].decode(),
                           "query_string": scope["query_string"].decode(),
                           "body_len": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


@contextmanager
def running(server: ApiServer) -> Iterator[ApiServer]:
    server.start_thread()
    try:
        yield server
    finally:
        server.stop()


def uds_server(path: Path, *, limits: Limits = FAST, **kw: Any) -> ApiServer:
    return ApiServer(echo_app, [listen_unix(path, 0o666)], uds_path=str(path), limits=limits,
                     **kw)


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def read_response(s: socket.socket, *, head_request: bool = False,
                  ) -> tuple[int, dict[str, str], bytes]:
    """One response (status, headers, body by Content-Length: none for a HEAD
    request); status 0 for EOF.  Reads no byte past it (a pipelined answer
    stays for the next call)."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = s.recv(1)
        if not byte:
            return 0, {}, head
        head += byte
    lines = head.decode().strip().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    body = b""
    while not head_request and len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(int(headers["content-length"]) - len(body))
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes ``s`` (EOF or reset) within ``seconds``."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def wait_for(cond: Callable[[], object], seconds: float = 5.0) -> bool:
    """Polls ``cond`` every 20 ms until it holds or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())
