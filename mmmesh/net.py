"""Addresses and listening sockets: the one place that parses ``host:port``
and sets up a listening socket, for qosd, the sidecar and the CLIs.

An address is ``host:port`` or ``[v6-address]:port``; ``port`` is 0..65535
(0 = any free port when binding).  The host may be left out (``:port``) only
where the caller gives a ``default_host``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Callable

__all__ = ["check_hostport", "listen_tcp", "listen_unix", "parse_hostport"]

LISTEN_BACKLOG = 128


def parse_hostport(text: str, *, default_host: str | None = None,
                   what: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:8470"`` / ``"[::1]:8470"`` / ``":8470"`` -> ``(host, port)``.

    Raises ValueError naming ``what`` and the expected form."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected host:port, got {type(text).__name__}")
    s = text.strip()
    if s.startswith("["):
        host, sep, port = s[1:].partition("]:")
        if not sep or not host:
            raise ValueError(f"{what} {text!r}: expected [v6-address]:port")
    else:
        host, sep, port = s.rpartition(":")
        if not sep:
            raise ValueError(f"{what} {text!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"{what} {text!r}: write an IPv6 address as [address]:port")
    if not host:
        if default_host is None:
            raise ValueError(f"{what} {text!r}: expected host:port (the host is missing)")
        host = default_host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r}: the port must be a number 0..65535")
    return host, int(port)


def check_hostport(text: str, *, default_host: str | None = None, what: str = "address") -> str:
    """``text`` unchanged when :func:`parse_hostport` accepts it (a pydantic validator)."""
    parse_hostport(text, default_host=default_host, what=what)
    return text


def listen_tcp(host: str, port: int, *, backlog: int = LISTEN_BACKLOG,
               blocking: bool = False) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0 = an ephemeral port), with
    SO_REUSEADDR, IPv6 sockets v6-only; non-blocking unless asked."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)

    def setup() -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)

    return _listening(sock, setup, backlog, blocking)


def _listening(sock: socket.socket, setup: Callable[[], None], backlog: int,
               blocking: bool) -> socket.socket:
    """``setup()`` (options, bind), then listen; the socket is closed on any error."""
    try:
        setup()
        sock.listen(backlog)
        sock.setblocking(blocking)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_unix(path: str | os.PathLike[str], mode: int, *, backlog: int = LISTEN_BACKLOG,
                blocking: bool = False) -> socket.socket:
    """A listening unix socket at ``path`` with ``mode`` set before it listens.

    A stale socket file (nobody answers) is replaced; a live one or any other
    kind of file is an error.  The parent directory is created (0755)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise OSError(f"{path}: another process is serving on this socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def setup() -> None:
        sock.bind(path)
        os.chmod(path, mode)  # nobody can connect before listen(): the mode is in place first

    return _listening(sock, setup, backlog, blocking)
