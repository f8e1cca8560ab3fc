"""mmmesh.wire.FrameReader: splitting a TCP byte stream into frames, zero copy,
and the reading order of docs/wire-format.md section 3 applied to a stream."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mmmesh.abi import MMH_MAX_PAYLOAD, Modality
from mmmesh.errors import WireError
from mmmesh.wire import FrameReader, Header, decode_frame, encode_header, frame
from testkit.mmh_bytes import raw_header, tlv
from testkit.wire_cases import MALFORMED, ORDER


def _stream(n: int, seed: int) -> tuple[bytes, list[tuple[Header, bytes]]]:
    rng = random.Random(seed)
    frames = []
    for i in range(n):
        h = Header(
            rng.choice(list(Modality)),
            sla_class=rng.randrange(64),
            stream_id=i,
            sequence=rng.randrange(2**64),
            fps=rng.choice([None, 30, 60]),
        )
        payload = rng.randbytes(rng.choice([0, 1, 5, 100, 3000]))
        frames.append((dataclasses.replace(h, payload_len=len(payload)), payload))
    data = b"".join(encode_header(h) + p for h, p in frames)
    return data, frames


@pytest.mark.parametrize("seed", range(8))
def test_frame_reader_random_chunks(seed: int) -> None:
    data, frames = _stream(40, seed)
    rng = random.Random(1000 + seed)
    reader = FrameReader()
    got: list[tuple[Header, bytes]] = []
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 2, 3, 7, 12, 13, 100, 1500, 9000])
        reader.feed(data[pos : pos + n])
        pos += n
        got.extend((h, bytes(p)) for h, p in reader)
    reader.close()
    assert got == frames
    assert reader.buffered == 0 and reader.position == len(data)


def test_frame_reader_whole_stream_is_zero_copy() -> None:
    data, frames = _stream(10, 99)
    reader = FrameReader()
    reader.feed(data)
    out = list(reader)
    assert [(h, bytes(p)) for h, p in out] == frames
    assert all(p.obj is data for _, p in out)


def test_frame_reader_copies_writable_buffers() -> None:
    data, frames = _stream(3, 5)
    buf = bytearray(data)
    reader = FrameReader()
    reader.feed(buf)
    buf[:] = bytes(len(buf))  # a reused receive buffer
    assert [(h, bytes(p)) for h, p in reader] == frames


def test_frame_reader_rejects_garbage_early_with_stream_offset() -> None:
    data, _ = _stream(2, 1)
    reader = FrameReader()
    reader.feed(data + b"GE")
    frames = iter(reader)
    next(frames)
    next(frames)
    with pytest.raises(WireError) as ei:
        next(frames)
    assert ei.value.reason == "bad magic" and ei.value.offset == len(data)
    with pytest.raises(WireError):  # stays failed
        reader.feed(b"MMH")


def test_frame_reader_malformed_tlv_offset_is_absolute() -> None:
    first = b"".join(frame(Header(Modality.TEXT), b"abc"))
    bad = raw_header(tlv(1, b"abc"))
    reader = FrameReader()
    reader.feed(first + bad)
    with pytest.raises(WireError) as ei:
        list(reader)
    assert ei.value.offset == len(first) + 13


def test_frame_reader_max_payload() -> None:
    reader = FrameReader(max_payload=100)
    reader.feed(raw_header(plen=101))
    with pytest.raises(WireError, match="exceeds limit 100") as ei:
        list(reader)
    assert ei.value.offset == 8
    with pytest.raises(ValueError):
        FrameReader(max_payload=MMH_MAX_PAYLOAD + 1)


def test_frame_reader_close_reports_partial_frame() -> None:
    data = b"".join(frame(Header(Modality.TEXT), b"abcdef"))
    reader = FrameReader()
    reader.feed(data[:-2])
    assert list(reader) == []
    with pytest.raises(WireError, match="truncated payload"):
        reader.close()
    reader = FrameReader()
    reader.feed(data[:5])
    assert reader.next_frame() is None
    with pytest.raises(WireError, match="^malformed MMH at byte 5: truncated$"):
        reader.close()


# --------------------------------------------------------------------------
# The reading order of docs/wire-format.md section 3 on a stream
# --------------------------------------------------------------------------
def _stream_error(data: bytes, step: int) -> tuple[str, int] | None:
    """(reason, offset) a FrameReader fed ``data`` in ``step``-byte chunks, then
    closed, reports; None if it reads every byte as whole frames."""
    reader = FrameReader()
    try:
        for i in range(0, len(data), step):
            reader.feed(data[i : i + step])
            list(reader)
        reader.close()
    except WireError as e:
        return e.reason, e.offset
    return None


@pytest.mark.parametrize(
    "data", [pytest.param(d, id=name) for name, d, _, _ in [*MALFORMED, *ORDER] if d]
)
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_stream_reports_what_decode_frame_reports(data: bytes, step: int) -> None:
    try:
        decode_frame(data)
    except WireError as e:
        want: tuple[str, int] | None = (e.reason, e.offset)
    else:
        want = None
    assert _stream_error(data, step) == want


def test_stream_refuses_preamble_fields_without_waiting_for_the_header() -> None:
    """Steps 4 and 5 fail as soon as the 12 preamble bytes are in, although
    hdr_len bytes (step 6) have not arrived."""
    for data, offset in ((raw_header(hdr_len=20, plen=2**31), 8), (raw_header(hdr_len=5), 4)):
        reader = FrameReader()
        reader.feed(data)
        with pytest.raises(WireError) as ei:
            reader.next_frame()
        assert ei.value.offset == offset


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"MMH\x01\x05", "truncated"),  # step 3
        (raw_header(hdr_len=20), "truncated"),  # step 6
        (raw_header(plen=10) + b"12345", "truncated payload"),  # step 8
    ],
)
def test_stream_waits_where_steps_3_6_and_8_are_not_met_yet(data: bytes, reason: str) -> None:
    reader = FrameReader()
    reader.feed(data)
    assert reader.next_frame() is None
    with pytest.raises(WireError) as ei:
        reader.close()
    assert (ei.value.reason, ei.value.offset) == (reason, len(data))


def test_an_empty_stream_is_no_error() -> None:
    """Unlike decode_header(b"") (truncated at 0): a stream that ends between
    frames, with none at all, has no partial frame."""
    FrameReader().close()
