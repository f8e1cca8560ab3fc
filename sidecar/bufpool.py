"""Reused, page-aligned receive buffers for large payloads.

A large frame's payload is read by the kernel straight into a buffer of its
own (``recv_into``), and that buffer then travels, without a copy, through the
stage (a numpy view of it) and out again (``sendmsg`` of a view).  How that
buffer is allocated turned out to matter more than anything else on the
sidecar's large-frame path (``bench/sidecar.py``, 4 MiB frames, relay CPU per
frame on a 2-vCPU AMD EPYC VM; the raw socket relay needs ~1.9 ms):

* a fresh ``np.empty`` per frame: ~3.5 ms.  Multi-MiB allocations come from
  ``mmap`` or from heap the allocator gave back, so every frame page-faults
  its buffer in and the kernel zeroes each page first (~10 % of the CPU);
* reused ``np.empty`` buffers: ~4.5 ms, worse: malloc'ed memory starts 16
  bytes past a page boundary, and the kernel's socket copies (``rep movsb``)
  run ~1.6x slower from and into such a buffer here (the same pool with the
  buffers moved to a page boundary: ~2.8 ms; moved 16 bytes off it: ~4.3 ms);
* reused anonymous ``mmap`` buffers (page-aligned): ~2.8 ms.  This module.

A buffer goes back into service only when nothing but the pool refers to it
any more: every view of it (the ``memoryview`` handed to the stage, numpy
arrays made from it, a view kept by a stage that holds on to its inputs, a
``sendmsg`` in progress) holds a reference to the ``mmap`` object, so
CPython's reference count says exactly when it is free (under the GIL; a
free-threaded build would need explicit release).  The pool never hands out
memory that somebody can still see; a stage that keeps its input simply keeps
that buffer out of the pool.

Bounded: the pool owns at most ``max_bytes``; beyond that a request gets a
fresh, unpooled buffer.  Sizes are rounded up to a power of two (from 64 KiB),
a request only takes a free buffer of at most twice its size, and of the free
ones it takes the one handed out last (frames finish in order, so that is the
one freed last, the most likely to still be in the CPU's caches).
"""

from __future__ import annotations

import mmap
import sys

__all__ = ["BufferPool"]

_MIN_CLASS = 64 * 1024
# references to a pooled buffer nobody uses: the pool's list, and
# getrefcount's own argument
_IDLE_REFS = 2


def _size_class(n: int) -> int:
    return max(_MIN_CLASS, 1 << (max(n, 1) - 1).bit_length())


class BufferPool:
    """Hands out writable, page-aligned ``memoryview``s of exactly the asked size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._bufs: list[mmap.mmap] = []  # every buffer the pool owns
        self._stamp: list[int] = []  # when each was last handed out
        self._clock = 0
        self.owned_bytes = 0
        self.hits = 0  # requests served by a reused buffer
        self.misses = 0  # requests that needed a new buffer (pooled or not)

    def get(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes that nobody else can see."""
        cls = _size_class(n)
        bufs = self._bufs
        best = -1
        for i in range(len(bufs)):
            size = len(bufs[i])
            if (cls <= size <= 2 * cls and sys.getrefcount(bufs[i]) == _IDLE_REFS
                    and (best < 0 or self._stamp[i] > self._stamp[best])):
                best = i
        self._clock += 1
        if best >= 0:
            self.hits += 1
            self._stamp[best] = self._clock
            return memoryview(bufs[best])[:n]
        self.misses += 1
        if self.owned_bytes + cls > self.max_bytes:
            self._evict_idle(cls)
        if self.owned_bytes + cls <= self.max_bytes:
            buf = mmap.mmap(-1, cls)
            bufs.append(buf)
            self._stamp.append(self._clock)
            self.owned_bytes += cls
            return memoryview(buf)[:n]
        # over budget, every pooled buffer busy: one for this frame only
        return memoryview(mmap.mmap(-1, max(n, 1)))[:n]

    def _evict_idle(self, need: int) -> None:
        """Lets go of idle buffers (of other sizes) until ``need`` more bytes fit."""
        bufs = self._bufs
        i = 0
        while i < len(bufs) and self.owned_bytes + need > self.max_bytes:
            if sys.getrefcount(bufs[i]) == _IDLE_REFS:
                self.owned_bytes -= len(bufs[i])
                del bufs[i]  # unmapped when the last reference goes: now
                del self._stamp[i]
            else:
                i += 1

    def in_use(self) -> int:
        """Pooled buffers somebody still refers to."""
        bufs = self._bufs
        return sum(1 for i in range(len(bufs)) if sys.getrefcount(bufs[i]) > _IDLE_REFS)

    def snapshot(self) -> dict[str, int]:
        return {"owned_bytes": self.owned_bytes, "buffers": len(self._bufs),
                "in_use": self.in_use(), "hits": self.hits, "misses": self.misses}
