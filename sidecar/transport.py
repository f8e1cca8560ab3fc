"""MMH frames in and out of a sidecar: ``FrameServer`` (TCP + optional UDP) and
``FrameSender`` (one per configured Output).

Receive path (TCP), per connection: non-blocking socket + ``loop.sock_recv_into``.
Headers are read into a 64 KiB staging buffer (several small frames per
``recv``); a payload that is already in the staging buffer is copied out once;
one that is not is read by the kernel straight into a buffer allocated for it
(``recv_into``), so every payload byte is copied at most once in user space.
Those buffers come from a ``BufferPool`` and are reused once nothing refers to
them any more (no page faults per frame; see ``sidecar/bufpool.py``).
A complete frame goes to a ``FrameQueue`` (bounded in frames and in payload
bytes).  When the queue is full
the connection's coroutine waits in ``queue.put`` and does not read: the
kernel's receive window fills and TCP flow control stops the sender.  Frames
the ``realtime`` predicate selects are dropped (and counted) instead.

A connection that sends a malformed header, a ``payload_len`` over
``limits.max_frame_bytes``, ends mid-frame, or makes no progress mid-frame for
``limits.read_timeout_s`` is closed; the reason is counted
(``malformed[reason]`` and ``conn_closed[reason]``) and logged.  Other
connections are unaffected.  UDP carries one frame per datagram; malformed
datagrams are counted and dropped.

Send path: ``FrameSender.send()`` puts ``(header, array)`` on a bounded queue
(waits when full; real-time outputs drop instead).  A writer task frames it
with :func:`mmmesh.wire.frame` and hands ``[header bytes, memoryview(array)]``
to ``socket.sendmsg`` (scatter/gather, the tensor is never copied; frames
already waiting go out in the same call, up to 64 frames or 256 KiB; when
nothing is queued, ``send()`` writes the frame itself, without waking the
writer task), waiting
for writability when the socket buffer is full (that wait is the backpressure
``drain()`` gives on a stream).  It connects with TCP_NODELAY, detects a
closed peer while idle, and reconnects with capped, jittered exponential
backoff; a frame whose send failed is retried on the new connection.
Real-time outputs drop frames that are past their deadline instead of
sending them late, and drop their oldest queued frame when the queue is full
instead of making the stage wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmmesh import _abi
from mmmesh._errors import WireError
from mmmesh.wire import Header, decode_frame, decode_header, frame

from .bufpool import BufferPool
from .config import Limits, Listen, Output

__all__ = [
    "FrameQueue",
    "FrameSender",
    "FrameServer",
    "InFrame",
    "SenderCounters",
    "ServerCounters",
    "inframe_queue",
    "split_hostport",
]

log = logging.getLogger("mmmesh.sidecar.transport")

STAGING_BYTES = 64 * 1024
_PREAMBLE = _abi.MMH_PREAMBLE_LEN
_MAGIC_V1 = _abi.MMH_MAGIC + bytes([_abi.MMH_VERSION])
_PLEN = struct.Struct("!I")
_EMPTY = memoryview(b"")
_MAX_DATAGRAM = 65507


class FrameQueue(asyncio.Queue):  # type: ignore[type-arg]
    """An ``asyncio.Queue`` bounded in frames AND in payload bytes.

    A count alone does not bound memory: 64 queued 64 MiB frames are 4 GiB.
    The queue is full when it holds ``maxsize`` frames or at least
    ``max_bytes`` of payload; it always admits a frame when empty, so a frame
    bigger than ``max_bytes`` still passes, one at a time.  Built on the
    ``_put``/``_get`` hooks asyncio's own queue subclasses use."""

    def __init__(self, maxsize: int, max_bytes: int, size: Callable[[Any], int]) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._size = size

    def _put(self, item: Any) -> None:
        super()._put(item)  # type: ignore[misc]
        self.bytes += self._size(item)

    def _get(self) -> Any:
        item = super()._get()  # type: ignore[misc]
        self.bytes -= self._size(item)
        return item

    def full(self) -> bool:
        if 0 < self.maxsize <= self.qsize():
            return True
        return self.bytes >= self.max_bytes > 0 and not self.empty()

    def get_nowait(self) -> Any:
        item = super().get_nowait()
        # one frame's bytes may make room for several waiting producers (the
        # base class wakes one per get); each woken one re-checks full()
        while self._putters and not self.full():  # type: ignore[attr-defined]
            self._wakeup_next(self._putters)  # type: ignore[attr-defined]
        return item

    def pop_oldest(self, keep: Callable[[Any], bool]) -> Any | None:
        """Removes and returns the oldest item ``keep`` does not protect (None
        if every item is protected); the caller calls ``task_done`` for it."""
        dq = self._queue  # type: ignore[attr-defined]
        for i, item in enumerate(dq):
            if not keep(item):
                del dq[i]
                self.bytes -= self._size(item)
                self._wakeup_next(self._putters)  # type: ignore[attr-defined]
                return item
        return None


def inframe_queue(limits: Limits) -> FrameQueue:
    """The inbound queue: ``limits.inbound_queue`` frames, ``inbound_queue_mb``."""
    return FrameQueue(limits.inbound_queue, limits.inbound_queue_mb << 20,
                      lambda f: len(f.payload))


def split_hostport(addr: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[::1]:9000"`` -> ``(host, port)``."""
    host, _, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


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


# --------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------
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
    dropped_deadline: int = 0  # (kept for symmetry; deadline drops happen in the stage/sender)
    backpressure_waits: int = 0  # times a connection stopped reading because the queue was full
    connections_total: int = 0
    connections_open: int = 0
    queue_hwm: int = 0  # highest inbound queue depth seen

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["malformed"] = dict(self.malformed)
        d["conn_closed"] = dict(self.conn_closed)
        return d


@dataclass
class SenderCounters:
    frames_out: int = 0
    bytes_out: int = 0
    writes: int = 0  # sendmsg calls (a burst of queued small frames shares one)
    dropped_deadline: int = 0  # real-time output: past its deadline before it could be sent
    dropped_overload: int = 0  # real-time output: queue full, its oldest frame dropped
    dropped_other: int = 0  # not sent: the sender was closed first, or an unexpected error
    reconnects: int = 0  # connections made after the first one
    connect_failures: int = 0
    send_errors: int = 0  # connection lost while sending (frame retried) / UDP send failed
    connected: bool = False
    queue_hwm: int = 0

    def snapshot(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --------------------------------------------------------------------------
# Receive side
# --------------------------------------------------------------------------
@dataclass(slots=True)
class InFrame:
    """A received frame; what the stage turns into an ``iface.StageInput``."""

    header: Header
    payload: memoryview  # this frame's alone (a pooled buffer is reused only once
    #                      nothing refers to it: sidecar/bufpool.py)
    received_ns: int  # time.time_ns() when the whole frame had arrived
    source: str  # "host:port" of the peer
    transport: str = "tcp"  # "tcp" | "udp"


class _Close(Exception):
    """Internal: end a connection with a counted reason."""

    def __init__(self, reason: str, malformed: bool, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.malformed = malformed
        self.detail = detail


class _Conn:
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


DropHook = Callable[[InFrame, str], None]


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
            host, port = split_hostport(self.listen.tcp)
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            lsock = socket.socket(family, socket.SOCK_STREAM)
            try:
                lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                lsock.bind(addr)
                lsock.listen(128)
                lsock.setblocking(False)
            except BaseException:
                lsock.close()
                raise
            self._lsock = lsock
            self.port = lsock.getsockname()[1]
            self._accept_task = loop.create_task(self._accept_loop(lsock),
                                                 name=f"{self.name}-accept")
        if self.listen.udp:
            host, port = split_hostport(self.listen.udp)
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(host, port))
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


# --------------------------------------------------------------------------
# Send side
# --------------------------------------------------------------------------
@dataclass(slots=True)
class _OutFrame:
    header: Header
    payload: Any  # np.ndarray / buffer, referenced (never copied) until sent
    nbytes: int = 0  # payload bytes (the byte budget; header.payload_len is set on the wire)
    framed: _Framed | None = None  # already framed and partly written by send()


# frames already waiting in the outbound queue go out in one sendmsg, up to
# this many (IOV_MAX is 1024; two iovecs per frame) or this much payload
_BATCH_FRAMES = 64
_BATCH_BYTES = 256 * 1024


class _Framed:
    """One frame's iovecs (header bytes, payload view) and what is left to write."""

    __slots__ = ("bufs", "header", "total", "views")

    def __init__(self, header: Header, bufs: list[Any]) -> None:
        self.header = header
        self.bufs = [b if isinstance(b, memoryview) else memoryview(b) for b in bufs if len(b)]
        self.views = list(self.bufs)
        self.total = sum(len(b) for b in self.bufs)

    def consume(self, n: int) -> int:
        """Marks up to ``n`` bytes written; returns the bytes left over."""
        views = self.views
        while n and views:
            first = len(views[0])
            if n >= first:
                n -= first
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
        return n

    def rewind(self) -> None:
        self.views = list(self.bufs)

    @property
    def started(self) -> bool:
        return sum(len(v) for v in self.views) != self.total


def _payload_view(payload: Any) -> Any:
    if isinstance(payload, np.ndarray):
        if payload.size == 0:
            return b""  # (memoryview.cast refuses zero-size shapes)
        if not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload)
    return payload


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FrameSender:
    """Sends frames to one Output (one connection per downstream and class).

    ``send()`` enqueues (waits while the outbound queue is full, which is how a
    slow downstream slows the stage; real-time outputs drop their oldest queued
    frame instead).  A
    background task does the I/O.  ``flush()`` waits until everything queued
    was written to the socket.
    """

    def __init__(
        self,
        output: Output,
        limits: Limits,
        *,
        on_drop: Callable[[Output, Header, str], None] | None = None,
        backoff_initial: float = 0.05,
        backoff_max: float = 5.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.output = output
        self.limits = limits
        self.counters = SenderCounters()
        self.host, self.port = split_hostport(output.address)
        self.realtime = output.realtime
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self._on_drop = on_drop
        self._queue: FrameQueue | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self._dead = False
        self._writable: asyncio.Future[None] | None = None
        self._ever_connected = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch: list[_Framed] = []  # the TCP writer's frames in progress
        self._direct = output.transport != "udp"  # send() may write itself (TCP)

    @property
    def name(self) -> str:
        return self.output.name

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = FrameQueue(self.limits.outbound_queue, self.limits.outbound_queue_mb << 20,
                                 lambda item: item.nbytes)
        run = self._run_udp if self.output.transport == "udp" else self._run_tcp
        self._task = self._loop.create_task(run(), name=f"sender-{self.output.name}")

    async def send(self, header: Header, payload: Any = b"") -> bool:
        """Queue one frame; ``payload`` (usually an ndarray) is referenced, not
        copied, and must not be modified afterwards.  False if it was dropped."""
        q = self._queue
        assert q is not None, "start() first"
        if self.realtime:
            if header.deadline_ns is not None and time.time_ns() > header.deadline_ns:
                self._drop(header, "deadline")
                return False
            while q.full():  # real-time: the freshest frame is worth most; drop the oldest
                # (never a frame already partly on the wire: the stream would break)
                old = q.pop_oldest(lambda it: it.framed is not None)
                if old is None:
                    break
                q.task_done()
                self._drop(old.header, "overload")
        payload = _payload_view(payload)
        try:
            nbytes = memoryview(payload).nbytes
        except TypeError:  # not a buffer: the writer reports it when framing
            nbytes = 0
        framed = None
        if self._direct and q.empty() and not self._batch:
            framed = self._write_now(header, payload)
            if framed is True:
                return True
        item = _OutFrame(header, payload, nbytes, framed or None)
        if q.full():
            await q.put(item)
        else:
            q.put_nowait(item)
        depth = q.qsize()
        self.counters.queue_hwm = max(self.counters.queue_hwm, depth)
        return True

    def _write_now(self, header: Header, payload: Any) -> _Framed | bool:
        """The fast path when nothing is queued or being written: one
        ``sendmsg`` from the caller, no hand-over to the writer task (at low
        rates that hand-over is a good part of the sidecar's added latency).
        True when the whole frame was written; the partly written frame when
        the socket buffer filled (the writer finishes it, first); False when
        the frame should simply be queued (not connected, an error: the writer
        deals with it as usual)."""
        sock = self._sock
        if sock is None or self._dead:
            return False
        try:
            f = _Framed(header, frame(header, payload))
            n = sock.sendmsg(f.views, (), socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return f
        except Exception:  # WireError, OSError, ...: the writer reports it as usual
            return False
        self.counters.writes += 1
        f.consume(n)
        if f.views:
            return f
        self._sent(f)
        return True

    def _sent(self, f: _Framed) -> None:
        self.counters.frames_out += 1
        self.counters.bytes_out += f.total

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued frame was sent or dropped.  False on timeout."""
        if self._queue is None:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stops now (``flush()`` first for a graceful stop): frames not yet
        sent are dropped and counted (``dropped_other``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._close_sock()
        q = self._queue
        if q is not None:
            for f in self._batch:
                self._drop(f.header, "shutdown")
                q.task_done()
            self._batch.clear()
            while not q.empty():
                self._drop(q.get_nowait().header, "shutdown")
                q.task_done()

    # -- internals -----------------------------------------------------------
    def _drop(self, header: Header, reason: str) -> None:
        if reason == "deadline":
            self.counters.dropped_deadline += 1
        elif reason == "overload":
            self.counters.dropped_overload += 1
        else:  # "shutdown", "error"
            self.counters.dropped_other += 1
        if self._on_drop is not None:
            try:
                self._on_drop(self.output, header, reason)
            except Exception:
                log.exception("on_drop hook failed")

    def _close_sock(self) -> None:
        sock = self._sock
        self._sock = None
        self.counters.connected = False
        if sock is not None and self._loop is not None:
            fd = sock.fileno()
            if fd >= 0:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(fd)
                with contextlib.suppress(Exception):
                    self._loop.remove_writer(fd)
            sock.close()

    def _on_readable(self) -> None:
        """The downstream never sends: readable means it closed (or reset)."""
        sock = self._sock
        if sock is None:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            return  # unexpected bytes from downstream: ignore
        log.info("sender %s: %s closed the connection", self.name, self.output.address)
        self._dead = True
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._close_sock()

    async def _connect_tcp(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        delay = self.backoff_initial
        while True:
            sock: socket.socket | None = None
            try:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                family, _, _, _, addr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.wait_for(loop.sock_connect(sock, addr), self.connect_timeout)
            except (TimeoutError, OSError) as e:
                if sock is not None:
                    sock.close()
                self.counters.connect_failures += 1
                wait = random.uniform(delay / 2, delay)
                log.debug("sender %s: connect to %s failed (%s); retry in %.2fs",
                          self.name, self.output.address, e, wait)
                await asyncio.sleep(wait)
                delay = min(delay * 2, self.backoff_max)
                continue
            if self._ever_connected:
                self.counters.reconnects += 1
                log.info("sender %s: reconnected to %s", self.name, self.output.address)
            self._ever_connected = True
            self._sock = sock
            self._dead = False
            self.counters.connected = True
            loop.add_reader(sock.fileno(), self._on_readable)
            return sock

    async def _wait_writable(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._writable = fut
        fd = sock.fileno()
        loop.add_writer(fd, _wake, fut)
        try:
            await fut
        finally:
            self._writable = None
            if sock.fileno() >= 0:
                loop.remove_writer(fd)

    def _expired(self, header: Header) -> bool:
        d = header.deadline_ns
        return self.realtime and d is not None and time.time_ns() > d

    async def _collect(self, q: FrameQueue, batch: list[_Framed]) -> None:
        """Waits for a frame, then takes every frame already waiting (up to
        ``_BATCH_FRAMES`` / ``_BATCH_BYTES``) into ``batch``, framed: one
        ``sendmsg`` writes them all (one system call for a burst of small
        frames instead of one each).  Real-time frames past their deadline and
        frames whose header cannot be encoded are dropped here."""
        items = [await q.get()]
        nbytes = items[0].nbytes
        while len(items) < _BATCH_FRAMES and nbytes < _BATCH_BYTES and not q.empty():
            item = q.get_nowait()
            items.append(item)
            nbytes += item.nbytes
        for item in items:
            if item.framed is not None:  # partly written by send(): finish it first
                batch.append(item.framed)
                continue
            if self._expired(item.header):
                self._drop(item.header, "deadline")
                q.task_done()
                continue
            try:
                batch.append(_Framed(item.header, frame(item.header, item.payload)))
            except WireError as e:  # a header we cannot encode: drop it, keep going
                log.error("sender %s: cannot frame: %s", self.name, e)
                q.task_done()
            except Exception:  # a payload that is not a buffer, ...: same
                log.exception("sender %s: cannot frame", self.name)
                q.task_done()

    async def _write(self, sock: socket.socket, q: FrameQueue, batch: list[_Framed]) -> None:
        """Writes ``batch`` with scatter/gather ``sendmsg`` (no copy), waiting
        for writability when the socket buffer is full; each frame leaves the
        batch (counted, ``task_done``) once all its bytes are written."""
        while batch:
            if self._dead:
                raise ConnectionResetError("downstream closed the connection")
            views = [v for f in batch for v in f.views]
            try:
                n = sock.sendmsg(views, (), socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                await self._wait_writable(sock)
                continue
            self.counters.writes += 1
            while n:
                f = batch[0]
                n = f.consume(n)
                if not f.views:
                    batch.pop(0)
                    self._sent(f)
                    q.task_done()

    async def _run_tcp(self) -> None:
        q = self._queue
        assert q is not None
        batch = self._batch  # framed, not completely written yet (send() looks at it)
        while True:
            try:
                if self._sock is None or self._dead:
                    self._close_sock()
                    await self._connect_tcp()
                    self._after_reconnect(q, batch)
                if not batch:
                    await self._collect(q, batch)
                    continue  # (re-checks the connection before writing)
                await self._write(self._sock, q, batch)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                self.counters.send_errors += 1
                log.info("sender %s: connection to %s lost: %s", self.name,
                         self.output.address, e)
                self._close_sock()
                self._dead = True  # (the reconnect rewinds a frame cut off mid-write)
            except Exception:  # never die
                log.exception("sender %s: unexpected error", self.name)
                if any(f.started for f in batch):  # part of a frame is on the wire: start over
                    self._close_sock()
                    self._dead = True
                for f in batch:
                    self._drop(f.header, "error")
                    q.task_done()
                batch.clear()
                await asyncio.sleep(0.1)

    def _after_reconnect(self, q: FrameQueue, batch: list[_Framed]) -> None:
        """A new connection: a frame cut off on the old one is sent whole, and
        real-time frames that expired while we were reconnecting are dropped."""
        keep = []
        for f in batch:
            if self._expired(f.header):
                self._drop(f.header, "deadline")
                q.task_done()
            else:
                f.rewind()
                keep.append(f)
        batch[:] = keep

    async def _run_udp(self) -> None:
        q = self._queue
        assert q is not None
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.connect(addr)
        self._sock = sock
        self.counters.connected = True
        while True:
            item = await q.get()
            try:
                if self._expired(item.header):
                    self._drop(item.header, "deadline")
                    continue
                bufs = frame(item.header, item.payload)
                size = len(bufs[0]) + len(bufs[1])
                if size > _MAX_DATAGRAM:
                    raise OSError(f"frame of {size} bytes does not fit in a datagram")
                while True:
                    try:
                        sock.sendmsg(bufs)
                        break
                    except (BlockingIOError, InterruptedError):
                        await self._wait_writable(sock)
                self.counters.frames_out += 1
                self.counters.bytes_out += size
            except asyncio.CancelledError:
                raise
            except (OSError, WireError) as e:  # ECONNREFUSED from ICMP, EMSGSIZE...
                self.counters.send_errors += 1
                log.debug("sender %s: udp send failed: %s", self.name, e)
            finally:
                q.task_done()
