"""When a sidecar's SLA window closes (issue 20): on the wall clock's multiples
of the report interval, so that every sidecar of a mesh closes the same
window at the same moment and qosd's controller, woken by it, judges them
together; the first window at least one interval long; a sidecar that fell
behind skips to the next multiple (no burst).  On a fake clock: nothing here
depends on how fast the host is."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import SidecarConfig
from sidecar.sla import SlaRecorder, next_close


def test_windows_close_on_the_multiples_of_the_interval() -> None:
    assert next_close(1001.3, 4.0) == 1004.0
    assert next_close(1004.0, 4.0) == 1008.0  # at a close: the next one
    assert next_close(1003.999, 4.0) == 1004.0
    assert next_close(1001.3, 0.5) == 1001.5
    # two sidecars started apart close their windows together
    assert next_close(1000.2, 4.0) == next_close(1003.7, 4.0)


def test_the_first_window_is_at_least_one_interval_long() -> None:
    for start in (1000.0, 1000.1, 1003.9):
        first = next_close(start, 4.0, first=True)
        assert 4.0 < first - start <= 8.0 and first % 4.0 == 0.0
    # an hour's window (the pipeline demo's one report a phase) is never cut short
    assert next_close(3599.0, 3600.0, first=True) == 7200.0


def test_a_late_sidecar_skips_to_the_next_close() -> None:
    # closed 9.5 s after a close due at 1004 (a busy host): the next at 1016, not 1008
    assert next_close(1013.5, 4.0) == 1016.0


class _Clock:
    """time.time() for the reporter, moved by the test."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_reporter_closes_on_the_grid(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    """The reporter's task waits for each multiple of its interval on the wall
    clock (a fake one here: each wait ends at once, the clock jumps there)."""
    clock = _Clock(1000.3)
    monkeypatch.setattr("sidecar.sla.time.time", clock)
    closes: list[float] = []

    cfg = SidecarConfig.model_validate({
        "stage": "asr", "runner": {"kind": "python", "target": "examples.x:y"},
        "qosd": {"socket": None, "report_interval_s": 4.0}})  # fmt: skip
    rec = SlaRecorder(cfg)

    async def report_now() -> bool:
        closes.append(clock.t)
        if len(closes) == 2:
            clock.t += 9.0  # the loop was busy for two windows
        if len(closes) >= 4:
            rec._stopping.set()
        return True

    rec.report_now = report_now  # type: ignore[method-assign]
    real_wait_for = asyncio.wait_for

    async def wait_for(aw: Any, timeout: float | None) -> Any:
        if timeout:  # the wall clock gets there at once
            clock.t += timeout
        return await real_wait_for(aw, 0)

    monkeypatch.setattr("sidecar.sla.asyncio.wait_for", wait_for)

    async def main() -> None:
        rec._stopping = asyncio.Event()
        await real_wait_for(rec._run(), 10)

    asyncio.run(main())
    assert closes[0] == pytest.approx(1008.0)  # the first: more than an interval after 1000.3
    assert closes[1] == pytest.approx(1012.0)
    # the close due at 1016 comes when the loop is back (1021), once: no burst for the
    # windows missed; the next is on the grid again
    assert closes[2] == pytest.approx(1021.0)
    assert closes[3] == pytest.approx(1024.0)
