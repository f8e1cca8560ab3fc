"""One TCP connection of an output to one downstream replica: a *lane*.

A ``FrameSender`` has one lane per address of its Output (one without
``replicas``).  A lane owns its connection and its part of the outbound
queue, and writes its frames in the order they were given to it:

* ``write_now()``: the sender's fast path, one ``sendmsg`` from the caller
  when nothing is queued or being written on the lane;
* its writer task takes every frame already waiting (up to 64 frames or
  256 KiB) into one scatter/gather ``sendmsg`` and waits for writability
  when the socket buffer is full;
* it connects with TCP_NODELAY, notices a closed peer while idle, and
  reconnects with capped, jittered exponential backoff.

A lane knows of the sender it belongs to only what it is handed at
construction, a :class:`LaneOwner`: the output's name and settings, the
sender's totals and ``ready`` event, and three callbacks (``changed``,
``drop``, ``rebalance``).  A lane is *up* from its start until a connect
fails or its connection breaks, and again once it reconnects.  Going down or
up is reported through ``changed``: the sender moves the frames of a lane
that is down to lanes that are up (``take_all``/``force_put``: frames are
moved whole, a frame cut off mid-write starts over on its new lane) and
leaves it out of the pick until it is back.  A broken connection is closed with an
abortive close (SO_LINGER 0): it reaches TCP_CLOSE at once, which is when
the socket layer releases the lane and a lead claim (docs/socklayer.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mmmesh.errors import WireError
from mmmesh.net import parse_hostport
from mmmesh.wire import Header, frame

from ..contract import drop_late
from .frames import Framed, FrameQueue, OutFrame

__all__ = ["Lane", "LaneCounters", "LaneOwner", "SenderTotals"]

log = logging.getLogger("mmmesh.sidecar.transport")

# frames already waiting in a lane's queue go out in one sendmsg, up to this
# many (IOV_MAX is 1024; two iovecs per frame) or this much payload
_BATCH_FRAMES = 64
_BATCH_BYTES = 256 * 1024
_LINGER_ABORT = struct.pack("ii", 1, 0)
# a connection that breaks sooner than this after it was made (a replica, or
# a proxy in front of one, that accepts and closes at once) counts as a
# failed connect for the backoff, else the lane reconnects in a busy loop
_SHORT_LIVED_S = 1.0


@dataclass
class LaneCounters:
    """One lane of an output (``senders[output].lanes``, docs/sidecar.md)."""

    address: str
    frames_out: int = 0
    bytes_out: int = 0
    reconnects: int = 0  # connections made after the lane's first one
    connect_failures: int = 0
    send_errors: int = 0  # connection lost while sending
    moved: int = 0  # frames handed to other lanes while this one was down
    connected: bool = False
    up: bool = True  # in the pick (connected, or not failed yet)
    lead: bool = False  # spread: kernel: every frame is written here


class SenderTotals(Protocol):
    """The sender's counters a lane adds to (``send.SenderCounters`` is one)."""

    frames_out: int
    bytes_out: int
    writes: int
    reconnects: int
    connect_failures: int
    send_errors: int


@dataclass(frozen=True, slots=True)
class LaneOwner:
    """What a lane is handed by the sender it belongs to (one for all its lanes)."""

    name: str
    """The output's name (logs, task names)."""
    realtime: bool
    """Real-time output: frames past their deadline are dropped, not sent."""
    ready: asyncio.Event
    """Lanes may write (``spread: kernel``: once every lane tried to connect)."""
    totals: SenderTotals
    """The sender's counters, summed over its lanes."""
    changed: Callable[[Lane], None]
    """A lane went up or down (or connected for the first time)."""
    drop: Callable[[Header, str], None]
    """A frame not sent, and why (``deadline``, ``error``)."""
    rebalance: Callable[[], None]
    """Frames of lanes that are down should move to lanes that are up."""
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    connect_timeout: float = 5.0


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_writable(owner: Any, sock: socket.socket) -> None:
    """Waits until ``sock`` can be written; the wait's future is
    ``owner._writable`` meanwhile (so that closing the owner can end it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    owner._writable = fut
    fd = sock.fileno()
    loop.add_writer(fd, _wake, fut)
    try:
        await fut
    finally:
        owner._writable = None
        if sock.fileno() >= 0:
            loop.remove_writer(fd)


class Lane:
    """The connection to ``address`` (replica ``index`` of ``owner``'s Output)."""

    def __init__(self, owner: LaneOwner, index: int, address: str, queue: FrameQueue) -> None:
        self.owner = owner
        self.index = index
        self.address = address
        self.host, self.port = parse_hostport(address, what=f"output {owner.name}")
        self.queue = queue
        self.batch: list[Framed] = []  # framed, not completely written yet (send() looks)
        self.counters = LaneCounters(address)
        self.attempted = False  # the first connect finished (either way)
        self._sock: socket.socket | None = None
        self._dead = False
        self._writable: asyncio.Future[None] | None = None
        self._idle: asyncio.Future[None] | None = None  # the writer waits for a frame
        self._ever_connected = False
        self._connected_at: float | None = None  # loop time of the current connection
        self._short_delay = owner.backoff_initial  # backoff over short-lived connections
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def up(self) -> bool:
        return self.counters.up

    @property
    def idle(self) -> bool:
        """Nothing queued or being written: the fast path may write."""
        return not self.batch and self.queue.empty()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(),
                                            name=f"sender-{self.owner.name}-{self.index}")

    async def stop(self) -> None:
        task = self._task
        if task is not None:
            while not task.done():  # (a cancel is re-sent should one ever be swallowed)
                task.cancel()
                await asyncio.wait((task,), timeout=1.0)
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
            self._task = None
        self._close_sock(abort=False)

    # -- the fast path -------------------------------------------------------
    def write_now(self, header: Header, payload: Any) -> tuple[bool, Framed | None]:
        """One ``sendmsg`` from the caller when the lane is idle and connected.
        ``(True, None)`` when the whole frame was written.  Otherwise the frame
        is to be queued on this lane: ``(False, the partly written frame)``
        when the socket buffer took only part of it (the writer finishes it,
        first); ``(False, None)`` when not connected or on an error (the
        writer deals with it as usual)."""
        sock = self._sock
        if sock is None or self._dead:
            return False, None
        try:
            f = Framed(header, frame(header, payload))
            n = sock.sendmsg(f.views, (), socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return False, f
        except Exception:  # noqa: BLE001  (WireError, OSError, ...: the writer reports it)
            return False, None
        self.owner.totals.writes += 1
        f.consume(n)
        if f.views:
            return False, f
        self._sent(f)
        return True, None

    def write_frames(self, items: list[tuple[Header, Any, int]]) -> None:
        """``write_now`` for several frames ``(header, payload, nbytes)`` of an
        idle lane: one ``sendmsg`` from the caller; what the socket buffer did
        not take (the first frame maybe partly written), or everything when
        the lane is not connected or the call failed, goes to the front of
        the lane's queue, in order, for the writer (which finishes a partly
        written frame first and reports errors as usual).  Frames written
        whole cost no ``Framed`` (one per frame only for what is left)."""
        sock = self._sock
        if sock is None or self._dead:
            self.queue.force_put_front([OutFrame(h, p, nb) for h, p, nb in items])
            return
        views: list[Any] = []
        bufs: list[list[Any]] = []
        for header, payload, _ in items:
            try:
                b = frame(header, payload)
            except Exception:  # noqa: BLE001  (WireError, not a buffer: the writer reports it)
                break
            bufs.append(b)
            views += b
        n = 0
        if bufs:
            try:
                n = sock.sendmsg(views, (), socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                pass
            except Exception:  # noqa: BLE001  (OSError...: the writer deals with it)
                bufs = []
            else:
                self.owner.totals.writes += 1
        done = sent = 0
        for b in bufs:
            size = len(b[0]) + len(b[1])
            if n < size:
                break
            n -= size
            sent += size
            done += 1
        if done:
            c, oc = self.counters, self.owner.totals
            c.frames_out += done
            c.bytes_out += sent
            oc.frames_out += done
            oc.bytes_out += sent
            if done == len(items):
                return
        left = []
        for i in range(done, len(items)):
            h, p, nb = items[i]
            f = None
            if i < len(bufs):  # framed already (the first maybe partly written)
                f = Framed(h, bufs[i])
                if i == done and n:
                    f.consume(n)
            left.append(OutFrame(h, p, nb, f))
        self.queue.force_put_front(left)

    def _sent(self, f: Framed) -> None:
        c, oc = self.counters, self.owner.totals
        c.frames_out += 1
        c.bytes_out += f.total
        oc.frames_out += 1
        oc.bytes_out += f.total

    # -- moving frames between lanes -------------------------------------------
    def take_all(self) -> list[OutFrame]:
        """Every frame of this lane not written yet, in order, for another
        lane (the lane is down: its writer is not writing).  A frame cut off
        mid-write is rewound: it is sent whole on its new lane."""
        q = self.queue
        out = []
        for f in self.batch:
            f.rewind()
            out.append(OutFrame(f.header, None, f.total, f))
            q.task_done()
        self.batch.clear()
        while not q.empty():
            out.append(q.get_nowait())
            q.task_done()
        self.counters.moved += len(out)
        return out

    # -- the writer ------------------------------------------------------------
    def _close_sock(self, *, abort: bool) -> None:
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
                if abort:  # straight to TCP_CLOSE (see the module)
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
            sock.close()
            # a frame send() cut off on that connection (queued, not yet taken
            # by the writer) starts over too, wherever it goes next
            for item in list(self.queue._queue):  # type: ignore[attr-defined]
                if item.framed is not None:
                    item.framed.rewind()

    def _set_up(self, up: bool) -> None:
        if self.counters.up != up:
            self.counters.up = up
            self.owner.changed(self)

    def _broken(self) -> None:
        """The connection is gone: wake the writer wherever it waits."""
        self._dead = True
        for fut in (self._writable, self._idle):
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._close_sock(abort=True)
        self._set_up(False)

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
        log.info("sender %s: %s closed the connection", self.owner.name, self.address)
        self._broken()

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        delay = self.owner.backoff_initial
        while True:
            sock: socket.socket | None = None
            try:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                family, _, _, _, addr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a
                # cancel that meets a finished connect (close() then hangs)
                async with asyncio.timeout(self.owner.connect_timeout):
                    await loop.sock_connect(sock, addr)
            except (TimeoutError, OSError) as e:
                if sock is not None:
                    sock.close()
                self.counters.connect_failures += 1
                self.owner.totals.connect_failures += 1
                self.attempted = True
                self._set_up(False)
                wait = random.uniform(delay / 2, delay)
                log.debug("sender %s: connect to %s failed (%s); retry in %.2fs",
                          self.owner.name, self.address, e, wait)
                await asyncio.sleep(wait)
                delay = min(delay * 2, self.owner.backoff_max)
                continue
            if self._ever_connected:
                self.counters.reconnects += 1
                self.owner.totals.reconnects += 1
                log.info("sender %s: reconnected to %s", self.owner.name, self.address)
            self._ever_connected = True
            self._connected_at = loop.time()
            self._sock = sock
            self._dead = False
            self.counters.connected = True
            self.attempted = True
            loop.add_reader(sock.fileno(), self._on_readable)
            self.counters.up = True
            self.owner.changed(self)  # (also a first connect: spread kernel waits for it)
            return sock

    async def _next(self) -> OutFrame | None:
        """The next queued frame; None when the connection broke while the
        lane was idle.  The frame stays in the queue until the writer takes it
        here, so ``send()``'s fast path never overtakes it."""
        q = self.queue
        loop = asyncio.get_running_loop()
        while q.empty():
            if self._dead:
                return None
            fut: asyncio.Future[None] = loop.create_future()
            self._idle = fut
            try:
                await q.wait_item(fut)
            finally:
                self._idle = None
        item: OutFrame = q.get_nowait()
        return item

    async def _collect(self) -> None:
        """Takes every frame already waiting (up to ``_BATCH_FRAMES`` /
        ``_BATCH_BYTES``) into the batch, framed: one ``sendmsg`` writes them
        all.  Real-time frames past their deadline and frames whose header
        cannot be encoded are dropped here."""
        q = self.queue
        first = await self._next()
        if first is None:
            return
        items = [first]
        nbytes = first.nbytes
        while len(items) < _BATCH_FRAMES and nbytes < _BATCH_BYTES and not q.empty():
            item = q.get_nowait()
            items.append(item)
            nbytes += item.nbytes
        owner, batch = self.owner, self.batch
        for item in items:
            if item.framed is not None and item.framed.started:  # partly written: finish it
                batch.append(item.framed)
                continue
            if drop_late(item.header, owner.realtime):
                owner.drop(item.header, "deadline")
                q.task_done()
                continue
            if item.framed is not None:  # framed already (moved from another lane)
                batch.append(item.framed)
                continue
            try:
                batch.append(Framed(item.header, frame(item.header, item.payload)))
            except WireError as e:  # a header we cannot encode: drop it, keep going
                log.error("sender %s: cannot frame: %s", owner.name, e)
                q.task_done()
            except Exception:  # a payload that is not a buffer, ...: same
                log.exception("sender %s: cannot frame", owner.name)
                q.task_done()

    async def _write(self, sock: socket.socket) -> None:
        """Writes the batch with scatter/gather ``sendmsg`` (no copy), waiting
        for writability when the socket buffer is full; each frame leaves the
        batch (counted, ``task_done``) once all its bytes are written."""
        batch, q = self.batch, self.queue
        while batch:
            if self._dead:
                raise ConnectionResetError("downstream closed the connection")
            views = [v for f in batch for v in f.views]
            try:
                n = sock.sendmsg(views, (), socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                await wait_writable(self, sock)
                continue
            self.owner.totals.writes += 1
            while n:
                f = batch[0]
                n = f.consume(n)
                if not f.views:
                    batch.pop(0)
                    self._sent(f)
                    q.task_done()

    async def _run(self) -> None:
        owner, batch = self.owner, self.batch
        while True:
            try:
                sock = self._sock
                if sock is None or self._dead:
                    self._close_sock(abort=True)
                    if self._ever_connected:
                        self._set_up(False)
                    if not self.idle:  # a frame that arrived as it broke: to a lane that is up
                        self.owner.rebalance()
                    await self._short_lived_backoff()
                    sock = await self._connect()
                    self._after_reconnect()
                    continue  # (the owner may have moved frames meanwhile)
                if not owner.ready.is_set():  # spread kernel: every lane connects first
                    await owner.ready.wait()
                    continue
                if not batch:
                    await self._collect()
                    continue  # (re-checks the connection before writing)
                await self._write(sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                self.counters.send_errors += 1
                owner.totals.send_errors += 1
                log.info("sender %s: connection to %s lost: %s", owner.name, self.address, e)
                self._broken()  # (the reconnect rewinds a frame cut off mid-write)
            except Exception:  # never die
                log.exception("sender %s: unexpected error", owner.name)
                if any(f.started for f in batch):  # part of a frame is on the wire: start over
                    self._broken()
                for f in batch:
                    owner.drop(f.header, "error")
                    self.queue.task_done()
                batch.clear()
                await asyncio.sleep(0.1)

    async def _short_lived_backoff(self) -> None:
        """After a connection that broke within ``_SHORT_LIVED_S``: waits as
        after a failed connect (the wait doubles while it keeps happening)."""
        made, self._connected_at = self._connected_at, None
        if made is None:
            return
        owner = self.owner
        if asyncio.get_running_loop().time() - made >= _SHORT_LIVED_S:
            self._short_delay = owner.backoff_initial
            return
        delay = self._short_delay
        self._short_delay = min(delay * 2, owner.backoff_max)
        await asyncio.sleep(random.uniform(delay / 2, delay))

    def _after_reconnect(self) -> None:
        """A new connection: a frame cut off on the old one is sent whole, and
        real-time frames that expired while we were reconnecting are dropped."""
        keep = []
        for f in self.batch:
            if drop_late(f.header, self.owner.realtime):
                self.owner.drop(f.header, "deadline")
                self.queue.task_done()
            else:
                f.rewind()
                keep.append(f)
        self.batch[:] = keep
