"""The closed-loop demo's settings: its timeline in windows, the class it
watches and the stages that measure each class (demo/closed_loop/run.py runs
it, report.py and show.py read it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from demo import EXAMPLES

__all__ = ["POLICY", "STAGES", "WATCH", "ClosedLoopConfig", "Progress"]

POLICY = EXAMPLES / "closed-loop-policy.yaml"
WATCH = "voice"
# the stage whose windows measure each class (on the edge node)
STAGES = {"voice": "audio-frontend", "video": "vision-encoder", "lidar": "lidar-encoder"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ClosedLoopConfig:
    # the controller's period and the stages' SLA window; 4 s, not the law's 5: qosd closes
    # a keep-alive connection idle for 5 s, and a sidecar posting every 5 s races that
    # close and loses windows ("Server disconnected without sending a response")
    window_s: float = 4.0
    warm: int = 2  # windows of warm-up (no objective yet), before the timeline
    quiet: int = 2  # windows of the pipeline alone before the flood
    flood: int = 10  # windows of flood (steady load)
    after: int = 10  # windows observed after the flood (controller on)
    after_off: int = 1  # the same with the controller off (nothing moves there)
    flood_factor: float = 0.5  # the flood's target rate, x the link rate
    audio_per_tick: int = 5  # microphone chunks per 50 ms tick
    push_pull_s: float = 0.5  # the mesh's push-pull interval (carries the SLA sketches)
    policy_path: str | None = None  # None: examples/closed-loop-policy.yaml
    runs: tuple[str, ...] = ("off", "on")
    realtime_voice: bool = True  # the microphone and the audio front end under SCHED_FIFO
    setup_s: float = 3.0  # processes start this long before the sensors

    def timeline(self, on: bool) -> tuple[float, float, float, float]:
        """(timeline start: the policy applied, flood start, flood stop, end)
        in seconds from the sensors' start."""
        w = self.window_s
        after = self.after if on else self.after_off
        a = self.warm * w
        return a, a + self.quiet * w, a + (self.quiet + self.flood) * w, a + (
            self.quiet + self.flood + after + 0.5) * w
