"""Rollout on the virtual clock: real ``Membership`` and ``Rollout`` cores in
``qosd.mesh.membership.core.simulation``, with each node's host faked in-process.

The fake host of node i does what qosd does, minus the kernel: on
``Realise`` it waits ``apply_s`` (the time qosd's validate + reconcile +
store commit takes; the default 0.1 s is above the ~80 ms measured for
``PUT /v1/policy`` on these machines), localises the text to the node's link
(``links[i]``, a :class:`LinkOverride`; none: the policy's link) and validates
it (``localise_policy``: a PolicyError is the NACK's reason), then records
the version as applied.  On ``Fetch`` it asks the peer's core for the text
(``serve_fetch``), answering after ``fetch_s`` if the peer runs and is on the
same side of a partition (a gRPC call over TCP: not subject to packet loss),
else it reports a failure; ``SendReport`` reaches the peer's core the same way
(``direct_reports=False``: a transport without that call, gossip only).
What a node applied survives its crash, as the policy store does.

For tests and measurements; nothing here sleeps.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping, Sequence

from mmmesh.errors import PolicyError
from qosd.mesh.membership.core import Config, Event, State
from qosd.mesh.membership.core.simulation import Simulation
from qosd.mesh.rollout.core._core import Rollout
from qosd.mesh.rollout.core._link import LinkOverride, localise_policy
from qosd.mesh.rollout.core._types import (
    Action,
    Announcement,
    Fetch,
    MeshVersion,
    RolloutConfig,
    SendReport,
)


class RolloutSimulation:
    """``n`` nodes, each a membership core, a rollout core and a fake host."""

    def __init__(
        self, n: int, config: Config | None = None, *, seed: int = 0, loss: float = 0.0,
        rollout_config: RolloutConfig | None = None, apply_s: float = 0.1,
        fetch_s: float = 0.005, links: Mapping[int, LinkOverride] | None = None,
        latency_s: tuple[float, float] = (0.0005, 0.002), direct_reports: bool = True,
    ) -> None:
        self.sim = Simulation(n, config, seed=seed, loss=loss, latency_s=latency_s,
                              on_event=self._on_event)
        self.seed = seed
        self.rollout_config = rollout_config or RolloutConfig()
        self.apply_s = apply_s
        self.fetch_s = fetch_s
        self.links = dict(links or {})
        self.direct_reports = direct_reports
        """Carry SendReport (a transport with ReportRollout); False: gossip only."""
        self.applied: list[MeshVersion | None] = [None] * n
        """What each node's store holds (kept across crashes)."""
        self.realised: list[tuple[float, int, MeshVersion, bool, str]] = []
        """Every realisation: (time, node, version, ok, reason)."""
        self._index = {node: i for i, node in enumerate(self.sim.ids)}
        self._tick_at = [math.inf] * n
        self.rollouts = [self._make(i) for i in range(n)]

    def _make(self, i: int) -> Rollout:
        rng = random.Random(self.seed * 7_000_003 + i * 104_729 + len(self.realised))
        return Rollout(self.sim.nodes[i], rng, config=self.rollout_config,
                       applied=self.applied[i])

    # -- scenario ----------------------------------------------------------------
    def form(self, settle: float = 15.0, join_rate: float = 20.0) -> None:
        """Start every node (joining through nodes 0-2) and run until each
        knows every other alive (at most ``settle`` s past the last join)."""
        n = len(self.sim.nodes)
        self.sim.start(0)
        for i in range(1, n):
            self.sim.start(i, seeds=[0, 1, 2][: min(3, i)], at=i / join_rate)
        last = (n - 1) / join_rate
        self.sim.run_until(last)
        self.sim.run_while(lambda: not self.formed(), last + settle)
        if not self.formed():
            raise AssertionError("the cluster did not form")

    def formed(self) -> bool:
        n = len(self.sim.nodes)
        return all(m.live_members() == n - 1 for m in self.sim.nodes)

    def propose(self, i: int, text: str, *, author: str | None = None,
                base: MeshVersion | None = None) -> Announcement:
        ann, actions = self.rollouts[i].propose(text, self.sim.now, author=author, base=base)
        self._run(i, actions)
        return ann

    def crash(self, i: int) -> None:
        self.sim.crash(i)

    def restart(self, i: int, seeds: Sequence[int] = (0, 1, 2)) -> None:
        """A new process on node i: fresh cores, the store's applied version."""
        self.sim.restart(i, [s for s in seeds if s != i],
                         app_seq_start=int(self.sim.now * 1e6) + 1)
        self._tick_at[i] = math.inf
        self.rollouts[i] = self._make(i)
        self.sim.run_until(self.sim.now)  # it runs (and sent its join) from now on

    def running(self) -> list[int]:
        return [i for i, up in enumerate(self.sim.running) if up]

    # -- observation ---------------------------------------------------------------
    def converged(self, version: MeshVersion, nodes: Sequence[int] | None = None,
                  except_nacked: bool = True) -> bool:
        """Every node of ``nodes`` (default: the running ones) applied
        ``version`` (or NACKed it, with ``except_nacked``) and knows every live
        member's answer to it."""
        nodes = self.running() if nodes is None else nodes
        for i in nodes:
            r = self.rollouts[i]
            d = r.desired
            if d is None or d.version != version:
                return False
            mine = r.reports().get(self.sim.ids[i])
            if self.applied[i] != version and not (except_nacked and mine is not None
                                                   and mine.version == version
                                                   and not mine.ok):
                return False
        return all(self.answered(i, version) for i in nodes)

    def answered(self, i: int, version: MeshVersion) -> bool:
        """Node i's table of ``version`` is complete (cheaper than building it)."""
        r = self.rollouts[i]
        d = r.desired
        if d is None or d.version != version:
            return False
        reports = r.reports()
        for m in self.sim.nodes[i].members():
            if m.state >= State.DEAD:
                continue
            rep = reports.get(m.node)
            if rep is None or rep.about(d) < 0:
                return False
        return True

    # -- the fake hosts --------------------------------------------------------------
    def _on_event(self, now: float, i: int, events: list[Event]) -> None:
        self._run(i, self.rollouts[i].on_events(events, now))

    def _run(self, i: int, actions: list[Action]) -> None:
        r = self.rollouts[i]
        for a in actions:
            if isinstance(a, Fetch):
                self.sim.at(self.sim.now + self.fetch_s, functools.partial(self._fetched, i, r, a))
            elif isinstance(a, SendReport):
                if self.direct_reports:
                    self.sim.at(self.sim.now + self.fetch_s, functools.partial(self._sent, i, a))
            else:
                self.sim.at(self.sim.now + self.apply_s,
                            functools.partial(self._realised, i, r, a.version, a.text))
        due = max(r.next_deadline(), self.sim.now)
        if due < self._tick_at[i]:
            self._tick_at[i] = due
            self.sim.at(due, lambda: self._tick(i, r, due))

    def _alive(self, i: int, r: Rollout) -> bool:
        return self.sim.running[i] and self.rollouts[i] is r

    def _tick(self, i: int, r: Rollout, due: float) -> None:
        if self._alive(i, r) and self._tick_at[i] == due:
            self._tick_at[i] = math.inf
            self._run(i, r.tick(self.sim.now))

    def _realised(self, i: int, r: Rollout, version: MeshVersion, text: str) -> None:
        if not self._alive(i, r):
            return  # the process died during its apply: the store kept the old version
        try:
            localise_policy(text, self.links.get(i))
            ok, reason = True, ""
        except PolicyError as e:
            ok, reason = False, str(e)
        if ok:
            self.applied[i] = version
        self.realised.append((self.sim.now, i, version, ok, reason))
        self._run(i, r.on_realised(version, ok, reason, self.sim.now))

    def _sent(self, i: int, a: SendReport) -> None:
        j = self._reachable(i, a.peer)
        if j is not None:
            r = self.rollouts[j]
            self._run(j, r.on_peer_report(self.sim.ids[i], a.data, self.sim.now))

    def _reachable(self, i: int, peer: str) -> int | None:
        """Node ``peer``'s index when it runs on i's side of any partition."""
        j = self._index.get(peer)
        if j is None or not self.sim.running[j] or self.sim.group[j] != self.sim.group[i]:
            return None
        return j

    def _fetched(self, i: int, r: Rollout, a: Fetch) -> None:
        if not self._alive(i, r):
            return
        j = self._reachable(i, a.peer)
        data = None if j is None else self.rollouts[j].serve_fetch(a.key)
        self._run(i, r.on_fetch_reply(a.version, data, self.sim.now))
