"""Plumbing for the socket-layer tests and bench/sockmsg.py: a cgroup v2 of
their own, entering it (sockets belong to the cgroup of the process that
creates them; accepted sockets to their listener's), MMH frames, and reading
them back off a socket."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mmmesh.dataplane import _sock
from mmmesh.wire import FrameReader, Header, encode_header

_seq = itertools.count()


def own_cgroup() -> str:
    """This process's cgroup v2 path (below the mount)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip().lstrip("/")
    return ""


@contextmanager
def scratch_cgroup(tag: str) -> Iterator[tuple[str, str]]:
    """A fresh cgroup below the cgroup v2 mount: (absolute path, relative
    path); removed afterwards (its processes, if any, moved out first)."""
    mount = _sock.cgroup2_mount()
    rel = f"mmmesh-{tag}-{os.getpid()}-{next(_seq)}"
    path = os.path.join(mount, rel)
    os.mkdir(path)
    try:
        yield path, rel
    finally:
        home = os.path.join(mount, own_cgroup())
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:
                with open(os.path.join(home, "cgroup.procs"), "w") as f:
                    f.write(pid)
        except OSError:
            pass
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.05)


def join_cgroup(path: str, pid: int = 0) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid or os.getpid()))


@contextmanager
def inside(path: str) -> Iterator[None]:
    """This process inside cgroup ``path`` for the block (sockets created
    there stay the cgroup's)."""
    home = os.path.join(_sock.cgroup2_mount(), own_cgroup())
    join_cgroup(path)
    try:
        yield
    finally:
        join_cgroup(home)


def listener(addr: str = "127.0.0.1") -> tuple[socket.socket, int]:
    ls = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    ls.bind((addr, 0))
    ls.listen(64)
    return ls, ls.getsockname()[1]


def connect(ls: socket.socket, port: int, addr: str = "127.0.0.1",
            src: str | None = None) -> tuple[socket.socket, socket.socket]:
    """A connected (client, server) pair on ``ls``, TCP_NODELAY on both."""
    c = socket.socket(ls.family)
    if src:
        c.bind((src, 0))
    c.connect((addr, port))
    s, _ = ls.accept()
    for x in (c, s):
        x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c, s


def frame(modality: int, payload: bytes | int = 0, *, cls: int = 0, stream: int = 1,
          seq: int = 0) -> bytes:
    """A whole MMH frame (header with stream id and sequence TLVs)."""
    body = payload if isinstance(payload, bytes) else bytes([seq & 0xFF]) * payload
    hdr = encode_header(Header(modality=modality, sla_class=cls, stream_id=stream,
                               sequence=seq), payload_len=len(body))
    return hdr + body


def read_exactly(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        d = sock.recv(min(n - len(buf), 1 << 20))
        if not d:
            break
        buf += d
    return bytes(buf)


def read_frames(sock: socket.socket, n: int, timeout: float = 10.0) -> list[tuple[Header, bytes]]:
    """The next ``n`` frames off a stream socket."""
    sock.settimeout(timeout)
    rd = FrameReader()
    out: list[tuple[Header, bytes]] = []
    while len(out) < n:
        d = sock.recv(1 << 20)
        if not d:
            break
        rd.feed(d)
        out += [(h, bytes(p)) for h, p in rd]
    return out


def bytes_received(sock: socket.socket) -> int:
    """tcpi_bytes_received: what arrived over TCP (redirected bytes never do)."""
    import struct

    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    # struct tcp_info: 8 u8 + 24 u32 (104 bytes) then u64 pacing/max_pacing/
    # bytes_acked (offset 120), bytes_received (offset 128)
    return int(struct.unpack_from("Q", info, 128)[0])


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def swrr_counts(weights: list[int], n: int) -> list[int]:
    """How many of ``n`` frames each replica gets from the smooth weighted
    round robin of bpf/lib/sock.h (the reference model of mm_sock_swrr)."""
    cur = [0] * len(weights)
    out = [0] * len(weights)
    total = sum(weights)
    for _ in range(n):
        best = -1
        for i, w in enumerate(weights):
            if w:
                cur[i] += w
                if best < 0 or cur[i] > cur[best]:
                    best = i
        cur[best] -= total
        out[best] += 1
    return out
