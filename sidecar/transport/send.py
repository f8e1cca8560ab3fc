"""The send side of a sidecar: one ``FrameSender`` per configured Output.

``send(header, payload)`` hands a frame over; the payload (usually the
stage's output array) is referenced, never copied: it is framed with
:func:`mmmesh.wire.frame` and ``[header bytes, memoryview(array)]`` go to
``socket.sendmsg`` (scatter/gather).

A TCP output has one connection, a *lane* (``lane.Lane``), per address: one
without ``replicas``, one per replica of the next stage with them.  Which
lane a frame takes:

* ``spread: user`` (the default): the smooth weighted round robin of the
  socket layer's weighted pick, in user space (``spread.Swrr``, the Output's
  ``weights``), over the lanes that are up: a lane that is down is left out
  (its share goes to the others by their weights) until it reconnects;
* ``spread: kernel``: every frame goes to one lane, the *lead* (the first
  lane that is up); the node's socket layer redirects each frame to a
  replica by the weights qosd wrote (docs/socklayer.md, "Weighted pick").
  The lead writes nothing before every lane made its first connection
  attempt (the kernel only picks lanes it has seen), the other lanes never
  write (a lane that sent TCP bytes is out of the kernel's pick), and when
  the lead's connection breaks the next lane that is up takes over.

On its lane, a frame is written by ``send()`` itself when nothing is queued
or being written there and the lane is connected (one ``sendmsg``, no
hand-over to the writer task: lower latency at low rates); otherwise it goes
on the lane's outbound ``FrameQueue`` (bounded in frames and in bytes: the
output's ``limits`` shared out between its lanes; ``send()`` waits while it
is full, which is how a slow downstream slows the stage), where the lane's
writer task sends every frame already waiting in one ``sendmsg``.  Frames of
a lane are written in the order they were given to it, whole: a frame cut
off by a broken connection, like every frame still queued on a lane that
went down, moves whole to a lane that is up (or waits for its own lane's
reconnect when none is).

Real-time outputs drop frames that are past their deadline
(``contract.drop_late``) instead of sending them late, and drop their oldest
queued frame when the queue is full instead of making the stage wait.  UDP
outputs (one address) always queue: the writer task sends one datagram per
frame.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmmesh.errors import WireError
from mmmesh.net import parse_hostport
from mmmesh.wire import Header, frame

from ..config import Limits, Output
from ..contract import drop_late
from .frames import FrameQueue, OutFrame, joined, payload_view
from .lane import _BATCH_BYTES, _BATCH_FRAMES, Lane, LaneCounters, LaneOwner, wait_writable
from .spread import Swrr

__all__ = ["FrameSender", "SenderCounters"]

log = logging.getLogger("mmmesh.sidecar.transport")

_MAX_DATAGRAM = 65507


@dataclass
class SenderCounters:
    """What a FrameSender did (docs/sidecar.md, "Counters"); the per-lane
    counters are in ``lanes``."""

    frames_out: int = 0
    bytes_out: int = 0
    writes: int = 0  # sendmsg calls (a burst of queued small frames shares one)
    dropped_deadline: int = 0  # real-time output: past its deadline before it could be sent
    dropped_overload: int = 0  # real-time output: queue full, its oldest frame dropped
    dropped_other: int = 0  # not sent: the sender was closed first, or an unexpected error
    reconnects: int = 0  # connections made after each lane's first one
    connect_failures: int = 0
    send_errors: int = 0  # connection lost while sending (frame retried) / UDP send failed
    connected: bool = False  # at least one lane is connected
    queue_hwm: int = 0
    lanes_up: int = 0  # lanes in the pick
    lead: int | None = None  # spread kernel: the lane every frame is written to
    lanes: list[LaneCounters] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["lanes"] = [dict(c.__dict__) for c in self.lanes]
        return d


def _nbytes(payload: Any) -> int:
    """A payload's bytes (0 for one that is not a buffer: the writer reports it
    when framing)."""
    try:
        return memoryview(payload).nbytes
    except TypeError:
        return 0


class _Group:
    """Frames ``send_nowait`` gives one idle lane, written in one ``sendmsg``:
    at most ``_BATCH_FRAMES`` / ``_BATCH_BYTES`` (as the writer's batches) and
    never more than the lane's queue could hold (the bound stays the queue's)."""

    __slots__ = ("items", "lane", "max_bytes", "max_n", "nbytes")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.items: list[tuple[Header, Any, int]] = []
        self.nbytes = 0
        q = lane.queue
        self.max_n = min(_BATCH_FRAMES, q.maxsize) if q.maxsize > 0 else _BATCH_FRAMES
        self.max_bytes = q.max_bytes

    def fits(self, nbytes: int) -> bool:
        n = len(self.items)
        return not n or (n < self.max_n and self.nbytes < _BATCH_BYTES
                         and (self.max_bytes <= 0 or self.nbytes + nbytes <= self.max_bytes))

    def add(self, header: Header, payload: Any, nbytes: int) -> None:
        self.items.append((header, payload, nbytes))
        self.nbytes += nbytes

    def write(self) -> None:
        items, self.items, self.nbytes = self.items, [], 0
        if items:
            self.lane.write_frames(items)


def _lane_bound(total: int, n: int, least: int) -> int:
    """A lane's share of an output's bound (0 stays 0: no bound)."""
    return 0 if total == 0 else max(total // n, least)


class FrameSender:
    """Sends frames to one Output (one lane per downstream address).

    ``send()`` picks the frame's lane (see the module) and writes the frame
    itself when that lane is idle and connected, else queues it on the lane
    (waiting while the lane's queue is full; a real-time output drops its
    oldest queued frame instead).  ``flush()`` waits until every frame handed
    to ``send()`` was written to a socket or dropped.
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
        self.realtime = output.realtime
        self.kernel = output.spread == "kernel"
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connect_timeout = connect_timeout
        self.lanes: list[Lane] = []
        self.ready = asyncio.Event()  # lanes may write (spread kernel: all lanes tried once)
        self._on_drop = on_drop
        self._swrr = Swrr(output.lane_weights)
        self._lead = 0
        self._queue: FrameQueue | None = None  # UDP
        self._task: asyncio.Task[None] | None = None  # UDP
        self._sock: socket.socket | None = None  # UDP
        self._writable: asyncio.Future[None] | None = None  # UDP
        self._udp = output.transport == "udp"
        for a in output.addresses:  # a bad address fails here, not in a task
            parse_hostport(a, what=f"output {output.name}")
        self.lane_owner = LaneOwner(
            output.name, self.realtime, self.ready, self.counters, changed=self._lane_changed,
            drop=self._drop, rebalance=self._rebalance, backoff_initial=backoff_initial,
            backoff_max=backoff_max, connect_timeout=connect_timeout)
        """What each of its lanes is handed (:class:`~.lane.LaneOwner`)."""

    @property
    def name(self) -> str:
        return self.output.name

    @property
    def queued(self) -> int:
        if self._queue is not None:
            return self._queue.qsize()
        return sum(lane.queue.qsize() for lane in self.lanes)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        lim = self.limits
        if self._udp:
            self._queue = FrameQueue(lim.outbound_queue, lim.outbound_queue_mb << 20,
                                     lambda item: item.nbytes)
            self._task = loop.create_task(self._run_udp(), name=f"sender-{self.output.name}")
            return
        addrs = self.output.addresses
        n = len(addrs)
        owner = self.lane_owner
        self.lanes = [Lane(owner, i, a, FrameQueue(_lane_bound(lim.outbound_queue, n, 1),
                                                   _lane_bound(lim.outbound_queue_mb << 20, n, 1),
                                                   lambda item: item.nbytes))
                      for i, a in enumerate(addrs)]
        self.counters.lanes = [lane.counters for lane in self.lanes]
        self.counters.lanes_up = n
        if self.kernel:
            self.lanes[0].counters.lead = True
            self.counters.lead = 0
        else:
            self.ready.set()
        for lane in self.lanes:
            lane.start()

    def _pick(self) -> Lane:
        lanes = self.lanes
        assert lanes, "start() first"
        if self.kernel:
            return lanes[self._lead]
        if len(lanes) == 1:
            return lanes[0]
        i = self._swrr.pick([lane.up for lane in lanes])
        if i is None:  # no lane up (or none with a weight): wait on one by the weights
            i = self._swrr.pick()
        assert i is not None  # (the config guarantees a weight above 0)
        return lanes[i]

    def _make_room(self, q: FrameQueue) -> None:
        """Real-time: the freshest frame is worth most; while ``q`` is full its
        oldest frame is dropped (never a frame already partly on the wire: the
        stream would break)."""
        while q.full():
            old = q.pop_oldest(lambda it: it.framed is not None and it.framed.started)
            if old is None:
                break
            q.task_done()
            self._drop(old.header, "overload")

    async def send(self, header: Header, payload: Any = b"") -> bool:
        """Writes one frame now or queues it (see the class); ``payload``
        (usually an ndarray) is referenced, not copied, and must not be
        modified afterwards.  False if it was dropped (real-time and late)."""
        if drop_late(header, self.realtime):
            self._drop(header, "deadline")
            return False
        if self._udp:
            q = self._queue
            lane = None
        else:
            lane = self._pick()
            q = lane.queue
        assert q is not None, "start() first"
        if self.realtime:
            self._make_room(q)
        payload = payload_view(payload)
        nbytes = _nbytes(payload)
        framed = None
        if lane is not None and lane.idle and self.ready.is_set():
            written, framed = lane.write_now(header, payload)
            if written:
                return True
        item = OutFrame(header, payload, nbytes, framed)
        if q.full():
            await q.put(item)
            if lane is not None and not lane.up:  # it went down while we waited
                self._rebalance()
        else:
            q.put_nowait(item)
        depth = q.qsize()
        self.counters.queue_hwm = max(self.counters.queue_hwm, depth)
        return True

    def send_nowait(self, frames: Sequence[tuple[Header, Any]]) -> int:
        """``send()`` for several frames, in order, without waiting: each is
        written, queued or dropped (real-time and late) as ``send()`` would;
        the frames an idle, connected lane gets are written together, one
        ``sendmsg`` per lane (up to 64 frames / 256 KiB, and never more than
        its queue could hold).  Stops at the first frame that would have to
        wait for room in a full queue and returns how many it took: the caller
        ``await``s ``send()`` for the rest."""
        if self._udp:
            uq = self._queue
            assert uq is not None, "start() first"
            for i, (header, payload) in enumerate(frames):
                if drop_late(header, self.realtime):
                    self._drop(header, "deadline")
                    continue
                if self.realtime:
                    self._make_room(uq)
                if uq.full():
                    return i
                payload = payload_view(payload)
                uq.put_nowait(OutFrame(header, payload, _nbytes(payload)))
                self._hwm(uq)
            return len(frames)
        realtime = self.realtime
        ready = self.ready.is_set()
        lanes = self.lanes
        # one lane takes every frame (no replicas, or spread: kernel's lead): no pick
        fixed = lanes[self._lead] if self.kernel else lanes[0] if len(lanes) == 1 else None
        swrr = self._swrr if fixed is None else None
        groups: dict[int, _Group] = {}
        taken = len(frames)
        for i, (header, payload) in enumerate(frames):
            if realtime and drop_late(header, True):
                self._drop(header, "deadline")
                continue
            before = None
            if swrr is None:
                lane = fixed
            else:
                before = swrr.cur[:]
                lane = self._pick()
            assert lane is not None
            q = lane.queue
            if realtime:
                self._make_room(q)
            if type(payload) is np.ndarray and payload.size and payload.flags.c_contiguous:
                nbytes = payload.nbytes  # (payload_view's and _nbytes' answer, inline)
            else:
                payload = payload_view(payload)
                nbytes = _nbytes(payload)
            if ready:
                g = groups.get(lane.index)
                if g is None and lane.idle:
                    g = groups[lane.index] = _Group(lane)
                if g is not None:  # (a lane stays idle while its group waits)
                    if g.fits(nbytes):
                        g.add(header, payload, nbytes)
                        continue
                    g.write()  # that many go out now; this frame sees again
                    if lane.idle:
                        g.add(header, payload, nbytes)
                        continue
                    del groups[lane.index]  # what is left is queued: behind it
            if q.full():
                if before is not None:  # not taken: the pick did not happen
                    swrr.cur[:] = before  # type: ignore[union-attr]
                taken = i
                break
            q.put_nowait(OutFrame(header, payload, nbytes))
            self._hwm(q)
        for g in groups.values():
            g.write()
        return taken

    def _hwm(self, q: FrameQueue) -> None:
        self.counters.queue_hwm = max(self.counters.queue_hwm, q.qsize())

    def _lane_changed(self, lane: Lane) -> None:
        """A lane went up or down (or connected for the first time)."""
        lanes, c = self.lanes, self.counters
        c.connected = any(x.counters.connected for x in lanes)
        c.lanes_up = sum(x.up for x in lanes)
        if self.kernel:
            if not self.ready.is_set() and all(x.attempted for x in lanes):
                self.ready.set()
            lead = lanes[self._lead]
            if not lead.up:
                new = next((x for x in lanes if x.up and x.counters.connected), None)
                if new is not None:
                    log.info("sender %s: lead lane %s -> %s", self.name, lead.address,
                             new.address)
                    lead.counters.lead = False
                    new.counters.lead = True
                    self._lead = c.lead = new.index
        self._rebalance()

    def _rebalance(self) -> None:
        """Frames of lanes that are down go to lanes that are up (if any can
        take them: one with a weight above 0; spread kernel: the lead)."""
        if self.kernel:
            if not self.lanes[self._lead].up:
                return
        elif not any(x.up and w for x, w in zip(self.lanes, self._swrr.weights)):
            return
        for lane in self.lanes:
            if lane.up or lane.idle:
                continue
            moved = lane.take_all()
            log.info("sender %s: %d frames of %s (down) moved to other lanes", self.name,
                     len(moved), lane.address)
            for item in moved:
                self._pick().queue.force_put(item)

    def _all_done(self) -> bool:
        return all(lane.queue.unfinished == 0 for lane in self.lanes)

    async def flush(self, timeout: float | None = None) -> bool:
        """Waits until every frame handed to ``send()`` was written to a
        socket or dropped.  False on timeout."""
        if self._queue is not None:
            return await joined(self._queue, timeout)

        async def lanes_done() -> None:
            while not self._all_done():  # (frames may move between lanes meanwhile)
                for lane in self.lanes:
                    await lane.queue.join()

        try:
            async with asyncio.timeout(timeout):
                await lanes_done()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stops now (``flush()`` first for a graceful stop): frames not yet
        sent are dropped and counted (``dropped_other``)."""
        for lane in self.lanes:
            await lane.stop()
        for lane in self.lanes:
            for f in lane.batch:
                self._drop(f.header, "shutdown")
                lane.queue.task_done()
            lane.batch.clear()
            self._drain_dropped(lane.queue)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.counters.connected = False
        if self._queue is not None:
            self._drain_dropped(self._queue)

    # -- internals -----------------------------------------------------------
    def _drain_dropped(self, q: FrameQueue) -> None:
        while not q.empty():
            self._drop(q.get_nowait().header, "shutdown")
            q.task_done()

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

    async def _run_udp(self) -> None:
        q = self._queue
        assert q is not None
        loop = asyncio.get_running_loop()
        host, port = parse_hostport(self.output.addresses[0], what=f"output {self.name}")
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
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
                        await wait_writable(self, sock)
                self.counters.frames_out += 1
                self.counters.bytes_out += size
            except asyncio.CancelledError:
                raise
            except (OSError, WireError) as e:  # ECONNREFUSED from ICMP, EMSGSIZE...
                self.counters.send_errors += 1
                log.debug("sender %s: udp send failed: %s", self.name, e)
            finally:
                q.task_done()

