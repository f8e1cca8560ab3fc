"""The loop's delay taken out (issue 20): each window counted once, an urgent
miss acted on at once with a step that fits it, a load that is gone taking
the boost back in one decay; the host stepping as soon as a window is in
(woken by the board, the view read again while a window is due), on a
virtual clock: nothing here depends on how fast the host is."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from mmmesh.sla.report import SlaReport
from qosd.controller.core import Controller, Law, Measure, SlaInput, from_board, from_cluster
from qosd.controller.core._law import step_of
from qosd.controller.host import HOLD, POLL_S, SlaController
from qosd.sla.board import SlaBoard
from testkit.controller_cases import BUSY, COMFY, EXAMPLE, MISS, OKAY, Run

LAW = Law()
W = LAW.period_s
URGENT = Measure(500, 0.2, 480.0)  # 80 % of the frames late: the window itself, not a tail
FIFTH = Measure(500, 0.8, 300.0)  # a fifth late: urgent, one step
GONE = Measure(100, 0.99, 50.0)  # video: 2000 -> 100 frames a window (5 %)


def voice(r: Run) -> tuple[int, int]:
    p = r.decisions[-1].classes["voice"]
    return p.rate, p.weight


# --------------------------------------------------------------------------
# The law: an urgent miss at once, its step fitting it, bounded
# --------------------------------------------------------------------------
def test_an_urgent_miss_is_acted_on_at_once_with_a_step_that_fits_it() -> None:
    r = Run()
    r.step({"voice": URGENT, "video": BUSY})  # one window: 80 % late
    assert r.changes("voice") == [0]
    # 0.8 / 0.2 = 4 steps, at most max_scale (2): 2 x 0.5 x the policy value
    assert voice(r) == (1_200_000 + 1_200_000, 3 + 3)
    rec = r.ctrl.classes["voice"].history[-1]
    assert rec.why.startswith("an urgent miss (2 steps): p99 480 ms > 120 ms; attainment "
                              "0.200 < 0.99; 80% of the frames late"), rec.why
    r.step({"voice": URGENT, "video": BUSY})  # blackout: nothing
    assert r.changes("voice") == [0]


def test_a_fifth_late_is_urgent_by_one_step_and_a_tenth_is_not() -> None:
    r = Run()
    r.step({"voice": FIFTH, "video": BUSY})
    assert voice(r) == (1_800_000, 4)  # one step, at once
    assert r.ctrl.classes["voice"].history[-1].why.startswith("an urgent miss (1 step): ")
    r2 = Run()
    r2.step({"voice": MISS, "video": BUSY})  # 10 % late: waits for a second window
    assert r2.changes("voice") == []


def test_urgent_steps_stay_within_max_scale_and_the_range() -> None:
    r = Run()
    r.run(12, {"voice": URGENT, "video": BUSY})
    rate = r.series("voice", "rate")
    steps = [b - a for a, b in itertools.pairwise(rate) if b != a]
    assert max(steps) <= LAW.max_scale * step_of("rate", 1_200_000, LAW)
    assert max(rate) == 4_800_000  # the range's top, no further
    assert r.changes("voice") == [0, 2, 4]  # every other window (blackout)
    assert max(r.series("voice", "weight")) == 10


@pytest.mark.parametrize("bad", [{"max_scale": 0.5}, {"urgent_share": 1.0},
                                 {"gone_share": 0.8}])
def test_law_refuses_a_nonsense_urgent_rule(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="law"):
        Law(**bad)


# --------------------------------------------------------------------------
# Each window counted once
# --------------------------------------------------------------------------
def test_the_same_window_seen_again_is_not_counted_again() -> None:
    r = Run()
    r.step({"voice": MISS})  # a window, taken at r.now
    r.step({"voice": Measure(500, 0.90, 180.0, age_s=W)})  # the same window, 5 s older
    assert r.changes("voice") == [] and r.ctrl.classes["voice"].miss == 1
    assert r.ctrl.classes["voice"].note == "the window judged already: not counted again"
    r.step({"voice": MISS})  # a new window: the second miss
    assert r.changes("voice") == [2]


def test_a_window_that_began_before_the_change_is_not_counted() -> None:
    r = Run()
    r.run(2, {"voice": MISS, "video": BUSY})  # raised at window 1 (t + 5)
    r.step({"video": BUSY})  # blackout, and voice's window is late
    # it came in window 3: taken 6 s ago (t + 9), 5 s long: it began before the change
    late = Measure(500, 0.90, 180.0, age_s=6.0)
    r.step({"voice": late, "video": BUSY})
    assert r.changes("voice") == [1]
    assert r.ctrl.classes["voice"].note == "the window began before the last change: not counted"
    r.step({"voice": MISS, "video": BUSY})  # a window wholly after it: counts
    assert r.changes("voice") == [1, 4]


def test_after_an_urgent_step_a_smaller_miss_is_the_queue_draining() -> None:
    r = Run()
    r.step({"voice": URGENT, "video": BUSY})  # raised at once, 2 steps
    r.step({"voice": URGENT, "video": BUSY})  # blackout
    draining = Measure(500, 0.9, 200.0)  # still misses, by less, not urgently
    r.step({"voice": draining, "video": BUSY})
    assert r.changes("voice") == [0] and r.ctrl.classes["voice"].miss == 1
    assert "draining" in r.ctrl.classes["voice"].note
    r.run(3, {"voice": COMFY, "video": BUSY})  # settled: nothing moves
    assert r.changes("voice") == [0]
    # a miss that does not shrink after an urgent step is a fresh one
    r2 = Run()
    r2.run(3, {"voice": URGENT, "video": BUSY})
    assert r2.changes("voice") == [0, 2]


# --------------------------------------------------------------------------
# Back: a load that is gone takes the boost back at once
# --------------------------------------------------------------------------
def test_a_load_that_is_gone_takes_every_knob_back_to_the_policy_in_one_decay() -> None:
    r = Run()
    r.step({"voice": URGENT, "video": BUSY})
    r.run(4, {"voice": COMFY, "video": BUSY})
    assert voice(r) == (2_400_000, 6)
    r.step({"voice": COMFY, "video": GONE})
    assert voice(r) == (1_200_000, 3)  # the policy, in one decay
    why = r.ctrl.classes["voice"].history[-1].why
    assert "load gone: video 2000 -> 100 frames a window; back to the policy" in why, why


def test_a_load_that_appears_right_after_an_increase_is_its_load() -> None:
    """The competitor's window may reach the view after the miss that raised
    the class: a load that appears (ten times what it was) in the windows
    right after it is the load the increase was for."""
    r = Run()
    r.step({"voice": URGENT, "video": Measure(150, 0.99, 50.0)})  # before the flood's window
    r.step({"voice": COMFY, "video": BUSY})  # the flood's window: 2000 frames, appeared
    r.run(3, {"voice": COMFY, "video": BUSY})
    assert r.ctrl.classes["voice"].need == {"video": 2000.0, "voice": 500.0}
    r.step({"voice": COMFY, "video": GONE})
    assert voice(r) == (1_200_000, 3)


def test_a_noisy_class_does_not_make_its_ordinary_window_look_eased() -> None:
    """A LiDAR encoder's windows swing 61-131 frames under CPU contention: its
    largest right after the increase is not the load the increase was for,
    and its next ordinary window does not decay voice in the middle of a flood."""
    lidar = [Measure(n, 1.0, 20.0) for n in (61, 95, 131, 80, 75, 120, 64)]
    r = Run()
    r.step({"voice": URGENT, "video": BUSY, "lidar": lidar[0]})
    for m in lidar[1:]:
        r.step({"voice": COMFY, "video": BUSY, "lidar": m})
    assert r.changes("voice") == [0]  # raised once, held through the flood
    assert r.ctrl.classes["voice"].need is not None
    assert r.ctrl.classes["voice"].need["lidar"] == 61.0


# --------------------------------------------------------------------------
# Which window a measure is: every part's oldest
# --------------------------------------------------------------------------
def test_the_oldest_window_of_every_node_and_sender_is_known() -> None:
    row = {"sla_class": "voice", "modality": "audio", "frames": 800, "attainment": 0.9,
           "p99_ms": 200.0, "nodes": 2, "window_s": 4.0, "breakdown": [
               {"node": "a", "age_s": 0.5, "stale": False},
               {"node": "b", "age_s": 3.5, "stale": False},
               {"node": "c", "age_s": 30.0, "stale": True}]}  # fmt: skip
    m = from_cluster({"classes": [row], "stages": []}, 100.0, 0.0).classes["voice"]
    assert m.age_s == 0.5 and m.oldest_s == 3.5 and m.oldest == 3.5
    board = SlaBoard()
    for stage, at in (("asr", 90.0), ("tts", 93.0)):
        board.report(SlaReport.model_validate({"stage": stage, "reports": [{
            "sla_class": "voice", "modality": "audio", "window_s": 4.0, "frames": 200,
            "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0}]}), now=at)
    inp = from_board(board.view(95.0), 95.0)
    assert inp.classes["voice"].age_s == 2.0 and inp.classes["voice"].oldest == 5.0
    assert inp.stages[("voice", "tts")].oldest == 2.0
    assert Measure(1, 1.0, 1.0, age_s=2.0).oldest == 2.0  # unknown: its age


def test_waiting_names_the_classes_whose_window_of_the_period_has_not_come() -> None:
    ctrl = Controller(EXAMPLE)
    t = 1_000_000.0  # a multiple of the period: a window closes here
    assert ctrl.waiting(SlaInput(t + 1.0, {"voice": MISS})) == ()  # taken at t + 1: this one
    older = Measure(500, 0.9, 180.0, age_s=1.5)  # taken before the period began
    assert ctrl.waiting(SlaInput(t + 1.0, {"voice": older})) == ("voice",)
    assert ctrl.waiting(SlaInput(t + 1.0, {"voice": older, "video": older})) == ("voice",)
    ctrl.step(SlaInput(t + 1.0, {"voice": MISS}))
    again = Measure(500, 0.9, 180.0, age_s=W)  # the window judged, a period later
    assert ctrl.waiting(SlaInput(t + W + 1.0, {"voice": again})) == ("voice",)
    assert ctrl.waiting(SlaInput(t + W + 1.0, {"voice": MISS})) == ()  # its new one
    assert ctrl.waiting(SlaInput(t + W + 1.0, {})) == ()  # no data: nothing to wait for
    stale = Measure(500, 0.9, 180.0, age_s=4 * W)
    assert ctrl.waiting(SlaInput(t + 4 * W, {"voice": stale})) == ()


def test_windows_are_on_the_grid_of_the_period() -> None:
    """The first step fixes no phase of its own: a step just after each
    multiple of the period is one window each, however late the first was."""
    ctrl = Controller(EXAMPLE)
    base = 200_000 * W
    ctrl.step(SlaInput(base + 3.9, {"voice": MISS}))
    assert ctrl.window == 0
    ctrl.step(SlaInput(base + W + 0.2, {"voice": MISS}))  # 1.3 s later: the next window
    assert ctrl.window == 1 and ctrl.window_of(base + 2 * W + 0.01) == 2


def test_the_new_state_survives_a_restart() -> None:
    r = Run()
    r.step({"voice": URGENT, "video": BUSY})
    data = r.ctrl.snapshot()
    ctrl, said = Controller.restore(EXAMPLE, data, r.now)
    assert said.startswith("restored"), said
    a, b = r.ctrl.classes["voice"], ctrl.classes["voice"]
    assert (b.seen, b.changed_at, b.raised_w, b.raised_on) == (
        a.seen, a.changed_at, a.raised_w, a.raised_on)
    data["classes"]["voice"]["urgent"] = 99.0
    assert "unreadable" in Controller.restore(EXAMPLE, data, r.now)[1]


# --------------------------------------------------------------------------
# The host: a window as soon as it is in, once
# --------------------------------------------------------------------------
class _Policy:
    def current(self) -> Any:
        from qosd.model import PolicyVersion

        return PolicyVersion(1, EXAMPLE, EXAMPLE.to_yaml(), "", 0.0)


class _Adapter:
    def __init__(self) -> None:
        self.writes: list[float] = []

    def adapt(self, version: int, effective: Any) -> None:
        self.writes.append(version)


class _Kernel:
    def write(self, version: int, decision: Any, now: float) -> None:
        pass

    def release(self, version: int) -> bool:
        return True

    def explain(self) -> dict[str, Any]:
        return {}


class _View:
    """A global view whose voice window of each period arrives ``delay`` s
    after the window's close (the period's multiples)."""

    def __init__(self, delay: float, miss_from: float) -> None:
        self.delay, self.miss_from, self.clock = delay, miss_from, 0.0
        self.reads = 0

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        self.reads += 1
        now = self.clock
        close = math.floor((now - self.delay) / W) * W  # the newest window that has come
        att = 0.2 if close > self.miss_from else 1.0
        return {"classes": [{
            "sla_class": "voice", "modality": "audio", "frames": 500, "attainment": att,
            "p99_ms": 480.0 if att < 1 else 10.0, "nodes": 1, "window_s": W,
            "breakdown": [{"node": "edge", "age_s": now - close, "stale": False}]}],
            "stages": []}  # fmt: skip

    def suspect_share(self) -> float:
        return 0.0


def _host(tmp_path: Path, view: _View) -> tuple[SlaController, _Adapter]:
    adapter = _Adapter()
    host = SlaController(LAW, policy=_Policy(), adapter=adapter, kernel=_Kernel(),  # type: ignore[arg-type]
                         board=SlaBoard(), cluster=view, state_dir=tmp_path)
    return host, adapter


@pytest.mark.parametrize("delay", [0.3, 1.7, 3.2])
def test_the_host_steps_as_soon_as_the_window_is_in(tmp_path: Path, delay: float) -> None:
    """Whatever the view's delay, the step comes within one poll of the
    window's arrival, once a window: not at a phase of its own."""
    view = _View(delay, miss_from=200_000 * W + 10 * W)
    host, adapter = _host(tmp_path, view)
    t = 200_000 * W + 0.001
    steps: list[tuple[float, bool]] = []  # (when, changed)
    while t < 200_000 * W + 20 * W:
        view.clock = t
        n = len(adapter.writes)
        stepped = host.last
        wait = host.tick(t)
        if host.last is not stepped:
            steps.append((t, len(adapter.writes) > n))
        assert 0 < wait <= W + 0.01
        t += wait
    windows = [math.floor(s / W) for s, _ in steps]
    assert windows == sorted(set(windows)) and len(windows) >= 19  # one step a window
    for s, _ in steps[1:]:  # each within a poll of its window's arrival
        arrived = math.floor(s / W) * W + delay
        assert arrived - 1e-6 <= s <= arrived + POLL_S + 1e-6, (s, arrived)
    # the first missed window closes at miss_from + W; acted on as soon as it comes
    first = next(s for s, changed in steps if changed)
    assert first <= 200_000 * W + 11 * W + delay + POLL_S + 1e-6


def test_the_host_does_not_wait_past_its_hold(tmp_path: Path) -> None:
    view = _View(delay=W * 0.95, miss_from=math.inf)  # every window arrives after the hold
    host, _ = _host(tmp_path, view)
    t = 200_000 * W + 0.001
    steps = []
    for _ in range(300):
        view.clock = t
        stepped = host.last
        wait = host.tick(t)
        if host.last is not stepped:
            steps.append(t - math.floor(t / W) * W)
        t += wait
    assert len(steps) >= 10 and all(s <= HOLD * W + POLL_S for s in steps[1:]), steps


def test_run_is_woken_by_the_board(tmp_path: Path) -> None:
    """A report to the board wakes the loop at once (no wait for a timer)."""
    board = SlaBoard()
    host = SlaController(LAW, policy=_Policy(), adapter=_Adapter(), kernel=_Kernel(),  # type: ignore[arg-type]
                         board=board, state_dir=tmp_path)
    ticks: list[float] = []

    def tick(now: float | None = None) -> float:
        ticks.append(0.0)
        return 3600.0  # left alone, it would sleep for an hour

    host.tick = tick  # type: ignore[method-assign]

    async def main() -> None:
        stop = asyncio.Event()

        async def run_sync(fn: Any) -> float:
            return float(fn())

        task = asyncio.create_task(host.run(stop, run_sync, board))
        while not ticks:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(board.report, SlaReport.model_validate(
            {"stage": "asr", "reports": []}))
        async with asyncio.timeout(30):
            while len(ticks) < 2:
                await asyncio.sleep(0.01)
        stop.set()
        async with asyncio.timeout(30):
            await task

    asyncio.run(main())
    assert len(ticks) >= 2
    assert board._listeners == []  # unsubscribed when it stopped


def test_a_failing_listener_never_breaks_a_report() -> None:
    board = SlaBoard()

    def boom() -> None:
        raise RuntimeError("boom")

    unsub = board.subscribe(boom)
    assert board.report(SlaReport.model_validate({"stage": "asr", "reports": []})) == 0
    unsub()
    unsub()  # twice is harmless
    assert board._listeners == []


def test_one_missed_window_then_okay_still_moves_nothing() -> None:
    """The hysteresis for a miss that is not urgent is the law's as before."""
    r = Run()
    for _ in range(10):
        r.step({"voice": MISS})
        r.step({"voice": OKAY})
    assert r.changes("voice") == []


def test_an_empty_view_is_waited_for_until_the_hold(tmp_path: Path) -> None:
    """Just started, nothing reported yet: the step waits for the hold (a
    window may still come), then goes on without data (expiry counts it)."""

    class Empty(_View):
        def sla(self, nodes: bool) -> dict[str, Any] | None:
            self.reads += 1
            return {"classes": [], "stages": []}

    view = Empty(0.0, math.inf)
    host, _ = _host(tmp_path, view)
    t = 200_000 * W + 0.001
    while True:
        assert t < 200_000 * W + W
        view.clock = t
        wait = host.tick(t)
        if host.last is not None:
            break
        t += wait
    assert host.waiting == () and t - 200_000 * W >= HOLD * W - 1e-6  # stepped at the hold
    assert host.loop[-1]["data"] == {} and view.reads >= 2


def test_only_a_load_that_grew_into_the_miss_is_a_reason_to_decay() -> None:
    """The load an increase is for is the class's own and what grew into the
    miss since its last good window: best-effort's 481 frames a window, the
    same before and during the flood, dipping to 288 under CPU contention,
    are no reason to take voice's boost back in the middle of the flood."""
    be = {"best-effort": Measure(481, None, None)}
    r = Run()
    r.run(2, {"voice": COMFY, "video": Measure(150, 1.0, 20.0), **be})  # the calm window
    r.step({"voice": URGENT, "video": BUSY, **be})  # the flood: raised at once
    need = r.ctrl.classes["voice"].need
    assert need is not None and set(need) == {"voice", "video"}  # best-effort did not grow
    r.run(3, {"voice": COMFY, "video": BUSY, "best-effort": Measure(288, None, None)})
    assert r.changes("voice") == [2]  # held: the flood is still there
    r.step({"voice": COMFY, "video": GONE, **be})
    assert voice(r) == (1_200_000, 3)  # the flood gone: back to the policy
