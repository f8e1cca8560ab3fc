"""Mergeable SLA latency sketches, shared by the sidecar (which measures) and
qosd (which merges what the sidecars on its node report).

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
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddsketch import DDSketch
from ddsketch.ddsketch import BaseDDSketch

from mmmesh.sla.report import MAX_COUNT

_proto: Any  # ddsketch.pb.proto (untyped), or None
_pb: Any  # its generated protobuf module, or None
try:  # protobuf is optional for ddsketch
    from ddsketch.pb import proto as _proto

    _pb = _proto.pb
except Exception:  # noqa: BLE001 # pragma: no cover - depends on the environment
    _proto = _pb = None

__all__ = [
    "MAX_ABS_KEY",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "Sketch",
    "check_sketch",
    "decode_sketch",
    "encode_sketch",
    "merge",
    "new_sketch",
    "parse_sketch",
    "summary",
    "validate_sketch",
]

RELATIVE_ACCURACY = 0.01
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))

# Keys of the values a sidecar can report (1e-6 ms .. one hour: about -690 ..
# 755 at 1 % accuracy), with room to spare.  A store is dense between its
# lowest and highest key, so an unchecked far-apart pair of keys in a
# 40-byte message would allocate hundreds of MiB when decoded.
MAX_ABS_KEY = 2048
_GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_SPAN = 2 * MAX_ABS_KEY + 1  # every key a sketch may use


def new_sketch() -> DDSketch:
    return DDSketch(RELATIVE_ACCURACY)


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

    def check(self) -> None:
        """Raises ``ValueError`` unless this is a sketch :func:`parse_sketch`
        could have made (keys within +-MAX_ABS_KEY, counts finite, >= 0, at
        most MAX_COUNT in all): what a reader checks before merging it."""
        import numpy as np  # only where sketches are merged (import mmmesh stays light)

        if not isinstance(self.bins, bytes) or len(self.bins) % 8 or type(self.offset) is not int:
            raise ValueError("not a packed float64 bin array with an int offset")
        n = len(self.bins) // 8
        if n and not (-MAX_ABS_KEY <= self.offset and self.offset + n - 1 <= MAX_ABS_KEY):
            raise ValueError(f"bins {self.offset}..{self.offset + n - 1} outside "
                             f"+-{MAX_ABS_KEY}")
        counts = np.frombuffer(self.bins, dtype=np.float64)
        total = float(counts.sum()) + float(self.zero)
        if not (np.isfinite(counts).all() and (counts >= 0).all() and self.zero >= 0
                and total <= MAX_COUNT):
            raise ValueError(f"counts not finite, negative, or more than {MAX_COUNT} in all")

    def proto(self) -> Any:
        """The canonical protobuf message."""
        _need_pb()
        pos = _pb.Store()
        if self.bins:
            pos = _pb.Store(contiguousBinCounts=self.counts().tolist(),
                            contiguousBinIndexOffset=self.offset)
        return _pb.DDSketch(mapping=_proto.KeyMappingProto.to_proto(new_sketch()._mapping),
                            positiveValues=pos, negativeValues=_pb.Store(),
                            zeroCount=self.zero)

    def encode(self) -> str:
        """The canonical base64 protobuf (what ``sketch_e2e`` carries)."""
        raw = self.proto().SerializeToString(deterministic=True)
        return base64.b64encode(raw).decode("ascii")

    def to_ddsketch(self) -> BaseDDSketch:
        """A ddsketch object with these counts (for quantiles)."""
        sk: BaseDDSketch = _proto.DDSketchProto.from_proto(self.proto())
        return sk

    @classmethod
    def of_counts(cls, offset: int, counts: Sequence[float], zero: float) -> Sketch:
        """From dense ``counts`` (key ``offset + i``), trimmed to the non-zero bins."""
        nz = [i for i, c in enumerate(counts) if c]
        if not nz:
            return cls(0, b"", float(zero))
        lo, hi = nz[0], nz[-1]
        return cls(offset + lo, array("d", counts[lo:hi + 1]).tobytes(), float(zero))


def _need_pb() -> None:
    if _pb is None:  # pragma: no cover - depends on the environment
        raise RuntimeError("ddsketch protobuf support is not available")


# --------------------------------------------------------------------------
# Sketch (de)serialisation and summaries
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
    the message's size plus ``2 * MAX_ABS_KEY + 1`` counts."""
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
    zero = _count(msg.zeroCount, "zeroCount")
    if not entries:
        return Sketch(zero=zero)
    lo, hi = min(k for k, _ in entries), max(k for k, _ in entries)
    if lo < -MAX_ABS_KEY or hi > MAX_ABS_KEY:
        raise ValueError(f"bins {lo}..{hi} outside +-{MAX_ABS_KEY}")
    dense = [0.0] * (hi - lo + 1)  # at most _SPAN counts, whatever was sent
    for k, c in entries:
        dense[k - lo] += _count(c, "bin count")
    if zero + math.fsum(dense) > MAX_COUNT:
        raise ValueError(f"the sketch counts more than {MAX_COUNT} values")
    return Sketch.of_counts(lo, dense, zero)


def _count(c: float, what: str) -> float:
    if not (math.isfinite(c) and 0 <= c <= MAX_COUNT):
        raise ValueError(f"{what} {c!r}: must be finite, >= 0 and at most {MAX_COUNT}")
    return float(c)


def summary(sk: BaseDDSketch, max_ms: float | None = None) -> dict[str, float] | None:
    """{"p50","p90","p99","max"} in ms, None for an empty sketch."""
    if sk.count == 0:
        return None
    out = {name: round(float(sk.get_quantile_value(q) or 0.0), 4) for name, q in QUANTILES}
    if max_ms is None:
        mx = getattr(sk, "_max", -math.inf)
        max_ms = float(mx) if math.isfinite(mx) else float(sk.get_quantile_value(1.0) or 0.0)
    out["max"] = round(max_ms, 4)
    return out


# --------------------------------------------------------------------------
# Node-wide view
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

    Counts add up; attainment is frame-weighted; e2e quantiles come from the
    merged sketches (the e2e max is the largest reported max).  An entry's
    ``_sketch`` (a :class:`Sketch`, or None) is used instead of parsing its
    ``sketch_e2e``.  Entries without a sketch add to the counts but not to
    the quantiles.  queue/service quantiles cannot be merged from summaries
    and are left out.
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
    """One group's sums; sketches are added bin by bin into one dense array."""

    def __init__(self) -> None:
        self.sources = 0
        self.window_s = 0.0
        self.frames = self.misses = self.drops = self.errors = 0
        self.met = 0.0
        self.bins: Any = None  # numpy float64[_SPAN], key k at k + MAX_ABS_KEY
        self.zero = 0.0
        self.max_ms: float | None = None

    def add(self, e: Mapping[str, Any]) -> None:
        frames = int(e.get("frames", 0))
        sk = e["_sketch"] if "_sketch" in e else (
            parse_sketch(e["sketch_e2e"]) if e.get("sketch_e2e") else None)
        e2e = e.get("e2e_ms") or {}
        self.sources += 1
        self.window_s = max(self.window_s, float(e.get("window_s") or 0.0))
        self.frames += frames
        self.misses += int(e.get("deadline_misses", 0))
        self.drops += int(e.get("drops", 0))
        self.errors += int(e.get("errors", 0))
        self.met += float(e.get("attainment", 1.0)) * frames
        if sk is not None:
            self._add_sketch(sk)
        if e2e.get("max") is not None:
            self.max_ms = max(self.max_ms or 0.0, float(e2e["max"]))

    def _add_sketch(self, sk: Sketch) -> None:
        import numpy as np  # only where sketches are merged (import mmmesh stays light)

        if self.bins is None:
            self.bins = np.zeros(_SPAN)
        start = sk.offset + MAX_ABS_KEY
        counts = np.frombuffer(sk.bins, dtype=np.float64)
        self.bins[start:start + len(counts)] += counts
        self.zero += sk.zero

    def sketch(self) -> Sketch:
        if self.bins is None:
            return Sketch(zero=self.zero)
        return Sketch.of_counts(-MAX_ABS_KEY, self.bins.tolist(), self.zero)

    def result(self) -> dict[str, Any]:
        sk = self.sketch()
        res: dict[str, Any] = {
            "sources": self.sources,
            "window_s": self.window_s,
            "frames": self.frames,
            "deadline_misses": self.misses,
            "drops": self.drops,
            "errors": self.errors,
            "attainment": round(self.met / self.frames, 6) if self.frames else 1.0,
            "e2e_ms": summary(sk.to_ddsketch(), self.max_ms) if _pb is not None else None,
        }
        if _pb is not None:
            res["sketch_e2e"] = sk.encode()
        return res
