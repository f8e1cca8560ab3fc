"""The aggregation trees' two messages and their bytes.

* :class:`Up`: a partial sum going up a tree: one member's own windows (a
  leaf, ``src`` 0) or the sum of a node's inputs (``src`` its arc id), for
  the node ``dst`` of the receiver.
* :class:`Down`: the root's record going back down the paths the partials
  came up, with the receipt of the recipient's own partial (``ack``: its
  sequence number, ``digest``: its counts as they were merged) and when to
  sample next (``next_sample_s``, from the receipt: every member of a tree
  samples at about the same moment, so a round is one pass up and one down).

Layout (little-endian; ``varint`` as in ``_codec``)::

    up     = 0xA1 varint seq  varint src  varint dst  varint count  str key
             census  rows(up)
    down   = 0xA2 varint epoch  varint ack  varint next_ms  varint count  u64 digest
             str key  str root  census  rows(down)
    str    = u8 len  utf-8
    census = u8 0 | u8 1 varint members varint reporting varint sketched u8 n  n x str
    rows   = u8 n  n x str (names)  u8 n  n x row
    row    = u8 stage (0xFF: node-wide)  u8 class  u8 modality
             varint frames  misses  nodes  stale  sketched  window_ms
             [varint newest_age_ms  oldest_age_ms]    when nodes > 0
             i16 lo  i16 hi                           p99 keys of the members without a sketch
             up:   sketch
             down: i16 p50  i16 p99  i16 p999  varint sketch_frames
    sketch = u8 0 (none) | u8 width (1, 2, 4: whole counts; 8: float64)  i16 offset
             u16 nbins  zero  nbins x count       each of ``width`` bytes

A sketch's counts have one width, the least that holds the largest (a
leaf's fit a byte, a root's four): packed and unpacked whole, not count by
count, so a message costs the same to size, write and read whatever its bins.

Times: a message's parts (rows) hold the ends of windows on its maker's
clock, and ``t0`` is when it was made on that clock; the bytes carry ages
(``t0 - end``), and :func:`decode` puts them back on the reader's clock
(``now - age``: the time in transit, a millisecond, is left out).  A
simulator whose members share one clock passes the objects as they are.

Reading treats the bytes as hostile (every length and number checked,
sketches rebuilt and checked as ``_codec`` does); anything wrong raises
``ValueError``.  ``wire`` is the encoded size (cached), what the simulator
counts.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmmesh.sla import KEY_SPAN, MAX_ABS_KEY, MAX_NAME, NO_KEY, ZERO_KEY, Sketch

from ._aggregate import Census, Part, RecordRow
from ._codec import (
    MAX_STAGE,
    MAX_STRINGS,
    MAX_WINDOW_MS,
    MAX_WINDOWS,
    NODE_WIDE,
    Key,
    _Reader,
    _varint,
)

__all__ = ["MAGIC_DOWN", "MAGIC_UP", "MAX_AGE_MS", "MAX_CLASSES", "MAX_MEMBERS", "Down", "Up",
           "decode", "up_digest"]

MAGIC_UP = 0xA1
MAGIC_DOWN = 0xA2
MAX_CLASSES = 64
MAX_MEMBERS = 10_000_000
MAX_TOTAL = (1 << 53) - 1
MAX_AGE_MS = 10 * MAX_WINDOW_MS
MAX_SEQ = (1 << 63) - 1
MAX_ARC = (1 << 72) - 1
MAX_KEY_CHARS = MAX_NAME
_I16x2 = struct.Struct("<hh")
_I16x3 = struct.Struct("<hhh")
_U64 = struct.Struct("<Q")


def _age(t0: float, end: float) -> int:
    """How long before ``t0`` a window ended, in ms (0 .. MAX_AGE_MS)."""
    return min(MAX_AGE_MS, max(0, round((t0 - end) * 1000)))


@dataclass(frozen=True, slots=True, eq=False)
class Up:
    """A partial sum for node ``dst`` (see the module doc)."""

    key: str
    src: int
    dst: int
    seq: int
    count: int
    parts: tuple[Part, ...] = ()
    census: Census | None = None
    inputs: tuple[tuple[str, int], ...] = ()
    """What it merged (sender, seq): for receipts and the simulator, not sent."""
    t0: float = 0.0
    """When it was made, on the clock of its parts' times."""
    _cache: list[bytes] = field(default_factory=list, repr=False, compare=False)
    _digest: list[int] = field(default_factory=list, repr=False, compare=False)

    def to_node(self, dst: int) -> Up:
        """The same message for another node (``dst`` is not in its digest)."""
        return Up(self.key, self.src, dst, self.seq, self.count, self.parts, self.census,
                  self.inputs, self.t0, [], self._digest)

    def encode(self) -> bytes:
        if not self._cache:
            self._cache.append(_encode(self))
        return self._cache[0]

    @property
    def wire(self) -> int:
        """Its encoded size (computed without encoding it: what the simulator counts)."""
        return len(self._cache[0]) if self._cache else _size(self)


@dataclass(frozen=True, slots=True, eq=False)
class Down:
    """The root's record (see the module doc)."""

    key: str
    epoch: int
    root: str
    ack: int
    next_sample_s: float
    count: int
    digest: int
    rows: tuple[RecordRow, ...] = ()
    census: Census | None = None
    t0: float = 0.0
    """When it was made (or passed on), on the clock of its rows' times."""
    _cache: list[bytes] = field(default_factory=list, repr=False, compare=False)

    def encode(self) -> bytes:
        if not self._cache:
            self._cache.append(_encode(self))
        return self._cache[0]

    @property
    def wire(self) -> int:
        return len(self._cache[0]) if self._cache else _size(self)

    def to(self, ack: int, digest: int, next_sample_s: float) -> Down:
        """The same record as the receipt of another recipient."""
        return Down(self.key, self.epoch, self.root, ack, next_sample_s, self.count, digest,
                    self.rows, self.census, self.t0)


@functools.lru_cache(maxsize=4096)
def _key_code(key: str, row: tuple[str | None, str, str]) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{row}".encode(), digest_size=8).digest(),
                          "little")


def up_digest(up: Up) -> int:
    """A partial's counts as a 64-bit digest (the receipt a parent returns: the
    sender checks it against what it sent).  Ages and sketch bins are not in
    it; the sketches' totals are."""
    if up._digest:
        return up._digest[0]
    vals = [up.count]
    for p in up.parts:
        vals += (_key_code(up.key, p.key), p.frames, p.misses, p.nodes, p.stale, p.sketched,
                 p.total, p.lo & 0xFFFF, p.hi & 0xFFFF)
    if up.census is not None:
        c = up.census
        vals += (c.members, c.reporting, c.sketched, _key_code(up.key, ("", "", str(c.classes))))
    raw = struct.pack(f"<{len(vals)}Q", *(v & 0xFFFFFFFFFFFFFFFF for v in vals))
    d = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    up._digest.append(d)
    return d


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------
def _str(s: str, out: bytearray) -> None:
    b = s.encode()
    if len(b) > 255:
        raise ValueError("string too long")
    out.append(len(b))
    out += b


def _census(c: Census | None, out: bytearray) -> None:
    if c is None:
        out.append(0)
        return
    out.append(1)
    for v in (c.members, c.reporting, c.sketched):
        _varint(v, out)
    out.append(len(c.classes))
    for name in c.classes:
        _str(name, out)


def _rows(rows: Sequence[Part] | Sequence[RecordRow], out: bytearray, up: bool,
          t0: float) -> None:
    names: dict[str, int] = {}
    for r in rows:
        for s in r.key:
            if s is not None and s not in names:
                names[s] = len(names)
    if len(names) > MAX_STRINGS or len(rows) > MAX_WINDOWS:
        raise ValueError("too many rows or names")
    out.append(len(names))
    for s in names:
        _str(s, out)
    out.append(len(rows))
    for r in rows:
        stage, cls, mod = r.key
        out += bytes((NODE_WIDE if stage is None else names[stage], names[cls], names[mod]))
        for v in (r.frames, r.misses, r.nodes, r.stale, r.sketched, r.window_ms):
            _varint(v, out)
        if r.nodes:
            _varint(_age(t0, r.newest), out)
            _varint(_age(t0, r.oldest), out)
        out += _I16x2.pack(r.lo, r.hi)
        if up:
            assert isinstance(r, Part)
            out += b"\x00" if r.sketch is None else _sketch_wire(r.sketch)
        else:
            assert isinstance(r, RecordRow)
            out += _I16x3.pack(*r.quantiles)
            _varint(r.sketch_frames, out)


def _vlen(v: int) -> int:
    return 1 if v < 0x80 else (v.bit_length() + 6) // 7


_WIDTH = {1: "B", 2: "H", 4: "I", 8: "d"}  # little-endian on the wire
_BIG = sys.byteorder == "big"
assert all(array(c).itemsize == w for w, c in _WIDTH.items())
_SK_HEAD = struct.Struct("<BhH")


def _width(sk: Sketch) -> tuple[int, array[float]]:
    counts = sk.counts()
    top = max(max(counts, default=0.0), sk.zero)
    if top < 256:
        w = 1
    elif top < 65536:
        w = 2
    elif top < 4294967296:
        w = 4
    else:
        return 8, counts
    if array("d", map(int, counts)) != counts or sk.zero != int(sk.zero):
        return 8, counts
    return w, counts


@functools.lru_cache(maxsize=8192)
def _sketch_wire(sk: Sketch) -> bytes:
    """A sketch's bytes in an :class:`Up` (a leaf's are sent every round: cached)."""
    w, counts = _width(sk)
    head = _SK_HEAD.pack(w, sk.offset, len(counts))
    if w == 8:
        raw = array("d", [sk.zero, *counts])
        if _BIG:
            raw.byteswap()
        return head + raw.tobytes()
    body = array(_WIDTH[w], [int(sk.zero)])
    body.extend(map(int, counts))
    if _BIG:
        body.byteswap()
    return head + body.tobytes()


@functools.lru_cache(maxsize=8192)
def _sketch_len(sk: Sketch) -> int:
    """``len(_sketch_wire(sk))`` without making them."""
    w, counts = _width(sk)
    return _SK_HEAD.size + w * (len(counts) + 1)


def _read_sketch(r: _Reader) -> Sketch | None:
    w = r.u8()
    if w == 0:
        return None
    if w not in _WIDTH:
        raise ValueError(f"sketch width {w}")
    offset, n = _OFF.unpack(r.take(_OFF.size))
    if n == 0 or n > KEY_SPAN or offset < -MAX_ABS_KEY or offset + n - 1 > MAX_ABS_KEY:
        raise ValueError(f"sketch bins {offset}..{offset + n - 1}: outside +-{MAX_ABS_KEY}")
    raw = array(_WIDTH[w])
    raw.frombytes(r.take(w * (n + 1)))
    if _BIG:
        raw.byteswap()
    values = array("d", raw) if w != 8 else raw
    zero = values[0]
    if not all(math.isfinite(c) and c >= 0 for c in values):
        raise ValueError("sketch counts not finite or negative")
    sk = Sketch.of_counts(offset, values[1:], zero)
    sk.check()  # total within MAX_COUNT, as parse_sketch checks a sidecar's
    return sk


_OFF = struct.Struct("<hH")


def _size(m: Up | Down) -> int:
    """The encoded size of ``m`` (``len(_encode(m))``, tested)."""
    key = len(m.key.encode())
    if isinstance(m, Up):
        size = 1 + _vlen(m.seq) + _vlen(m.src) + _vlen(m.dst) + _vlen(m.count) + 1 + key
        rows: Sequence[Part] | Sequence[RecordRow] = m.parts
    else:
        size = (1 + _vlen(m.epoch) + _vlen(m.ack)
                + _vlen(min(MAX_AGE_MS, max(0, round(m.next_sample_s * 1000))))
                + _vlen(m.count) + 8 + 1 + key + 1 + len(m.root.encode()))
        rows = m.rows
    c = m.census
    size += 1 if c is None else (2 + _vlen(c.members) + _vlen(c.reporting) + _vlen(c.sketched)
                                 + sum(1 + len(n.encode()) for n in c.classes))
    names: set[str] = set()
    size += 2
    for r in rows:
        for n in r.key:
            if n is not None and n not in names:
                names.add(n)
                size += 1 + len(n.encode())
        size += 3 + 4 + sum(_vlen(v) for v in (r.frames, r.misses, r.nodes, r.stale,
                                               r.sketched, r.window_ms))
        if r.nodes:
            size += _vlen(_age(m.t0, r.newest)) + _vlen(_age(m.t0, r.oldest))
        if isinstance(r, Part):
            size += 1 if r.sketch is None else _sketch_len(r.sketch)
        else:
            size += 6 + _vlen(r.sketch_frames)
    return size


def _encode(m: Up | Down) -> bytes:
    out = bytearray()
    if isinstance(m, Up):
        out.append(MAGIC_UP)
        for v in (m.seq, m.src, m.dst, m.count):
            _varint(v, out)
        _str(m.key, out)
        _census(m.census, out)
        _rows(m.parts, out, True, m.t0)
    else:
        out.append(MAGIC_DOWN)
        for v in (m.epoch, m.ack, min(MAX_AGE_MS, max(0, round(m.next_sample_s * 1000))),
                  m.count):
            _varint(v, out)
        out += _U64.pack(m.digest)
        _str(m.key, out)
        _str(m.root, out)
        _census(m.census, out)
        _rows(m.rows, out, False, m.t0)
    return bytes(out)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------
def _key_ok(k: int, what: str) -> int:
    if k in (NO_KEY, ZERO_KEY) or -MAX_ABS_KEY <= k <= MAX_ABS_KEY:
        return k
    raise ValueError(f"{what}: key {k} outside +-{MAX_ABS_KEY}")


def _text(r: _Reader, max_chars: int, what: str, empty: bool = False) -> str:
    n = r.u8()
    if n == 0:
        if empty:
            return ""
        raise ValueError(f"{what}: empty")
    s = r.take(n).decode("utf-8")
    if len(s) > max_chars:
        raise ValueError(f"{what}: longer than {max_chars} characters")
    return s


def _read_census(r: _Reader) -> Census | None:
    flag = r.u8()
    if flag == 0:
        return None
    if flag != 1:
        raise ValueError(f"census flag {flag}")
    members = r.varint(MAX_MEMBERS, "members")
    reporting = r.varint(members, "reporting")
    sketched = r.varint(reporting, "sketched")
    n = r.u8()
    if n > MAX_CLASSES:
        raise ValueError(f"{n} classes")
    classes = tuple(_text(r, MAX_NAME, "class") for _ in range(n))
    if list(classes) != sorted(set(classes)):
        raise ValueError("classes not sorted or repeated")
    return Census(members, reporting, sketched, classes)


def _read_rows(r: _Reader, up: bool, count: int, now: float) -> list[Part] | list[RecordRow]:
    names = [_text(r, MAX_STAGE, "name") for _ in range(r.u8())]
    if len(names) > MAX_STRINGS:
        raise ValueError(f"{len(names)} names")

    def name(i: int, limit: int, what: str) -> str:
        if i >= len(names) or len(names[i]) > limit:
            raise ValueError(f"{what}: string {i} of {len(names)} (or too long)")
        return names[i]

    out: list[Part | RecordRow] = []
    seen: set[Key] = set()
    for _ in range(r.u8()):
        s, c, m = r.take(3)
        key: Key = (None if s == NODE_WIDE else name(s, MAX_STAGE, "stage"),
                    name(c, MAX_NAME, "class"), name(m, MAX_NAME, "modality"))
        if key in seen:
            raise ValueError("a row twice")
        seen.add(key)
        frames = r.varint(MAX_TOTAL, "frames")
        misses = r.varint(frames, "misses")
        nodes = r.varint(count, "nodes")
        stale = r.varint(count - nodes, "stale")
        sketched = r.varint(nodes, "sketched")
        window_ms = r.varint(MAX_WINDOW_MS, "window_ms")
        newest, oldest = -math.inf, math.inf
        if nodes:
            a_new = r.varint(MAX_AGE_MS, "newest age")
            a_old = r.varint(MAX_AGE_MS, "oldest age")
            if a_old < a_new:
                raise ValueError("oldest window newer than the newest")
            newest, oldest = now - a_new / 1000, now - a_old / 1000
        lo, hi = (_key_ok(k, "p99 bound") for k in _I16x2.unpack(r.take(4)))
        if (lo == NO_KEY) != (hi == NO_KEY) or (lo != NO_KEY and lo > hi):
            raise ValueError(f"p99 bounds {lo}..{hi}")
        if up:
            sk = _read_sketch(r)
            if (sk is None) != (sketched == 0) or (sk is not None and not nodes):
                raise ValueError("a sketch without sketched members, or the reverse")
            out.append(Part(key, frames, misses, nodes, stale, sketched, sk, lo, hi, window_ms,
                            newest, oldest, 0 if sk is None else round(sk.count)))
        else:
            q = _I16x3.unpack(r.take(6))
            known = [_key_ok(k, "quantile") for k in q if k != NO_KEY]
            if known != sorted(known):
                raise ValueError(f"quantile keys {q} not in order")
            sk_frames = r.varint(frames, "sketch frames")
            out.append(RecordRow(key, frames, misses, nodes, stale, sketched, sk_frames,
                                 (q[0], q[1], q[2]), lo, hi, window_ms, newest, oldest))
    return out  # type: ignore[return-value]


def decode(data: bytes, now: float = 0.0, max_bytes: int = 1 << 20) -> Up | Down:
    """An :class:`Up` or :class:`Down` from bytes a peer sent (checked), its
    times on the reader's clock (``now``: when it came)."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than {max_bytes}")
    r = _Reader(bytes(data))
    magic = r.u8()
    if magic == MAGIC_UP:
        seq = r.varint(MAX_SEQ, "seq")
        src = r.varint(MAX_ARC, "src")
        dst = r.varint(MAX_ARC, "dst")
        count = r.varint(MAX_MEMBERS, "count")
        key = _text(r, MAX_KEY_CHARS, "tree", empty=True)
        census = _read_census(r)
        parts = _read_rows(r, True, count, now)
        if r.pos != r.end:
            raise ValueError(f"{r.end - r.pos} bytes after the last row")
        if census is not None and census.members != count:
            raise ValueError("a census of another count")
        return Up(key, src, dst, seq, count, tuple(parts), census, (),  # type: ignore[arg-type]
                  now)
    if magic == MAGIC_DOWN:
        epoch = r.varint(MAX_SEQ, "epoch")
        ack = r.varint(MAX_SEQ, "ack")
        next_ms = r.varint(MAX_AGE_MS, "next sample")
        count = r.varint(MAX_MEMBERS, "count")
        (digest,) = _U64.unpack(r.take(8))
        key = _text(r, MAX_KEY_CHARS, "tree", empty=True)
        root = _text(r, 253, "root")
        census = _read_census(r)
        rows = _read_rows(r, False, count, now)
        if r.pos != r.end:
            raise ValueError(f"{r.end - r.pos} bytes after the last row")
        return Down(key, epoch, root, ack, next_ms / 1000, count, digest,
                    tuple(rows), census, now)  # type: ignore[arg-type]
    raise ValueError(f"not an SLA tree message (0x{magic:02x})")


def sketch_size(sk: Sketch | None) -> int:
    """Bytes a sketch takes in an :class:`Up`."""
    return 1 if sk is None else _sketch_len(sk)
