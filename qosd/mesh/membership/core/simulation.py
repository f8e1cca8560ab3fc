"""Many ``Membership`` cores on one virtual clock, over an in-memory lossy network.

For tests and ``bench/cluster.py``: no sleeping, no threads.  Time advances
from one event to the next on a heap: packet deliveries (after a latency drawn
uniformly from ``latency_s``, each packet dropped with probability ``loss``)
and ticks (each core is ticked exactly at its ``next_deadline()``).  Members
can be crashed (they stop; packets to them vanish), restarted, partitioned
into groups that cannot reach each other, and healed.  Everything random comes
from ``seed``, so a run is reproducible.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Sequence

from ._config import Config
from ._events import Event
from ._membership import Membership
from ._messages import Packet, Send

EventHook = Callable[[float, int, list[Event]], None]
LinkFilter = Callable[[int, int, Packet], bool]
_TICK, _DELIVER, _CALL = 0, 1, 2


class Simulation:
    """``n`` members named ``node-<i>`` at ``10.<i // 250>.<i % 250>.1:7946``.
    Nothing runs until ``start`` schedules a member."""

    def __init__(
        self, n: int, config: Config | None = None, *, seed: int = 0, loss: float = 0.0,
        latency_s: tuple[float, float] = (0.0005, 0.002), on_event: EventHook | None = None,
    ) -> None:
        self.config = config or Config()
        self.seed = seed
        self.loss = loss
        self.latency_s = latency_s
        self.on_event = on_event
        self.link: LinkFilter | None = None
        """When set, a packet from i to j is delivered only if link(i, j, packet)."""
        self.now = 0.0
        self.ids = [f"node-{i}" for i in range(n)]
        self.addrs = [f"10.{i // 250}.{i % 250}.1:7946" for i in range(n)]
        self._index = {a: i for i, a in enumerate(self.addrs)}
        self.nodes = [self._make(i) for i in range(n)]
        self.running = [False] * n
        self.group = [0] * n
        self.delivered = 0
        self.dropped = 0
        self._rng = random.Random(seed)
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        self._tick_at = [math.inf] * n

    def _make(self, i: int, app_seq_start: int = 0) -> Membership:
        rng = random.Random(self.seed * 1_000_003 + i * 7919 + app_seq_start)
        return Membership(self.config, self.ids[i], self.addrs[i], rng,
                          app_seq_start=app_seq_start)

    # -- scenario control ----------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t``."""
        self._push(t, _CALL, -1, fn)

    def start(self, i: int, seeds: Sequence[int] = (), at: float | None = None) -> None:
        """Start member i (at ``at``, default now), joining through ``seeds``."""
        def go() -> None:
            self.running[i] = True
            self._dispatch(i, self.nodes[i].join([self.addrs[s] for s in seeds], self.now))
        self.at(self.now if at is None else at, go)

    def crash(self, i: int) -> None:
        """Member i stops at once: no ticks, packets to it are lost."""
        self.running[i] = False
        self._tick_at[i] = math.inf

    def resume(self, i: int) -> None:
        """A crashed (paused, SIGSTOP-like) member runs on with the state it had."""
        self.running[i] = True
        self._reschedule(i)

    def restart(self, i: int, seeds: Sequence[int], app_seq_start: int = 1) -> None:
        """A fresh core (incarnation 0) with the same id and address joins again."""
        self.nodes[i] = self._make(i, app_seq_start)
        self.start(i, seeds)

    def leave(self, i: int) -> None:
        self._dispatch(i, self.nodes[i].leave(self.now))

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """Members of different groups cannot reach each other (a member in no
        group is in group 0)."""
        self.group = [0] * len(self.nodes)
        for g, members in enumerate(groups, start=1):
            for i in members:
                self.group[i] = g

    def heal(self) -> None:
        self.group = [0] * len(self.nodes)

    def broadcast(self, i: int, key: str, payload: bytes) -> int:
        seq = self.nodes[i].broadcast(key, payload)
        self._reschedule(i)
        return seq

    # -- the event loop ------------------------------------------------------------
    def run_until(self, t_end: float) -> None:
        """Process every event up to ``t_end``; the clock ends at ``t_end``."""
        heap = self._heap
        pop = heapq.heappop
        nodes = self.nodes
        running = self.running
        tick_at = self._tick_at
        while heap and heap[0][0] <= t_end:
            t, _, kind, i, payload = pop(heap)
            self.now = t
            if kind == _DELIVER:
                if running[i]:
                    self.delivered += 1
                    self._dispatch(i, nodes[i].handle(payload, t))  # type: ignore[arg-type]
            elif kind == _TICK:
                if running[i] and tick_at[i] == t:
                    tick_at[i] = math.inf
                    self._dispatch(i, nodes[i].tick(t))
            else:
                payload()  # type: ignore[operator]
        self.now = max(self.now, t_end)

    def run_while(self, cond: Callable[[], bool], t_max: float, step: float = 0.5) -> float:
        """Run in ``step`` slices while ``cond()`` holds, at most until ``t_max``;
        returns the time it stopped."""
        while cond() and self.now < t_max:
            self.run_until(min(t_max, self.now + step))
        return self.now

    def _push(self, t: float, kind: int, i: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, i, payload))

    def _reschedule(self, i: int) -> None:
        due = max(self.nodes[i].next_deadline(), self.now)
        if due < self._tick_at[i] and self.running[i]:
            self._tick_at[i] = due
            self._push(due, _TICK, i, None)

    def _dispatch(self, i: int, sends: list[Send]) -> None:
        node = self.nodes[i]
        if sends:
            self._transmit(i, sends)
        if self.on_event is not None:
            events = node.events()
            if events:
                self.on_event(self.now, i, events)
        else:
            node.events()
        self._reschedule(i)

    def _transmit(self, i: int, sends: list[Send]) -> None:
        rnd = self._rng.random
        lo, hi = self.latency_s
        span = hi - lo
        group = self.group
        src_group = group[i]
        link = self.link
        for send in sends:
            j = self._index.get(send.to)
            if j is None or group[j] != src_group or (self.loss and rnd() < self.loss) \
                    or (link is not None and not link(i, j, send.packet)):
                self.dropped += 1
                continue
            self._push(self.now + lo + span * rnd(), _DELIVER, j, send.packet)

    # -- observation ---------------------------------------------------------------
    def view(self, i: int) -> dict[str, str]:
        """Member i's view: node id -> state name."""
        return {m.node: m.state.name for m in self.nodes[i].members()}

