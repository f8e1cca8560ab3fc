"""mmmesh/net.py: the one host:port parser and the listening sockets."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from mmmesh.net import check_hostport, listen_tcp, listen_unix, parse_hostport


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_hostport("[::1]:9464") == ("::1", 9464)
    assert parse_hostport("node-a.example:0") == ("node-a.example", 0)
    assert parse_hostport(":9464", default_host="0.0.0.0") == ("0.0.0.0", 9464)
    assert check_hostport("10.0.0.1:1") == "10.0.0.1:1"
    for bad in ("host:port", "[::1]", "1.2.3.4:70000", "9464", ":9464", "::1:80", "[]:80",
                "1.2.3.4:-1", ""):
        with pytest.raises(ValueError, match="address"):
            parse_hostport(bad)


def test_listen_tcp_on_an_ephemeral_loopback_port() -> None:
    srv = listen_tcp("127.0.0.1", 0)
    try:
        port = srv.getsockname()[1]
        assert port > 0 and not srv.getblocking()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        srv.close()


def test_listen_unix_mode_and_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "api.sock"
    first = listen_unix(path, 0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(OSError, match="another process"):
        listen_unix(path, 0o600)  # a live socket is never taken over
    first.close()  # leaves a stale socket file behind
    second = listen_unix(path, 0o666)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    finally:
        second.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        listen_unix(tmp_path / "file", 0o600)
