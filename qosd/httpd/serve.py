"""Serving an app on listening sockets: qosd's own small HTTP/1.1 server.

The sockets come from mmmesh/net.py (``listen_unix``: mode set before
listen, a stale socket file replaced, a live one refused; ``listen_tcp``) and
are bound before the server starts, so a bind error reaches the caller.

Each :class:`ApiServer` accepts only while it holds fewer than
``max_connections`` connections: at the cap it stops calling accept(), so a
waiting client costs qosd no file descriptor (it waits in the kernel's listen
backlog, or its connect() fails once that is full), and it hurries the
connections it holds (idle keep-alive ones close, slow requests get
``pressure_timeout_s``: see qosd/httpd/http11.py) so that the waiting get in.  Every listener has its
own cap, so a flood on sla.sock cannot take the admin socket's connections.
The connections themselves (deadlines, sizes, the SO_PEERCRED scope
extension) are qosd/httpd/http11.py's; their errors are logged at most once per
cause per interval (qosd/logs.py).

Stopping: accept no more, remove the unix socket file, close idle
connections, let requests in flight finish for ``grace_s``, close the rest.
The server leaves signals to its owner (the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import threading
from collections import Counter
from typing import Any

from mmmesh.net import listen_tcp, listen_unix, parse_hostport
from qosd.model import MAX_BODY_BYTES

from ..logs import DEFAULT_INTERVAL_S, RateLimitedLog
from .http11 import Asgi, Connection, Limits, Peer, read_peer

log = logging.getLogger(__name__)

ADMIN_MAX_CONNECTIONS = 32  # the admin socket, and the admin API on TCP: each its own
SLA_MAX_CONNECTIONS = 64  # sla.sock, which any local process may connect to
METRICS_MAX_CONNECTIONS = 8  # the Prometheus endpoint
GRACE_S = 5.0  # how long requests in flight may finish when the server stops
ACCEPT_BACKOFF_S = 0.1  # after accept() failed for want of descriptors or memory
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def default_limits() -> Limits:
    """The connection limits of qosd's listeners (the body cap is the API's)."""
    return Limits(max_body_bytes=MAX_BODY_BYTES)


class ApiServer:
    """An HTTP/1.1 server for ``app`` on sockets bound before it starts.

    ``await server.serve()`` runs it (or :meth:`start_thread`); :meth:`stop`,
    :meth:`stop_async` or ``server.should_exit = True`` ends it.  ``stats``
    counts what happened to connections (accepted, timeouts, refusals);
    ``connections`` is how many are open now."""

    def __init__(self, app: Asgi, sockets: list[socket.socket], uds_path: str | None = None,
                 *, max_connections: int = ADMIN_MAX_CONNECTIONS,
                 limits: Limits | None = None, grace_s: float = GRACE_S,
                 log_interval_s: float = DEFAULT_INTERVAL_S, name: str | None = None) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.app = app
        self.sockets = sockets
        self.uds_path = uds_path
        self.max_connections = max_connections
        self.limits = limits if limits is not None else default_limits()
        self.grace_s = grace_s
        if uds_path is not None:
            self._address: str | tuple[str, int] = uds_path
        else:
            host, port = sockets[0].getsockname()[:2]
            self._address = (str(host), int(port))
        self.name = name or self._default_name()
        self.stats: Counter[str] = Counter()
        self.started = False
        self._log = RateLimitedLog(log, log_interval_s)
        self._uds_inode: int | None = None
        if uds_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._uds_inode = os.lstat(uds_path).st_ino
        self._conns: dict[asyncio.Task[None], Connection] = {}
        self._slots: asyncio.Semaphore | None = None
        self._exit_requested = False
        self._pressed = False  # at the cap, waiting for a connection to end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    def _default_name(self) -> str:
        if isinstance(self._address, str):
            return os.path.basename(self._address)
        host, port = self._address
        return f"tcp:{host}:{port}"

    # -------------------------------------------------------------- where
    @property
    def address(self) -> str | tuple[str, int]:
        """The unix socket path, or (host, port) for TCP (the real port when 0 was asked)."""
        return self._address

    @property
    def port(self) -> int:
        addr = self.address
        if isinstance(addr, str):
            raise AttributeError("a unix socket server has no port")  # noqa: TRY004
        return addr[1]

    @property
    def connections(self) -> int:
        """Connections open now (at most ``max_connections``)."""
        return len(self._conns)

    # -------------------------------------------------------------- running
    @property
    def should_exit(self) -> bool:
        return self._exit_requested

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._request_exit()

    def _request_exit(self) -> None:
        """Thread-safe: wakes :meth:`serve` to stop."""
        self._exit_requested = True
        loop, event = self._loop, self._exit
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(event.set)

    async def serve(self) -> None:
        """Serves until asked to exit, then stops gracefully (see the module doc)."""
        self._loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        if self._exit_requested:
            self._exit.set()
        self._slots = asyncio.Semaphore(self.max_connections)
        accepting = [asyncio.create_task(self._accept_loop(s), name=f"accept {self.name}")
                     for s in self.sockets]
        flushing = asyncio.create_task(self._flush_logs())
        self.started = True
        try:
            await self._exit.wait()
        finally:
            for t in accepting:
                t.cancel()
            await asyncio.gather(*accepting, return_exceptions=True)
            self._close_listeners()
            await self._drain()
            flushing.cancel()
            self._log.flush()

    async def _accept_loop(self, sock: socket.socket) -> None:
        assert self._slots is not None
        loop = asyncio.get_running_loop()
        while True:
            if self._slots.locked():
                self.stats["at_cap"] += 1
                self._log.log(logging.WARNING, (self.name, "at_cap"),
                              "%s: at its cap of %d connections; new ones wait in the "
                              "listen backlog, slow ones are cut sooner", self.name,
                              self.max_connections)
                for held in self._conns.values():
                    held.hurry()
            self._pressed = self._slots.locked()
            try:
                await self._slots.acquire()
            finally:
                self._pressed = False
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as e:
                self._slots.release()
                self.stats["accept_error"] += 1
                self._log.log(logging.ERROR, (self.name, "accept", e.errno),
                              "%s: accept() failed: %s", self.name, e)
                if e.errno in _OUT_OF_RESOURCES:
                    await asyncio.sleep(ACCEPT_BACKOFF_S)
                continue
            except BaseException:
                self._slots.release()
                raise
            try:
                self._open(conn, addr)
            except OSError as e:  # the client reset before it could be served
                conn.close()
                self._slots.release()
                self.stats["client_gone"] += 1
                self._log.log(logging.INFO, (self.name, "open", e.errno),
                              "%s: connection lost at accept: %s", self.name, e)

    def _open(self, conn: socket.socket, addr: Any) -> None:
        """Starts serving an accepted socket (its slot is taken)."""
        assert self._slots is not None
        self.stats["accepted"] += 1
        peer: Peer | None = None
        client: tuple[str, int] | None = None
        if conn.family == socket.AF_UNIX:
            server: tuple[str, int | None] = (self.uds_path or "", None)
            with contextlib.suppress(OSError):  # the client is gone already: it reads EOF
                peer = read_peer(conn)
        else:
            client = (str(addr[0]), int(addr[1]))
            host, port = conn.getsockname()[:2]
            server = (str(host), int(port))
        c = Connection(conn, self.app, self.limits, name=self.name, server=server,
                       client=client, peer=peer, log=self._log, stats=self.stats,
                       pressed=lambda: self._pressed)
        task = asyncio.get_running_loop().create_task(c.run(), name=f"conn {self.name}")
        self._conns[task] = c
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._conns.pop(task, None)
        if self._slots is not None:
            self._slots.release()

    async def _drain(self) -> None:
        """Idle connections close now; busy ones get ``grace_s`` to finish."""
        for task, conn in list(self._conns.items()):
            if conn.busy:
                conn.closing = True  # this response is its last
            else:
                task.cancel()
        pending = set(self._conns)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.grace_s)
        for task in pending:
            self.stats["cut_at_stop"] += 1
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    async def _flush_logs(self) -> None:
        while True:
            await asyncio.sleep(self._log.limiter.interval_s)
            self._log.flush()

    def _close_listeners(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()
        if self.uds_path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.uds_path)
            # only our own socket file: a newer qosd may have bound the path since
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._uds_inode:
                os.unlink(self.uds_path)

    async def wait_started(self, timeout: float = 10.0) -> None:
        """Returns once the server accepts (raises what made it fail, or TimeoutError)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.started:
            if self._task is not None and self._task.done():
                self._task.result()  # raises what made it fail
                raise RuntimeError("the API server stopped before it started")
            if loop.time() > deadline:
                raise TimeoutError("the API server did not start")
            await asyncio.sleep(0.01)

    def start_thread(self, timeout: float = 10.0) -> threading.Thread:
        """Runs the server in a daemon thread (own event loop); returns once it serves."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as e:
                errors.append(e)
                log.exception("API server thread failed")

        t = threading.Thread(target=run, name=f"qosd-api-{self.name}", daemon=True)
        self._thread = t
        t.start()
        ticker = threading.Event()
        waited = 0.0
        while not self.started:
            if errors:
                raise RuntimeError("the API server failed to start") from errors[0]
            if not t.is_alive():
                raise RuntimeError("the API server stopped before it started")
            if waited > timeout:
                raise TimeoutError("the API server did not start")
            ticker.wait(0.01)
            waited += 0.01
        return t

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the server to exit; waits for its thread when it runs in one."""
        self._request_exit()
        if self._thread is not None:
            self._thread.join(timeout)

    async def stop_async(self) -> None:
        """Asks the server to exit; waits for it when :func:`serve_uds` & co started it."""
        self._request_exit()
        if self._task is not None:
            await self._task


def bind_uds(app: Any, path: str | os.PathLike[str], *, mode: int = 0o600,
             max_connections: int = ADMIN_MAX_CONNECTIONS, limits: Limits | None = None,
             grace_s: float = GRACE_S) -> ApiServer:
    """Binds a unix socket at ``path`` (mode ``mode`` before it listens) for ``app``.

    A stale socket file is replaced; a live one (something answers) or any
    other kind of file is an error.  The parent directory is created (0755)
    when missing."""
    sock = listen_unix(path, mode)
    return ApiServer(app, [sock], uds_path=os.fspath(path), max_connections=max_connections,
                     limits=limits, grace_s=grace_s)


def bind_tcp(app: Any, host: str, port: int, *, max_connections: int = ADMIN_MAX_CONNECTIONS,
             limits: Limits | None = None, grace_s: float = GRACE_S) -> ApiServer:
    """Binds TCP ``host``:``port`` (0 = an ephemeral port, see ``server.port``)."""
    return ApiServer(app, [listen_tcp(host, port)], max_connections=max_connections,
                     limits=limits, grace_s=grace_s)


async def _start(server: ApiServer) -> ApiServer:
    """Starts ``server`` in the running loop; returns it once it accepts requests."""
    server._task = asyncio.get_running_loop().create_task(server.serve())
    await server.wait_started()
    return server


async def serve_uds(app: Any, path: str | os.PathLike[str], **kw: Any) -> ApiServer:
    """Binds (see :func:`bind_uds` for ``mode=``, ``max_connections=``, ``limits=``)
    and starts serving ``app`` on a unix socket in the running loop.

    Returns once it accepts requests; stop it with ``await server.stop_async()``."""
    return await _start(bind_uds(app, path, **kw))


async def serve_tcp(app: Any, host: str, port: int, **kw: Any) -> ApiServer:
    """Like :func:`serve_uds`, on TCP."""
    return await _start(bind_tcp(app, host, port, **kw))


async def serve(app: Any, *, uds: str | None, tcp: str | None, app_tcp: Any | None = None,
                max_connections: int = ADMIN_MAX_CONNECTIONS,
                limits: Limits | None = None) -> list[ApiServer]:
    """Starts the listeners asked for: ``uds`` (a path) with ``app``, ``tcp``
    ("host:port") with ``app_tcp`` (build that one with the token; defaults to
    ``app``), each with its own ``max_connections``.  Returns the running servers."""
    servers: list[ApiServer] = []
    kw: dict[str, Any] = {"max_connections": max_connections, "limits": limits}
    try:
        if uds is not None:
            servers.append(await serve_uds(app, uds, **kw))
        if tcp is not None:
            host, port = parse_hostport(tcp, what="api_tcp")
            servers.append(await serve_tcp(app_tcp if app_tcp is not None else app,
                                           host, port, **kw))
    except BaseException:
        for s in servers:
            await s.stop_async()
        raise
    return servers
