"""mmmesh.sla's public face, and its rules written once: the merge (bin by
bin), the quantile rule (ddsketch's), the attainment (frames within their
deadline over frames, merged frame-weighted), and the bounds."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from mmmesh import sla
from mmmesh.sla import _attainment, _limits, report, sketch

PUBLIC = [
    "ATTAINMENT_DIGITS", "KEY_SPAN", "MAX_ABS_KEY", "MAX_COUNT", "MAX_MS", "MAX_NAME",
    "MAX_REPORTS", "MAX_SAMPLE_MS", "MAX_SKETCH_B64", "MAX_WINDOW_S", "NO_KEY", "QUANTILES",
    "RELATIVE_ACCURACY", "ZERO_KEY", "Quantiles", "Sketch", "SketchSum", "SlaAccepted",
    "SlaClassReport", "SlaEntry", "SlaMerged", "SlaReport", "SlaView", "SlaWindow",
    "attainment", "check_count", "check_positive", "check_sketch", "decode_sketch",
    "encode_sketch", "key_value", "merge", "new_sketch", "parse_sketch", "quantile_keys",
    "summary", "validate_sketch", "value_key", "within_deadline",
]  # fmt: skip


def home(name: str) -> object:
    """The role module that defines ``name`` (the bounds are the limits' own)."""
    for mod in (_attainment, _limits):
        if name in mod.__all__:
            return mod
    return report if name in (*report.__all__, "SlaAccepted") else sketch


def test_the_face_exports_each_name_from_its_role_module() -> None:
    assert sla.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(sla, name) is getattr(home(name), name), name
    # the schema's and the sketch's bounds are the limits' own, not copies
    for name in ("MAX_COUNT", "MAX_MS", "MAX_NAME", "MAX_WINDOW_S"):
        assert getattr(report, name) is getattr(_limits, name)
    assert sketch.MAX_ABS_KEY is _limits.MAX_ABS_KEY


def samples(rng: random.Random, n: int) -> list[float]:
    return [0.0 if rng.random() < 0.03 else min(rng.lognormvariate(rng.uniform(-2, 7), 1.5),
                                                 sla.MAX_SAMPLE_MS) for _ in range(n)]


def test_the_quantile_rule_is_ddsketchs_and_the_merge_that_of_the_union() -> None:
    rng = random.Random(11)
    for _ in range(60):
        parts = [samples(rng, rng.choice([1, 3, 50, 400])) for _ in range(rng.randint(1, 4))]
        union = sla.new_sketch()
        total = sla.SketchSum()
        for values in parts:
            sk = sla.new_sketch()
            for v in values:
                sk.add(v)
                union.add(v)
            total.add(sla.parse_sketch(sla.encode_sketch(sk) or ""))
        assert total.count == union.count
        qs = (0.0, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0)
        for q, key in zip(qs, total.quantile_keys(qs), strict=True):
            want = union.get_quantile_value(q)
            assert sla.key_value(key) == round(float(want), 4), (q, key, want)
        # a live sketch, a decoded one and the canonical sum summarise alike
        merged = total.sketch()
        assert sla.summary(merged, 1.0) == sla.summary(union, 1.0)
        assert sla.summary(merged, 1.0) == sla.summary(sla.decode_sketch(merged.encode()), 1.0)
    assert sla.SketchSum().quantile_keys((0.5,)) == (sla.NO_KEY,)
    assert sla.summary(sla.new_sketch()) is None
    zero = sla.new_sketch()
    zero.add(0.0)
    assert sla.quantile_keys(0, [], 1.0, (0.5,)) == (sla.ZERO_KEY,)
    assert sla.summary(zero) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}


def test_attainment_is_frames_within_their_deadline_over_frames() -> None:
    assert sla.attainment(0, 0) == 1.0
    assert sla.attainment(3, 2) == round(2 / 3, 6)
    assert sla.attainment(3, 2, digits=None) == 2 / 3
    # merged: the frames within their deadline add up (frame-weighted)
    within = sla.within_deadline(100, 0.9) + sla.within_deadline(300, 0.5)
    assert sla.attainment(400, within) == pytest.approx((90 + 150) / 400)
    # a window that states none is taken at its counts
    assert sla.within_deadline(10, None, misses=3) == 7
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError):
            sla.within_deadline(10, bad)


def test_a_dropped_frame_counts_against_attainment_in_every_merge() -> None:
    """The disagreement this package ended: 100 frames, 5 late, 5 dropped on
    time (overload): 90 within their deadline, although 1 - misses / frames
    would say 95."""
    entry = {"sla_class": "voice", "modality": "audio", "frames": 100, "deadline_misses": 5,
             "drops": 5, "errors": 0, "attainment": 0.9}
    g = sla.merge([entry, {**entry, "frames": 300, "deadline_misses": 0, "drops": 0,
                           "attainment": 1.0}])["total"]
    assert (g["frames"], g["deadline_misses"], g["drops"]) == (400, 5, 5)
    assert g["attainment"] == pytest.approx(390 / 400)


def test_one_check_for_a_laws_constants() -> None:
    @dataclasses.dataclass
    class Law:
        a: float = 1.0
        b: int = 2
        nested: object = None

    sla.check_positive(Law(), "law", skip=("nested",))
    for bad in (0, -1, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match=r"law\.a must be a finite number > 0"):
            sla.check_positive(Law(a=bad), "law", skip=("nested",))  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        sla.check_positive(Law(b=0), "x", error=KeyError, skip=("nested",))
    assert sla.check_count(5, "n") == 5.0
    for bad_count in (-1, math.nan, math.inf, sla.MAX_COUNT + 1):
        with pytest.raises(ValueError, match="must be finite"):
            sla.check_count(bad_count, "n")
