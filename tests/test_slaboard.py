"""qosd's SLA board: replicas kept apart, windows expire, the board is bounded."""

from __future__ import annotations

from typing import Any

from qosd.slaboard import SlaBoard


def body(stage: str, instance: str | None, frames: int, cls: str = "voice") -> dict[str, Any]:
    return {"node": None, "stage": stage, "instance": instance, "reports": [
        {"sla_class": cls, "modality": "audio", "window_s": 5.0, "frames": frames,
         "deadline_misses": frames // 10, "drops": 0, "errors": 0,
         "attainment": 0.9 if frames else 1.0, "e2e_ms": None}]}


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
