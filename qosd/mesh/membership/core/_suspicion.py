"""Lifeguard's suspicion timer, without a clock (memberlist ``suspicion.go``).

A suspicion starts with the maximum timeout and shrinks towards the minimum as
independent confirmations arrive (other members that suspect the same node at
the same incarnation).  With n confirmations of the k wanted, the timeout
measured from the start is::

    timeout(n) = max(min, max - (max - min) * log(n + 1) / log(k + 1))

floored to whole milliseconds, as memberlist does.  With k == 0 (too few
members to expect confirmations) the timeout is ``min`` from the start.  The
member that raised the suspicion and duplicates never count, and
confirmations past k are not counted (the timer is already at its minimum).
The caller fixes min/max/k at the start: ``Config.suspicion_min_s(n)``,
``suspicion_max_s(n)``, ``suspicion_k(n)``.
"""

from __future__ import annotations

import math


def suspicion_timeout(n: int, k: int, min_s: float, max_s: float) -> float:
    """Total timeout (from the start) after n of k confirmations."""
    if k < 1 or n >= k:
        return min_s
    frac = math.log(n + 1.0) / math.log(k + 1.0)
    raw = max_s - frac * (max_s - min_s)
    return max(min_s, math.floor(raw * 1000.0) / 1000.0)


class Suspicion:
    """The timer of one suspected member, started at ``start``."""

    __slots__ = ("_deadline", "_seen", "incarnation", "k", "max_s", "min_s", "start")

    def __init__(
        self, start: float, accuser: str, k: int, min_s: float, max_s: float, incarnation: int
    ) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError("suspicion needs 0 < min_s <= max_s")
        self.start = start
        self.k = k
        self.min_s = min_s
        self.max_s = max_s
        self.incarnation = incarnation
        self._seen = {accuser}
        self._deadline = start + suspicion_timeout(0, k, min_s, max_s)

    @property
    def confirmations(self) -> int:
        """Independent confirmations counted so far (at most k)."""
        return len(self._seen) - 1

    @property
    def deadline(self) -> float:
        """When the suspect is to be declared dead, given what is known now."""
        return self._deadline

    def confirm(self, accuser: str) -> bool:
        """Count ``accuser`` as a confirmation.  True iff it was new and the
        timer moved (it is then worth re-gossiping the suspicion)."""
        if self.confirmations >= self.k or accuser in self._seen:
            return False
        self._seen.add(accuser)
        self._deadline = self.start + suspicion_timeout(
            self.confirmations, self.k, self.min_s, self.max_s
        )
        return True

    def expired(self, now: float) -> bool:
        return now >= self._deadline
