"""The global SLA view in qosd: ``qosd.mesh.slaview.core.SlaView`` hosted on
the peers' event loop (docs/cluster.md, "Global SLA view").

Every ``TICK_S`` the node's own windows (``SlaBoard.view()``) are offered to
the view; when a digest is due it is gossiped (section ``sla``), and the
node's bundle of sketches is refreshed in the push-pull state.  Peers'
digests, sketches and membership changes reach the view through the peers'
subscription.  Every call into the view runs on the peers' loop (the view,
like the membership core, is not thread-safe); the API's thread asks for a
snapshot through :meth:`ClusterSla.snapshot`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from qosd.mesh.slaview.core import SlaView, SlaViewConfig
from qosd.model import BoardView

if TYPE_CHECKING:
    from qosd.mesh.membership.peers import Peers

log = logging.getLogger("qosd.mesh.slaview.host")

TICK_S = 1.0
SECTION = "sla"


class ClusterSla:
    """The view, fed by the board and the peers; ``targets()`` gives each
    class's p99 objective in ms (from the current policy)."""

    def __init__(self, peers: Peers, board: BoardView,
                 targets: Callable[[], Mapping[str, float] | None]) -> None:
        self.peers = peers
        self.board = board
        self.targets = targets
        self.view = SlaView(peers.node_id, SlaViewConfig(cluster=peers.config),
                            seq_start=time.time_ns() // 1000)
        self._section = peers.section(SECTION)
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Subscribes to the peers' events and starts publishing (call on the loop)."""
        self._unsubscribe = self.peers.subscribe(self._on_events, section=SECTION)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="cluster-sla")

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_events(self, events: list[Any]) -> None:
        now = self.peers.now()
        for e in events:
            self.view.on_event(e, now)

    async def _loop(self) -> None:
        while True:
            try:
                self.publish()
            except Exception:  # keep publishing; the board or a peer may recover
                log.exception("cluster SLA: publishing failed")
            await asyncio.sleep(TICK_S)

    def publish(self) -> None:
        """Offers the board's windows; gossips a digest when one is due."""
        now = self.peers.now()
        board_view = self.board.view()
        members = self.peers.core.live_members() + 1
        for key, payload in self.view.local_windows(board_view, now, wall=time.time(),
                                                    members=members):
            self._section.broadcast(key, payload)
        self._section.set_app_state(self.view.app_state(now))

    def snapshot(self, nodes: bool = True) -> dict[str, Any]:
        """The global view now (from any thread: it runs on the peers' loop)."""
        targets = self.targets()

        def take() -> dict[str, Any]:
            return self.view.snapshot(self.peers.now(), targets, nodes=nodes)

        return self.peers.on_loop(take)
