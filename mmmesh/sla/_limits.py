"""The bounds of everything SLA, in one place: what a report may say
(``report.py``), what a sketch may hold (``sketch.py``), what a sidecar puts
in one (``sidecar/sla/windows.py``), and the checks that apply them.  A leaf:
it imports nothing of the package, so the schema and the sketch both build on
it."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import fields
from typing import Any

__all__ = [
    "KEY_SPAN",
    "MAX_ABS_KEY",
    "MAX_COUNT",
    "MAX_MS",
    "MAX_NAME",
    "MAX_REPORTS",
    "MAX_SAMPLE_MS",
    "MAX_SKETCH_B64",
    "MAX_WINDOW_S",
    "RELATIVE_ACCURACY",
    "check_count",
    "check_positive",
]

# -- a report ------------------------------------------------------------------
MAX_COUNT = 10**12  # frames in one window: far above any real rate, exact as a float
MAX_MS = 86_400_000.0  # a latency of a day is not a measurement
MAX_WINDOW_S = 86_400.0
MAX_NAME = 64
MAX_REPORTS = 256  # (class, modality) windows in one report
# Room for every bin of +-MAX_ABS_KEY in either protobuf layout (packed: ~44 KiB
# of base64; one map entry per bin: ~77 KiB).
MAX_SKETCH_B64 = 128 * 1024

# -- a sketch ------------------------------------------------------------------
RELATIVE_ACCURACY = 0.01  # DDSketch's logarithmic mapping: 1 % relative accuracy
# The largest value a sidecar puts into a sketch (ms; larger ones are clamped to
# it, sidecar/sla/windows.py).  With values of whole nanoseconds (1e-6 ms) up to
# it, the keys stay within about -690 .. 755 at 1 % accuracy:
MAX_SAMPLE_MS = 3_600_000.0
# Keys a received sketch may use, with room to spare over those.  A store is
# dense between its lowest and highest key, so an unchecked far-apart pair of
# keys in a 40-byte message would allocate hundreds of MiB when decoded.
MAX_ABS_KEY = 2048
KEY_SPAN = 2 * MAX_ABS_KEY + 1  # every key a sketch may use


def check_count(c: float, what: str) -> float:
    """``c`` as a float when it is a count a window may hold (finite, >= 0, at
    most ``MAX_COUNT``), else ``ValueError`` naming ``what``."""
    if not (math.isfinite(c) and 0 <= c <= MAX_COUNT):
        raise ValueError(f"{what} {c!r}: must be finite, >= 0 and at most {MAX_COUNT}")
    return float(c)


def check_positive(obj: Any, prefix: str, *, error: type[Exception] = ValueError,
                   skip: Collection[str] = ()) -> None:
    """Every dataclass field of ``obj`` but ``skip`` is a finite number > 0,
    else ``error`` naming the first that is not (``<prefix>.<field>``): the
    check of a law's constants (the SLA controller's ``Law`` and
    ``ReplicaLaw``, the global SLA view's ``SlaViewConfig``)."""
    for f in fields(obj):
        if f.name in skip:
            continue
        v = getattr(obj, f.name)
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise error(f"{prefix}.{f.name} must be a finite number > 0 (got {v!r})")
