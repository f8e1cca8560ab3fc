"""Frames spread over a stage's replicas by the socket layer, counted per
replica (tests/system/dataplane/test_socklayer.py, tests/system/qosd/)."""

from __future__ import annotations

import selectors
import socket

from mmmesh.wire import FrameReader


def spread(lead: socket.socket, servers: list[socket.socket],
           frames: list[bytes]) -> list[list[int]]:
    """Sends ``frames`` on ``lead`` (100 per send) and returns, per server,
    the sequence numbers it received."""
    total = sum(map(len, frames))
    for i in range(0, len(frames), 100):
        lead.sendall(b"".join(frames[i:i + 100]))
    sel = selectors.DefaultSelector()
    readers = []
    for i, s in enumerate(servers):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        readers.append(FrameReader())
    got: list[list[int]] = [[] for _ in servers]
    n = 0
    while n < total:
        events = sel.select(10)
        assert events, f"stalled at {n} of {total} bytes"
        for key, _ in events:
            d = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
            n += len(d)
            readers[key.data].feed(d)
            got[key.data] += [int(h.sequence or 0) for h, _ in readers[key.data]]
    sel.close()
    for s in servers:
        s.setblocking(True)
    return got
