"""Frames inside a sidecar and the queue that bounds them.

* ``InFrame``: a received frame (what ``FrameServer`` produces and the stage
  consumes);
* ``OutFrame``: a frame handed to a ``FrameSender``, waiting to be written;
* ``Framed``: one frame's iovecs while they are written, and what is left;
* ``FrameQueue``: bounded in frames AND in payload bytes; the inbound queue
  (``inframe_queue``) and each sender's outbound queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmmesh.wire import Header

from ..config import Limits

__all__ = [
    "FrameQueue",
    "Framed",
    "InFrame",
    "OutFrame",
    "inframe_queue",
    "joined",
    "payload_view",
]


@dataclass(slots=True)
class InFrame:
    """A received frame; what the stage turns into a ``contract.StageInput``."""

    header: Header
    payload: memoryview  # this frame's alone (a pooled buffer is reused only once
    #                      nothing refers to it: sidecar/bufpool.py)
    received_ns: int  # time.time_ns() when the whole frame had arrived
    source: str  # "host:port" of the peer
    transport: str = "tcp"  # "tcp" | "udp"


@dataclass(slots=True)
class OutFrame:
    """A frame handed to ``FrameSender.send()`` and not written yet."""

    header: Header
    payload: Any  # np.ndarray / buffer, referenced (never copied) until sent
    nbytes: int = 0  # payload bytes (the byte budget; header.payload_len is set on the wire)
    framed: Framed | None = None  # already framed: partly written by send(), or moved
    #                               from another lane (rewound)


class Framed:
    """One frame's iovecs (header bytes, payload view) and what is left to write."""

    __slots__ = ("bufs", "header", "total", "views")

    def __init__(self, header: Header, bufs: list[Any]) -> None:
        self.header = header
        self.bufs = [b if type(b) is memoryview else memoryview(b) for b in bufs if len(b)]
        self.views = self.bufs[:]
        total = 0
        for b in self.bufs:
            total += len(b)
        self.total = total

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
        """Nothing written yet (the frame starts over on a new connection)."""
        self.views = list(self.bufs)

    @property
    def started(self) -> bool:
        """Some of the frame's bytes were written."""
        return sum(len(v) for v in self.views) != self.total


def payload_view(payload: Any) -> Any:
    """What ``sendmsg`` can take without a copy: a C-contiguous array as it is
    (a non-contiguous one is made contiguous: the one copy), an empty one as
    ``b""``, any other buffer unchanged."""
    if isinstance(payload, np.ndarray):
        if payload.size == 0:
            return b""  # (memoryview.cast refuses zero-size shapes)
        if not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload)
    return payload


class FrameQueue(asyncio.Queue):  # type: ignore[type-arg]
    """An ``asyncio.Queue`` bounded in frames AND in payload bytes.

    A count alone does not bound memory: 64 queued 64 MiB frames are 4 GiB.
    The queue is full when it holds ``maxsize`` frames or at least
    ``max_bytes`` of payload; it always admits a frame when empty, so a frame
    bigger than ``max_bytes`` still passes, one at a time.  ``size(item)`` is
    an item's payload bytes.  Built on the ``_put``/``_get`` hooks asyncio's
    own queue subclasses use."""

    def __init__(self, maxsize: int, max_bytes: int, size: Callable[[Any], int]) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._size = size

    def _put(self, item: Any) -> None:
        super()._put(item)
        self.bytes += self._size(item)

    def _get(self) -> Any:
        item = super()._get()
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

    def force_put(self, item: Any) -> None:
        """Puts ``item`` even when the queue is full: frames moved from one of
        an output's lanes to another (the output's frames stay within the sum
        of its lanes' bounds)."""
        self._put(item)
        self._unfinished_tasks += 1  # type: ignore[attr-defined]
        self._finished.clear()  # type: ignore[attr-defined]
        self._wakeup_next(self._getters)  # type: ignore[attr-defined]

    def offer(self, item: Any) -> bool:
        """``put_nowait(item)`` when there is room (True), else False: one
        call for what a receiver does per frame."""
        if self.full():
            return False
        self._queue.append(item)  # type: ignore[attr-defined]
        self.bytes += self._size(item)
        self._unfinished_tasks += 1  # type: ignore[attr-defined]
        self._finished.clear()  # type: ignore[attr-defined]
        self._wakeup_next(self._getters)  # type: ignore[attr-defined]
        return True

    def take_nowait(self, n: int) -> list[Any]:
        """Up to ``n`` items at once, oldest first (``get_nowait`` for each;
        the producers waiting for room are woken once, as many as now fit)."""
        dq = self._queue  # type: ignore[attr-defined]
        size = self._size
        out: list[Any] = []
        while dq and len(out) < n:
            item = dq.popleft()
            self.bytes -= size(item)
            out.append(item)
        if out:
            while self._putters and not self.full():  # type: ignore[attr-defined]
                self._wakeup_next(self._putters)  # type: ignore[attr-defined]
        return out

    def done(self, n: int) -> None:
        """``task_done()`` ``n`` times."""
        if n > self._unfinished_tasks:  # type: ignore[attr-defined]
            raise ValueError("task_done() called too many times")
        self._unfinished_tasks -= n  # type: ignore[attr-defined]
        if self._unfinished_tasks == 0:  # type: ignore[attr-defined]
            self._finished.set()  # type: ignore[attr-defined]

    def force_put_front(self, items: list[Any]) -> None:
        """Puts ``items`` ahead of everything queued, in order, even when the
        queue is full: frames a sender started to write itself and could not
        finish (they were within the queue's bound when they were taken)."""
        dq = self._queue  # type: ignore[attr-defined]
        for item in reversed(items):
            dq.appendleft(item)
            self.bytes += self._size(item)
        self._unfinished_tasks += len(items)  # type: ignore[attr-defined]
        self._finished.clear()  # type: ignore[attr-defined]
        self._wakeup_next(self._getters)  # type: ignore[attr-defined]

    async def wait_item(self, fut: asyncio.Future[None]) -> None:
        """Waits until ``fut`` is done: when an item is put, or when whoever
        else holds ``fut`` sets it.  Unlike ``get`` it takes nothing: the item
        stays in the queue until its one consumer takes it (a frame is never
        out of the queue and not yet in the writer's hands)."""
        self._getters.append(fut)  # type: ignore[attr-defined]
        try:
            await fut
        finally:
            with contextlib.suppress(ValueError):
                self._getters.remove(fut)  # type: ignore[attr-defined]

    @property
    def unfinished(self) -> int:
        """Items put and not marked done yet (what ``join`` waits for)."""
        return int(self._unfinished_tasks)  # type: ignore[attr-defined]

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


async def joined(queue: asyncio.Queue[Any], timeout: float | None) -> bool:
    """Waits until every item put on ``queue`` was marked done
    (``task_done``); False when ``timeout`` seconds passed first."""
    try:
        async with asyncio.timeout(timeout):  # (not wait_for: it can swallow a cancel)
            await queue.join()
    except TimeoutError:
        return False
    return True


def inframe_queue(limits: Limits) -> FrameQueue:
    """The inbound queue: ``limits.inbound_queue`` frames, ``inbound_queue_mb`` MiB."""
    return FrameQueue(limits.inbound_queue, limits.inbound_queue_mb << 20,
                      lambda f: len(f.payload))
