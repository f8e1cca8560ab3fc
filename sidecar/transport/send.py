"""The send side of a sidecar: one ``FrameSender`` per configured Output.

``send(header, payload)`` hands a frame over; the payload (usually the
stage's output array) is referenced, never copied: it is framed with
:func:`mmmesh.wire.frame` and ``[header bytes, memoryview(array)]`` go to
``socket.sendmsg`` (scatter/gather).  Which path a TCP frame takes:

* nothing queued or being written, and connected: ``send()`` writes the frame
  itself, one ``sendmsg`` with no hand-over to the writer task (lower latency
  at low rates).  What the socket buffer does not take stays first in line
  for the writer task;
* otherwise it goes on the outbound ``FrameQueue`` (bounded in frames and in
  bytes; ``send()`` waits while it is full, which is how a slow downstream
  slows the stage).  The writer task takes every frame already waiting (up to
  64 frames or 256 KiB) into one ``sendmsg`` and waits for writability when
  the socket buffer is full (that wait is the backpressure ``drain()`` gives
  on a stream).

The sender connects with TCP_NODELAY, notices a closed peer while idle, and
reconnects with capped, jittered exponential backoff; a frame whose send
failed is sent whole on the new connection.  Real-time outputs drop frames
that are past their deadline (``contract.drop_late``) instead of sending them
late, and drop their oldest queued frame when the queue is full instead of
making the stage wait.  UDP outputs always queue: the writer task sends one
datagram per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmmesh._errors import WireError
from mmmesh._net import parse_hostport
from mmmesh.wire import Header, frame

from ..config import Limits, Output
from ..contract import drop_late
from .frames import Framed, FrameQueue, OutFrame, joined, payload_view

__all__ = ["FrameSender", "SenderCounters"]

log = logging.getLogger("mmmesh.sidecar.transport")

_MAX_DATAGRAM = 65507
# frames already waiting in the outbound queue go out in one sendmsg, up to
# this many (IOV_MAX is 1024; two iovecs per frame) or this much payload
_BATCH_FRAMES = 64
_BATCH_BYTES = 256 * 1024


@dataclass
class SenderCounters:
    """What a FrameSender did (docs/sidecar.md, "Counters")."""

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


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FrameSender:
    """Sends frames to one Output (one connection per downstream and class).

    ``send()`` writes the frame itself when nothing is queued or being written
    on a connected TCP output, else queues it for the writer task (waiting
    while the outbound queue is full; a real-time output drops its oldest
    queued frame instead).  ``flush()`` waits until every frame handed to
    ``send()`` was written to the socket or dropped.
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
        self.host, self.port = parse_hostport(output.address, what=f"output {output.name}")
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
        self._batch: list[Framed] = []  # the TCP writer's frames in progress
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
        """Writes one frame now or queues it (see the class); ``payload``
        (usually an ndarray) is referenced, not copied, and must not be
        modified afterwards.  False if it was dropped (real-time and late)."""
        q = self._queue
        assert q is not None, "start() first"
        if drop_late(header, self.realtime):
            self._drop(header, "deadline")
            return False
        if self.realtime:
            while q.full():  # real-time: the freshest frame is worth most; drop the oldest
                # (never a frame already partly on the wire: the stream would break)
                old = q.pop_oldest(lambda it: it.framed is not None)
                if old is None:
                    break
                q.task_done()
                self._drop(old.header, "overload")
        payload = payload_view(payload)
        try:
            nbytes = memoryview(payload).nbytes
        except TypeError:  # not a buffer: the writer reports it when framing
            nbytes = 0
        framed = None
        if self._direct and q.empty() and not self._batch:
            written, framed = self._write_now(header, payload)
            if written:
                return True
        item = OutFrame(header, payload, nbytes, framed)
        if q.full():
            await q.put(item)
        else:
            q.put_nowait(item)
        depth = q.qsize()
        self.counters.queue_hwm = max(self.counters.queue_hwm, depth)
        return True

    def _write_now(self, header: Header, payload: Any) -> tuple[bool, Framed | None]:
        """The fast path when nothing is queued or being written: one
        ``sendmsg`` from the caller, no hand-over to the writer task (at low
        rates that hand-over is a good part of the sidecar's added latency).
        ``(True, None)`` when the whole frame was written.  Otherwise the frame
        is to be queued: ``(False, the partly written frame)`` when the socket
        buffer took only part of it (the writer finishes it, first); ``(False,
        None)`` when not connected or on an error (the writer deals with it as
        usual)."""
        sock = self._sock
        if sock is None or self._dead:
            return False, None
        try:
            f = Framed(header, frame(header, payload))
            n = sock.sendmsg(f.views, (), socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return False, f
        except Exception:  # WireError, OSError, ...: the writer reports it as usual
            return False, None
        self.counters.writes += 1
        f.consume(n)
        if f.views:
            return False, f
        self._sent(f)
        return True, None

    def _sent(self, f: Framed) -> None:
        self.counters.frames_out += 1
        self.counters.bytes_out += f.total

    async def flush(self, timeout: float | None = None) -> bool:
        """Waits until every frame handed to ``send()`` was written to the
        socket or dropped.  False on timeout."""
        return self._queue is None or await joined(self._queue, timeout)

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
        """Counts a frame not sent (``reason``: deadline, overload, shutdown,
        error) and tells the ``on_drop`` hook."""
        c = self.counters
        if reason == "deadline":
            c.dropped_deadline += 1
        elif reason == "overload":
            c.dropped_overload += 1
        else:
            c.dropped_other += 1
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

    async def _collect(self, q: FrameQueue, batch: list[Framed]) -> None:
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
            if drop_late(item.header, self.realtime):
                self._drop(item.header, "deadline")
                q.task_done()
                continue
            try:
                batch.append(Framed(item.header, frame(item.header, item.payload)))
            except WireError as e:  # a header we cannot encode: drop it, keep going
                log.error("sender %s: cannot frame: %s", self.name, e)
                q.task_done()
            except Exception:  # a payload that is not a buffer, ...: same
                log.exception("sender %s: cannot frame", self.name)
                q.task_done()

    async def _write(self, sock: socket.socket, q: FrameQueue, batch: list[Framed]) -> None:
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
                sock = self._sock
                if sock is None or self._dead:
                    self._close_sock()
                    sock = await self._connect_tcp()
                    self._after_reconnect(q, batch)
                if not batch:
                    await self._collect(q, batch)
                    continue  # (re-checks the connection before writing)
                await self._write(sock, q, batch)
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

    def _after_reconnect(self, q: FrameQueue, batch: list[Framed]) -> None:
        """A new connection: a frame cut off on the old one is sent whole, and
        real-time frames that expired while we were reconnecting are dropped."""
        keep = []
        for f in batch:
            if drop_late(f.header, self.realtime):
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
                if drop_late(item.header, self.realtime):
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

