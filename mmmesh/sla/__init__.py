"""SLA measurement shared by the sidecar, qosd's board and the global SLA view:
the report schema, the bounds, the mergeable sketch, and the rules every part
applies the same way (one merge, one quantile rule, one attainment).

Import everything from here; one module per role:

- ``report``: the report schema (pydantic), :class:`SlaReport` and the
  windows it carries, :class:`SlaView` (``GET /v1/sla``);
- ``sketch``: the canonical DDSketch (:class:`Sketch`, :func:`parse_sketch`
  for what came over a socket, the base64 codec), **the merge**
  (:class:`SketchSum`, bin by bin), **the quantile rule**
  (:func:`quantile_keys`, :func:`key_value`, :func:`summary`) and
  :func:`merge`, the windows of several sidecars merged;
- ``_attainment``: **the attainment**, frames within their deadline over
  frames, merged frame-weighted (:func:`attainment`,
  :func:`within_deadline`; its module doc says why not ``1 - misses /
  frames``);
- ``_limits``: every bound (counts, latencies, names, sketch keys, the
  largest value a sidecar puts into a sketch) and the checks that apply
  them (:func:`check_count`, :func:`check_positive` for a law's constants).

Who uses what: the sidecar measures (``sidecar/sla/windows.py``: counts,
live sketches, attainment) and reports with the schema; qosd's board
(``qosd/sla/board.py``) keeps the windows and merges them with :func:`merge`;
the global SLA view (``qosd/mesh/slaview/core``) merges the nodes' windows
with :class:`SketchSum`, the quantile rule and the attainment.
"""

from ._attainment import ATTAINMENT_DIGITS, attainment, within_deadline
from ._limits import (
    KEY_SPAN,
    MAX_ABS_KEY,
    MAX_COUNT,
    MAX_MS,
    MAX_NAME,
    MAX_REPORTS,
    MAX_SAMPLE_MS,
    MAX_SKETCH_B64,
    MAX_WINDOW_S,
    RELATIVE_ACCURACY,
    check_count,
    check_positive,
)
from .report import (
    Quantiles,
    SlaAccepted,
    SlaClassReport,
    SlaEntry,
    SlaMerged,
    SlaReport,
    SlaView,
    SlaWindow,
)
from .sketch import (
    NO_KEY,
    QUANTILES,
    ZERO_KEY,
    Sketch,
    SketchSum,
    check_sketch,
    decode_sketch,
    encode_sketch,
    key_value,
    merge,
    new_sketch,
    parse_sketch,
    quantile_keys,
    summary,
    validate_sketch,
    value_key,
)

__all__ = [
    "ATTAINMENT_DIGITS",
    "KEY_SPAN",
    "MAX_ABS_KEY",
    "MAX_COUNT",
    "MAX_MS",
    "MAX_NAME",
    "MAX_REPORTS",
    "MAX_SAMPLE_MS",
    "MAX_SKETCH_B64",
    "MAX_WINDOW_S",
    "NO_KEY",
    "QUANTILES",
    "RELATIVE_ACCURACY",
    "ZERO_KEY",
    "Quantiles",
    "Sketch",
    "SketchSum",
    "SlaAccepted",
    "SlaClassReport",
    "SlaEntry",
    "SlaMerged",
    "SlaReport",
    "SlaView",
    "SlaWindow",
    "attainment",
    "check_count",
    "check_positive",
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
    "within_deadline",
]
