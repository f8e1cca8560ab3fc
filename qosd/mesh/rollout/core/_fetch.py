"""Getting a version's text from the members that hold it (the transport's
``Fetch`` RPC; the core only decides whom to ask and when).

One peer at a time, chosen at random among the holders not yet asked in this
round (random: a thousand members fetching at once spread over the origin
and those that already have it); an attempt ends after ``timeout_s``, or at
once when the host reports a failure; after a round in which every holder
failed, wait ``timeout_s`` and start a new round (the holders may have
changed: every report names one more).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from qosd.mesh.rollout.core._types import Announcement, Fetch, RolloutStats


class Fetcher:
    """The fetch of one version's text at a time (a new version starts anew)."""

    def __init__(self, rng: random.Random, timeout_s: float, stats: RolloutStats) -> None:
        self._rng = rng
        self._timeout = timeout_s
        self._stats = stats
        self._key: tuple[int, str, str] | None = None
        self._tried: set[str] = set()
        self.peer: str | None = None
        """The member asked now (None: between attempts)."""
        self.until = -math.inf
        """The current attempt, or the wait for a new round, ends then."""

    def reset(self) -> None:
        self._key, self.peer, self.until = None, None, -math.inf
        self._tried.clear()

    def deadline(self, ann: Announcement | None) -> float:
        return self.until if ann is not None and ann.key == self._key else math.inf

    def want(self, ann: Announcement, holders: Sequence[str], now: float) -> Fetch | None:
        """The next :class:`Fetch` for the text of ``ann``, if one is due."""
        if self._key != ann.key:
            self.reset()
            self._key = ann.key
        if now < self.until:
            return None  # an attempt (or the wait for a new round) is under way
        fresh = [h for h in holders if h not in self._tried]
        if not fresh:  # a round is over (or nobody to ask): wait, then start again
            self._tried.clear()
            self.peer, self.until = None, now + self._timeout
            return None
        self.peer = self._rng.choice(fresh)
        self._tried.add(self.peer)
        self.until = now + self._timeout
        self._stats.fetches += 1
        return Fetch(ann.version, ann.sha256, self.peer)

    def failed(self, ann: Announcement | None, peer: str | None, now: float) -> None:
        """The attempt at ``peer`` got nothing: the next holder may be asked now."""
        self._stats.fetch_failures += 1
        if ann is not None and ann.key == self._key and peer == self.peer:
            self.peer, self.until = None, now
