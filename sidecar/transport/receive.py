"""The receive side of a sidecar: ``FrameServer`` takes MMH frames over TCP
(and UDP) into the inbound ``FrameQueue``.

TCP, per connection: non-blocking socket + ``loop.sock_recv_into``.  Headers
are read into a 64 KiB staging buffer (several small frames per ``recv``); a
payload that is already in the staging buffer is copied out once; one that is
not is read by the kernel straight into a buffer allocated for it
(``recv_into``), so every payload byte is copied at most once in user space.
Those buffers come from a ``BufferPool`` and are reused once nothing refers to
them any more (no page faults per frame; see ``sidecar/bufpool.py``).

A complete frame goes to the queue (bounded in frames and in payload bytes).
When the queue is full the connection's coroutine waits in ``queue.put`` and
does not read: the kernel's receive window fills and TCP flow control stops
the sender.  Frames the ``realtime`` predicate selects are dropped (and
counted) instead.

A connection that sends a malformed header, a ``payload_len`` over
``limits.max_frame_bytes``, ends mid-frame, or makes no progress mid-frame for
``limits.read_timeout_s`` is closed; the reason is counted
(``malformed[reason]`` and ``conn_closed[reason]``) and logged.  Other
connections are unaffected.  UDP carries one frame per datagram; malformed
datagrams are counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmmesh import abi as _abi
from mmmesh.errors import WireError
from mmmesh.net import listen_tcp, parse_hostport
from mmmesh.wire import Header, decode_frame, decode_header

from ..bufpool import BufferPool
from ..config import Limits, Listen
from .frames import InFrame

__all__ = ["DropHook", "FrameServer", "ServerCounters", "wire_reason"]

log = logging.getLogger("mmmesh.sidecar.transport")

STAGING_BYTES = 64 * 1024
_PREAMBLE = _abi.MMH_PREAMBLE_LEN
_MAGIC_V1 = _abi.MMH_MAGIC + bytes([_abi.MMH_VERSION])
_PLEN = struct.Struct("!I")
_EMPTY = memoryview(b"")


def _fmt_peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in str(host) else f"{host}:{addr[1]}"
    return str(addr)


def wire_reason(e: WireError) -> str:
    """A small, fixed set of metric labels for WireError reasons."""
    r = e.reason
    if r == "bad magic":
        return "bad_magic"
    if r.startswith("unsupported version"):
        return "bad_version"
    if r.startswith("payload_len"):
        return "oversized"
    if r.startswith("truncated"):
        return "truncated"
    return "bad_header"


@dataclass
class ServerCounters:
    """What a FrameServer saw.  ``malformed`` / ``conn_closed`` count by reason:
    bad_magic, bad_version, bad_header, oversized, truncated, datagram_length
    (malformed); the same plus eof, reset, read_timeout, shutdown (closed)."""

    frames_in: int = 0
    bytes_in: int = 0
    malformed: Counter[str] = field(default_factory=Counter)
    conn_closed: Counter[str] = field(default_factory=Counter)
    dropped_overload: int = 0  # real-time / UDP frames dropped because the queue was full
    backpressure_waits: int = 0  # times a connection stopped reading because the queue was full
    connections_total: int = 0
    connections_open: int = 0
    queue_hwm: int = 0  # highest inbound queue depth seen

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["malformed"] = dict(self.malformed)
        d["conn_closed"] = dict(self.conn_closed)
        return d


class _Close(Exception):
    """Internal: end a connection with a counted reason."""

    def __init__(self, reason: str, malformed: bool, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.malformed = malformed
        self.detail = detail


class _Conn:
    """One inbound TCP connection: its task and its read-timeout state."""

    __slots__ = (
        "idle",
        "kill_reason",
        "last_progress",
        "mid_frame",
        "peer",
        "sock",
        "task",
        "timer",
    )

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.task: asyncio.Task[None] | None = None
        self.mid_frame = False  # waiting for the rest of a frame (stall timer applies)
        self.idle = False  # waiting for the first byte of the next frame
        self.last_progress = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.kill_reason: str | None = None


DropHook = Callable[[InFrame, str], None]  # (the dropped frame, "overload")


class FrameServer:
    """Accepts MMH frames on ``listen.tcp`` (and ``listen.udp``) into ``queue``.

    ``realtime(header)`` says which frames are dropped (counted) instead of
    stopping the connection when the queue is full; UDP frames always are.
    ``on_drop(frame, reason)`` is called for every dropped frame.
    """

    def __init__(
        self,
        listen: Listen,
        limits: Limits,
        queue: asyncio.Queue[InFrame],
        *,
        realtime: Callable[[Header], bool] | None = None,
        on_drop: DropHook | None = None,
        name: str = "sidecar",
    ) -> None:
        self.listen = listen
        self.limits = limits
        self.queue = queue
        self.counters = ServerCounters()
        self.name = name
        self._realtime = realtime or (lambda h: False)
        self._on_drop = on_drop
        self._lsock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._conns: set[_Conn] = set()
        self._closing = False
        self.port: int | None = None
        self.udp_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pool = BufferPool(limits.buffer_pool_mb << 20)

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if self.listen.tcp:
            lsock = listen_tcp(*parse_hostport(self.listen.tcp, what="listen.tcp"))
            self._lsock = lsock
            self.port = lsock.getsockname()[1]
            self._accept_task = loop.create_task(self._accept_loop(lsock),
                                                 name=f"{self.name}-accept")
        if self.listen.udp:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self),
                local_addr=parse_hostport(self.listen.udp, what="listen.udp"))
            self._udp = transport
            self.udp_port = transport.get_extra_info("sockname")[1]
        log.info("%s: listening tcp=%s udp=%s", self.name, self.port, self.udp_port)

    async def stop_accepting(self) -> None:
        """Close the listening socket and the UDP endpoint (connections stay)."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None

    async def close(self, grace: float = 0.0) -> None:
        """Stop accepting; let connections finish the frame they are in the
        middle of (and hand over what is already buffered) for up to ``grace``
        seconds, then close every connection."""
        self._closing = True
        await self.stop_accepting()
        tasks = [c.task for c in self._conns if c.task is not None]
        for c in list(self._conns):
            # a connection waiting for the first byte of a frame has nothing to finish
            if c.idle and c.task is not None:
                c.kill_reason = "shutdown"
                c.task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(grace, 0.0))
            for t in pending:
                for c in self._conns:
                    if c.task is t:
                        c.kill_reason = "shutdown"
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- TCP -----------------------------------------------------------------
    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # EMFILE and friends: keep serving
                log.warning("%s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Conn(sock, _fmt_peer(addr))
            self._conns.add(c)
            self.counters.connections_total += 1
            self.counters.connections_open += 1
            c.task = loop.create_task(self._serve_conn(c), name=f"{self.name}-conn-{c.peer}")

    def _progress(self, c: _Conn) -> None:
        assert self._loop is not None
        c.last_progress = self._loop.time()
        if c.timer is None:
            c.timer = self._loop.call_at(c.last_progress + self.limits.read_timeout_s,
                                         self._check_stall, c)

    def _check_stall(self, c: _Conn) -> None:
        assert self._loop is not None
        c.timer = None
        if not c.mid_frame or c.task is None or c.task.done():
            return
        due = c.last_progress + self.limits.read_timeout_s
        if self._loop.time() >= due:
            c.kill_reason = "read_timeout"
            c.task.cancel()
        else:
            c.timer = self._loop.call_at(due, self._check_stall, c)

    async def _serve_conn(self, c: _Conn) -> None:
        reason, malformed, detail = "eof", False, ""
        try:
            await self._read_frames(c)
        except _Close as e:
            reason, malformed, detail = e.reason, e.malformed, e.detail
        except asyncio.CancelledError:
            reason = c.kill_reason or "shutdown"
            if reason == "read_timeout":
                detail = f"no progress mid-frame for {self.limits.read_timeout_s}s"
            elif c.kill_reason is None:
                self._finish_conn(c, reason, False, "")
                raise
        except WireError as e:
            reason, malformed, detail = wire_reason(e), True, str(e)
        except OSError as e:
            reason, detail = "reset", str(e)
        except Exception as e:  # a bug must not take the server down
            log.exception("%s: connection %s failed", self.name, c.peer)
            reason, detail = "internal", repr(e)
        self._finish_conn(c, reason, malformed, detail)

    def _finish_conn(self, c: _Conn, reason: str, malformed: bool, detail: str) -> None:
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None
        with contextlib.suppress(OSError):
            c.sock.close()
        if c in self._conns:
            self._conns.discard(c)
            self.counters.connections_open -= 1
        self.counters.conn_closed[reason] += 1
        if malformed:
            self.counters.malformed[reason] += 1
        if malformed or reason in ("read_timeout", "internal"):
            log.warning("%s: closed connection from %s: %s%s", self.name, c.peer, reason,
                        f" ({detail})" if detail else "")
        else:
            log.debug("%s: connection from %s closed: %s", self.name, c.peer, reason)

    async def _read_frames(self, c: _Conn) -> None:
        loop = asyncio.get_running_loop()
        sock = c.sock
        buf = bytearray(STAGING_BYTES)
        mv = memoryview(buf)
        start = end = 0
        max_payload = self.limits.max_frame_bytes
        while True:
            # ---- hand over every complete frame in the staging buffer ----
            while True:
                avail = end - start
                if avail < _PREAMBLE:
                    if avail and buf[start:start + min(avail, 4)] != _MAGIC_V1[:min(avail, 4)]:
                        decode_header(mv[start:end])  # raises the precise WireError
                    break
                if buf[start:start + 4] != _MAGIC_V1 or buf[start + 4] < _PREAMBLE:
                    decode_header(mv[start:end])  # raises
                hdr_len = buf[start + 4]
                (plen,) = _PLEN.unpack_from(buf, start + 8)
                if plen > max_payload:
                    raise _Close("oversized", True,
                                 f"payload_len {plen} > max_frame_bytes {max_payload}")
                if avail < hdr_len:
                    break
                header = decode_header(mv[start:start + hdr_len])
                pstart = start + hdr_len
                have = min(plen, end - pstart)
                if have == plen:  # whole payload staged: one copy out
                    payload = memoryview(bytearray(mv[pstart:pstart + plen])) if plen else _EMPTY
                    start = pstart + plen
                    c.mid_frame = False
                    await self._deliver(c, header, payload)
                    continue
                # payload not all here: read the rest straight into a buffer of
                # its own, from the pool (no page faults on a fresh allocation)
                pmv = self.pool.get(plen)
                pmv[:have] = mv[pstart:pstart + have]
                start = end = 0
                got = have
                c.mid_frame = True
                self._progress(c)
                while got < plen:
                    n = await loop.sock_recv_into(sock, pmv[got:])
                    if not n:
                        raise _Close("truncated", True, f"EOF after {got} of {plen} payload bytes")
                    got += n
                    self._progress(c)
                c.mid_frame = False
                await self._deliver(c, header, pmv)
            # ---- need more bytes ----
            if start == end:
                start = end = 0
            elif STAGING_BYTES - end < 2 * _abi.MMH_HDR_MAX:
                n = end - start
                mv[:n] = mv[start:end]
                start, end = 0, n
            c.mid_frame = start != end
            if c.mid_frame:
                self._progress(c)
            elif self._closing:
                return  # graceful stop at a frame boundary
            c.idle = not c.mid_frame
            n = await loop.sock_recv_into(sock, mv[end:])
            c.idle = False
            if not n:
                if start != end:
                    raise _Close("truncated", True, f"EOF inside a header ({end - start} bytes)")
                return
            end += n

    def _offer(self, f: InFrame) -> bool:
        """Count ``f`` and queue it if there is room; False when the queue is full."""
        cnt = self.counters
        cnt.frames_in += 1
        cnt.bytes_in += (f.header.hdr_len or _PREAMBLE) + f.header.payload_len
        q = self.queue
        if q.full():
            return False
        q.put_nowait(f)
        depth = q.qsize()
        cnt.queue_hwm = max(cnt.queue_hwm, depth)
        return True

    def _drop(self, f: InFrame) -> None:
        self.counters.dropped_overload += 1
        if self._on_drop is not None:
            try:
                self._on_drop(f, "overload")
            except Exception:
                log.exception("on_drop hook failed")

    async def _deliver(self, c: _Conn, header: Header, payload: memoryview) -> None:
        f = InFrame(header, payload, time.time_ns(), c.peer, "tcp")
        if self._offer(f):
            return
        if self._realtime(header):
            self._drop(f)
            return
        # stop reading this connection until the stage makes room: TCP flow control
        # pushes the wait back to the sender
        self.counters.backpressure_waits += 1
        await self.queue.put(f)
        depth = self.queue.qsize()
        self.counters.queue_hwm = max(self.counters.queue_hwm, depth)

    # -- UDP -----------------------------------------------------------------
    def _datagram(self, data: bytes, addr: Any) -> None:
        peer = _fmt_peer(addr)
        try:
            header, payload = decode_frame(data)
        except WireError as e:
            self._bad_datagram(peer, wire_reason(e), str(e))
            return
        if header.payload_len > self.limits.max_frame_bytes:
            self._bad_datagram(peer, "oversized", f"payload_len {header.payload_len}")
            return
        if header.frame_len != len(data):
            self._bad_datagram(peer, "datagram_length",
                               f"frame is {header.frame_len} bytes, datagram {len(data)}")
            return
        f = InFrame(header, payload, time.time_ns(), peer, "udp")
        if not self._offer(f):  # a datagram cannot be pushed back: drop it
            self._drop(f)

    def _bad_datagram(self, peer: str, reason: str, detail: str) -> None:
        self.counters.malformed[reason] += 1
        log.debug("%s: dropped malformed datagram from %s: %s", self.name, peer, detail)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: FrameServer) -> None:
        self.server = server

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.server._datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("%s: udp error: %s", self.server.name, exc)

