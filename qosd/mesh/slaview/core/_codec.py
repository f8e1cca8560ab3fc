"""The bytes of the global SLA view: one node's windows (a *publication*) and
the push-pull state that carries several of them with their sketches.

The layout (little-endian; ``varint`` is protobuf's unsigned LEB128, at most
10 bytes; docs/cluster.md "Global SLA view" has a hex example)::

    digest   = 0xD1 body                       gossip payload, key "sla/<origin>"
    state    = 0xD2 u8 n  n x bundle           push-pull app state
    bundle   = u8 len  origin (utf-8)  varint len  body
    body     = varint seq  varint sent_ms  varint interval_ms  varint delay_ms
               tail
    tail     = u8 n  n x (u8 len, utf-8)       string table (stage, class, modality names)
               u8 n  n x window
    window   = u8 stage (0xFF: node-wide)  u8 class  u8 modality      (string indices)
               varint frames  varint misses  varint window_ms  varint age_ms
               i16 p50  i16 p99  i16 p999      DDSketch keys (NO_KEY, ZERO_KEY)
               u8 sketch: 0 none | 1 varint counts | 2 float64 counts
               [i16 offset  u16 nbins  zero  nbins x count]  (zero, counts: as said)

A window's age is ``age_ms`` (how old it was when its node published it)
plus the publication's ``delay_ms`` (how long relays held it since): a relay
rewrites the head only, never the tail.

A quantile is carried as the DDSketch key of its bin (``mmmesh.sla``'s
mapping, 1 % relative accuracy; ``NO_KEY`` and ``ZERO_KEY`` are its sentinels
for none and the zero bucket): 2 bytes, no precision lost against the sketch
it came from.  A window's ``misses`` are its frames not within their deadline
(late or dropped; see ``_merge.py``).  A sketch is the canonical
:class:`~mmmesh.sla.Sketch` (positive bins from ``offset``, first and last
non-zero) with its counts as varints when they are whole numbers, float64
otherwise.

:func:`decode_digest` and :func:`decode_state` treat their input as hostile:
every length is checked before it is read, every number against the SLA
report's bounds (``mmmesh.sla``), names like a report's, each sketch
rebuilt in canonical form and checked (:meth:`Sketch.check`, the same bounds
``parse_sketch`` applies to a sidecar's).  Anything else raises ``ValueError``.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from mmmesh.sla import (
    KEY_SPAN,
    MAX_ABS_KEY,
    MAX_COUNT,
    MAX_NAME,
    MAX_WINDOW_S,
    NO_KEY,
    ZERO_KEY,
    Sketch,
    check_count,
)

MAGIC_DIGEST = 0xD1
MAGIC_STATE = 0xD2
NODE_WIDE = 0xFF
MAX_STAGE = 128  # SlaReport.stage's max_length
MAX_STRINGS = 254  # 0xFF is the node-wide marker
MAX_WINDOWS = 255
MAX_BUNDLES = 255
MAX_WINDOW_MS = int(MAX_WINDOW_S * 1000)
MAX_AGE_MS = 10 * MAX_WINDOW_MS
MAX_SEQ = (1 << 63) - 1
MAX_SENT_MS = 1 << 53
_EXACT = float(1 << 53)  # whole counts up to here are exact as float64 and as varints
_I16 = struct.Struct("<h")
_Q = struct.Struct("<hhh")
_SK = struct.Struct("<hH")
_HEAD_ROOM = 30  # encode_head: four varints of at most 9, 8, 5 and 5 bytes

Key = tuple[str | None, str, str]  # (stage or None for node-wide, class, modality)


@dataclass(frozen=True, slots=True)
class Window:
    """One (stage, class, modality) window of one node."""

    stage: str | None
    sla_class: str
    modality: str
    frames: int
    misses: int
    window_ms: int
    age_ms: int
    """How old the window was when the publication was made."""
    quantiles: tuple[int, int, int]
    """p50, p99, p999 as DDSketch keys (``NO_KEY``, ``ZERO_KEY``)."""
    sketch: Sketch | None = None

    @property
    def key(self) -> Key:
        return (self.stage, self.sla_class, self.modality)


@dataclass(frozen=True, slots=True)
class Publication:
    """One node's windows at one moment; ``seq`` orders its publications."""

    seq: int
    sent_ms: int
    """The origin's unix time in ms (shown, never compared with other clocks)."""
    interval_ms: int
    """The origin's digest interval: the receivers' staleness clock."""
    windows: tuple[Window, ...]
    delay_ms: int = 0
    """Added to every window's age: time spent in relays since it was made."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What an encoder writes and a decoder accepts."""

    max_bytes: int
    """A digest, or a bundle's body."""
    max_sketches: int = MAX_WINDOWS
    max_bins: int = KEY_SPAN


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------
def _varint(v: int, out: bytearray) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _sketch_bytes(sk: Sketch) -> bytes:
    counts = sk.counts()
    whole = all(c == int(c) and c < _EXACT for c in counts) and sk.zero == int(sk.zero)
    out = bytearray((1 if whole else 2,))
    out += _SK.pack(sk.offset, len(counts))
    if whole:
        for c in (sk.zero, *counts):
            _varint(int(c), out)
    else:
        out += struct.pack(f"<{len(counts) + 1}d", sk.zero, *counts)
    return bytes(out)


def _window_bytes(w: Window, idx: dict[str, int], sketch: bytes | None) -> bytes:
    out = bytearray((NODE_WIDE if w.stage is None else idx[w.stage], idx[w.sla_class],
                     idx[w.modality]))
    for v in (w.frames, w.misses, w.window_ms, w.age_ms):
        _varint(v, out)
    out += _Q.pack(*w.quantiles)
    out += sketch if sketch is not None else b"\x00"
    return bytes(out)


def encode_head(pub: Publication, delay_ms: int) -> bytes:
    """The first part of a body: seq, sent_ms, interval_ms, ``delay_ms``."""
    out = bytearray()
    for v in (pub.seq, pub.sent_ms, pub.interval_ms, min(MAX_AGE_MS, max(0, delay_ms))):
        _varint(v, out)
    return bytes(out)


def encode_tail(pub: Publication, limits: Limits, *,
                sketches: bool) -> tuple[bytes, int, int]:
    """The rest of a body within ``limits.max_bytes`` (with a head of up to
    30 bytes): first the windows, in their order, as many as fit without
    sketches (counts matter most); then, while ``sketches``, the room and
    ``max_sketches`` allow, their sketches in the same order.  Returns (tail,
    windows left out, sketches left out)."""
    names: dict[str, int] = {}
    table = bytearray()
    kept: list[Window] = []
    size = _HEAD_ROOM + 2
    for w in pub.windows:
        new = [s for s in dict.fromkeys((w.stage, w.sla_class, w.modality))
               if s is not None and s not in names]
        cost = sum(1 + len(s.encode()) for s in new)
        idx = {**names, **{s: len(names) + k for k, s in enumerate(new)}}
        blob = _window_bytes(w, idx, None)
        if (len(names) + len(new) > MAX_STRINGS or len(kept) >= MAX_WINDOWS
                or size + cost + len(blob) > limits.max_bytes):
            continue
        names = idx
        for s in new:
            table.append(len(s.encode()))
            table += s.encode()
        kept.append(w)
        size += cost + len(blob)
    parts: list[bytes] = []
    left_sketches = n_sketches = 0
    for w in kept:
        sk = None
        if w.sketch is not None and sketches:
            if n_sketches < limits.max_sketches and len(w.sketch.bins) // 8 <= limits.max_bins:
                sk = _sketch_bytes(w.sketch)
                if size + len(sk) - 1 > limits.max_bytes:
                    sk = None
            if sk is None:
                left_sketches += 1
            else:
                n_sketches += 1
                size += len(sk) - 1
        parts.append(_window_bytes(w, names, sk))
    tail = bytes((len(names),)) + bytes(table) + bytes((len(parts),)) + b"".join(parts)
    return tail, len(pub.windows) - len(kept), left_sketches


def encode_digest(pub: Publication, max_bytes: int) -> tuple[bytes, int]:
    """The gossip payload of ``pub`` (no sketches) and the windows left out."""
    tail, left, _ = encode_tail(pub, Limits(max_bytes - 1), sketches=False)
    return bytes((MAGIC_DIGEST,)) + encode_head(pub, pub.delay_ms) + tail, left


def encode_state(bundles: Iterable[tuple[str, bytes]]) -> bytes:
    """The push-pull state of (origin, body) pairs (at most ``MAX_BUNDLES``)."""
    out = bytearray((MAGIC_STATE, 0))
    n = 0
    for origin, body in bundles:
        name = origin.encode()
        out.append(len(name))
        out += name
        _varint(len(body), out)
        out += body
        n += 1
    out[1] = n
    return bytes(out)


def bundle_size(origin: str, body: bytes) -> int:
    """Bytes a bundle adds to the state."""
    head = bytearray()
    _varint(len(body), head)
    return 1 + len(origin.encode()) + len(head) + len(body)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------
class _Reader:
    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise ValueError(f"truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        if self.pos >= self.end:
            raise ValueError(f"truncated at byte {self.pos}")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, limit: int, what: str) -> int:
        data, pos, end = self.data, self.pos, min(self.end, self.pos + 10)
        v = shift = 0
        while pos < end:
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                if v > limit:
                    raise ValueError(f"{what} {v} above {limit}")
                return v
            shift += 7
        raise ValueError(f"{what}: truncated or longer than 10 bytes at byte {self.pos}")

    def text(self, max_chars: int, what: str) -> str:
        n = self.u8()
        if n == 0:
            raise ValueError(f"{what}: empty")
        s = self.take(n).decode("utf-8")  # UnicodeDecodeError is a ValueError
        if len(s) > max_chars:
            raise ValueError(f"{what}: longer than {max_chars} characters")
        return s


def _key(k: int, what: str) -> int:
    if k in (NO_KEY, ZERO_KEY) or -MAX_ABS_KEY <= k <= MAX_ABS_KEY:
        return k
    raise ValueError(f"{what}: key {k} outside +-{MAX_ABS_KEY}")


def _quantiles(r: _Reader) -> tuple[int, int, int]:
    q = _Q.unpack(r.take(_Q.size))
    known = [_key(k, "quantile") for k in q if k != NO_KEY]
    if known != sorted(known):
        raise ValueError(f"quantile keys {q} not in order")
    return (q[0], q[1], q[2])


def _sketch(r: _Reader, limits: Limits) -> Sketch | None:
    kind = r.u8()
    if kind == 0:
        return None
    if kind not in (1, 2):
        raise ValueError(f"sketch kind {kind}")
    offset, n = _SK.unpack(r.take(_SK.size))
    if n == 0 or n > limits.max_bins or offset < -MAX_ABS_KEY or offset + n - 1 > MAX_ABS_KEY:
        raise ValueError(f"sketch bins {offset}..{offset + n - 1}: outside +-{MAX_ABS_KEY} "
                         f"or more than {limits.max_bins}")
    if kind == 1:
        values = [float(r.varint(MAX_COUNT, "sketch count")) for _ in range(n + 1)]
    else:
        values = [check_count(c, "sketch count")
                  for c in struct.unpack(f"<{n + 1}d", r.take(8 * (n + 1)))]
    sk = Sketch.of_counts(offset, array("d", values[1:]), values[0])
    sk.check()  # total within MAX_COUNT, as parse_sketch checks a sidecar's
    return sk


def _name(names: list[str], i: int, max_chars: int, what: str) -> str:
    if i >= len(names):
        raise ValueError(f"{what}: string {i} of {len(names)}")
    if len(names[i]) > max_chars:
        raise ValueError(f"{what} longer than {max_chars} characters")
    return names[i]


def _window(r: _Reader, names: list[str], limits: Limits) -> Window:
    s, c, m = r.take(3)
    stage = None if s == NODE_WIDE else _name(names, s, MAX_STAGE, "stage")
    frames = r.varint(MAX_COUNT, "frames")
    misses = r.varint(frames, "misses")
    window_ms = r.varint(MAX_WINDOW_MS, "window_ms")
    age_ms = r.varint(MAX_AGE_MS, "age_ms")
    quantiles = _quantiles(r)
    return Window(stage, _name(names, c, MAX_NAME, "class"), _name(names, m, MAX_NAME,
                                                                    "modality"),
                  frames, misses, window_ms, age_ms, quantiles, _sketch(r, limits))


def _body(r: _Reader, limits: Limits) -> Publication:
    seq = r.varint(MAX_SEQ, "seq")
    sent_ms = r.varint(MAX_SENT_MS, "sent_ms")
    interval_ms = r.varint(MAX_AGE_MS, "interval_ms")
    delay_ms = r.varint(MAX_AGE_MS, "delay_ms")
    names = [r.text(MAX_STAGE, "name") for _ in range(r.u8())]
    if len(names) > MAX_STRINGS:
        raise ValueError(f"{len(names)} strings")
    windows = [_window(r, names, limits) for _ in range(r.u8())]
    if len({w.key for w in windows}) != len(windows):
        raise ValueError("a (stage, class, modality) twice")
    if sum(w.sketch is not None for w in windows) > limits.max_sketches:
        raise ValueError(f"more than {limits.max_sketches} sketches")
    if r.pos != r.end:
        raise ValueError(f"{r.end - r.pos} bytes after the last window")
    return Publication(seq, sent_ms, interval_ms, tuple(windows), delay_ms)


def decode_digest(data: bytes, limits: Limits) -> Publication:
    """A gossip payload, checked (``ValueError`` says what is wrong)."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"{len(data)} bytes, more than {limits.max_bytes}")
    r = _Reader(bytes(data))
    if r.u8() != MAGIC_DIGEST:
        raise ValueError("not an SLA digest")
    return _body(r, limits)


def decode_state(data: bytes, max_bytes: int,
                 limits: Limits) -> list[tuple[str, Publication | ValueError]]:
    """The bundles of a push-pull state: (origin, publication), or (origin,
    the error) for a bundle that is malformed but whose frame is intact (the
    others are still read).  A broken frame raises ``ValueError``."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than {max_bytes}")
    r = _Reader(bytes(data))
    if r.u8() != MAGIC_STATE:
        raise ValueError("not an SLA state")
    out: list[tuple[str, Publication | ValueError]] = []
    for _ in range(r.u8()):
        origin = r.text(253, "origin")
        n = r.varint(limits.max_bytes, "bundle length")
        start = r.pos
        r.take(n)
        try:
            out.append((origin, _body(_Reader(r.data, start, start + n), limits)))
        except ValueError as e:
            out.append((origin, e))
    if r.pos != r.end:
        raise ValueError(f"{r.end - r.pos} bytes after the last bundle")
    return out


__all__ = [
    "MAGIC_DIGEST",
    "MAGIC_STATE",
    "NODE_WIDE",
    "NO_KEY",
    "ZERO_KEY",
    "Key",
    "Limits",
    "Publication",
    "Window",
    "bundle_size",
    "decode_digest",
    "decode_state",
    "encode_digest",
    "encode_head",
    "encode_state",
    "encode_tail",
]
