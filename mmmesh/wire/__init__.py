"""MMH v1: the modality header that starts every tensor-stream frame.

The byte-level specification is ``docs/wire-format.md``; every number used here
comes from :mod:`mmmesh.abi`.  In short::

    0      3   4        5         6          7      8            12        hdr_len
    | MMH | 1 | hdr_len | modality | sla_class | flags | payload_len | TLVs... | payload

This module is the public face; the code lives in private modules by role:

- ``_wire_header``: the values, :class:`Header` and :class:`TensorSpec`;
- ``_wire_codec``: :func:`encode_header`, :func:`decode_header`,
  :func:`decode_frame`, :func:`frame`, :func:`peek_class_inputs`;
- ``_wire_stream``: :class:`FrameReader`, the TCP stream splitter;
- ``_wire_text``: modality names and aliases, W3C traceparent text.

Decoding never copies the payload and raises only
:class:`~mmmesh.errors.WireError` on malformed input; encoding raises
``WireError`` (a ``ValueError``) naming the field that does not fit.

Typical use::

    bufs = frame(Header(modality=Modality.AUDIO, stream_id=7), pcm)
    sock.sendmsg(bufs)
    ...
    reader = FrameReader()
    reader.feed(sock.recv(65536))
    for hdr, payload in reader:
        ...
"""

from __future__ import annotations

from mmmesh.wire._codec import decode_frame, decode_header, encode_header, frame, peek_class_inputs
from mmmesh.wire._header import Buffer, Header, TensorSpec
from mmmesh.wire._stream import FrameReader
from mmmesh.wire._text import (
    MODALITY_ALIASES,
    TRACEPARENT_LEN,
    modality_from_name,
    modality_name,
    modality_names,
    parse_modality,
    traceparent_from_text,
    traceparent_to_text,
)

__all__ = [
    "MODALITY_ALIASES",
    "TRACEPARENT_LEN",
    "Buffer",
    "FrameReader",
    "Header",
    "TensorSpec",
    "decode_frame",
    "decode_header",
    "encode_header",
    "frame",
    "modality_from_name",
    "modality_name",
    "modality_names",
    "parse_modality",
    "peek_class_inputs",
    "traceparent_from_text",
    "traceparent_to_text",
]
