"""The receive side of a sidecar: ``FrameServer`` takes MMH frames over TCP
(and UDP) into the inbound ``FrameQueue``.

TCP, per connection: an ``asyncio.BufferedProtocol`` on the loop's own
transport (with uvloop, libuv reads the socket into the buffer the protocol
names: one ``read`` per readable event, no per-read registration of the
socket, no future and no task step per read; ``loop.sock_recv_into`` costs
four system calls and a task wake-up per read).  Headers are read into a
64 KiB staging buffer (several small frames per read); a payload that is
already in the staging buffer is copied out once; one that is not is read by
the kernel straight into a buffer allocated for it, so every payload byte is
copied at most once in user space.  Those buffers come from a ``BufferPool``
and are reused once nothing refers to them any more (no page faults per
frame; see ``sidecar/bufpool.py``).

A complete frame goes to the queue (bounded in frames and in payload bytes).
When the queue is full the connection stops reading (``pause_reading``) and
waits in ``queue.put`` for room: the kernel's receive window fills and TCP
flow control stops the sender.  Frames the ``realtime`` predicate selects are
dropped (and counted) instead.

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
_PRE = struct.Struct("!IB3xI")  # magic+version, hdr_len, (modality, class, flags), payload_len
_MAGIC_V1_U32 = _abi.MMH_MAGIC_V1_U32
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
        self._queue_offer = getattr(queue, "offer", None)  # a FrameQueue's: one call a frame

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
        conns = list(self._conns)
        for c in conns:
            # a connection waiting for the first byte of a frame has nothing to finish
            if c.idle:
                c.finish("shutdown")
        waiting = [c.done for c in conns if not c.done.done()]
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=max(grace, 0.0))
            if pending:
                for c in conns:
                    if not c.done.done():
                        c.finish("shutdown")

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
            c = _Conn(self, _fmt_peer(addr))
            self._conns.add(c)
            self.counters.connections_total += 1
            self.counters.connections_open += 1
            try:
                await loop.connect_accepted_socket(lambda c=c: c, sock)  # type: ignore[misc]
            except OSError as e:
                c.finish("reset", detail=str(e))
                with contextlib.suppress(OSError):
                    sock.close()

    def _closed(self, c: _Conn, reason: str, malformed: bool, detail: str) -> None:
        """A connection ended (``_Conn.finish``): counted and logged."""
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

    def _offer(self, f: InFrame) -> bool:
        """Count ``f`` and queue it if there is room; False when the queue is full."""
        cnt = self.counters
        cnt.frames_in += 1
        cnt.bytes_in += (f.header.hdr_len or _PREAMBLE) + f.header.payload_len
        q = self.queue
        offer = self._queue_offer
        if offer is not None:
            if not offer(f):
                return False
        elif q.full():
            return False
        else:
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


class _Conn(asyncio.BufferedProtocol):
    """One inbound TCP connection: the transport reads into :meth:`get_buffer`
    (the staging buffer, or the payload buffer of a big frame) and calls
    :meth:`buffer_updated`, which hands every complete frame to the queue."""

    def __init__(self, server: FrameServer, peer: str) -> None:
        self.server = server
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(STAGING_BYTES)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0
        # a big frame whose payload is read straight into its own buffer
        self.header: Header | None = None
        self.payload: memoryview | None = None
        self.got = 0
        self.blocked = False  # waiting for room in the queue (not reading)
        self.mid_frame = False  # waiting for the rest of a frame (stall timer applies)
        self.last_progress = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.waiter: asyncio.Task[None] | None = None

    @property
    def idle(self) -> bool:
        """Waiting for the first byte of the next frame."""
        return not (self.mid_frame or self.blocked or self.done.done())

    # -- asyncio's calls ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.payload is not None:
            return self.payload[self.got:]
        return self.mv[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self.payload is not None:
                self.got += nbytes
                self._progress()
                if self.got < len(self.payload):
                    return
                header, payload = self.header, self.payload
                self.header = self.payload = None
                self.mid_frame = False
                assert header is not None
                if not self._deliver(header, payload, time.time_ns()):
                    return
            else:
                self.end += nbytes
            self._hand_over()
        except _Close as e:
            self.finish(e.reason, e.malformed, e.detail)
        except WireError as e:
            self.finish(wire_reason(e), True, str(e))
        except Exception as e:  # a bug must not take the server down
            log.exception("%s: connection %s failed", self.server.name, self.peer)
            self.finish("internal", detail=repr(e))

    def eof_received(self) -> bool:
        if self.payload is not None:
            self.finish("truncated", True,
                        f"EOF after {self.got} of {len(self.payload)} payload bytes")
        elif self.start != self.end:
            self.finish("truncated", True,
                        f"EOF inside a header ({self.end - self.start} bytes)")
        else:
            self.finish("eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.finish("eof")
        else:
            self.finish("reset", detail=str(exc))

    # -- frames ---------------------------------------------------------------
    def _hand_over(self) -> None:
        """Every complete frame in the staging buffer to the queue (until the
        queue is full: the rest waits, unread), then what the next read needs."""
        srv = self.server
        buf, mv = self.buf, self.mv
        start, end = self.start, self.end
        max_payload = srv.limits.max_frame_bytes
        now = time.time_ns()
        while True:
            avail = end - start
            if avail < _PREAMBLE:
                if avail and buf[start:start + min(avail, 4)] != _MAGIC_V1[:min(avail, 4)]:
                    decode_header(mv[start:end])  # raises the precise WireError
                break
            magic, hdr_len, plen = _PRE.unpack_from(buf, start)
            if magic != _MAGIC_V1_U32 or hdr_len < _PREAMBLE:
                decode_header(mv[start:end])  # raises
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
                self.start = start
                if not self._deliver(header, payload, now):
                    return  # the rest when there is room
                continue
            # payload not all here: read the rest straight into a buffer of its
            # own, from the pool (no page faults on a fresh allocation)
            pmv = srv.pool.get(plen)
            pmv[:have] = mv[pstart:pstart + have]
            self.start = self.end = 0
            self.header, self.payload, self.got = header, pmv, have
            self.mid_frame = True
            self._progress()
            return
        # ---- need more bytes ----
        if start == end:
            start = end = 0
        elif STAGING_BYTES - end < 2 * _abi.MMH_HDR_MAX:
            n = end - start
            mv[:n] = mv[start:end]
            start, end = 0, n
        self.start, self.end = start, end
        self.mid_frame = start != end
        if self.mid_frame:
            self._progress()
        elif srv._closing:
            self.finish("eof")  # graceful stop at a frame boundary

    def _deliver(self, header: Header, payload: memoryview, now: int) -> bool:
        """Counts the frame and queues it; False when the queue is full and the
        connection now waits for room (reading paused)."""
        srv = self.server
        f = InFrame(header, payload, now, self.peer, "tcp")
        if srv._offer(f):
            return True
        if srv._realtime(header):
            srv._drop(f)
            return True
        # stop reading this connection until the stage makes room: TCP flow control
        # pushes the wait back to the sender
        srv.counters.backpressure_waits += 1
        self.blocked = True
        self.mid_frame = False  # (time blocked by our own backpressure does not count)
        if self.transport is not None:
            self.transport.pause_reading()
        self.waiter = self.loop.create_task(self._wait_for_room(f),
                                            name=f"{srv.name}-conn-{self.peer}")
        return False

    async def _wait_for_room(self, f: InFrame) -> None:
        srv = self.server
        try:
            await srv.queue.put(f)
        except asyncio.CancelledError:
            return  # (the connection was closed meanwhile)
        srv.counters.queue_hwm = max(srv.counters.queue_hwm, srv.queue.qsize())
        self.waiter = None
        self.blocked = False
        if self.done.done():
            return
        try:
            self._hand_over()
        except _Close as e:
            self.finish(e.reason, e.malformed, e.detail)
            return
        except WireError as e:
            self.finish(wire_reason(e), True, str(e))
            return
        except Exception as e:
            log.exception("%s: connection %s failed", srv.name, self.peer)
            self.finish("internal", detail=repr(e))
            return
        if not self.blocked and not self.done.done() and self.transport is not None:
            self.transport.resume_reading()

    # -- timeouts and the end ---------------------------------------------------
    def _progress(self) -> None:
        self.last_progress = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(
                self.last_progress + self.server.limits.read_timeout_s, self._check_stall)

    def _check_stall(self) -> None:
        self.timer = None
        if not self.mid_frame or self.done.done():
            return
        timeout = self.server.limits.read_timeout_s
        due = self.last_progress + timeout
        if self.loop.time() >= due:
            self.finish("read_timeout", detail=f"no progress mid-frame for {timeout}s")
        else:
            self.timer = self.loop.call_at(due, self._check_stall)

    def finish(self, reason: str, malformed: bool = False, detail: str = "") -> None:
        """Closes the connection (once) and has it counted."""
        if self.done.done():
            return
        self.done.set_result(None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.waiter is not None and self.waiter is not asyncio.current_task():
            self.waiter.cancel()
        self.waiter = None
        if self.transport is not None:
            self.transport.abort()
        self.server._closed(self, reason, malformed, detail)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: FrameServer) -> None:
        self.server = server

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.server._datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("%s: udp error: %s", self.server.name, exc)

