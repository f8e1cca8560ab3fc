"""Scapy layers for MMH v1 (``docs/wire-format.md``): build and dissect test packets.

    >>> from scapy.all import IP, UDP, Raw
    >>> pkt = IP() / UDP(dport=7000) / MMH(
    ...     modality="audio", tlvs=[MMHTLV(type="stream_id", value=7)]) / Raw(b"pcm")
    >>> MMH(bytes(pkt[MMH])).tlvs[0].value
    b'\\x00\\x00\\x00\\x07'

``hdr_len`` and each TLV's ``len`` are computed on build, ``payload_len``
defaults to the length of whatever follows the MMH layer.  A TLV ``value`` may
be given as raw bytes or, for known types, as a Python value (an int for the
integer TLVs, a :class:`~mmmesh.wire.TensorSpec`, W3C traceparent text, an
``(code, message)`` tuple for ERROR); ``show()`` prints known values decoded.
Nothing is bound to a port by default: call :func:`bind_mmh_port`.
"""

from __future__ import annotations

import struct
from typing import Any

from scapy.fields import (
    ByteEnumField,
    ByteField,
    FieldLenField,
    FlagsField,
    IntField,
    PacketListField,
    StrFixedLenField,
    StrLenField,
)
from scapy.layers.inet import TCP, UDP
from scapy.packet import (
    Packet,
    Raw,
    bind_bottom_up,
    bind_layers,
    split_bottom_up,
    split_layers,
)

from mmmesh.abi import (
    MMH_MAGIC,
    MMH_PREAMBLE_LEN,
    MMH_VERSION,
    TLV_FIXED_LEN,
    Flag,
    Modality,
    Tlv,
)
from mmmesh.wire import (
    MODALITY_ALIASES,
    TRACEPARENT_LEN,
    Header,
    TensorSpec,
    decode_header,
    encode_header,
    traceparent_from_text,
    traceparent_to_text,
)

__all__ = [
    "MMH",
    "MMHTLV",
    "bind_mmh_port",
    "header_from_mmh",
    "mmh_from_header",
    "unbind_mmh_port",
]

_INT_FORMATS = {2: "!H", 4: "!I", 8: "!Q"}
_TLV_ALIASES = {"fps": Tlv.VIDEO_FPS, "bitrate": Tlv.AUDIO_BITRATE, "density": Tlv.POINT_DENSITY}


def _int_format(typ: int) -> str | None:
    """struct format of an integer TLV type, None for the others."""
    try:
        n = TLV_FIXED_LEN[Tlv(typ)]
    except ValueError:
        return None
    return None if typ == Tlv.TRACEPARENT or n is None else _INT_FORMATS[n]


def _value_to_bytes(typ: int, value: Any) -> bytes:
    """A TLV value given as a Python value -> its wire bytes."""
    if value is None:
        return b""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    fmt = _int_format(typ)
    if isinstance(value, int) and fmt is not None:
        return struct.pack(fmt, value)
    if isinstance(value, TensorSpec):
        return struct.pack(f"!BB{value.ndim}I", value.dtype, value.ndim, *value.shape)
    if isinstance(value, tuple) and typ == Tlv.ERROR:
        return struct.pack("!H", value[0]) + str(value[1]).encode("utf-8")
    if isinstance(value, str) and typ == Tlv.TRACEPARENT:
        return traceparent_from_text(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"cannot encode {value!r} as the value of TLV type {typ}")


def _describe(typ: int, raw: bytes) -> str | None:
    """Human form of a known TLV value, None if not decodable."""
    fmt = _int_format(typ)
    if fmt is not None and len(raw) == struct.calcsize(fmt):
        return str(struct.unpack(fmt, raw)[0])
    if typ == Tlv.TRACEPARENT and len(raw) == TRACEPARENT_LEN:
        return traceparent_to_text(raw)
    if typ == Tlv.TENSOR and len(raw) >= 2 and len(raw) == 2 + 4 * raw[1]:
        spec = TensorSpec(raw[0], struct.unpack(f"!{raw[1]}I", raw[2:]))
        return f"{spec.dtype_name}{list(spec.shape)}"
    if typ == Tlv.ERROR and len(raw) >= 2:
        return f"{struct.unpack('!H', raw[:2])[0]} {raw[2:].decode('utf-8', 'replace')!r}"
    return None


class _TLVValueField(StrLenField):
    """TLV value: bytes on the wire, accepts Python values for known types."""

    def any2i(self, pkt: Packet | None, x: Any) -> Any:
        # Keep str as given (StrField would UTF-8 encode it): the TLV type decides.
        return x

    def i2m(self, pkt: Packet | None, x: Any) -> bytes:
        return _value_to_bytes(pkt.type if pkt is not None else -1, x)

    def i2len(self, pkt: Packet | None, x: Any) -> int:
        return len(self.i2m(pkt, x))

    def i2repr(self, pkt: Packet | None, x: Any) -> str:
        if pkt is not None and isinstance(x, bytes):
            text = _describe(pkt.type, x)
            if text is not None:
                return text
        return repr(x)


def _enum_field(name: str, names: dict[int, str], aliases: dict[str, int]) -> ByteEnumField:
    """A ByteEnumField that also accepts ``aliases`` when building."""
    field = ByteEnumField(name, 0, names)
    assert field.s2i is not None  # built from a dict, so scapy filled s2i
    field.s2i.update(aliases)
    return field


class MMHTLV(Packet):
    """One TLV: ``type`` (u8), ``len`` (u8, auto), ``value``."""

    name = "MMH TLV"
    fields_desc = [  # noqa: RUF012 (scapy's class-level field list)
        _enum_field(
            "type",
            {int(t): t.name.lower() for t in Tlv},
            {k: int(v) for k, v in _TLV_ALIASES.items()},
        ),
        FieldLenField("len", None, length_of="value", fmt="B"),
        _TLVValueField("value", b"", length_from=lambda pkt: pkt.len),
    ]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        """A TLV has no payload: the rest belongs to the next TLV."""
        return b"", s


def _tlvs_len(pkt: Packet) -> int:
    return max(0, (pkt.hdr_len or MMH_PREAMBLE_LEN) - MMH_PREAMBLE_LEN)


class MMH(Packet):
    """The MMH v1 header; what follows it (payload_len bytes) is the payload."""

    name = "MMH"
    fields_desc = [  # noqa: RUF012 (scapy's class-level field list)
        StrFixedLenField("magic", MMH_MAGIC, 3),
        ByteField("version", MMH_VERSION),
        FieldLenField(
            "hdr_len", None, length_of="tlvs", fmt="B", adjust=lambda _p, x: x + MMH_PREAMBLE_LEN
        ),
        _enum_field(
            "modality",
            {int(m): m.name.lower() for m in Modality},
            {k: int(v) for k, v in MODALITY_ALIASES.items()},
        ),
        ByteField("sla_class", 0),
        FlagsField("flags", 0, 8, [str(f.name) for f in Flag if f.value]),
        IntField("payload_len", None),
        PacketListField("tlvs", [], MMHTLV, length_from=_tlvs_len),
    ]

    @classmethod
    def dispatch_hook(cls, _pkt: bytes | None = None, *args: Any, **kargs: Any) -> type[Packet]:
        """Bytes that do not start with the magic are Raw (e.g. a TCP continuation)."""
        if _pkt and not _pkt.startswith(MMH_MAGIC[: len(_pkt)]):
            return Raw
        return cls

    def post_build(self, p: bytes, pay: bytes) -> bytes:
        """Fill ``payload_len`` with the payload size unless it was set."""
        if self.payload_len is None:
            p = p[:8] + struct.pack("!I", len(pay)) + p[12:]
        return p + pay

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        """``payload_len`` bytes are the payload (Raw); anything after is padding."""
        if self.payload_len is None:
            return s, b""
        return s[: self.payload_len], s[self.payload_len :]

    def default_payload_class(self, payload: bytes) -> type[Packet]:
        return Raw

    def mysummary(self) -> str:
        return str(self.sprintf("MMH %modality% class=%sla_class% len=%payload_len%"))


def bind_mmh_port(port: int, udp: bool = True, tcp: bool = True) -> None:
    """Dissect UDP/TCP traffic to or from ``port`` as MMH; ``UDP()/MMH()`` sets the dport.

    The MMH bindings are tried before scapy's own, so that a packet from the
    default source port 53 to ``port`` is MMH, not DNS.
    """
    for l4, on in ((UDP, udp), (TCP, tcp)):
        if not on:
            continue
        bind_bottom_up(l4, MMH, sport=port)
        bind_layers(l4, MMH, dport=port)
        ours = [g for g in l4.payload_guess if g[1] is MMH]
        l4.payload_guess = ours + [g for g in l4.payload_guess if g[1] is not MMH]


def unbind_mmh_port(port: int, udp: bool = True, tcp: bool = True) -> None:
    """Undo :func:`bind_mmh_port`."""
    for l4, on in ((UDP, udp), (TCP, tcp)):
        if on:
            split_bottom_up(l4, MMH, sport=port)
            split_layers(l4, MMH, dport=port)


def mmh_from_header(h: Header, payload: bytes | None = None) -> Packet:
    """The MMH layer for ``h`` (exactly the bytes of :func:`encode_header`).

    With ``payload``, returns ``MMH/Raw(payload)`` and payload_len is computed.
    """
    pkt = MMH(encode_header(h))
    pkt.hdr_len = None
    if payload is None:
        return pkt
    pkt.payload_len = None
    return pkt / Raw(payload)


def header_from_mmh(pkt: Packet) -> Header:
    """Decode the MMH layer of ``pkt`` with :func:`mmmesh.wire.decode_header`."""
    return decode_header(bytes(pkt[MMH]))
