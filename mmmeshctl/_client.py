"""The client side of qosd's admin API: one JSON request per connection over the
unix socket (``--socket``) or TCP/TLS (``--server``).

Over TCP/TLS the standard library's ``http.client`` (httpx costs ~130 ms of
start-up; one small request per command needs no more).  Over the unix
socket, the node's own path and the one an operator's ``policy apply`` takes,
not even that: importing ``http.client`` (with the ``email`` parser it pulls
in) is about half as much work as starting the interpreter (callgrind: +68 M
instructions on 116 M for ``python -c pass``), while one request with
``Connection: close`` is one ``sendall`` and reads until qosd closes:
:func:`_unix_exchange` writes it and reads the answer (status line, headers,
a ``Content-Length`` or chunked body), and refuses anything else as a broken
answer, as ``http.client`` would.

Every failure ends the program through :func:`~mmmeshctl._exit.fail` with
its exit code: qosd unreachable (5), an HTTP error status mapped by
``_HTTP_EXIT``, a bad ``--server`` URL (2).
"""

from __future__ import annotations

import errno
import functools
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ._exit import EXIT, PROG, fail

if TYPE_CHECKING:  # imported where used (start-up time)
    import http.client

    import typer

__all__ = ["DEFAULT_SOCKET", "Conn", "Response", "conn_of"]

DEFAULT_SOCKET = "/run/mmmesh/qosd.sock"

_HTTP_EXIT = {401: EXIT.AUTH, 403: EXIT.AUTH, 404: EXIT.NOT_FOUND, 409: EXIT.CONFLICT,
              422: EXIT.REJECTED}


class Response:
    """An answer: its status and body.  (Plain classes here, not dataclasses:
    importing ``dataclasses`` pulls in ``inspect``, ~4 ms of every start.)"""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def __repr__(self) -> str:
        return f"Response(status_code={self.status_code!r}, content={self.content[:60]!r})"

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)  # ValueError when it is not JSON (or not UTF-8)


_HttpClass = type["http.client.HTTPConnection"]


@functools.cache
def _connection_classes() -> tuple[Callable[..., http.client.HTTPConnection], _HttpClass,
                                   _HttpClass | None]:
    """(unix socket, TCP, TLS or None) connection classes, made on first use.

    Each takes ``timeout``, the limit for connecting (and the TLS handshake);
    :meth:`Conn._send` sets the read timeout once connected.  TLS uses the
    default context: certificates verified against the system CAs.
    """
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def __init__(self, path: str, *, timeout: float) -> None:
            super().__init__("qosd", timeout=timeout)
            self.unix_path = path

        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect(self.unix_path)
            except BaseException:
                sock.close()
                raise
            self.sock = sock

    tls = getattr(http.client, "HTTPSConnection", None)  # None: Python built without ssl
    return UnixConnection, http.client.HTTPConnection, tls


class RequestLost(Exception):
    """The connection broke after the request was (or may have been) sent:
    whether qosd acted on it is unknown (``request(..., may_be_lost=True)``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Conn:
    """Where qosd is (the global options) and how to ask it."""

    def __init__(self, socket: str = DEFAULT_SOCKET, server: str | None = None,
                 token: str | None = None, timeout: float = 30.0) -> None:
        self.socket = socket
        self.server = server
        self.token = token
        self.timeout = timeout
        self._lost_ok = False

    def __repr__(self) -> str:
        return (f"Conn(socket={self.socket!r}, server={self.server!r}, "
                f"token={'***' if self.token else None}, timeout={self.timeout!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Conn):
            return NotImplemented
        return (self.socket, self.server, self.token, self.timeout) == \
            (other.socket, other.server, other.token, other.timeout)

    __hash__ = None  # type: ignore[assignment]  # (as the dataclass was: unhashable)

    @property
    def where(self) -> str:
        return self.server if self.server else f"unix socket {self.socket}"

    def close(self) -> None:
        """Nothing to do: each request has its own connection (closed after it)."""

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        """A new connection to qosd (not yet connected) and the path prefix of
        --server (or "")."""
        unix, tcp, tls = _connection_classes()
        connect_timeout = min(self.timeout, 5.0)
        if not self.server:
            return unix(self.socket, timeout=connect_timeout), ""
        from urllib.parse import urlsplit

        url = self.server if "://" in self.server else f"http://{self.server}"
        try:
            parts = urlsplit(url)
            host, port = _host_port(parts.netloc)
            scheme = parts.scheme.lower()
            cls = tcp if scheme == "http" else tls if scheme == "https" else None
            if cls is None:
                raise ValueError(f"unsupported scheme {parts.scheme!r} (http or https)")
            if not host:
                raise ValueError("no host")
            # with the port given, http.client takes an IPv6 host without brackets
            conn = cls(host, cls.default_port if port is None else port,
                       timeout=connect_timeout)
        except ValueError as e:  # http.client.InvalidURL is one
            fail(EXIT.USAGE, f"error: bad --server URL {self.server!r}: {e}")
        return conn, parts.path.rstrip("/")

    def _send(self, method: str, path: str, json_body: Any,
              params: dict[str, Any] | None) -> Response:
        if params:
            from urllib.parse import urlencode

            path = f"{path}?{urlencode(params)}"
        headers = {"User-Agent": f"{PROG}/1", "Accept": "application/json",
                   "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        body = None
        if json_body is not None:
            body = json.dumps(json_body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if not self.server:
            try:
                return _unix_exchange(self.socket, min(self.timeout, 5.0), self.timeout,
                                      method, path, body, headers)
            except Sent as e:  # (could not connect: the OSError as it is)
                if self._lost_ok and not isinstance(e.cause, TimeoutError):
                    raise RequestLost(e.reason) from e.cause
                raise e.cause from None
        import http.client

        conn, prefix = self._connection()
        try:
            conn.connect()  # within the connect timeout (--timeout, at most 5 s)
            conn.sock.settimeout(self.timeout)  # then up to --timeout for each read
            try:
                try:
                    conn.request(method, prefix + path, body=body, headers=headers)
                except (BrokenPipeError, ConnectionResetError) as cut:
                    # A server may answer before it has read the whole body (a 401
                    # for a large policy) and close: that answer, when there is one.
                    r = _early_answer(conn, cut)
                else:
                    r = conn.getresponse()
                return Response(r.status, r.read())
            except (OSError, http.client.HTTPException) as e:
                if self._lost_ok and not isinstance(e, TimeoutError):
                    raise RequestLost(e.strerror if isinstance(e, OSError) and e.strerror
                                      else str(e) or type(e).__name__) from e
                raise
        finally:
            conn.close()

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict[str, Any] | None = None, may_be_lost: bool = False) -> Any:
        """The JSON answer of a 2xx; anything else ends the program with its exit code.

        With ``may_be_lost``, a connection that breaks once the request went
        out raises :class:`RequestLost` instead (the caller finds out what
        happened); not being able to connect at all still exits 5."""
        self._lost_ok = may_be_lost
        if not self.server:
            try:
                os.stat(self.socket)
            except (FileNotFoundError, NotADirectoryError):
                fail(EXIT.UNREACHABLE,
                     f"error: no qosd socket at {self.socket} (is qosd running? "
                     "set --socket/MMMESH_SOCKET, or --server for TCP)")
            except OSError:
                pass  # e.g. EACCES on the directory: connect() says it properly
        try:
            r = self._send(method, path, json_body, params)
        except TimeoutError:  # socket.timeout: connecting, the TLS handshake or the answer
            fail(EXIT.UNREACHABLE, f"error: qosd at {self.where} did not answer within "
                                   f"{self.timeout:g}s")
        except OSError as e:  # refused, reset, no such host, TLS errors, ...
            if e.errno in (errno.EACCES, errno.EPERM):
                fail(EXIT.AUTH, f"error: permission denied on {self.where} "
                                "(the socket is root only; use sudo)")
            reason = e.strerror or str(e) or type(e).__name__
            fail(EXIT.UNREACHABLE, f"error: cannot reach qosd at {self.where}: {reason}")
        except Exception as e:
            if not _broken_answer(e):
                raise
            fail(EXIT.UNREACHABLE, f"error: cannot reach qosd at {self.where}: "
                                   f"{str(e) or type(e).__name__}")
        if r.is_success:
            try:
                return r.json()
            except ValueError:
                fail(EXIT.OTHER, f"error: qosd sent a non-JSON answer ({r.status_code})")
        _http_error(r)


    def try_request(self, method: str, path: str, *, json_body: Any = None) -> Any | None:
        """Like :meth:`request`, but None (quietly) when qosd cannot be reached
        or the connection breaks; an HTTP error still exits with its code."""
        self._lost_ok = False
        try:
            r = self._send(method, path, json_body, None)
        except Exception as e:
            if isinstance(e, OSError) or _broken_answer(e):
                return None
            raise
        if r.is_success:
            try:
                return r.json()
            except ValueError:
                return None
        _http_error(r)


class BrokenAnswer(Exception):
    """What came back over the unix socket is not an HTTP answer (or was cut
    short): the unix path's ``http.client.HTTPException``."""


class Sent(Exception):
    """Internal: ``cause`` (an OSError or BrokenAnswer) came after the request
    went out, so qosd may have acted on it (``request(may_be_lost=True)``)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.reason = (cause.strerror if isinstance(cause, OSError) and cause.strerror
                       else str(cause) or type(cause).__name__)


def _broken_answer(e: BaseException) -> bool:
    """A cut or malformed answer (unix: BrokenAnswer; TCP: http.client's)."""
    if isinstance(e, BrokenAnswer):
        return True
    import sys

    hc = sys.modules.get("http.client")
    return hc is not None and isinstance(e, hc.HTTPException)


def _unix_exchange(path: str, connect_timeout: float, timeout: float, method: str,
                   target: str, body: bytes | None, headers: dict[str, str]) -> Response:
    """One HTTP/1.1 request with ``Connection: close`` over the unix socket
    ``path`` and its answer.  Connecting raises OSError as is; whatever fails
    once the request is on its way is raised as :class:`Sent` (its cause an
    OSError, a timeout or :class:`BrokenAnswer`).  A server that answers
    before it read the whole body (a 401 for a large policy) and closes: that
    answer."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(connect_timeout)
        sock.connect(path)
        sock.settimeout(timeout)
        lines = [f"{method} {target} HTTP/1.1", "Host: qosd", "Accept-Encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        try:
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError) as cut:
                try:
                    return _read_answer(sock)
                except (OSError, BrokenAnswer):
                    raise cut from None
            return _read_answer(sock)
        except (OSError, BrokenAnswer) as e:
            raise Sent(e) from e
    finally:
        sock.close()


def _read_answer(sock: Any) -> Response:
    """The answer on ``sock``: status line, headers, then a body of
    Content-Length bytes, a chunked one, or (neither) up to the close."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise BrokenAnswer("Remote end closed connection without response" if not data
                               else "incomplete answer headers")
        data += chunk
        if len(data) > 1 << 16 and b"\r\n\r\n" not in data:
            raise BrokenAnswer("answer headers over 64 KiB")
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit() \
            or len(parts[1]) != 3:
        raise BrokenAnswer(f"not an HTTP answer: {status_line[:40]!r}")
    status = int(parts[1])
    fields: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise BrokenAnswer(f"bad answer header: {line[:40]!r}")
        fields[name.strip().lower()] = value.strip()
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return Response(status, _unchunk(sock, rest))
    if "content-length" in fields:
        try:
            size = int(fields["content-length"])
        except ValueError:
            raise BrokenAnswer("bad Content-Length") from None
        while len(rest) < size:
            chunk = sock.recv(max(65536, size - len(rest)))
            if not chunk:
                raise BrokenAnswer(f"IncompleteRead({len(rest)} bytes read, "
                                   f"{size - len(rest)} more expected)")
            rest += chunk
        return Response(status, rest[:size])
    while True:  # no length: the body ends with the connection
        chunk = sock.recv(65536)
        if not chunk:
            return Response(status, rest)
        rest += chunk


def _unchunk(sock: Any, data: bytes) -> bytes:
    """A chunked body (RFC 9112 7.1), reading from ``sock`` as needed."""
    out = b""

    def need(n: int) -> None:
        nonlocal data
        while len(data) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise BrokenAnswer("incomplete chunked answer")
            data += chunk

    while True:
        while b"\r\n" not in data:
            need(len(data) + 1)
        line, _, data = data.partition(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise BrokenAnswer("bad chunk size") from None
        if size == 0:
            return out
        need(size + 2)
        out += data[:size]
        data = data[size + 2:]


def _early_answer(conn: http.client.HTTPConnection,
                  cut: OSError) -> http.client.HTTPResponse:
    """The answer that came before sending the request failed with ``cut``;
    ``cut`` itself when none came."""
    import http.client

    try:
        return conn.getresponse()
    except (OSError, http.client.HTTPException):
        raise cut from None


def _host_port(netloc: str) -> tuple[str, int | None]:
    """The host and port of a URL's authority (credentials in it are not used).

    Without a port (``node1``, ``[::1]``) the port is None (the scheme's
    default); with one, :func:`mmmesh.net.parse_hostport`
    reads it (a missing host comes back as "").  Raises ValueError.
    """
    from mmmesh.net import parse_hostport  # only with --server

    hostport = netloc.rpartition("@")[2]
    if ":" not in hostport.rpartition("]")[2]:  # the colons of [v6] are not a port
        return hostport.removeprefix("[").removesuffix("]"), None
    return parse_hostport(hostport, default_host="", what="address")


def _http_error(r: Response) -> NoReturn:
    """Exit with the code of an error answer and qosd's explanation of it."""
    code = _HTTP_EXIT.get(r.status_code, EXIT.OTHER)
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        fail(code, f"error: qosd answered HTTP {r.status_code}: {r.text[:200].strip()}")
    kind = str(body.get("error", f"http_{r.status_code}"))
    message = str(body.get("message", "")) or kind
    details: list[str] = []
    for item in body.get("errors") or []:
        if isinstance(item, list | tuple) and len(item) == 2:
            loc, msg = item
            details.append(f"{loc}: {msg}" if loc else str(msg))
    if kind == "invalid_policy" and details:
        n = len(details)
        fail(code, f"error: policy rejected: {n} problem{'s' if n != 1 else ''}", details)
    if kind == "unrealizable" and details:
        fail(code, "error: policy rejected: it cannot be applied on this node", details)
    if kind == "invalid_request" and details:
        fail(code, "error: request rejected by qosd", details)
    if kind == "conflict":
        fail(code, f"error: conflict: {message}; re-read it (mmmeshctl policy get) and retry"
                   " with --base-version " + str(body.get("current_version", "N")))
    if kind == "unauthorized":
        fail(code, "error: authentication failed: missing or wrong token (--token / "
                   "MMMESH_TOKEN)")
    if kind == "dataplane":
        fail(code, f"error: the node's dataplane refused the change (last good policy kept): "
                   f"{message}")
    fail(code, f"error: {message}")


def conn_of(ctx: typer.Context) -> Conn:
    """The :class:`Conn` the global options made (``mmmeshctl --socket/--server ...``)."""
    obj = ctx.find_object(Conn)
    if obj is None:  # pragma: no cover - the callback always sets it
        obj = Conn()
    return obj
