"""Mergeable SLA latency sketches, shared by the sidecar (which measures) and
qosd (which merges what the sidecars on its node report).

DDSketch (``ddsketch``, DataDog's reference implementation; 1 % relative
accuracy, values in milliseconds) because its sketches merge exactly: the
sketch of two sidecars' windows merged equals the sketch of all their samples,
so a node-wide p99 is a real p99, not an average of p99s.  On the wire a
sketch is the base64 of its protobuf (``sketch_e2e`` in ``POST /v1/sla``).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ddsketch import DDSketch
from ddsketch.ddsketch import BaseDDSketch

try:  # protobuf is optional for ddsketch
    from ddsketch.pb.proto import DDSketchProto, KeyMappingProto
    from ddsketch.pb.proto import pb as _pb
except Exception:  # noqa: BLE001 # pragma: no cover - depends on the environment
    DDSketchProto = KeyMappingProto = _pb = None

__all__ = [
    "MAX_ABS_KEY",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "check_sketch",
    "decode_sketch",
    "encode_sketch",
    "merge",
    "new_sketch",
    "summary",
    "validate_sketch",
]

RELATIVE_ACCURACY = 0.01
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def new_sketch() -> DDSketch:
    return DDSketch(RELATIVE_ACCURACY)


# --------------------------------------------------------------------------
# Sketch (de)serialisation and summaries
# --------------------------------------------------------------------------
def encode_sketch(sketch: BaseDDSketch) -> str | None:
    """Base64 of the DDSketch protobuf (bins trimmed to the used range), or
    None when ddsketch's protobuf support is not available."""
    if _pb is None:
        return None

    def store(st: Any) -> Any:
        if st.count == 0 or not st.bins:
            return _pb.Store()
        lo, hi = st.min_key - st.offset, st.max_key - st.offset
        return _pb.Store(contiguousBinCounts=st.bins[lo:hi + 1],
                         contiguousBinIndexOffset=st.min_key)

    msg = _pb.DDSketch(
        mapping=KeyMappingProto.to_proto(sketch._mapping),
        positiveValues=store(sketch._store),
        negativeValues=store(sketch._negative_store),
        zeroCount=sketch._zero_count,
    )
    return base64.b64encode(msg.SerializeToString()).decode("ascii")


def decode_sketch(data: str) -> BaseDDSketch:
    """The sketch from :func:`encode_sketch` (min/max/sum are not carried).
    Trusts its input: use :func:`check_sketch` for what came over a socket."""
    if _pb is None:  # pragma: no cover
        raise RuntimeError("ddsketch protobuf support is not available")
    msg = _pb.DDSketch()
    msg.ParseFromString(base64.b64decode(data, validate=True))
    return DDSketchProto.from_proto(msg)


# Keys of the values a sidecar can report (1e-6 ms .. one hour: about -690 ..
# 755 at 1 % accuracy), with room to spare.  A store is dense between its
# lowest and highest key, so an unchecked far-apart pair of keys in a
# 40-byte message would allocate hundreds of MiB when decoded.
MAX_ABS_KEY = 2048
_GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)


def check_sketch(data: str) -> BaseDDSketch:
    """Decodes a sketch received from elsewhere, or raises ``ValueError``
    saying why it is refused (see :func:`validate_sketch`)."""
    return DDSketchProto.from_proto(_checked_proto(data))


def validate_sketch(data: str) -> None:
    """Raises ``ValueError`` saying why a received sketch is refused: not
    base64 / not a DDSketch protobuf, another relative accuracy or key
    mapping (it could not be merged), negative values (times are >= 0), bins
    outside +-MAX_ABS_KEY, negative or non-finite counts.  Checks the message
    only; it does not build the sketch."""
    _checked_proto(data)


def _checked_proto(data: str) -> Any:
    if _pb is None:  # pragma: no cover
        raise RuntimeError("ddsketch protobuf support is not available")
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
    if abs(m.gamma - _GAMMA) > 1e-9 or m.indexOffset != 0 or m.interpolation != 0:
        raise ValueError(f"key mapping gamma={m.gamma:.6g} offset={m.indexOffset} "
                         f"interpolation={m.interpolation}: expected the logarithmic mapping "
                         f"of {RELATIVE_ACCURACY:.0%} relative accuracy (gamma {_GAMMA:.6g})")
    neg = msg.negativeValues
    if any(neg.contiguousBinCounts) or any(neg.binCounts.values()):
        raise ValueError("negative values (latencies are >= 0)")
    pos = msg.positiveValues
    keys = list(pos.binCounts.keys())
    if pos.contiguousBinCounts:
        keys += [pos.contiguousBinIndexOffset,
                 pos.contiguousBinIndexOffset + len(pos.contiguousBinCounts) - 1]
    if keys and (min(keys) < -MAX_ABS_KEY or max(keys) > MAX_ABS_KEY):
        raise ValueError(f"bins {min(keys)}..{max(keys)} outside +-{MAX_ABS_KEY}")
    counts = [*pos.contiguousBinCounts, *pos.binCounts.values(), msg.zeroCount]
    if any(not math.isfinite(c) or c < 0 for c in counts):
        raise ValueError("negative or non-finite bin counts")
    return msg


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
    ``_sketch`` (already decoded, or None) is used instead of decoding its
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
    def __init__(self) -> None:
        self.sources = 0
        self.window_s = 0.0
        self.frames = self.misses = self.drops = self.errors = 0
        self.met = 0.0
        self.sketch = new_sketch()
        self.max_ms: float | None = None

    def add(self, e: Mapping[str, Any]) -> None:
        frames = int(e.get("frames", 0))
        self.sources += 1
        self.window_s = max(self.window_s, float(e.get("window_s") or 0.0))
        self.frames += frames
        self.misses += int(e.get("deadline_misses", 0))
        self.drops += int(e.get("drops", 0))
        self.errors += int(e.get("errors", 0))
        self.met += float(e.get("attainment", 1.0)) * frames
        if "_sketch" in e:  # decoded (and checked) by the caller already
            if e["_sketch"] is not None:
                self.sketch.merge(e["_sketch"])
        elif e.get("sketch_e2e"):
            self.sketch.merge(decode_sketch(e["sketch_e2e"]))
        e2e = e.get("e2e_ms") or {}
        if e2e.get("max") is not None:
            self.max_ms = max(self.max_ms or 0.0, float(e2e["max"]))

    def result(self) -> dict[str, Any]:
        e2e = summary(self.sketch, self.max_ms)
        res: dict[str, Any] = {
            "sources": self.sources,
            "window_s": self.window_s,
            "frames": self.frames,
            "deadline_misses": self.misses,
            "drops": self.drops,
            "errors": self.errors,
            "attainment": round(self.met / self.frames, 6) if self.frames else 1.0,
            "e2e_ms": e2e,
        }
        enc = encode_sketch(self.sketch)
        if enc is not None:
            res["sketch_e2e"] = enc
        return res
