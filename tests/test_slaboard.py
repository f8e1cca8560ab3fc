"""qosd's SLA board: replicas kept apart, windows expire, the board is bounded."""

from __future__ import annotations

from typing import Any

from mmmesh.slareport import SlaClassReport, SlaReport
from qosd.slaboard import SlaBoard


def raw(stage: str, instance: str | None, frames: int, cls: str = "voice") -> dict[str, Any]:
    return {"node": None, "stage": stage, "instance": instance, "reports": [
        {"sla_class": cls, "modality": "audio", "window_s": 5.0, "frames": frames,
         "deadline_misses": frames // 10, "drops": 0, "errors": 0,
         "attainment": 0.9 if frames else 1.0, "e2e_ms": None}]}


def body(stage: str, instance: str | None, frames: int, cls: str = "voice") -> SlaReport:
    return SlaReport.model_validate(raw(stage, instance, frames, cls))


def unchecked(d: dict[str, Any]) -> SlaReport:
    """A report as a model without validation (what the API would refuse)."""
    return SlaReport.model_construct(**{**d, "reports": [
        SlaClassReport.model_construct(**r) for r in d["reports"]]})


def test_replicas_are_kept_apart_and_merged() -> None:
    b = SlaBoard()
    b.report(body("asr", "asr-1", 100), now=10.0)
    b.report(body("asr", "asr-2", 300), now=11.0)
    b.report(body("asr", "asr-1", 200), now=12.0)  # asr-1's newer window replaces its old one
    b.report(body("asr", None, 50), now=12.0)  # a sidecar that names no instance
    v = b.view(now=13.0)
    assert [(r["instance"], r["frames"]) for r in v["instances"]] == [
        (None, 50), ("asr-1", 200), ("asr-2", 300)]
    (stage,) = v["stages"]
    assert stage["sources"] == 3 and stage["frames"] == 550
    assert stage["deadline_misses"] == 20 + 30 + 5 and stage["received_at"] == 12.0
    assert abs(stage["attainment"] - 0.9) < 1e-9


def test_old_windows_expire() -> None:
    b = SlaBoard(keep_s=60)
    b.report(body("asr", "a", 10), now=0.0)
    b.report(body("tts", "b", 10), now=50.0)
    assert [r["stage"] for r in b.instances(now=61.0)] == ["tts"]
    assert b.view(now=200.0) == {"instances": [], "stages": [], "classes": []}


def test_the_board_is_bounded_oldest_first() -> None:
    b = SlaBoard(max_rows=3)
    for i in range(5):
        b.report(body("s", f"i{i}", 10), now=float(i))
    b.report(body("s", "i2", 20), now=9.0)  # refreshed: now the newest
    b.report(body("s", "i5", 10), now=10.0)
    assert sorted(r["instance"] for r in b.instances(now=11.0)) == ["i2", "i4", "i5"]
    assert b.evicted == 3  # i0, i1, then i3 (i2 had been refreshed)


def _sketch_b64(*values: float, accuracy: float = 0.01) -> str:
    from ddsketch import DDSketch

    from mmmesh.slasketch import encode_sketch

    sk = DDSketch(accuracy)
    for v in values:
        sk.add(v)
    enc = encode_sketch(sk)
    assert enc is not None
    return enc


def _far_apart_bins() -> str:
    import base64

    from ddsketch.pb.proto import KeyMappingProto

    from mmmesh.slasketch import _pb, new_sketch

    msg = _pb.DDSketch(mapping=KeyMappingProto.to_proto(new_sketch()._mapping))
    msg.positiveValues.binCounts[-100_000] = 1
    msg.positiveValues.binCounts[100_000] = 1
    return base64.b64encode(msg.SerializeToString()).decode()


BAD_SKETCHES = {
    "not base64": "not*base64!",
    "another accuracy": _sketch_b64(5.0, accuracy=0.05),
    "negative values": _sketch_b64(-5.0, 3.0),
    "bins far apart": _far_apart_bins(),
}


def test_hostile_sketches_are_refused_and_never_break_the_view() -> None:
    """The report socket is open to every pod: a sketch that cannot be merged,
    or would allocate a huge store when decoded, is refused (the API answers
    422 naming the field) and the board's views keep working."""
    from pydantic import ValidationError

    from mmmesh.slasketch import check_sketch
    good = raw("asr", "a", 100)
    good["reports"][0]["sketch_e2e"] = _sketch_b64(*[float(v) for v in range(1, 101)])
    check_sketch(good["reports"][0]["sketch_e2e"])
    b = SlaBoard()
    b.report(SlaReport.model_validate(good), now=0.0)
    for why, sk in BAD_SKETCHES.items():
        bad = raw("asr", f"evil-{why}", 10)
        bad["reports"][0]["sketch_e2e"] = sk
        try:
            SlaReport.model_validate(bad)
        except ValidationError as e:
            assert "sketch_e2e" in str(e), why
        else:
            raise AssertionError(f"{why}: accepted")
        b.report(unchecked(bad), now=1.0)  # straight to the board: kept out of the merge
    assert b.bad_sketches == len(BAD_SKETCHES)
    (stage,) = b.view(now=2.0)["stages"]
    assert stage["sources"] == 1 + len(BAD_SKETCHES) and stage["e2e_ms"] is not None
    assert 98 <= stage["e2e_ms"]["p99"] <= 101  # from the good sketch only


def test_a_sidecar_that_stopped_reporting_is_listed_but_not_merged() -> None:
    b = SlaBoard()
    old = body("asr", "asr-old", 100)  # restarted: a new pid, a new instance name
    b.report(old, now=0.0)
    b.report(body("asr", "asr-new", 50), now=100.0)
    v = b.view(now=101.0)
    assert [(r["instance"], r["stale"]) for r in v["instances"]] == [
        ("asr-new", False), ("asr-old", True)]
    (stage,) = v["stages"]
    assert stage["sources"] == 1 and stage["frames"] == 50
