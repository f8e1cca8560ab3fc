"""Mergeable SLA latency sketches, shared by the sidecar (which measures) and
qosd (which merges what the sidecars on its node report, and what the nodes
of the mesh publish).

DDSketch (``ddsketch``, DataDog's reference implementation; 1 % relative
accuracy, values in milliseconds) because its sketches merge exactly: the
sketch of two sidecars' windows merged equals the sketch of all their samples,
so a node-wide p99 is a real p99, not an average of p99s.  On the wire a
sketch is the base64 of its protobuf (``sketch_e2e`` in ``POST /v1/sla``).

What comes over a socket is read with :func:`parse_sketch` only: it checks
every number (the mapping, keys within +-``MAX_ABS_KEY``, counts finite,
>= 0 and at most ``MAX_COUNT`` in all) and returns a :class:`Sketch`, the
canonical form qosd keeps: positive bins only, packed float64, trimmed to
the first and last non-zero bin.  Anything else the message carried (unknown
fields, an empty negative store, a non-canonical layout) is gone, so what is
kept is bounded by the bins, never by what was sent.  ``Sketch.encode()`` is
the canonical base64, the same bytes :func:`encode_sketch` writes for a
local sketch.

The rules, each written once here and used by the sidecar, qosd's board and
the global SLA view alike:

* **The merge** (:class:`SketchSum`): sketches add up bin by bin, into one
  dense array over every key a sketch may use.
* **The quantile rule** (:func:`quantile_keys`): ddsketch's own, on the keys:
  the rank of quantile ``q`` of ``n`` values is ``q x (n - 1)``; the value
  is that of the first bin whose running count exceeds the rank, 0 when the
  rank falls among the values too small for a bin.  A key stands for the
  value :func:`key_value` gives (ms, 4 places); :func:`summary` is a
  report's p50/p90/p99/max by that rule, for a canonical sketch and for a
  live ddsketch object alike.
* **Attainment** (``_attainment.py``): frames within their deadline over
  frames, merged frame-weighted (:func:`merge`).
"""

from __future__ import annotations

import base64
import bisect
import functools
import itertools
import math
import operator
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddsketch import DDSketch
from ddsketch.ddsketch import BaseDDSketch

from ._attainment import attainment, within_deadline
from ._limits import MAX_ABS_KEY, MAX_COUNT, RELATIVE_ACCURACY, check_count

_proto: Any  # ddsketch.pb.proto (untyped), or None
_pb: Any  # its generated protobuf module, or None
try:  # protobuf is optional for ddsketch
    from ddsketch.pb import proto as _proto

    _pb = _proto.pb
except Exception:  # noqa: BLE001 # pragma: no cover - depends on the environment
    _proto = _pb = None

__all__ = [
    "MAX_ABS_KEY",
    "NO_KEY",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "ZERO_KEY",
    "Sketch",
    "SketchSum",
    "check_sketch",
    "decode_sketch",
    "encode_sketch",
    "key_value",
    "merge",
    "new_sketch",
    "parse_sketch",
    "quantile_keys",
    "summary",
    "validate_sketch",
    "value_key",
]

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
"""The quantiles of a report's ``*_ms`` summaries (plus its max)."""
NO_KEY = -32768
"""No quantile: the sketch is empty (a key no bin has; the SLA view's i16 on the wire)."""
ZERO_KEY = -32767
"""The quantile falls among the values too small for a bin (below the lowest key): 0 ms."""

_GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)


def new_sketch() -> DDSketch:
    return DDSketch(RELATIVE_ACCURACY)


_MAPPING = new_sketch()._mapping  # the key <-> value mapping every sketch here uses


# --------------------------------------------------------------------------
# The canonical sketch
# --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sketch:
    """A checked sketch of latencies (ms >= 0) in canonical form.

    ``bins`` holds one float64 count (native byte order) per key from
    ``offset`` on; its first and last counts are non-zero (no bins: empty
    bytes, ``offset`` 0).  ``zero`` counts the values too small for a bin.
    Immutable and compact: 8 bytes per bin (:attr:`nbytes`)."""

    offset: int = 0
    bins: bytes = b""
    zero: float = 0.0

    def counts(self) -> array[float]:
        """The bin counts (a copy), ``counts()[i]`` for key ``offset + i``."""
        out = array("d")
        out.frombytes(self.bins)
        return out

    @property
    def count(self) -> float:
        return self.zero + math.fsum(self.counts())

    @property
    def nbytes(self) -> int:
        """The bytes its bins take (what a quota counts besides the encoded form)."""
        return len(self.bins)

    def quantile_keys(self, qs: Sequence[float]) -> tuple[int, ...]:
        """The keys of the quantiles ``qs`` (see :func:`quantile_keys`)."""
        return quantile_keys(self.offset, self.counts(), self.zero, qs)

    def check(self) -> None:
        """Raises ``ValueError`` unless this is a sketch :func:`parse_sketch`
        could have made (keys within +-MAX_ABS_KEY, counts finite, >= 0, at
        most MAX_COUNT in all): what a reader checks before merging it."""
        if not isinstance(self.bins, bytes) or len(self.bins) % 8 or type(self.offset) is not int:
            raise ValueError("not a packed float64 bin array with an int offset")
        n = len(self.bins) // 8
        if n and not (-MAX_ABS_KEY <= self.offset and self.offset + n - 1 <= MAX_ABS_KEY):
            raise ValueError(f"bins {self.offset}..{self.offset + n - 1} outside "
                             f"+-{MAX_ABS_KEY}")
        counts = self.counts()
        ok = all(math.isfinite(c) and c >= 0 for c in counts)
        if not (ok and math.isfinite(self.zero) and self.zero >= 0
                and math.fsum(counts) + self.zero <= MAX_COUNT):
            raise ValueError(f"counts not finite, negative, or more than {MAX_COUNT} in all")

    def proto(self) -> Any:
        """The canonical protobuf message."""
        _need_pb()
        pos = _pb.Store()
        if self.bins:
            pos = _pb.Store(contiguousBinCounts=self.counts().tolist(),
                            contiguousBinIndexOffset=self.offset)
        return _pb.DDSketch(mapping=_proto.KeyMappingProto.to_proto(_MAPPING),
                            positiveValues=pos, negativeValues=_pb.Store(),
                            zeroCount=self.zero)

    def encode(self) -> str:
        """The canonical base64 protobuf (what ``sketch_e2e`` carries)."""
        raw = self.proto().SerializeToString(deterministic=True)
        return base64.b64encode(raw).decode("ascii")

    def to_ddsketch(self) -> BaseDDSketch:
        """A ddsketch object with these counts."""
        sk: BaseDDSketch = _proto.DDSketchProto.from_proto(self.proto())
        return sk

    @classmethod
    def of_counts(cls, offset: int, counts: Sequence[float], zero: float) -> Sketch:
        """From dense ``counts`` (key ``offset + i``), trimmed to the non-zero bins."""
        n, lo = len(counts), 0
        while lo < n and not counts[lo]:
            lo += 1
        if lo == n:
            return cls(0, b"", float(zero))
        hi = n - 1
        while not counts[hi]:
            hi -= 1
        return cls(offset + lo, array("d", counts[lo:hi + 1]).tobytes(), float(zero))


def _need_pb() -> None:
    if _pb is None:  # pragma: no cover - depends on the environment
        raise RuntimeError("ddsketch protobuf support is not available")


# --------------------------------------------------------------------------
# The merge
# --------------------------------------------------------------------------
class SketchSum:
    """Canonical sketches added up bin by bin: the one merge of sketches.

    The sum of the sketches of several windows is the sketch of all their
    values (DDSketch merges exactly), so its quantiles are those of the
    union, never an average of quantiles.  While every count added is a
    whole number (a sidecar's always are), the bins are one Python integer of
    64-bit lanes, one lane per key from the lowest, so adding a sketch is one
    shift and one addition of integers (the global SLA view's aggregators add
    thousands a second); the first fractional count turns them into one
    float64 array over the keys (at most ``KEY_SPAN``).  Both give the same
    sums: whole counts below 2^53 add exactly either way.  Plain Python, no
    numpy: qosd merges with it, and numpy's BLAS would cost qosd ~20 MB and a
    system call (``mbind``) its hardened unit refuses."""

    __slots__ = ("_bins", "_int", "_lo", "_n", "zero")

    def __init__(self) -> None:
        self._int = 0  # whole counts: key self._lo + i in lane i (64 bits)
        self._n = 0  # lanes in use
        self._bins: array[float] | None = None  # fractional counts: key k at k - self._lo
        self._lo = 0
        self.zero = 0.0

    def add(self, sk: Sketch) -> None:
        n = len(sk.bins) // 8
        if n:
            packed = _packed(sk) if self._bins is None else None
            if packed is None:
                self._add_floats(sk)
            elif not self._n:
                self._int, self._lo, self._n = packed, sk.offset, n
            else:
                lo = min(self._lo, sk.offset)
                hi = max(self._lo + self._n, sk.offset + n)
                if lo < self._lo:
                    self._int <<= 64 * (self._lo - lo)
                    self._lo = lo
                self._int += packed << (64 * (sk.offset - self._lo))
                self._n = hi - lo
        self.zero += sk.zero

    def _add_floats(self, sk: Sketch) -> None:
        if self._bins is None:  # from now on fractional: the lanes become floats
            self._bins = self._counts()
        counts = sk.counts()
        if not self._bins:
            self._lo = sk.offset
        lo, hi = min(self._lo, sk.offset), max(self._lo + len(self._bins),
                                               sk.offset + len(counts))
        if lo < self._lo:
            self._bins = array("d", bytes(8 * (self._lo - lo))) + self._bins
            self._lo = lo
        if len(self._bins) < hi - lo:
            self._bins.extend(array("d", bytes(8 * (hi - lo - len(self._bins)))))
        bins, start, end = self._bins, sk.offset - self._lo, sk.offset - self._lo + len(counts)
        bins[start:end] = array("d", map(operator.add, bins[start:end], counts))

    def _counts(self) -> array[float]:
        """The bins from key ``self._lo`` on, as float64."""
        if self._bins is not None:
            return self._bins
        lanes = array("Q")
        lanes.frombytes(self._int.to_bytes(8 * self._n, "little"))
        if _BIG:
            lanes.byteswap()
        return array("d", lanes)

    @property
    def count(self) -> float:
        """The values in all the sketches added."""
        return self.zero + math.fsum(self._counts())

    def quantile_keys(self, qs: Sequence[float]) -> tuple[int, ...]:
        """The keys of the quantiles ``qs`` of everything added (see :func:`quantile_keys`)."""
        return quantile_keys(self._lo, self._counts(), self.zero, qs)

    def sketch(self) -> Sketch:
        """The sum as a canonical sketch."""
        return Sketch.of_counts(self._lo, self._counts(), self.zero)


_BIG = sys.byteorder == "big"


@functools.lru_cache(maxsize=8192)
def _packed(sk: Sketch) -> int | None:
    """A sketch's whole counts as 64-bit lanes of one integer (None: a
    fractional count, or one too large for a lane); a sketch added again and
    again (a node's window, every round) is packed once."""
    counts = sk.counts()
    try:
        lanes = array("Q", map(int, counts))
    except (OverflowError, ValueError):
        return None
    if array("d", lanes) != counts or max(counts, default=0.0) >= float(1 << 53):
        return None
    if _BIG:
        lanes.byteswap()
    return int.from_bytes(lanes.tobytes(), "little")


# --------------------------------------------------------------------------
# The quantile rule
# --------------------------------------------------------------------------
def quantile_keys(offset: int, counts: Sequence[float], zero: float,
                  qs: Sequence[float]) -> tuple[int, ...]:
    """The keys of the quantiles ``qs`` of a sketch, by ddsketch's rule: the
    rank of ``q`` is ``q x (count - 1)``; its key is that of the first bin
    whose running count exceeds the rank, ``ZERO_KEY`` when the rank falls
    among the ``zero`` values, ``NO_KEY`` for an empty sketch.  ``counts``
    are the bins from key ``offset`` on."""
    cum = list(itertools.accumulate(counts))
    total = zero + (cum[-1] if cum else 0.0)
    if total <= 0:
        return (NO_KEY,) * len(qs)
    out: list[int] = []
    for q in qs:
        rank = q * (total - 1)
        if rank < zero or not cum:
            out.append(ZERO_KEY)
            continue
        i = bisect.bisect_right(cum, rank - zero)
        out.append(offset + min(i, len(cum) - 1))
    return tuple(out)


def key_value(key: int, mapping: Any = None) -> float | None:
    """The latency (ms, 4 places) the quantile key ``key`` stands for, as
    ddsketch reports it: 0.0 for ``ZERO_KEY``, None for ``NO_KEY``.
    ``mapping``: a ddsketch object's own (default: the one of every sketch
    here, 1 % logarithmic)."""
    if key == NO_KEY:
        return None
    if key == ZERO_KEY:
        return 0.0
    return round(float((mapping or _MAPPING).value(key)), 4)


def value_key(ms: float | None) -> int:
    """The key of a latency given as a number (a window without a sketch):
    ``NO_KEY`` for none (or not a latency), ``ZERO_KEY`` below the lowest
    bin, else within +-MAX_ABS_KEY."""
    if ms is None or not math.isfinite(ms) or ms < 0:
        return NO_KEY
    if ms <= _MAPPING.min_possible:
        return ZERO_KEY
    return max(-MAX_ABS_KEY, min(MAX_ABS_KEY, int(_MAPPING.key(ms))))


def summary(sk: Sketch | BaseDDSketch, max_ms: float | None = None) -> dict[str, float] | None:
    """{"p50","p90","p99","max"} in ms (4 places), by the quantile rule; None
    for an empty sketch.  ``max`` is ``max_ms`` when given, else the exact
    maximum a live ddsketch object kept, else the value of quantile 1.  A
    ddsketch object is read with its own mapping; negative values (not
    latencies) raise ``ValueError``."""
    qs = (*(q for _, q in QUANTILES), 1.0)
    if isinstance(sk, Sketch):
        mapping, keys = None, sk.quantile_keys(qs)
    else:
        mapping, keys = sk._mapping, _canonical(sk).quantile_keys(qs)
    if keys[0] == NO_KEY:
        return None
    out = {name: key_value(k, mapping) or 0.0 for (name, _), k in zip(QUANTILES, keys)}
    if max_ms is None:
        mx = getattr(sk, "_max", -math.inf)
        max_ms = float(mx) if math.isfinite(mx) else key_value(keys[-1], mapping) or 0.0
    out["max"] = round(max_ms, 4)
    return out


def _canonical(sk: BaseDDSketch) -> Sketch:
    """A ddsketch object's counts as a :class:`Sketch` (not checked: a local
    sketch is trusted)."""
    if sk._negative_store.count:
        raise ValueError("negative values (latencies are >= 0)")
    st = sk._store
    if st.count == 0 or not st.bins:
        return Sketch(zero=float(sk._zero_count))
    lo, hi = st.min_key - st.offset, st.max_key - st.offset
    return Sketch.of_counts(st.min_key, st.bins[lo:hi + 1], float(sk._zero_count))


# --------------------------------------------------------------------------
# Sketch (de)serialisation
# --------------------------------------------------------------------------
def encode_sketch(sketch: BaseDDSketch) -> str | None:
    """Base64 of the DDSketch protobuf (bins trimmed to the used range), or
    None when ddsketch's protobuf support is not available.  For a sketch of
    values >= 0 this is the canonical form :func:`parse_sketch` gives back."""
    if _pb is None:
        return None

    def store(st: Any) -> Any:
        if st.count == 0 or not st.bins:
            return _pb.Store()
        lo, hi = st.min_key - st.offset, st.max_key - st.offset
        return _pb.Store(contiguousBinCounts=st.bins[lo:hi + 1],
                         contiguousBinIndexOffset=st.min_key)

    msg = _pb.DDSketch(
        mapping=_proto.KeyMappingProto.to_proto(sketch._mapping),
        positiveValues=store(sketch._store),
        negativeValues=store(sketch._negative_store),
        zeroCount=sketch._zero_count,
    )
    return base64.b64encode(msg.SerializeToString(deterministic=True)).decode("ascii")


def decode_sketch(data: str) -> BaseDDSketch:
    """The sketch from :func:`encode_sketch` (min/max/sum are not carried).
    Trusts its input: use :func:`parse_sketch` for what came over a socket."""
    _need_pb()
    msg = _pb.DDSketch()
    msg.ParseFromString(base64.b64decode(data, validate=True))
    sk: BaseDDSketch = _proto.DDSketchProto.from_proto(msg)
    return sk


def check_sketch(data: str) -> BaseDDSketch:
    """Decodes a sketch received from elsewhere, or raises ``ValueError``
    saying why it is refused (see :func:`parse_sketch`)."""
    return parse_sketch(data).to_ddsketch()


def validate_sketch(data: str) -> None:
    """Raises ``ValueError`` saying why a received sketch is refused (see
    :func:`parse_sketch`)."""
    parse_sketch(data)


def parse_sketch(data: str) -> Sketch:
    """The canonical :class:`Sketch` of a received base64 protobuf, or
    ``ValueError`` saying why it is refused: not base64 / not a DDSketch
    protobuf, another relative accuracy or key mapping (it could not be
    merged), negative values (times are >= 0), bins outside +-MAX_ABS_KEY,
    negative, non-finite or too large counts (all of them together at most
    MAX_COUNT).  Unknown fields are dropped.  It never allocates more than
    the message's size plus ``KEY_SPAN`` counts."""
    _need_pb()
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not base64: {e}") from None
    msg = _pb.DDSketch()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ValueError(f"not a DDSketch protobuf: {e}") from None
    m = msg.mapping
    if not abs(m.gamma - _GAMMA) <= 1e-9 or m.indexOffset != 0 or m.interpolation != 0:
        raise ValueError(f"key mapping gamma={m.gamma:.6g} offset={m.indexOffset} "
                         f"interpolation={m.interpolation}: expected the logarithmic mapping "
                         f"of {RELATIVE_ACCURACY:.0%} relative accuracy (gamma {_GAMMA:.6g})")
    neg = msg.negativeValues
    if any(c != 0 for c in (*neg.contiguousBinCounts, *neg.binCounts.values())):
        raise ValueError("negative values (latencies are >= 0)")
    pos = msg.positiveValues
    entries = [*pos.binCounts.items(),
               *enumerate(pos.contiguousBinCounts, start=pos.contiguousBinIndexOffset)]
    zero = check_count(msg.zeroCount, "zeroCount")
    if not entries:
        return Sketch(zero=zero)
    lo, hi = min(k for k, _ in entries), max(k for k, _ in entries)
    if lo < -MAX_ABS_KEY or hi > MAX_ABS_KEY:
        raise ValueError(f"bins {lo}..{hi} outside +-{MAX_ABS_KEY}")
    dense = [0.0] * (hi - lo + 1)  # at most KEY_SPAN counts, whatever was sent
    for k, c in entries:
        dense[k - lo] += check_count(c, "bin count")
    if zero + math.fsum(dense) > MAX_COUNT:
        raise ValueError(f"the sketch counts more than {MAX_COUNT} values")
    return Sketch.of_counts(lo, dense, zero)


# --------------------------------------------------------------------------
# Windows merged: the node-wide view
# --------------------------------------------------------------------------
def _entries(reports: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    for r in reports:
        if "reports" in r:  # a whole POST body
            for e in r["reports"]:
                yield {"stage": r.get("stage"), "node": r.get("node"), **e}
        else:
            yield dict(r)


def merge(reports: Iterable[Mapping[str, Any]],
          by: Sequence[str] = ("sla_class", "modality")) -> dict[str, Any]:
    """Merges SLA reports from several sidecars (POST /v1/sla bodies or their
    "reports" entries) into a summary grouped by ``by`` (any of "stage",
    "node", "sla_class", "modality")::

        {"groups": [{<by fields>, "sources": n, "window_s": max, "frames", "deadline_misses",
                     "drops", "errors", "attainment", "e2e_ms": {...} | null,
                     "sketch_e2e": str}, ...],
         "total": {same without the by fields}}

    Counts add up; attainment is the frames within their deadline over the
    frames (frame-weighted, ``_attainment.py``); e2e quantiles come from the
    merged sketches (:class:`SketchSum`; the e2e max is the largest reported
    max).  An entry's ``_sketch`` (a :class:`Sketch`, or None) is used
    instead of parsing its ``sketch_e2e``.  Entries without a sketch add to
    the counts but not to the quantiles.  queue/service quantiles cannot be
    merged from summaries and are left out.
    """
    by = tuple(by)
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    total = _Acc()
    for e in _entries(reports):
        gk = tuple(e.get(f) for f in by)
        acc = groups.get(gk)
        if acc is None:
            acc = groups[gk] = {"fields": dict(zip(by, gk, strict=True)), "acc": _Acc()}
        acc["acc"].add(e)
        total.add(e)
    out = []
    for gk in sorted(groups, key=lambda k: tuple("" if v is None else str(v) for v in k)):
        g = groups[gk]
        out.append({**g["fields"], **g["acc"].result()})
    return {"groups": out, "total": total.result()}


class _Acc:
    """One group's sums."""

    def __init__(self) -> None:
        self.sources = 0
        self.window_s = 0.0
        self.frames = self.misses = self.drops = self.errors = 0
        self.within = 0.0  # frames within their deadline
        self.sketches = SketchSum()
        self.max_ms: float | None = None

    def add(self, e: Mapping[str, Any]) -> None:
        frames, misses = int(e.get("frames", 0)), int(e.get("deadline_misses", 0))
        sk = e["_sketch"] if "_sketch" in e else (
            parse_sketch(e["sketch_e2e"]) if e.get("sketch_e2e") else None)
        e2e = e.get("e2e_ms") or {}
        self.sources += 1
        self.window_s = max(self.window_s, float(e.get("window_s") or 0.0))
        self.frames += frames
        self.misses += misses
        self.drops += int(e.get("drops", 0))
        self.errors += int(e.get("errors", 0))
        self.within += within_deadline(frames, e.get("attainment"), misses)
        if sk is not None:
            self.sketches.add(sk)
        if e2e.get("max") is not None:
            self.max_ms = max(self.max_ms or 0.0, float(e2e["max"]))

    def result(self) -> dict[str, Any]:
        sk = self.sketches.sketch()
        res: dict[str, Any] = {
            "sources": self.sources,
            "window_s": self.window_s,
            "frames": self.frames,
            "deadline_misses": self.misses,
            "drops": self.drops,
            "errors": self.errors,
            "attainment": attainment(self.frames, self.within),
            "e2e_ms": summary(sk, self.max_ms) if _pb is not None else None,
        }
        if _pb is not None:
            res["sketch_e2e"] = sk.encode()
        return res
