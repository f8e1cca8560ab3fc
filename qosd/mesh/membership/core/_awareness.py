"""Lifeguard's local health awareness (memberlist ``awareness.go``).

A score in ``[0, max_multiplier - 1]``; 0 is healthy.  The prober raises it
when its own probes go unanswered and the relays it asked do not even nack
(the trouble is probably here, not at the target), and when it has to refute
a suspicion of itself; each answered probe lowers it by one.  The probe
interval (and so the time a probe may take) is multiplied by ``score + 1``,
so a slow or overloaded member probes, and accuses, less often.
"""

from __future__ import annotations


class Awareness:
    """The health score of the local member."""

    __slots__ = ("max_multiplier", "score")

    def __init__(self, max_multiplier: int) -> None:
        if max_multiplier < 1:
            raise ValueError("max_multiplier must be >= 1")
        self.max_multiplier = max_multiplier
        self.score = 0

    def apply(self, delta: int) -> None:
        """Add ``delta``, clamped to ``[0, max_multiplier - 1]``."""
        self.score = min(self.max_multiplier - 1, max(0, self.score + delta))

    def scale(self, interval: float) -> float:
        """``interval x (score + 1)``."""
        return interval * (self.score + 1)

    @staticmethod
    def probe_delta(acked: bool, expected_nacks: int, nacks: int) -> int:
        """The score change after one probe (memberlist's rule): -1 when it was
        answered; otherwise one per missing nack, or +1 when no relay was asked
        for nacks."""
        if acked:
            return -1
        if expected_nacks > 0:
            return max(0, expected_nacks - nacks)
        return 1
