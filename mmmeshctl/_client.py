"""The client side of qosd's admin API: one JSON request per connection over the
unix socket (``--socket``) or TCP/TLS (``--server``), with the standard
library's ``http.client`` (httpx costs ~130 ms of start-up; one small request
per command needs no more).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ._exit import EXIT, PROG, fail

if TYPE_CHECKING:  # imported where used (start-up time)
    import http.client

    import typer

__all__ = ["DEFAULT_SOCKET", "Conn", "Response", "conn_of"]

DEFAULT_SOCKET = "/run/mmmesh/qosd.sock"

_HTTP_EXIT = {401: EXIT.AUTH, 403: EXIT.AUTH, 404: EXIT.NOT_FOUND, 409: EXIT.CONFLICT,
              422: EXIT.REJECTED}


@dataclass
class Response:
    status_code: int
    content: bytes

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


@dataclass
class Conn:
    """Where qosd is (the global options) and how to ask it."""

    socket: str = DEFAULT_SOCKET
    server: str | None = None
    token: str | None = None
    timeout: float = 30.0
    _lost_ok: bool = False

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
        import http.client

        conn, prefix = self._connection()
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
        import http.client

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
        except http.client.HTTPException as e:  # a broken or cut answer
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
        import http.client

        self._lost_ok = False
        try:
            r = self._send(method, path, json_body, None)
        except (OSError, http.client.HTTPException):
            return None
        if r.is_success:
            try:
                return r.json()
            except ValueError:
                return None
        _http_error(r)


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
