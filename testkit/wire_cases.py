"""Malformed headers and the order of the reading rules, shared by the wire
tests (tests/mmmesh/wire/)."""

from __future__ import annotations

from mmmesh.abi import (
    MMH_MAX_PAYLOAD,
)
from testkit.mmh_bytes import raw_header, tlv

# --------------------------------------------------------------------------
# Malformed input: every rule, with reason and offset
# --------------------------------------------------------------------------
MALFORMED: list[tuple[str, bytes, str, int]] = [
    ("empty", b"", r"^truncated$", 0),
    ("bad magic", b"XMH\x01" + bytes(8), r"^bad magic$", 0),
    ("bad magic short", b"MX", r"^bad magic$", 0),
    ("bad magic third byte", b"MMX\x01" + bytes(8), r"^bad magic$", 0),
    ("version 2", raw_header(magic=b"MMH\x02"), r"^unsupported version 2$", 3),
    ("version 0 short", b"MMH\x00", r"^unsupported version 0$", 3),
    ("preamble prefix", b"MMH\x01\x0c", r"^truncated$", 5),
    ("hdr_len 11", raw_header(hdr_len=11), r"hdr_len 11 < 12", 4),
    ("hdr_len 0", raw_header(hdr_len=0), r"hdr_len 0 < 12", 4),
    ("hdr_len past end", raw_header(hdr_len=20), r"^truncated$", 12),
    ("payload too big", raw_header(plen=MMH_MAX_PAYLOAD + 1), r"payload_len .* exceeds", 8),
    ("payload u32 max", raw_header(plen=2**32 - 1), r"payload_len .* exceeds", 8),
    ("lone trailing byte", raw_header(b"\x00"), r"TLV header runs past hdr_len", 12),
    ("trailing byte after tlv", raw_header(tlv(0x99, b"") + b"\x99"), r"header runs past", 14),
    ("value past hdr_len", raw_header(b"\x01\x04\x00\x00\x00"), r"value runs past hdr_len", 13),
    (
        "value past hdr_len, bytes follow",
        raw_header(b"\x99\x05ab", hdr_len=16) + b"cdef",
        r"value runs past hdr_len",
        13,
    ),
    ("too many TLVs", raw_header(tlv(0x99, b"") * 17), r"more than 16 TLVs", 12 + 2 * 16),
    ("too many with PAD", raw_header(tlv(0, b"") * 17), r"more than 16 TLVs", 44),
    ("STREAM_ID len 3", raw_header(tlv(1, b"abc")), r"STREAM_ID TLV length 3, expected 4", 13),
    ("SEQUENCE len 0", raw_header(tlv(2, b"")), r"SEQUENCE TLV length 0, expected 8", 13),
    ("TIMESTAMP len 9", raw_header(tlv(3, bytes(9))), r"TIMESTAMP_NS TLV length 9", 13),
    ("DEADLINE len 4", raw_header(tlv(4, bytes(4))), r"DEADLINE_NS TLV length 4", 13),
    ("FPS len 4", raw_header(tlv(0x10, bytes(4))), r"VIDEO_FPS TLV length 4, expected 2", 13),
    ("BITRATE len 2", raw_header(tlv(0x11, bytes(2))), r"AUDIO_BITRATE TLV length 2", 13),
    ("DENSITY len 8", raw_header(tlv(0x12, bytes(8))), r"POINT_DENSITY TLV length 8", 13),
    ("TRACEPARENT len 25", raw_header(tlv(0x30, bytes(25))), r"TRACEPARENT TLV length 25", 13),
    ("TENSOR len 0", raw_header(tlv(0x20, b"")), r"TENSOR TLV length 0, expected >= 2", 13),
    ("TENSOR len 1", raw_header(tlv(0x20, b"\x0b")), r"TENSOR TLV length 1", 13),
    ("TENSOR ndim 9", raw_header(tlv(0x20, b"\x0b\x09" + bytes(36))), r"TENSOR ndim 9 > 8", 15),
    (
        "TENSOR short dims",
        raw_header(tlv(0x20, b"\x0b\x02" + bytes(4))),
        r"TENSOR TLV length 6, expected 10 for ndim 2",
        13,
    ),
    (
        "TENSOR long dims",
        raw_header(tlv(0x20, b"\x0b\x01" + bytes(8))),
        r"TENSOR TLV length 10, expected 6",
        13,
    ),
    ("ERROR len 1", raw_header(tlv(0x40, b"\x00")), r"ERROR TLV length 1, expected >= 2", 13),
    ("ERROR bad utf8", raw_header(tlv(0x40, b"\x00\x01ok\xff")), r"not valid UTF-8", 18),
    (
        "duplicate STREAM_ID",
        raw_header(tlv(1, bytes(4)) + tlv(0x10, bytes(2)) + tlv(1, bytes(4))),
        r"duplicate STREAM_ID TLV",
        22,
    ),
    ("duplicate TENSOR", raw_header(tlv(0x20, b"\x01\x00") * 2), r"duplicate TENSOR", 16),
    ("duplicate ERROR", raw_header(tlv(0x40, b"\x00\x00") * 2), r"duplicate ERROR", 16),
]


# Inputs that break two rules: the first in the order of docs/wire-format.md
# section 3 (steps 1..7, then 7a..7k within a TLV) is the one reported.
ORDER: list[tuple[str, bytes, str, int]] = [
    ("1 magic before 3 truncated", b"MX", r"^bad magic$", 0),
    ("1 magic before 2 version", b"XMH\x09" + bytes(8), r"^bad magic$", 0),
    ("2 version before 3 truncated", b"MMH\x00", r"^unsupported version 0$", 3),
    ("2 version before 4 hdr_len", raw_header(magic=b"MMH\x02", hdr_len=3), r"version 2$", 3),
    ("3 truncated before 4 hdr_len", b"MMH\x01\x05", r"^truncated$", 5),
    ("4 hdr_len before 5 payload_len", raw_header(hdr_len=5, plen=2**31), r"hdr_len 5 < 12", 4),
    (
        "5 payload_len before 6 truncated",
        raw_header(hdr_len=20, plen=2**31),
        r"^payload_len 2147483648 exceeds 1073741824$",
        8,
    ),
    ("5 payload_len before 7 TLVs", raw_header(tlv(1, b"abc"), plen=2**31), r"exceeds", 8),
    ("6 truncated before 7 TLVs", raw_header(tlv(1, b"abc"), hdr_len=40), r"^truncated$", 17),
    ("first bad TLV wins", raw_header(tlv(0x10, b"\0") + tlv(2, b"")), r"VIDEO_FPS TLV length", 13),
    ("7a count before 7b header", raw_header(tlv(0x99, b"") * 16 + b"\x99"), r"more than 16", 44),
    (
        "7c value before 7e duplicate",
        raw_header(tlv(1, bytes(4)) + b"\x01\x09" + bytes(4)),
        r"STREAM_ID TLV value runs past hdr_len",
        19,
    ),
    ("7e duplicate before 7f length", raw_header(tlv(1, bytes(4)) + tlv(1, b"ab")), r"dup", 18),
    ("7h ndim before 7i length", raw_header(tlv(0x20, b"\x0b\x09" + bytes(4))), r"ndim 9", 15),
    (
        "7h ndim offset is the ndim byte",
        raw_header(tlv(0x99, b"") + tlv(0x20, b"\x01\x0c")),
        r"TENSOR ndim 12 > 8",
        17,
    ),
]
