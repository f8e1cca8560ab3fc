"""A standalone HTTP exporter for a registry (qosd itself serves its
registry through its own server, qosd/daemon.py's ``metrics_app``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Self

from prometheus_client import CollectorRegistry, start_http_server

from mmmesh.net import parse_hostport

DEFAULT_HOST = "127.0.0.1"  # an address without a host is served on loopback only


class MetricsServer:
    """The running exporter; ``shutdown()`` (or ``close()``) stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self.server = server
        self.thread = thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(timeout=5)
        self.server.server_close()

    close = shutdown

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve_metrics(registry: CollectorRegistry, addr: str) -> MetricsServer:
    """Serves ``registry`` over HTTP at ``addr`` (host:port; port 0 = any free
    one, see ``.port``; ``:port`` = loopback) from a daemon thread."""
    host, port = parse_hostport(addr, default_host=DEFAULT_HOST, what="metrics address")
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


def iter_samples(registry: CollectorRegistry) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample, for tests and debugging."""
    for fam in registry.collect():
        for s in fam.samples:
            yield s.name, dict(s.labels), float(s.value)
