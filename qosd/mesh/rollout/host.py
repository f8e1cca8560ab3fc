"""Mesh-wide policy rollout in qosd: ``qosd.mesh.rollout.core.Rollout`` hosted
on the peers' event loop (docs/cluster.md, "Policy rollout").

Every call into the core runs on the peers' loop (``Peers.on_loop``), as the
membership core's do.  The actions it returns are carried out here:

* ``Realise``: in a worker thread, :func:`qosd.mesh.rollout.realise.realise`
  (the path the etcd back end takes too): the text is localised to this
  node's link (qosd.yaml ``mesh_link``), checked realisable, and applied like
  any policy (the applier's store prepare -> kernel -> activate), the mesh version recorded
  in the version's note; the core is told the outcome (ACK, or NACK with the
  reason: xDS — a NACK keeps the previous version).
* ``Fetch``: the text is asked from a peer over the transport's Fetch RPC.
* ``SendReport``: the direct report to a version's origin is not sent; the
  same report reaches the origin by gossip (docs/cluster.md: the origin's
  table completes in a few seconds at hundreds of nodes).

A node-local apply (``PUT /v1/policy``, rollback) is refused while the mesh
has a version (409 ``mesh_managed``: qosd/service.py), so what this node runs
changes only through ``Realise``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from qosd.mesh.rollout.core import Action, Fetch, LinkOverride, Realise, Rollout
from qosd.mesh.rollout.provider import RolloutProvider
from qosd.mesh.rollout.realise import MeshApplier, applied_version, realise
from qosd.model import PolicySource

if TYPE_CHECKING:
    from qosd.mesh.membership.peers import Peers

log = logging.getLogger("qosd.mesh.rollout.host")

SECTION = "rollout"


class ClusterRollout:
    """The rollout core of this node, its timer and its actions: versions
    are realised through ``applier`` on ``link`` (qosd.yaml ``mesh_link``);
    ``policy`` says which one the node runs at start."""

    def __init__(self, peers: Peers, applier: MeshApplier, policy: PolicySource,
                 link: LinkOverride | None = None) -> None:
        self.peers = peers
        self.applier = applier
        self.rollout = Rollout(peers.section(SECTION), random.Random(),
                               applied=applied_version(policy),
                               wall_offset=time.time() - peers.now())
        self.link = link
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self.provider = RolloutProvider(self.rollout, peers.on_loop, self.dispatch,
                                        clock=peers.now)
        self.skipped_reports = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self.peers.subscribe(self._on_events, section=SECTION)
        self.peers.serve_fetch(SECTION, lambda _peer, key: self.rollout.serve_fetch(key))
        self._run(self.rollout.tick(self.peers.now()))

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._timer is not None:
            self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()

    # -- on the loop -------------------------------------------------------------
    def _on_events(self, events: list[Any]) -> None:
        self._run(self.rollout.on_events(events, self.peers.now()))

    def _tick(self) -> None:
        self._timer = None
        self._run(self.rollout.tick(self.peers.now()))

    def _run(self, actions: Iterable[Action]) -> None:
        """Carries out ``actions`` and re-arms the core's timer (on the loop)."""
        loop = self._loop
        assert loop is not None
        for a in actions:
            if isinstance(a, Realise):
                self._spawn(loop.run_in_executor(None, self._realise, a))
            elif isinstance(a, Fetch):
                self._spawn(loop.create_task(self._fetch(a)))
            else:  # SendReport: gossip carries the same report
                self.skipped_reports += 1
        deadline = self.rollout.next_deadline()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline != float("inf"):
            self._timer = loop.call_at(max(deadline, loop.time()), self._tick)

    def _spawn(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def dispatch(self, actions: list[Action]) -> None:
        """Carries out actions from any thread (the API's provider calls this)."""
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(self._run, actions)

    async def _fetch(self, a: Fetch) -> None:
        try:
            data = await self.peers.fetch(a.peer, SECTION, a.key)
        except Exception as e:  # the core retries with another peer
            log.info("rollout: fetching %s from %s failed: %s", a.version, a.peer, e)
            data = None
        self._run(self.rollout.on_fetch_reply(a.version, data, self.peers.now()))

    # -- in a worker thread -----------------------------------------------------------
    def _realise(self, a: Realise) -> None:
        ok, reason = realise(self.applier, self.link, a.version, a.text, a.author)

        def report() -> None:
            self._run(self.rollout.on_realised(a.version, ok, reason, self.peers.now()))

        self.peers.on_loop(report)
