"""The piggyback broadcast queue (memberlist's ``TransmitLimitedQueue``).

Items are keyed: queueing an item under a key already queued replaces the old
one and starts again from zero transmissions (newer news about the same thing
makes the old news pointless).  ``take`` fills a byte budget with the items
sent fewest times so far (among those sent equally often, the one that got
there last first: for unsent items, the newest), skipping items that do not
fit; each item taken counts one transmission, and an item is dropped after
``limit`` of them.  The membership core calls ``take`` for every packet it
sends (pings, acks, gossip) with ``limit = retransmit_mult x ceil(log10(N +
1))`` (``Config.retransmit_limit``), so each member forwards each item about
that many times, to random members.

The queue is generic: the key is any string and the item any message; the
core keys membership news ``m/<node>`` and application broadcasts
``a/<origin>/<key>``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")

# Stop filling when less room than this is left, or after this many misfits per
# tier: no item is that small, and scanning a long tier for a small enough one
# would make every send cost O(queue).
_MIN_ROOM = 8
_MAX_MISFITS = 8


class _Item(Generic[T]):
    __slots__ = ("key", "live", "msg", "size", "transmits")

    def __init__(self, key: str, msg: T, size: int) -> None:
        self.key = key
        self.msg = msg
        self.size = size
        self.transmits = 0
        self.live = True


class BroadcastQueue(Generic[T]):
    """Keyed, transmit-limited items waiting to be piggybacked.

    Tier t is a list of the items sent t times, oldest first; a replaced item
    is only marked dead and skipped when reached, so every operation is O(1)
    per item touched."""

    __slots__ = ("_dead", "_index", "_tiers", "max_items")

    def __init__(self, max_items: int = 4096) -> None:
        self._tiers: list[list[_Item[T]]] = [[]]
        self._index: dict[str, _Item[T]] = {}
        self._dead = 0
        self.max_items = max_items

    def __len__(self) -> int:
        return len(self._index)

    def push(self, key: str, msg: T, size: int) -> None:
        """Queue ``msg`` (``size`` bytes on the wire) under ``key``, replacing
        whatever was queued under it."""
        old = self._index.get(key)
        if old is not None:
            old.live = False
            self._dead += 1
        item = _Item(key, msg, size)
        self._index[key] = item
        self._tiers[0].append(item)
        if len(self._index) > self.max_items:
            self._prune()
        if self._dead > 64 and self._dead > len(self._index):
            self._compact()

    def pending(self, key: str) -> bool:
        """Whether an item is still queued under ``key``."""
        return key in self._index

    def transmits(self, key: str) -> int:
        """How often the item under ``key`` was taken (KeyError if none)."""
        return self._index[key].transmits

    def get(self, key: str) -> T | None:
        item = self._index.get(key)
        return None if item is None else item.msg

    def take(self, budget: int, limit: int) -> tuple[list[T], int]:
        """Items whose sizes sum to at most ``budget`` bytes, fewest
        transmissions first, and the bytes they use.  Each counts one
        transmission; those reaching ``limit`` leave the queue."""
        if not self._index or budget < _MIN_ROOM:
            return [], 0
        out: list[T] = []
        emit = out.append
        room = budget
        index = self._index
        tiers = self._tiers
        moved: list[tuple[int, list[_Item[T]]]] = []
        for t, tier in enumerate(tiers):
            if not tier:
                continue
            up: list[_Item[T]] = []
            keep = up.append
            pop = tier.pop
            misfits: list[_Item[T]] = []
            while tier and room >= _MIN_ROOM:
                item = pop()
                if not item.live:
                    self._dead -= 1
                    continue
                size = item.size
                if size > room:
                    misfits.append(item)
                    if len(misfits) >= _MAX_MISFITS:
                        break
                    continue
                room -= size
                emit(item.msg)
                item.transmits = t + 1
                if t + 1 >= limit:
                    item.live = False
                    del index[item.key]
                else:
                    keep(item)
            if misfits:
                tier.extend(reversed(misfits))
            if up:
                moved.append((t + 1, up))
            if room < _MIN_ROOM:
                break
        for t, items in moved:
            if t == len(tiers):
                tiers.append([])
            tiers[t].extend(reversed(items))  # keep their relative order
        return out, budget - room

    def _prune(self) -> None:
        """Drop the most-sent, oldest items until ``max_items`` remain."""
        for tier in reversed(self._tiers):
            for item in tier:
                if len(self._index) <= self.max_items:
                    break
                if item.live:
                    item.live = False
                    self._dead += 1
                    del self._index[item.key]

    def _compact(self) -> None:
        """Forget the replaced items still sitting in the tiers."""
        self._tiers = [[item for item in tier if item.live] for tier in self._tiers]
        self._dead = 0
