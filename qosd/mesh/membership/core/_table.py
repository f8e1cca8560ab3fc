"""The member table: who is known, in which state, and in which probe order.

Only storage and selection live here; the rules for changing a state are in
``_rules`` and ``_membership``.  Probing goes round-robin over ``ring`` (the
other members, shuffled); when the index wraps, members dead or left for
longer than ``gossip_to_the_dead_s`` leave the ring, tombstones past their
retention are forgotten, and the ring is shuffled again (memberlist's
``resetNodes``).  A new member is put at a random place in the ring, so that a
probe cycle reaches it after half a cycle on average.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ._config import Config
from ._events import MemberInfo
from ._messages import MemberRow, State


class Entry:
    """What this member knows about one member (itself included)."""

    __slots__ = ("_row", "addr", "in_ring", "incarnation", "last_ack", "node",
                 "rtt", "since", "state")

    def __init__(self, node: str, addr: str, state: State, incarnation: int, now: float) -> None:
        self.node = node
        self.addr = addr
        self.state = state
        self.incarnation = incarnation
        self.since = now
        self.last_ack: float | None = None
        self.rtt: float | None = None
        self.in_ring = False
        self._row: MemberRow | None = None

    def info(self) -> MemberInfo:
        return MemberInfo(
            self.node, self.addr, self.state, self.incarnation, self.since, self.last_ack, self.rtt
        )

    def row(self) -> MemberRow:
        """This entry as a push-pull row (kept until the entry changes)."""
        row = self._row
        if row is None or row.incarnation != self.incarnation or row.state != self.state \
                or row.addr != self.addr:
            row = self._row = MemberRow(self.node, self.addr, self.incarnation, self.state)
        return row


class MemberTable:
    """Entries by node id, plus the probe ring of the other members."""

    def __init__(self, me: Entry, rng: random.Random) -> None:
        self.me = me
        self.entries: dict[str, Entry] = {me.node: me}
        self.ring: list[Entry] = []
        self.probe_index = 0
        self.dead: dict[str, Entry] = {}
        """Members in state DEAD (reconnect candidates)."""
        self.live = 0
        """Other members alive or suspect."""
        self._rng = rng

    def size(self) -> int:
        """Members in the ring plus this one: the N of the scaling formulas."""
        return len(self.ring) + 1

    def add(self, entry: Entry) -> None:
        """A member heard of for the first time."""
        self.entries[entry.node] = entry
        if entry.state <= State.SUSPECT:
            self.live += 1
        elif entry.state == State.DEAD:
            self.dead[entry.node] = entry
        self._enter_ring(entry)

    def _enter_ring(self, entry: Entry) -> None:
        if entry.in_ring or not entry.addr:
            return  # a tombstone heard of without an address is nobody to talk to
        entry.in_ring = True
        ring = self.ring
        ring.append(entry)
        j = int(self._rng.random() * len(ring))
        ring[j], ring[-1] = ring[-1], ring[j]

    def set_state(self, entry: Entry, state: State, incarnation: int, now: float) -> None:
        """Record a change of another member; keeps the counters, the dead set
        and the ring right."""
        was_live = entry.state <= State.SUSPECT
        is_live = state <= State.SUSPECT
        self.live += is_live - was_live
        if entry.state == State.DEAD:
            self.dead.pop(entry.node, None)
        if state == State.DEAD:
            self.dead[entry.node] = entry
        if state != entry.state:
            entry.since = now
        entry.state = state
        entry.incarnation = incarnation
        if is_live:
            self._enter_ring(entry)

    def next_probe_target(self, now: float, cfg: Config) -> Entry | None:
        """The next alive or suspect member in ring order, or None."""
        checked = 0
        while checked <= len(self.ring):
            if self.probe_index >= len(self.ring):
                self.reset(now, cfg)
                self.probe_index = 0
                if not self.ring:
                    return None
            entry = self.ring[self.probe_index]
            self.probe_index += 1
            checked += 1
            if entry.state <= State.SUSPECT:
                return entry
        return None

    def reset(self, now: float, cfg: Config) -> None:
        """End of a probe cycle: drop long-dead members from the ring, forget
        expired tombstones, shuffle."""
        keep: list[Entry] = []
        for entry in self.ring:
            if entry.state <= State.SUSPECT or now - entry.since <= cfg.gossip_to_the_dead_s:
                keep.append(entry)
            else:
                entry.in_ring = False
        self.ring = keep
        for entry in list(self.entries.values()):
            if entry.in_ring or entry is self.me or entry.state <= State.SUSPECT:
                continue
            limit = cfg.left_retention_s if entry.state == State.LEFT else cfg.reconnect_timeout_s
            if now - entry.since > limit:
                del self.entries[entry.node]
                self.dead.pop(entry.node, None)
        self._rng.shuffle(self.ring)

    def random_members(self, k: int, accept: Callable[[Entry], bool]) -> list[Entry]:
        """Up to k distinct ring members for which ``accept`` holds, at random
        (memberlist's ``kRandomNodes``: random draws, exhaustive when small)."""
        ring = self.ring
        n = len(ring)
        out: list[Entry] = []
        if k <= 0 or n == 0:
            return out
        if n < 3 * k:
            order = list(ring)
            self._rng.shuffle(order)
            return [e for e in order if accept(e)][:k]
        rnd = self._rng.random
        for _ in range(3 * n):
            entry = ring[int(rnd() * n)]
            if accept(entry) and entry not in out:
                out.append(entry)
                if len(out) == k:
                    break
        return out

    def infos(self) -> list[MemberInfo]:
        return [e.info() for e in self.entries.values()]

    def rows(self) -> tuple[MemberRow, ...]:
        """The state this member offers in a push-pull: every entry, tombstones
        included (a member that the other side holds dead must hear it, to
        refute: that is how a healed partition converges)."""
        return tuple([e.row() for e in self.entries.values()])
