"""Many :class:`~qosd.mesh.slaview.core.SlaTree` cores on one virtual clock.

For tests and ``bench/cluster.py``: no sleeping, no threads.  The clock and
its event heap are a :class:`~qosd.mesh.membership.core.simulation.Simulation`'s
(pass the one that runs the members' SWIM cores to put both on one clock, or
let this make an empty one).  The trees' messages are direct calls (qosd
sends them as gRPC calls over TCP): each takes a latency drawn uniformly
from ``latency_s``; a lost transmission (probability ``loss``) is sent again
by TCP after its retransmission timeout (``rto_s``, doubling), so loss is
delay, not a hole; a call to a crashed member fails after ``refuse_s`` (the
connection is refused, or reset when it dies during the call: whatever it
got dies with it, so the sender may send elsewhere), one across a partition
after ``timeout_s`` (its deadline: maybe delivered, to a member still alive).

Membership: each member's view is the members it knows, given by the host
of the simulation (``learn_dead``, ``learn_alive``: what its SWIM core said,
or a model of it); members with the same view share one
:class:`~qosd.mesh.slaview.core.Topology` (the full build), so a view costs
one build however many members hold it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from qosd.mesh.membership.core.simulation import Simulation

from ._codec import Window
from ._topology import Topology
from ._tree import Out, SlaTree, TreeConfig

SendHook = Callable[[float, int, Out], None]

__all__ = ["TreeSimulation"]


class TreeSimulation:
    """Members ``ids`` (default ``node-<i>``), none running until :meth:`start`."""

    def __init__(self, n: int, config: TreeConfig | None = None, *, seed: int = 0,
                 loss: float = 0.0, latency_s: tuple[float, float] = (0.0005, 0.002),
                 rto_s: float = 0.2, refuse_s: float = 0.001, timeout_s: float = 1.0,
                 clock: Simulation | None = None, ids: Sequence[str] | None = None,
                 count_bytes: bool = True, bytes_of: Sequence[int] | None = None,
                 on_send: SendHook | None = None) -> None:
        """``bytes_of``: the members whose messages are sized (default every
        one; sizing costs as much as the rest of a message's handling)."""
        self.config = config or TreeConfig()
        self.sim = clock if clock is not None else Simulation(0, seed=seed)
        self.ids = list(ids) if ids is not None else [f"node-{i}" for i in range(n)]
        self.index = {m: i for i, m in enumerate(self.ids)}
        self.loss, self.latency_s, self.rto_s = loss, latency_s, rto_s
        self.refuse_s, self.timeout_s = refuse_s, timeout_s
        self.count_bytes = count_bytes
        self.bytes_of: set[int] | None = None if bytes_of is None else set(bytes_of)
        self.on_send = on_send
        self.rng = random.Random(seed * 7_000_003 + 11)
        self.trees = [SlaTree(m, self.config, seq_start=(i + 1) << 40)
                      for i, m in enumerate(self.ids)]
        n = len(self.ids)
        self.running = [False] * n
        self.group = [0] * n
        self.bytes_sent = [0] * n
        self.bytes_received = [0] * n
        self.messages = 0
        self.failed = 0
        self._tick_at = [math.inf] * n
        self._base: frozenset[str] = frozenset()
        self._dead: list[frozenset[str]] = [frozenset()] * n  # members each one knows gone
        self._extra: list[frozenset[str]] = [frozenset()] * n  # members each one knows joined
        self._topos: dict[tuple[frozenset[str], frozenset[str]], Topology] = {}

    @property
    def now(self) -> float:
        return self.sim.now

    # -- membership ----------------------------------------------------------------
    def set_base(self, members: Sequence[str]) -> None:
        """The members every view starts from (before any learn_*)."""
        self._base = frozenset(members)
        self._topos.clear()

    def topology(self, i: int) -> Topology:
        key = (self._dead[i], self._extra[i])
        topo = self._topos.get(key)
        if topo is None:
            members = (self._base | self._extra[i]) - self._dead[i]
            topo = self._topos[key] = Topology.full(members, bits=self.config.bits)
            if len(self._topos) > 64:  # views nobody holds any more
                held = {(self._dead[j], self._extra[j]) for j in range(len(self.ids))}
                self._topos = {k: v for k, v in self._topos.items() if k in held}
        return topo

    def _retopo(self, i: int) -> None:
        self.trees[i].set_topology(self.topology(i))
        self._reschedule(i)

    def learn_dead(self, i: int, member: str) -> None:
        """Member i now holds ``member`` dead (or left)."""
        if member in self._dead[i]:
            return
        self._dead[i] = self._dead[i] | {member}
        if self.running[i]:
            self._retopo(i)

    def learn_alive(self, i: int, member: str) -> None:
        """Member i now holds ``member`` alive (a joiner, or one back)."""
        changed = False
        if member in self._dead[i]:
            self._dead[i] = self._dead[i] - {member}
            changed = True
        if member not in self._base and member not in self._extra[i]:
            self._extra[i] = self._extra[i] | {member}
            changed = True
        self.trees[i].on_member_alive(member)
        if changed and self.running[i]:
            self._retopo(i)

    # -- scenario ------------------------------------------------------------------
    def start(self, i: int, at: float | None = None) -> None:
        def go() -> None:
            self.running[i] = True
            self._retopo(i)
        self.sim.at(self.sim.now if at is None else at, go)

    def crash(self, i: int) -> None:
        self.running[i] = False
        self._tick_at[i] = math.inf

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        self.group = [0] * len(self.ids)
        for g, members in enumerate(groups, start=1):
            for i in members:
                self.group[i] = g

    def heal(self) -> None:
        self.group = [0] * len(self.ids)

    def set_windows(self, i: int, windows: Sequence[Window]) -> None:
        self.trees[i].set_windows(windows, self.sim.now)

    def run_until(self, t: float) -> None:
        self.sim.run_until(t)

    # -- the event loop's parts -------------------------------------------------------
    def _reschedule(self, i: int) -> None:
        if not self.running[i]:
            return
        due = max(self.trees[i].next_deadline(), self.sim.now)
        if due < self._tick_at[i] and due < math.inf:
            self._tick_at[i] = due
            self.sim.at(due, lambda: self._tick(i, due))

    def _tick(self, i: int, due: float) -> None:
        if not self.running[i] or self._tick_at[i] != due:
            return
        self._tick_at[i] = math.inf
        self._dispatch(i, self.trees[i].tick(self.sim.now))

    def _dispatch(self, i: int, outs: list[Out]) -> None:
        for out in outs:
            self._send(i, out)
        self._reschedule(i)

    def _send(self, i: int, out: Out) -> None:
        j = self.index.get(out.to)
        now = self.sim.now
        self.messages += 1
        size = out.msg.wire if self.count_bytes and (
            self.bytes_of is None or i in self.bytes_of) else 0
        self.bytes_sent[i] += size
        if self.on_send is not None:
            self.on_send(now, i, out)
        lo, hi = self.latency_s
        rnd = self.rng.random
        if j is None or not self.running[j]:
            self.failed += 1
            self.sim.at(now + self.refuse_s, lambda: self._failed(i, out, False))
            return
        if self.group[j] != self.group[i]:
            self.failed += 1
            self.sim.at(now + self.timeout_s, lambda: self._failed(i, out, None))
            return
        delay, rto = lo + (hi - lo) * rnd(), self.rto_s
        while self.loss and rnd() < self.loss:
            delay += rto
            rto *= 2
        self.sim.at(now + delay, lambda: self._deliver(i, j, out, size))

    def _deliver(self, i: int, j: int, out: Out, size: int) -> None:
        if not self.running[j]:  # it died with the call under way: the connection resets, and
            self._failed(i, out, False)  # whatever it got died with it (never forwarded)
            return
        self.bytes_received[j] += size
        self._dispatch(j, self.trees[j].on_message(self.ids[i], out.msg, self.sim.now))

    def _failed(self, i: int, out: Out, delivered: bool | None) -> None:
        if self.running[i]:
            self._dispatch(i, self.trees[i].on_failed(out, self.sim.now, delivered=delivered))
