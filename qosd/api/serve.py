"""Serving an app on listening sockets with uvicorn.

The sockets come from mmmesh/_net.py (``listen_unix``: mode set before
listen, a stale socket file replaced, a live one refused; ``listen_tcp``) and
are bound before the server starts, so a bind error reaches the caller.  The
server leaves signals to its owner (the daemon) and removes its unix socket
file when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from mmmesh._net import listen_tcp, listen_unix, parse_hostport

log = logging.getLogger(__name__)


class ApiServer(uvicorn.Server):
    """A uvicorn server on sockets bound before it starts.

    ``await server.serve()`` runs it; ``server.should_exit = True`` (or
    :meth:`stop`) ends it.  It leaves signals to its owner (the daemon) and
    removes its unix socket file when it ends.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket],
                 uds_path: str | None = None) -> None:
        super().__init__(config)
        self.sockets = sockets
        self.uds_path = uds_path
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str | tuple[str, int]:
        """The unix socket path, or (host, port) for TCP (the real port when 0 was asked)."""
        if self.uds_path is not None:
            return self.uds_path
        name = self.sockets[0].getsockname()
        return (name[0], name[1])

    @property
    def port(self) -> int:
        addr = self.address
        if isinstance(addr, str):
            raise AttributeError("a unix socket server has no port")  # noqa: TRY004
        return addr[1]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the daemon owns the signals
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().serve(sockets=sockets if sockets is not None else self.sockets)
        finally:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._remove_socket_file()

    def _remove_socket_file(self) -> None:
        if self.uds_path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.uds_path).st_mode):
                os.unlink(self.uds_path)

    async def wait_started(self, timeout: float = 10.0) -> None:
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

        t = threading.Thread(target=run, name=f"qosd-api-{self.address}", daemon=True)
        self._thread = t
        t.start()
        waited = 0.0
        while not self.started:
            if errors:
                raise RuntimeError("the API server failed to start") from errors[0]
            if not t.is_alive():
                raise RuntimeError("the API server stopped before it started")
            if waited > timeout:
                raise TimeoutError("the API server did not start")
            threading.Event().wait(0.01)
            waited += 0.01
        return t

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the server to exit; waits for its thread when it runs in one."""
        self.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    async def stop_async(self) -> None:
        self.should_exit = True
        if self._task is not None:
            await self._task


def _config(app: Any, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        lifespan="off",  # the service's life is the daemon's business
        log_config=None,  # keep the daemon's logging setup
        log_level=log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=5,
        proxy_headers=False,
    )


def bind_uds(app: Any, path: str | os.PathLike[str], *, mode: int = 0o600,
             log_level: str = "warning") -> ApiServer:
    """Binds a unix socket at ``path`` (mode ``mode`` before it listens) for ``app``.

    A stale socket file is replaced; a live one (something answers) or any
    other kind of file is an error.  The parent directory is created (0755)
    when missing.
    """
    sock = listen_unix(path, mode)
    return ApiServer(_config(app, log_level), [sock], uds_path=os.fspath(path))


def bind_tcp(app: Any, host: str, port: int, *, log_level: str = "warning") -> ApiServer:
    """Binds TCP ``host``:``port`` (0 = an ephemeral port, see ``server.port``)."""
    return ApiServer(_config(app, log_level), [listen_tcp(host, port)])


async def _start(server: ApiServer) -> ApiServer:
    """Starts ``server`` in the running loop; returns it once it accepts requests."""
    server._task = asyncio.get_running_loop().create_task(server.serve())
    await server.wait_started()
    return server


async def serve_uds(app: Any, path: str | os.PathLike[str], **kw: Any) -> ApiServer:
    """Binds (0600 unless ``mode=`` says otherwise) and starts serving ``app`` on a
    unix socket in the running loop.

    Returns once it accepts requests; stop it with ``should_exit = True`` or
    ``await server.stop_async()``.
    """
    return await _start(bind_uds(app, path, **kw))


async def serve_tcp(app: Any, host: str, port: int, **kw: Any) -> ApiServer:
    """Like :func:`serve_uds`, on TCP."""
    return await _start(bind_tcp(app, host, port, **kw))


async def serve(app: Any, *, uds: str | None, tcp: str | None,
                app_tcp: Any | None = None) -> list[ApiServer]:
    """Starts the listeners asked for: ``uds`` (a path) with ``app``, ``tcp``
    ("host:port") with ``app_tcp`` (build that one with the token; defaults to
    ``app``).  Returns the running servers."""
    servers: list[ApiServer] = []
    try:
        if uds is not None:
            servers.append(await serve_uds(app, uds))
        if tcp is not None:
            host, port = parse_hostport(tcp, what="api_tcp")
            servers.append(await serve_tcp(app_tcp if app_tcp is not None else app,
                                           host, port))
    except BaseException:
        for s in servers:
            await s.stop_async()
        raise
    return servers
