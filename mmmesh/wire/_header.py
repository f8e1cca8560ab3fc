"""The values of the MMH codec: :class:`Header`, :class:`TensorSpec`, ``Buffer``.

Plain data: nothing here reads or writes bytes except :func:`byte_view`,
which every reader in the codec and the stream splitter uses to look at the
caller's buffer without copying it.  Re-exported by :mod:`mmmesh.wire`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeAlias

from mmmesh.abi import DType
from mmmesh.wire._text import modality_name, traceparent_from_text, traceparent_to_text

__all__ = ["Buffer", "Header", "TensorSpec"]

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Anything :func:`~mmmesh.wire.decode_header` and friends read from."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """The TENSOR TLV: element type and shape of the payload tensor."""

    dtype: int
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if type(self.shape) is not tuple:  # accept any iterable (a list, numpy's .shape)
            object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def ndim(self) -> int:
        """Number of dimensions (0 for a scalar)."""
        return len(self.shape)

    @property
    def dtype_name(self) -> str:
        """KServe v2 name of the dtype (``FP32``...), or the number for unknown ones."""
        try:
            return DType(self.dtype).name
        except ValueError:
            return str(self.dtype)


@dataclass(frozen=True)
class Header:
    """One decoded (or to-be-encoded) MMH header.

    ``None`` means "TLV absent".  ``extra`` holds TLVs of unknown type as
    ``(type, value)`` pairs so they survive a decode/encode round trip; PAD
    TLVs are dropped on decode.  ``flags`` is the flags byte as received or
    to be sent, reserved bits included (test known bits with ``&``).
    ``hdr_len`` is set by :func:`~mmmesh.wire.decode_header` and ignored by
    :func:`~mmmesh.wire.encode_header` and by ``==``.
    """

    modality: int
    sla_class: int = 0
    flags: int = 0
    payload_len: int = 0
    stream_id: int | None = None
    sequence: int | None = None
    timestamp_ns: int | None = None
    deadline_ns: int | None = None
    fps: int | None = None
    bitrate: int | None = None
    density: int | None = None
    tensor: TensorSpec | None = None
    traceparent: bytes | None = None
    error: tuple[int, str] | None = None
    extra: tuple[tuple[int, bytes], ...] = ()
    hdr_len: int | None = dataclasses.field(default=None, compare=False)

    @property
    def modality_name(self) -> str:
        """Lowercase modality name (``"audio"``), or the number if unknown."""
        return modality_name(self.modality)

    @property
    def traceparent_text(self) -> str | None:
        """The trace context in W3C text form, ``00-<32 hex>-<16 hex>-<2 hex>``."""
        return None if self.traceparent is None else traceparent_to_text(self.traceparent)

    @property
    def frame_len(self) -> int:
        """Header plus payload bytes (only known on a decoded header)."""
        if self.hdr_len is None:
            raise ValueError("frame_len is only known for a decoded header")
        return self.hdr_len + self.payload_len

    def with_traceparent(self, text: str) -> Header:
        """Copy of this header carrying the W3C ``traceparent`` text ``text``."""
        return dataclasses.replace(self, traceparent=traceparent_from_text(text))

    @classmethod
    def from_fields(cls, fields: dict[str, object]) -> Header:
        """``Header(**fields)`` without the frozen dataclass ``__init__`` (about
        3x faster: one store instead of a ``object.__setattr__`` per field), for
        a hot path that builds a header per frame (a sidecar's output headers).
        ``fields`` must name fields of the class only; absent ones keep their
        defaults.  Nothing is checked here, as in ``__init__``: the encoder
        checks every value."""
        h = object.__new__(cls)
        h.__dict__.update(fields)
        return h


def byte_view(data: Buffer) -> Buffer:
    """``data`` itself if bytes/bytearray, else a 1-D unsigned-byte view of it."""
    if type(data) is bytes or type(data) is bytearray:
        return data
    mv = memoryview(data)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if mv.nbytes == 0:  # memoryview.cast refuses zero-size views, e.g. shape (0, 3)
        return memoryview(b"")
    return mv.cast("B")
