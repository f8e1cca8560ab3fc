"""Hand-built MMH header bytes for the wire tests: no validation, so that a
test can make them wrong on purpose."""

from __future__ import annotations

import struct


def raw_header(
    tlvs: bytes = b"",
    *,
    hdr_len: int | None = None,
    modality: int = 4,
    sla: int = 0,
    flags: int = 0,
    plen: int = 0,
    magic: bytes = b"MMH\x01",
) -> bytes:
    """Preamble + ``tlvs``; ``hdr_len`` defaults to the true length."""
    n = 12 + len(tlvs) if hdr_len is None else hdr_len
    return magic + bytes([n, modality, sla, flags]) + struct.pack("!I", plen) + tlvs


def tlv(typ: int, value: bytes) -> bytes:
    """One TLV with the true length of ``value``."""
    return bytes([typ, len(value)]) + value
