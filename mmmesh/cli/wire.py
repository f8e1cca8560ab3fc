"""``mmmesh wire encode|decode``: MMH headers from and to the command line.

$ mmmesh wire encode --modality voice --class 3 --stream-id 7
4d4d48011204030000000000010400000007
$ mmmesh wire decode 4d4d48011204030000000000010400000007
{"modality": "audio", ...}
"""

from __future__ import annotations

import argparse
import json
import sys
from enum import IntEnum
from typing import Any

from mmmesh.abi import DType, Modality
from mmmesh.errors import WireError
from mmmesh.wire import Header, decode_header, encode_header, parse_modality, traceparent_from_text

# (option, Header attribute, help) for the integer options of `encode`.
_INT_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--class", "sla_class", "requested SLA class id (0 = none)"),
    ("--flags", "flags", "flags byte (1 = error, 2 = end of stream; other bits reserved)"),
    ("--payload-len", "payload_len", "payload bytes that follow the header"),
    ("--stream-id", "stream_id", "STREAM_ID TLV (u32)"),
    ("--seq", "sequence", "SEQUENCE TLV (u64)"),
    ("--timestamp-ns", "timestamp_ns", "TIMESTAMP_NS TLV (u64, CLOCK_REALTIME ns)"),
    ("--deadline-ns", "deadline_ns", "DEADLINE_NS TLV (u64, CLOCK_REALTIME ns)"),
    ("--fps", "fps", "VIDEO_FPS TLV (u16)"),
    ("--bitrate", "bitrate", "AUDIO_BITRATE TLV (u32, bit/s)"),
    ("--density", "density", "POINT_DENSITY TLV (u32, points per sweep)"),
)


def _int(text: str) -> int:
    """Decimal or 0x-prefixed integer."""
    return int(text, 0)


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``encode`` and ``decode`` sub-commands to the ``mmmesh wire`` parser."""
    sub = parser.add_subparsers(dest="wire_command", metavar="{encode,decode}")
    sub.required = True
    enc = sub.add_parser("encode", help="print an MMH header as hex")
    enc.add_argument("--modality", required=True, help="name (audio, video, lidar...) or 0..255")
    for option, dest, help_ in _INT_OPTIONS:
        enc.add_argument(option, dest=dest, type=_int, metavar="N", help=help_)
    enc.add_argument("--traceparent", metavar="TEXT", help="W3C traceparent 00-<32>-<16>-<2>")
    enc.set_defaults(func=cmd_encode)
    dec = sub.add_parser("decode", help="print an MMH header given as hex as JSON")
    dec.add_argument("hex", metavar="HEX", help="header bytes as hex ('-' reads stdin)")
    dec.set_defaults(func=cmd_decode)


def _fail(command: str, message: str, code: int) -> int:
    print(f"mmmesh wire {command}: error: {message}", file=sys.stderr)
    return code


def cmd_encode(args: argparse.Namespace) -> int:
    """Print the encoded header as one line of lowercase hex."""
    try:
        fields: dict[str, Any] = {"modality": parse_modality(args.modality)}
        if args.traceparent is not None:
            fields["traceparent"] = traceparent_from_text(args.traceparent)
    except ValueError as e:
        return _fail("encode", str(e), 2)
    for _, dest, _ in _INT_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            fields[dest] = value
    try:
        data = encode_header(Header(**fields))
    except WireError as e:
        return _fail("encode", e.reason, 2)
    print(data.hex())
    return 0


def _name_or_number(value: int, enum: type[IntEnum], lower: bool) -> str | int:
    """The enum member's name for a known value, the number itself otherwise."""
    try:
        name = enum(value).name
    except ValueError:
        return value
    return name.lower() if lower else name


def header_to_json(h: Header) -> dict[str, Any]:
    """The JSON object ``mmmesh wire decode`` prints (``docs/wire-format.md`` section 9).

    Every key is always present, in this order; absent TLVs are ``null``.
    Modality and dtype are names when known, numbers otherwise.
    """
    return {
        "modality": _name_or_number(h.modality, Modality, lower=True),
        "sla_class": h.sla_class,
        "flags": h.flags,
        "payload_len": h.payload_len,
        "stream_id": h.stream_id,
        "sequence": h.sequence,
        "timestamp_ns": h.timestamp_ns,
        "deadline_ns": h.deadline_ns,
        "fps": h.fps,
        "bitrate": h.bitrate,
        "density": h.density,
        "tensor": None
        if h.tensor is None
        else {
            "dtype": _name_or_number(h.tensor.dtype, DType, lower=False),
            "shape": list(h.tensor.shape),
        },
        "traceparent": h.traceparent_text,
        "error": None if h.error is None else {"code": h.error[0], "message": h.error[1]},
        "extra": [{"type": t, "value": bytes(v).hex()} for t, v in h.extra],
        "hdr_len": h.hdr_len,
    }


def _read_hex(text: str) -> bytes:
    """Hex digits, ignoring whitespace, ':' separators and a leading 0x."""
    if text == "-":
        text = sys.stdin.read()
    text = "".join(text.split()).replace(":", "")
    if text[:2].lower() == "0x":
        text = text[2:]
    return bytes.fromhex(text)


def cmd_decode(args: argparse.Namespace) -> int:
    """Print the header at the start of HEX as JSON; 1 if malformed."""
    try:
        data = _read_hex(args.hex)
    except ValueError:
        return _fail("decode", "input is not hex", 1)
    try:
        h = decode_header(data)
    except WireError as e:
        return _fail("decode", f"malformed MMH at byte {e.offset}: {e.reason}", 1)
    print(json.dumps(header_to_json(h), indent=2, ensure_ascii=False))
    return 0
