"""MMH v1 encoder and decoder: :class:`Header` to bytes and back.

Decoding never copies the payload (payloads come back as ``memoryview``
slices of the caller's buffer) and raises only :class:`~mmmesh.errors.WireError`
on malformed input, after the checks of ``docs/wire-format.md`` section 3 in
the order given there, so that the reason and offset of an error are those of
the first rule the input breaks.  Encoding validates every field and raises
``WireError`` (a ``ValueError``) naming the field that does not fit.
Re-exported by :mod:`mmmesh.wire`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from mmmesh.abi import (
    MMH_HDR_MAX,
    MMH_MAGIC,
    MMH_MAGIC_U24,
    MMH_MAGIC_V1_U32,
    MMH_MAX_PAYLOAD,
    MMH_MAX_TLVS,
    MMH_OFF_CLASS,
    MMH_OFF_FLAGS,
    MMH_OFF_HDR_LEN,
    MMH_OFF_MODALITY,
    MMH_OFF_PAYLOAD_LEN,
    MMH_OFF_VERSION,
    MMH_PREAMBLE_LEN,
    MMH_VERSION,
    TENSOR_MAX_DIMS,
    TLV_FIXED_LEN,
    Tlv,
)
from mmmesh.errors import WireError
from mmmesh.wire._header import Buffer, Header, TensorSpec, byte_view
from mmmesh.wire._text import TRACEPARENT_LEN

__all__ = [
    "decode_frame",
    "decode_header",
    "encode_header",
    "frame",
    "peek_class_inputs",
]

_PREAMBLE = struct.Struct("!IBBBBI")  # magic+version, hdr_len, modality, class, flags, payload_len
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_TLV_HDR = struct.Struct("!BB")
_TENSOR_HDR = struct.Struct("!BB")

# Integer TLVs: Header attribute -> (TLV type, struct).  Order = emission order.
_INT_TLVS: tuple[tuple[str, Tlv, struct.Struct], ...] = (
    ("stream_id", Tlv.STREAM_ID, _U32),
    ("sequence", Tlv.SEQUENCE, _U64),
    ("timestamp_ns", Tlv.TIMESTAMP_NS, _U64),
    ("deadline_ns", Tlv.DEADLINE_NS, _U64),
    ("fps", Tlv.VIDEO_FPS, _U16),
    ("bitrate", Tlv.AUDIO_BITRATE, _U32),
    ("density", Tlv.POINT_DENSITY, _U32),
)
_KNOWN_TYPES = frozenset(int(t) for t in Tlv)


def _check_uint(name: str, value: object, bits: int, offset: int) -> int:
    """``value`` as an int in 0..2**bits-1, else WireError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{name} must be an int, got {type(value).__name__}", offset)
    if not 0 <= value < (1 << bits):
        raise WireError(f"{name} {value} does not fit in u{bits}", offset)
    return value


def _encode_tensor(spec: TensorSpec, offset: int) -> bytes:
    dtype = _check_uint("tensor.dtype", spec.dtype, 8, offset)
    shape = tuple(spec.shape)
    if len(shape) > TENSOR_MAX_DIMS:
        raise WireError(f"tensor has {len(shape)} dims, at most {TENSOR_MAX_DIMS}", offset)
    for i, dim in enumerate(shape):
        _check_uint(f"tensor.shape[{i}]", dim, 32, offset)
    return _TENSOR_HDR.pack(dtype, len(shape)) + struct.pack(f"!{len(shape)}I", *shape)


def _encode_error(error: tuple[int, str], offset: int) -> bytes:
    code, message = error
    _check_uint("error code", code, 16, offset)
    if not isinstance(message, str):
        raise WireError("error message must be a str", offset)
    return _U16.pack(code) + message.encode("utf-8")


def _encode_traceparent(raw: bytes, offset: int) -> bytes:
    if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) != TRACEPARENT_LEN:
        raise WireError(f"traceparent must be {TRACEPARENT_LEN} raw bytes", offset)
    return bytes(raw)


def _tlv_values(h: Header) -> list[tuple[int, bytes]]:
    """(type, value) for every TLV the header carries, in emission order."""
    off = MMH_PREAMBLE_LEN
    out: list[tuple[int, bytes]] = []
    for attr, tlv, st in _INT_TLVS:
        value = getattr(h, attr)
        if value is not None:
            out.append((tlv, st.pack(_check_uint(attr, value, st.size * 8, off))))
    if h.tensor is not None:
        out.append((Tlv.TENSOR, _encode_tensor(h.tensor, off)))
    if h.traceparent is not None:
        out.append((Tlv.TRACEPARENT, _encode_traceparent(h.traceparent, off)))
    if h.error is not None:
        out.append((Tlv.ERROR, _encode_error(h.error, off)))
    for typ, value in h.extra:
        _check_uint("extra TLV type", typ, 8, off)
        if typ in _KNOWN_TYPES:
            raise WireError(f"extra TLV type {typ:#04x} is a known type; use its field", off)
        out.append((typ, bytes(value)))
    return out


def _pad_tlv(hdr_len: int, align: int) -> bytes:
    """A PAD TLV that brings ``hdr_len`` to a multiple of ``align`` (b"" if none needed)."""
    need = -hdr_len % align
    if need == 0:
        return b""
    if need == 1:  # a TLV is at least 2 bytes: pad one more alignment unit
        need += align
    return _TLV_HDR.pack(Tlv.PAD, need - 2) + bytes(need - 2)


def encode_header(h: Header, *, align: int = 1, payload_len: int | None = None) -> bytes:
    """The wire bytes of ``h`` (preamble + TLVs; known TLVs in type order, then ``extra``).

    ``align`` > 1 appends a PAD TLV so that the payload starts at a multiple of
    ``align`` bytes from the frame start.  ``payload_len``, when given, is
    written instead of ``h.payload_len``.  ``h.hdr_len`` is ignored.  The
    flags byte is written as given, reserved bits included: re-encoding a
    decoded header keeps them, as it keeps unknown TLVs (a sender that
    originates a frame sets only known bits).  Raises :class:`WireError` (a
    ``ValueError``) if a field is out of range or the header would exceed 255
    bytes or 16 TLVs.
    """
    _check_uint("modality", h.modality, 8, MMH_OFF_MODALITY)
    _check_uint("sla_class", h.sla_class, 8, MMH_OFF_CLASS)
    _check_uint("flags", h.flags, 8, MMH_OFF_FLAGS)  # reserved bits are written as given
    plen = h.payload_len if payload_len is None else payload_len
    _check_uint("payload_len", plen, 32, MMH_OFF_PAYLOAD_LEN)
    if plen > MMH_MAX_PAYLOAD:
        raise WireError(f"payload_len {plen} exceeds {MMH_MAX_PAYLOAD}", MMH_OFF_PAYLOAD_LEN)
    if not 1 <= align <= 64:
        raise ValueError(f"align must be 1..64, got {align}")
    parts = [b""]
    off = MMH_PREAMBLE_LEN
    for typ, value in _tlv_values(h):
        if len(value) > 0xFF:
            raise WireError(f"TLV {_tlv_name(typ)} value is {len(value)} bytes, max 255", off)
        parts.append(_TLV_HDR.pack(typ, len(value)) + value)
        off += 2 + len(value)
    pad = _pad_tlv(off, align)
    if pad:
        parts.append(pad)
        off += len(pad)
    if len(parts) - 1 > MMH_MAX_TLVS:
        raise WireError(f"{len(parts) - 1} TLVs, at most {MMH_MAX_TLVS}", MMH_PREAMBLE_LEN)
    if off > MMH_HDR_MAX:
        raise WireError(f"header would be {off} bytes, at most {MMH_HDR_MAX}", MMH_OFF_HDR_LEN)
    parts[0] = _PREAMBLE.pack(
        MMH_MAGIC_V1_U32, off, h.modality, h.sla_class, h.flags, plen
    )
    return b"".join(parts)


def frame(h: Header, payload: Buffer = b"", *, align: int = 1) -> list[bytes | memoryview]:
    """``[header bytes, payload view]`` for ``socket.sendmsg``: no copy of ``payload``.

    ``payload_len`` in the header is set to the payload size.
    """
    view = memoryview(byte_view(payload))
    hdr = _py_encode_header(h, align=align, payload_len=len(view))
    return [hdr, view]


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------
# A TLV decoder gets (header bytes, value offset, value length, TLV offset).
_Decoder = Callable[[bytes, int, int, int], Any]


def _decode_tensor(hb: bytes, voff: int, ln: int, off: int) -> TensorSpec:
    if ln < 2:
        raise WireError(f"TENSOR TLV length {ln}, expected >= 2", off + 1)
    dtype, ndim = _TENSOR_HDR.unpack_from(hb, voff)
    if ndim > TENSOR_MAX_DIMS:
        raise WireError(f"TENSOR ndim {ndim} > {TENSOR_MAX_DIMS}", voff + 1)
    if ln != 2 + 4 * ndim:
        raise WireError(f"TENSOR TLV length {ln}, expected {2 + 4 * ndim} for ndim {ndim}", off + 1)
    return TensorSpec(dtype, struct.unpack_from(f"!{ndim}I", hb, voff + 2))


def _decode_traceparent(hb: bytes, voff: int, ln: int, _off: int) -> bytes:
    return hb[voff : voff + ln]


def _decode_error(hb: bytes, voff: int, ln: int, off: int) -> tuple[int, str]:
    if ln < 2:
        raise WireError(f"ERROR TLV length {ln}, expected >= 2", off + 1)
    raw = hb[voff + 2 : voff + ln]
    try:
        message = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # e.start: first byte of the first ill-formed sequence
        raise WireError("ERROR message is not valid UTF-8", voff + 2 + e.start) from None
    return (_U16.unpack_from(hb, voff)[0], message)


def _fixed_len(typ: Tlv) -> int:
    """The TLV's fixed value length from the ABI table, -1 if variable."""
    n = TLV_FIXED_LEN[typ]
    return -1 if n is None else n


# TLV type -> (Header attribute, fixed length or -1, unpack_from, decoder).  Integer
# TLVs are read by their struct's unpack_from, inline in the loop (the hot path);
# the others by a _Decoder.  PAD and unknown types are absent.
_UnpackFrom = Callable[[bytes, int], tuple[int, ...]]
_DECODERS: dict[int, tuple[str, int, _UnpackFrom | None, _Decoder | None]] = {
    **{int(t): (attr, _fixed_len(t), st.unpack_from, None) for attr, t, st in _INT_TLVS},
    int(Tlv.TENSOR): ("tensor", _fixed_len(Tlv.TENSOR), None, _decode_tensor),
    int(Tlv.TRACEPARENT): ("traceparent", _fixed_len(Tlv.TRACEPARENT), None, _decode_traceparent),
    int(Tlv.ERROR): ("error", _fixed_len(Tlv.ERROR), None, _decode_error),
}


def _tlv_name(typ: int) -> str:
    try:
        return Tlv(typ).name
    except ValueError:
        return f"{typ:#04x}"


def check_magic(buf: Buffer) -> None:
    """WireError if the (possibly short) ``buf`` cannot start an MMH v1 header."""
    head = bytes(buf[:4])
    if head[:3] != MMH_MAGIC[: len(head[:3])]:
        raise WireError("bad magic", 0)
    if len(head) == 4 and head[3] != MMH_VERSION:
        raise WireError(f"unsupported version {head[3]}", MMH_OFF_VERSION)


def read_preamble(buf: Buffer) -> tuple[int, int, int, int, int]:
    """(hdr_len, modality, class, flags, payload_len) after steps 1 to 5 of the
    reading order: magic, version, 12 bytes present, ``hdr_len``, ``payload_len``.

    Does not check that ``hdr_len`` bytes are available (step 6).
    """
    if len(buf) < MMH_PREAMBLE_LEN:
        check_magic(buf)
        raise WireError("truncated", len(buf))
    magic, hdr_len, modality, sla, flags, plen = _PREAMBLE.unpack_from(buf, 0)
    if magic != MMH_MAGIC_V1_U32:
        if magic >> 8 != MMH_MAGIC_U24:
            raise WireError("bad magic", 0)
        raise WireError(f"unsupported version {magic & 0xFF}", MMH_OFF_VERSION)
    if hdr_len < MMH_PREAMBLE_LEN:
        raise WireError(f"hdr_len {hdr_len} < {MMH_PREAMBLE_LEN}", MMH_OFF_HDR_LEN)
    if plen > MMH_MAX_PAYLOAD:
        raise WireError(f"payload_len {plen} exceeds {MMH_MAX_PAYLOAD}", MMH_OFF_PAYLOAD_LEN)
    return hdr_len, modality, sla, flags, plen


def _decode_tlvs(hb: bytes, hdr_len: int) -> dict[str, Any]:
    """Walk the TLVs in ``hb[12:hdr_len]``: Header attribute -> value (unknown in "extra").

    Step 7 of the reading order.  For each TLV, in wire order: the TLV count,
    its 2-byte header, its value, then (known types only) duplicate, fixed
    length, and the TENSOR or ERROR rules; the first failure is raised.
    """
    fields: dict[str, Any] = {}
    extra: list[tuple[int, bytes]] = []
    off = MMH_PREAMBLE_LEN
    count = 0
    while off < hdr_len:
        count += 1
        if count > MMH_MAX_TLVS:
            raise WireError(f"more than {MMH_MAX_TLVS} TLVs", off)
        if off + 2 > hdr_len:
            raise WireError("TLV header runs past hdr_len", off)
        typ = hb[off]
        ln = hb[off + 1]
        end = off + 2 + ln
        if end > hdr_len:
            raise WireError(f"{_tlv_name(typ)} TLV value runs past hdr_len", off + 1)
        if typ:  # PAD (type 0) is skipped
            known = _DECODERS.get(typ)
            if known is None:
                extra.append((typ, hb[off + 2 : end]))
            else:
                attr, fixed, unpack, dec = known
                if attr in fields:
                    raise WireError(f"duplicate {_tlv_name(typ)} TLV", off)
                if fixed >= 0 and ln != fixed:
                    raise WireError(f"{_tlv_name(typ)} TLV length {ln}, expected {fixed}", off + 1)
                if unpack is not None:
                    fields[attr] = unpack(hb, off + 2)[0]
                else:
                    fields[attr] = dec(hb, off + 2, ln, off)  # type: ignore[misc]
        off = end
    if extra:
        fields["extra"] = tuple(extra)
    return fields


def _new_header(
    modality: int, sla: int, flags: int, plen: int, hdr_len: int, fields: dict[str, Any]
) -> Header:
    """Build a decoded Header without the frozen ``__init__`` (about 10x faster).

    Attributes go straight into the instance ``__dict__``; absent TLV fields
    fall back to the class-level defaults that ``@dataclass`` leaves in place.
    """
    h = object.__new__(Header)
    d = h.__dict__
    d["modality"] = modality
    d["sla_class"] = sla
    d["flags"] = flags
    d["payload_len"] = plen
    d["hdr_len"] = hdr_len
    if fields:
        d.update(fields)
    return h


_NO_FIELDS: dict[str, Any] = {}


def decode_header(buf: Buffer) -> Header:
    """Parse the MMH header at the start of ``buf`` (payload bytes may follow).

    Only the header (at most 255 bytes) is read; the payload is not touched.
    Raises :class:`WireError` with ``offset`` and ``reason`` on malformed input:
    the first of these that fails (``docs/wire-format.md`` section 3): 1 magic
    (``bad magic``, 0), 2 version (3), 3 fewer than 12 bytes (``truncated``,
    bytes available), 4 ``hdr_len < 12`` (4), 5 ``payload_len`` over 2^30 (8),
    6 fewer than ``hdr_len`` bytes (``truncated``), 7 the TLVs.  Empty input is
    ``truncated`` at 0.  Reserved flag bits are kept in ``Header.flags``.
    """
    buf = byte_view(buf)
    hdr_len, modality, sla, flags, plen = read_preamble(buf)
    if hdr_len > len(buf):
        raise WireError("truncated", len(buf))
    if hdr_len == MMH_PREAMBLE_LEN:
        return _new_header(modality, sla, flags, plen, hdr_len, _NO_FIELDS)
    fields = _decode_tlvs(bytes(buf[:hdr_len]), hdr_len)
    return _new_header(modality, sla, flags, plen, hdr_len, fields)


def decode_frame(buf: Buffer) -> tuple[Header, memoryview]:
    """Header and payload of the frame at the start of ``buf``.

    The payload is a ``memoryview`` of ``buf`` (no copy).  Bytes after the
    frame are ignored; ``Header.frame_len`` says where the next frame starts.
    After the header's checks, step 8: fewer than ``hdr_len + payload_len``
    bytes is ``truncated payload`` at the number of bytes available.
    """
    view = memoryview(byte_view(buf))
    h = _py_decode_header(view)
    start = h.hdr_len or MMH_PREAMBLE_LEN
    end = start + h.payload_len
    if end > len(view):
        raise WireError("truncated payload", len(view))
    return h, view[start:end]


def peek_class_inputs(buf: Buffer) -> tuple[int, int]:
    """``(modality, sla_class)`` from bytes 0..7, as the classifier reads them.

    Checks magic, version and ``hdr_len >= 12`` only; the TLVs are not read.
    """
    buf = byte_view(buf)
    if len(buf) < MMH_OFF_FLAGS + 1:
        check_magic(buf)
        raise WireError("truncated", len(buf))
    check_magic(buf)
    if buf[MMH_OFF_HDR_LEN] < MMH_PREAMBLE_LEN:
        raise WireError(f"hdr_len {buf[MMH_OFF_HDR_LEN]} < {MMH_PREAMBLE_LEN}", MMH_OFF_HDR_LEN)
    return buf[MMH_OFF_MODALITY], buf[MMH_OFF_CLASS]




# --------------------------------------------------------------------------
# The compiled fast path
# --------------------------------------------------------------------------
# mmmesh/wire/_cwire.c implements decode_header, decode_frame, encode_header
# and frame for the inputs they accept and calls the functions above (the
# reference) for anything else, so results and errors are theirs
# (tests/mmmesh/wire/test_wire_fast.py holds the two byte for byte).  It is
# built at install when a C compiler is there (pyproject.toml); without it,
# or with MMMESH_WIRE=python in the environment, the functions above run.
_py_decode_header = decode_header
_py_decode_frame = decode_frame
_py_encode_header = encode_header
_py_frame = frame
IMPLEMENTATION = "python"
"""Which codec this process runs: ``"c"`` (the compiled path) or ``"python"``."""


def _select() -> None:
    global decode_header, decode_frame, encode_header, frame, IMPLEMENTATION
    import os

    if os.environ.get("MMMESH_WIRE", "").lower() == "python":
        return
    import importlib

    try:
        # by name, not an import statement: the extension imports nothing of
        # this package (setup() hands it the classes and the reference
        # functions), so there is no circle through mmmesh.wire
        _cwire = importlib.import_module("mmmesh.wire._cwire")
    except ImportError:
        return
    _cwire.setup(Header, TensorSpec, _py_decode_header, _py_decode_frame, _py_encode_header,
                 _py_frame)
    decode_header = _cwire.decode_header
    decode_frame = _cwire.decode_frame
    encode_header = _cwire.encode_header
    frame = _cwire.frame
    IMPLEMENTATION = "c"


_select()
