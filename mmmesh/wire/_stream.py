"""Splitting a TCP byte stream into MMH frames: :class:`FrameReader`.

Framing is ``docs/wire-format.md`` section 6: frames follow each other back to
back, the next header starts ``hdr_len + payload_len`` bytes after the start
of the previous one.  The header checks are the codec's, in the same order
(section 3), so a stream and :func:`~mmmesh.wire.decode_header` report the same
reason for the same bytes.  Re-exported by :mod:`mmmesh.wire`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from mmmesh.abi import MMH_MAX_PAYLOAD, MMH_OFF_PAYLOAD_LEN, MMH_PREAMBLE_LEN
from mmmesh.errors import WireError
from mmmesh.wire._codec import check_magic, decode_header, read_preamble
from mmmesh.wire._header import Buffer, Header, byte_view

__all__ = ["FrameReader"]


class FrameReader:
    """Splits a TCP byte stream into ``(Header, payload)`` frames.

    ``feed()`` the bytes as they arrive, then iterate to drain every complete
    frame.  A payload that arrived inside one fed chunk is a ``memoryview`` of
    that chunk (no copy); one that spans chunks is joined once.  Read-only
    buffers (``bytes``) are kept by reference; writable ones are copied on feed
    so that reusing a receive buffer is safe.

    Malformed data raises :class:`WireError` with ``offset`` counted from the
    start of the stream; the reader then stays failed (a byte stream cannot
    resynchronise).  Frames whose payload_len exceeds ``max_payload`` are
    malformed too (``exceeds limit``, at the frame's payload_len byte, checked
    where step 5 checks the 2^30 bound: before the TLVs are read).
    """

    def __init__(self, max_payload: int = MMH_MAX_PAYLOAD) -> None:
        if not 0 <= max_payload <= MMH_MAX_PAYLOAD:
            raise ValueError(f"max_payload must be 0..{MMH_MAX_PAYLOAD}")
        self.max_payload = max_payload
        self._chunks: deque[memoryview] = deque()
        self._size = 0  # bytes buffered
        self._pos = 0  # stream offset of the first buffered byte
        self._header: Header | None = None  # parsed header of the frame in progress
        self._error: WireError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a frame."""
        return self._size

    @property
    def position(self) -> int:
        """Stream offset of the next frame (bytes consumed so far)."""
        return self._pos

    def feed(self, data: Buffer) -> None:
        """Append received bytes."""
        self._raise_if_failed()
        view = memoryview(byte_view(data))
        if not view.readonly:
            view = memoryview(view.tobytes())
        if len(view):
            self._chunks.append(view)
            self._size += len(view)

    def __iter__(self) -> Iterator[tuple[Header, memoryview]]:
        """Every complete frame buffered so far, in order."""
        while True:
            item = self.next_frame()
            if item is None:
                return
            yield item

    def next_frame(self) -> tuple[Header, memoryview] | None:
        """The next complete frame, or ``None`` if more bytes are needed."""
        self._raise_if_failed()
        try:
            return self._next_frame()
        except WireError as e:
            self._error = WireError(e.reason, self._pos + e.offset)
            raise self._error from None

    def close(self) -> None:
        """Declare end of stream: WireError if a partial frame is left over."""
        self._raise_if_failed()
        if self._size:
            what = "truncated payload" if self._header is not None else "truncated"
            self._error = WireError(what, self._pos + self._size)
            raise self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _next_frame(self) -> tuple[Header, memoryview] | None:
        h = self._header
        if h is None:
            h = self._read_header()
            if h is None:
                return None
            self._header = h
        hdr_len = h.hdr_len or MMH_PREAMBLE_LEN
        total = hdr_len + h.payload_len
        if self._size < total:
            return None
        data = self._contiguous(total)
        self._consume(total)
        self._header = None
        return h, data[hdr_len:total]

    def _read_header(self) -> Header | None:
        if self._size < MMH_PREAMBLE_LEN:
            if self._size:
                check_magic(self._contiguous(min(self._size, 4)))
            return None
        hdr_len, _, _, _, plen = read_preamble(self._contiguous(MMH_PREAMBLE_LEN))
        if plen > self.max_payload:
            raise WireError(
                f"payload_len {plen} exceeds limit {self.max_payload}", MMH_OFF_PAYLOAD_LEN
            )
        if self._size < hdr_len:
            return None
        return decode_header(self._contiguous(hdr_len))

    def _contiguous(self, n: int) -> memoryview:
        """A view of the first ``n`` buffered bytes (joins leading chunks if needed)."""
        first = self._chunks[0]
        if len(first) >= n:
            return first[:n]
        parts: list[memoryview] = []
        have = 0
        while have < n:
            chunk = self._chunks.popleft()
            parts.append(chunk)
            have += len(chunk)
        joined = memoryview(b"".join(parts))
        self._chunks.appendleft(joined)
        return joined[:n]

    def _consume(self, n: int) -> None:
        self._size -= n
        self._pos += n
        while n:
            first = self._chunks[0]
            if len(first) <= n:
                self._chunks.popleft()
                n -= len(first)
            else:
                self._chunks[0] = first[n:]
                n = 0
