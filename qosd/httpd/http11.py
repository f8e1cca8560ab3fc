"""One HTTP/1.1 connection of qosd's API server: h11 (sans-I/O) for the
protocol, asyncio socket calls for the bytes, and a deadline on every wait.

The deadlines and sizes (:class:`Limits`), each answered, when possible, with
a JSON error ``{"error": code, "message": text}`` and then a close:

    request line + headers   within header_timeout_s of the accept (or of the
                             first byte of a keep-alive request)     408 timeout
    headers                  at most max_header_bytes                431 headers_too_large
    Content-Length           at most max_body_bytes, refused before
                             a byte of the body is read              413 too_large
    body (any framing)       at most max_body_bytes, counted as it
                             arrives (chunked too)                   413 too_large
    body                     within body_timeout_s of the headers    408 timeout
    keep-alive               idle for keepalive_timeout_s: closed (no answer)
    each response message    written within write_timeout_s; a client that
                             does not read is closed
    malformed HTTP           -                                       400 bad_request

Under pressure (the server is at its connection cap and calls
:meth:`Connection.hurry`) the waits that a slow client controls shrink: an
idle keep-alive connection closes at once, and headers or a body still
arriving get ``pressure_timeout_s`` from their start (408).  A client that
sends slowly on purpose then holds a connection for about a second instead
of five or ten, so clients waiting behind the cap get in sooner; a request
already being answered is never cut.

The app is a standard ASGI 3 app.  Its scope carries, on a unix socket, the
connecting process's credentials read with SO_PEERCRED at accept time:
``scope["extensions"]["mmmesh.peer"] == {"pid": int, "uid": int, "gid": int}``
(:data:`PEER_EXTENSION`; qosd/identity.py reads it).  TCP connections have no
such extension.  ``send`` never raises for a client that is gone: the rest of the
response is dropped and the connection closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, fields
from functools import partial
from http import HTTPStatus
from typing import Any, TypedDict
from urllib.parse import unquote

import h11

from ..identity import PEER_EXTENSION  # the scope key; its value is a Peer
from ..logs import RateLimitedLog

__all__ = ["PEER_EXTENSION", "Connection", "Limits", "Peer", "read_peer"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

READ_CHUNK = 64 * 1024
LINGER_S = 1.0  # after refusing a TCP request: read what the client still sends, then close
LINGER_BYTES = 256 * 1024
_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


class Peer(TypedDict):
    """The process at the other end of a unix socket, as the kernel saw it at connect()."""

    pid: int
    uid: int
    gid: int


def read_peer(sock: socket.socket) -> Peer:
    """SO_PEERCRED of a connected unix socket (raises OSError)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return {"pid": pid, "uid": uid, "gid": gid}


@dataclass(frozen=True)
class Limits:
    """Deadlines (seconds) and sizes (bytes) of one connection; see the module doc."""

    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    pressure_timeout_s: float = 1.0
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0")


def error_response(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response with a JSON error body and ``connection: close``."""
    body = json.dumps({"error": code, "message": message}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _Abort(BaseException):  # not an error of the app: it must not catch it
    """Ends a request from inside ``receive()``: the app is unwound (it catches
    ``Exception`` only) and the server answers ``status`` (None: nobody to answer)."""

    def __init__(self, status: int | None, cause: str, message: str) -> None:
        super().__init__(message)
        self.status, self.cause, self.message = status, cause, message


_CODES = {400: "bad_request", 408: "timeout", 413: "too_large", 431: "headers_too_large",
          500: "internal", 503: "unavailable"}


@dataclass
class _Cycle:
    """One request and its response."""

    method: bytes
    body_bytes: int = 0
    body_done: bool = False
    started: bool = False
    complete: bool = False
    head: h11.Response | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class Connection:
    """Serves the requests of one accepted socket, one after the other, then closes it.

    ``busy`` is True while a request is being answered; ``closing`` (set by
    the server when it stops) makes the current response the last one.
    Every wait for the client is bounded by ``_deadline``, which belongs to
    the phase the connection is in (head, idle, body; none while the app
    answers) and which :meth:`hurry` brings forward: the server calls it when
    it reaches its cap, and a phase that begins while ``pressed()`` (the
    server is still at its cap) begins hurried."""

    def __init__(self, sock: socket.socket, app: Asgi, limits: Limits, *, name: str,
                 server: tuple[str, int | None], client: tuple[str, int] | None,
                 peer: Peer | None, log: RateLimitedLog, stats: Counter[str],
                 pressed: Callable[[], bool] = lambda: False) -> None:
        self.sock, self.app, self.limits, self.name = sock, app, limits, name
        self.server, self.client, self.peer = server, client, peer
        self._log, self.stats, self._pressed = log, stats, pressed
        self._loop = asyncio.get_running_loop()
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.accepted_at = self._loop.time()
        self.busy = False
        self.closing = False
        self._eof = False  # the client closed its side
        self._broken = False  # writing failed or timed out: nothing more goes out
        self._phase = "head"  # head | idle | body | app
        self._since = self.accepted_at  # when the phase began
        self._deadline = self.accepted_at + limits.header_timeout_s
        self._hurried = False
        self._wait: asyncio.Timeout | None = None  # the wait in progress

    def _enter(self, phase: str, timeout_s: float) -> None:
        self._phase, self._since = phase, self._loop.time()
        self._deadline, self._hurried = self._since + timeout_s, False
        if self._pressed():  # the server is at its cap: this phase starts hurried
            self.hurry()

    def hurry(self) -> None:
        """The server is at its cap: an idle keep-alive connection closes now, a
        request still arriving gets ``pressure_timeout_s`` from its start."""
        if self._phase == "app":
            return
        now = self._loop.time()
        when = now if self._phase == "idle" else self._since + self.limits.pressure_timeout_s
        if when >= self._deadline:
            return
        self._deadline, self._hurried = when, True
        if self._wait is not None:
            self._wait.reschedule(max(when, now))

    def _late(self, what: str, timeout_s: float) -> str:
        if self._hurried:
            return (f"{what} did not arrive within {self.limits.pressure_timeout_s:g} s "
                    "(the socket is at its connection cap)")
        return f"{what} did not arrive within {timeout_s:g} s"

    # -------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Serves until the client or a limit ends the connection; always closes it."""
        try:
            first = True
            while not self.closing:
                request = await self._read_request(first)
                if request is None:
                    return
                first = False
                self.busy = True
                keep = await self._answer(request)
                self.busy = False
                self._drop_unread_body()
                if not keep or self.closing or self._h11.our_state is not h11.DONE \
                        or self._h11.their_state is not h11.DONE:
                    return
                self._h11.start_next_cycle()
        except Exception:  # noqa: BLE001 - one connection's failure must not end the server
            self._note(logging.ERROR, "server_error", "%s: connection failed%s", self.name,
                       self._who(), exc_info=True)
        finally:
            self.sock.close()

    def _drop_unread_body(self) -> None:
        """The app answered without reading the whole body (a GET it never asked
        for, a 401): what of it has arrived already is dropped, so the
        connection can carry the next request; a body still on its way is not
        waited for (the connection then closes)."""
        while self._h11.their_state is h11.SEND_BODY:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError:
                return
            if not isinstance(event, h11.Data | h11.EndOfMessage):
                return

    def _who(self) -> str:
        if self.peer is not None:
            return f" (pid {self.peer['pid']} uid {self.peer['uid']})"
        return f" ({self.client[0]}:{self.client[1]})" if self.client else ""

    def _note(self, level: int, cause: str, msg: str, *args: object,
              exc_info: bool = False) -> None:
        self.stats[cause] += 1
        self._log.log(level, (self.name, cause), msg, *args, exc_info=exc_info)

    # -------------------------------------------------------------- bytes in and out
    async def _recv(self) -> bytes:
        """Reads what is there by the phase's deadline (TimeoutError) and feeds it to h11."""
        try:
            async with asyncio.timeout_at(self._deadline) as self._wait:
                data = await self._loop.sock_recv(self.sock, READ_CHUNK)
        finally:
            self._wait = None
        self._eof = not data
        self._h11.receive_data(data)
        return data

    async def _next_event(self) -> Any:
        """h11's next event, reading as needed until the phase's deadline
        (TimeoutError; h11.RemoteProtocolError for bad HTTP)."""
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            await self._recv()

    async def _write(self, data: bytes) -> None:
        if self._broken or not data:
            return
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                await self._loop.sock_sendall(self.sock, data)
        except TimeoutError:
            self._broken = True
            self._note(logging.WARNING, "write_timeout", "%s: closed a client that did not "
                       "read its response for %g s%s", self.name, self.limits.write_timeout_s,
                       self._who())
        except OSError as e:
            self._broken = True
            self._note(logging.INFO, "client_gone", "%s: client went away while answered: %s%s",
                       self.name, e, self._who())

    def _encode(self, event: Any) -> bytes:
        return self._h11.send(event) or b""

    async def _refuse(self, status: int, cause: str, message: str) -> None:
        """Answers ``status`` with a JSON error (unless the client is gone) before the close."""
        self._note(logging.WARNING, cause, "%s: %s; answered %d%s", self.name, message, status,
                   self._who())
        if self._eof:
            return
        await self._write(error_response(status, _CODES[status], message))
        if self.client is not None and not self._broken:
            await self._linger()

    async def _linger(self) -> None:
        """TCP: closing with unread request bytes would reset the connection and
        could destroy the answer in flight; read and drop them briefly first."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            got = 0
            async with asyncio.timeout(LINGER_S):
                while got < LINGER_BYTES:
                    chunk = await self._loop.sock_recv(self.sock, READ_CHUNK)
                    if not chunk:
                        return
                    got += len(chunk)
        except (OSError, TimeoutError):
            pass

    # -------------------------------------------------------------- a request
    async def _read_request(self, first: bool) -> h11.Request | None:
        """The next request's head, or None once the connection is to close."""
        limits = self.limits
        try:
            if not first:
                if not self._h11.trailing_data[0]:  # nothing pipelined: wait idle
                    self._enter("idle", limits.keepalive_timeout_s)
                    try:
                        await self._recv()
                    except TimeoutError:
                        self.stats["keepalive_closed"] += 1
                        return None
                self._enter("head", limits.header_timeout_s)
            event = await self._next_event()
        except TimeoutError:
            if self._h11.trailing_data[0]:  # a request had begun: tell why it ends
                await self._refuse(408, "header_timeout",
                                   self._late("the request headers", limits.header_timeout_s))
            else:
                self.stats["idle_closed"] += 1
            return None
        except h11.RemoteProtocolError as e:
            if self._eof:
                self.stats["client_gone"] += 1
            elif e.error_status_hint == 431:
                await self._refuse_head()
            else:
                await self._refuse(400, "bad_request", f"malformed request: {e}")
            return None
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed: the client is done
        # h11 bounds a head that arrives in pieces; one that arrives whole is measured here
        size = len(event.method) + len(event.target) + 12 + sum(
            len(n) + len(v) + 4 for n, v in event.headers)
        if size > limits.max_header_bytes:
            await self._refuse_head()
            return None
        for name, value in event.headers:
            if name == b"content-length" and int(value) > limits.max_body_bytes:
                await self._refuse(413, "too_large",
                                   f"request body over {limits.max_body_bytes} bytes")
                return None
        return event

    async def _refuse_head(self) -> None:
        await self._refuse(431, "headers_too_large", "the request headers are over "
                           f"{self.limits.max_header_bytes} bytes")

    def _scope(self, request: h11.Request) -> Scope:
        target = bytes(request.target)
        path, _, query = target.partition(b"?")
        extensions: dict[str, Any] = {}
        if self.peer is not None:
            extensions[PEER_EXTENSION] = dict(self.peer)
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(path.decode("utf-8", "replace")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": [(bytes(n), bytes(v)) for n, v in request.headers],  # names lowercased
            "client": self.client,
            "server": self.server,
            "extensions": extensions,
        }

    async def _answer(self, request: h11.Request) -> bool:
        """Runs the app for ``request``; True when the connection may carry another."""
        cycle = _Cycle(bytes(request.method))
        self._enter("body", self.limits.body_timeout_s)
        try:
            await self.app(self._scope(request), partial(self._receive, cycle),
                           partial(self._send, cycle))
        except _Abort as a:
            if a.status is None:
                self.stats[a.cause] += 1
            elif cycle.started:  # the app answered before it read all: nothing to say
                self._note(logging.WARNING, a.cause, "%s: %s%s", self.name, a.message,
                           self._who())
            else:
                await self._refuse(a.status, a.cause, a.message)
            return False
        except Exception:  # noqa: BLE001 - whatever the app raised: log it, answer 500
            self._note(logging.ERROR, "app_error", "%s: the app failed on %s %s%s", self.name,
                       request.method.decode("ascii"), bytes(request.target)[:200], self._who(),
                       exc_info=True)
            if not cycle.started:
                await self._write(error_response(500, "internal",
                                                 "internal error; see the qosd log"))
            return False
        finally:
            cycle.finished.set()
        if not cycle.complete:
            if not cycle.started:
                self._note(logging.ERROR, "no_response", "%s: the app sent no response to "
                           "%s %s", self.name, request.method.decode("ascii"),
                           bytes(request.target)[:200])
                await self._write(error_response(500, "internal", "no response"))
            return False
        return not self._broken

    async def _receive(self, cycle: _Cycle) -> Message:
        """ASGI receive: the body as it arrives (within the body deadline and size),
        then ``http.disconnect`` once the response is done or the client gone."""
        if cycle.body_done or self._broken or self._eof:
            await cycle.finished.wait()
            return {"type": "http.disconnect"}
        if self._h11.they_are_waiting_for_100_continue:
            await self._write(self._encode(h11.InformationalResponse(
                status_code=100, headers=[], reason=b"Continue")))
        body = bytearray()
        try:
            event = await self._next_event()
            while isinstance(event, h11.Data):
                body += event.data
                cycle.body_bytes += len(event.data)
                if cycle.body_bytes > self.limits.max_body_bytes:
                    raise _Abort(413, "too_large",
                                 f"request body over {self.limits.max_body_bytes} bytes")
                event = self._h11.next_event()  # what is already buffered; no waiting
                if event is h11.NEED_DATA:
                    return {"type": "http.request", "body": bytes(body), "more_body": True}
        except TimeoutError:
            raise _Abort(408, "body_timeout", self._late("the request body",
                                                         self.limits.body_timeout_s)) from None
        except h11.RemoteProtocolError as e:
            if self._eof:
                raise _Abort(None, "client_gone", "client went away mid-body") from None
            raise _Abort(400, "bad_request", f"malformed request body: {e}") from None
        if isinstance(event, h11.EndOfMessage):
            cycle.body_done = True
            self._enter("app", 0.0)  # the app's time is its own: nothing waits on the client
            return {"type": "http.request", "body": bytes(body), "more_body": False}
        raise _Abort(None, "client_gone", "client went away mid-body")

    async def _send(self, cycle: _Cycle, message: Message) -> None:
        """ASGI send.  The head waits for the first body message (one write for
        both); once the client is gone, messages are dropped."""
        kind = message["type"]
        if kind == "http.response.start":
            if cycle.started:
                raise RuntimeError("http.response.start sent twice")
            cycle.started = True
            status = int(message["status"])
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            if self.closing:
                headers.append((b"connection", b"close"))
            cycle.head = h11.Response(status_code=status, headers=headers,
                                      reason=_reason(status))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not cycle.started or cycle.complete:
            raise RuntimeError("http.response.body outside a response")
        out = bytearray()
        if cycle.head is not None:
            out += self._encode(cycle.head)
            cycle.head = None
        body = bytes(message.get("body", b""))
        if body and cycle.method != b"HEAD":
            out += self._encode(h11.Data(data=body))
        if not message.get("more_body", False):
            out += self._encode(h11.EndOfMessage())
            cycle.complete = True
        await self._write(bytes(out))
        if cycle.complete or self._broken:
            cycle.finished.set()


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
