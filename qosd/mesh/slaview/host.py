"""The global SLA view in qosd: ``qosd.mesh.slaview.core.SlaTree`` hosted on
the peers' event loop (docs/cluster.md, "Global SLA view").

The trees' messages are direct calls to one member each, over the peers'
mutual-TLS channels: the transport's ``Fetch`` RPC of section ``sla`` whose
key carries the message (``"m"`` + base64; the answer ``b"\\x01"`` says it
was taken), so the sender is authenticated by its certificate as every
peer's packet is.  ``"w"`` asks a member for its own part of the view (the
per-node breakdown, on demand: ``GET /v1/cluster/sla?node=...``).

Every ``BOARD_S`` the node's own windows (``SlaBoard.view()``) are offered to
the tree; the member list (alive and suspect members) becomes the tree's
topology whenever it changes; the core's timers are armed on the loop.  Every
call into the core runs on the peers' loop (the core is not thread-safe); the
API's thread asks through :meth:`ClusterSla.snapshot` and :meth:`breakdown`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from qosd.mesh.membership.core import MemberChanged, State
from qosd.mesh.slaview.core import Out, SlaTree, Topology, TreeConfig
from qosd.model import BoardView

if TYPE_CHECKING:
    from qosd.mesh.membership.peers import Peers

log = logging.getLogger("qosd.mesh.slaview.host")

BOARD_S = 1.0
"""How often the board's windows are read into the tree."""
SECTION = "sla"
MESSAGE = "m"
"""A ``Fetch`` key starting so carries a tree message (base64)."""
OWN = "w"
"""A ``Fetch`` of this key answers this node's part of the view (JSON)."""
TAKEN = b"\x01"
SEND_TIMEOUT_S = 1.0
"""A tree message's deadline (a round is 2.5 s; a slower call is a lost one)."""
BREAKDOWN_TIMEOUT_S = 3.0
MAX_BREAKDOWN = 64
REASK_S = 0.5
"""A node's answer to a breakdown is used again this long (aged), not asked again."""
"""Members asked at most for ``?nodes=true`` (``?node=X`` asks one)."""
MAX_KEY = 1 << 20
GONE = {"unknown", "unavailable", "identity"}
"""Failures after which the receiver cannot have merged the message (none
sent, no connection, or it broke: a receiver that died with it forwards
nothing): the tree sends it to the node's backup at once."""


class ClusterSla:
    """The view, fed by the board and the peers; ``targets()`` gives each
    class's p99 objective in ms (from the current policy), ``classes()`` the
    policy's classes (the trees this node takes part in from the start)."""

    def __init__(self, peers: Peers, board: BoardView,
                 targets: Callable[[], Mapping[str, float] | None],
                 classes: Callable[[], Iterable[str]] = tuple,
                 config: TreeConfig | None = None) -> None:
        self.peers = peers
        self.board = board
        self.targets = targets
        self.classes = classes
        self.tree = SlaTree(peers.node_id, config or TreeConfig(),
                            seq_start=time.time_ns() // 1000)
        self.traffic = {"messages_out": 0, "bytes_out": 0, "messages_in": 0, "bytes_in": 0,
                        "send_failures": 0, "malformed": 0}
        self._members: tuple[str, ...] = ()
        self._answers: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        """node -> (when, rows) of its last answer to a breakdown: shown, marked
        unanswered, while it stays a member and does not answer (a killed node
        is in the records until its leaves stop, and listed until it is dead)."""
        self._answers_lock = threading.Lock()  # the API's threads
        self._unsubscribe: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._next_board = -math.inf
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    async def start(self) -> None:
        """Subscribes to the peers' events and starts (call on the loop)."""
        self._unsubscribe = self.peers.subscribe(self._on_events, section=SECTION)
        self.peers.serve_fetch(SECTION, self._serve)
        self._retopo()
        self._run()

    async def stop(self) -> None:
        self._stopped = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- the core on the loop -------------------------------------------------------
    def _retopo(self) -> None:
        """The tree's topology from the member list, when it changed."""
        me = self.peers.node_id
        members = sorted({m.node for m in self.peers.core.members()
                          if m.state in (State.ALIVE, State.SUSPECT)} | {me})
        if tuple(members) != self._members:
            self._members = tuple(members)
            self.tree.set_topology(Topology.local(members, me, bits=self.tree.config.bits))

    def _on_events(self, events: list[Any]) -> None:
        changed = False
        for e in events:
            if isinstance(e, MemberChanged):
                changed = True
                if e.state == State.ALIVE:
                    self.tree.on_member_alive(e.node)
        if changed:
            self._retopo()
            self._arm()

    def _run(self) -> None:
        """Whatever is due: the board's windows, the tree's timers."""
        self._timer, self._timer_at = None, math.inf
        if self._stopped:
            return
        now = self.peers.now()
        try:
            if now >= self._next_board:
                self._next_board = now + BOARD_S
                self.tree.set_classes(self.classes())
                self.tree.local_windows(self.board.view(), now, wall=time.time())
            self._send_all(self.tree.tick(now))
        except Exception:  # keep going; the board or a peer may recover
            log.exception("cluster SLA: a round failed")
        self._arm()

    def _arm(self) -> None:
        if self._stopped:
            return
        loop = asyncio.get_running_loop()
        due = min(self.tree.next_deadline(), self._next_board)
        if due >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = loop.call_at(max(due, loop.time()), self._run)

    def _send_all(self, outs: list[Out]) -> None:
        loop = asyncio.get_running_loop()
        for out in outs:
            task = loop.create_task(self._send(out))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, out: Out) -> None:
        data = out.msg.encode()
        self.traffic["messages_out"] += 1
        self.traffic["bytes_out"] += len(data)
        key = MESSAGE + base64.b64encode(data).decode("ascii")
        reply, why = await self.peers.fetch_detail(out.to, SECTION, key, SEND_TIMEOUT_S)
        if reply == TAKEN:
            return
        self.traffic["send_failures"] += 1
        delivered = False if why in GONE else None
        log.debug("cluster SLA: %s to %s failed (%s)", type(out.msg).__name__, out.to, why)
        self._send_all(self.tree.on_failed(out, self.peers.now(), delivered=delivered))
        self._arm()

    def _serve(self, peer: str, key: str) -> bytes | None:
        """A peer's ``Fetch`` of section ``sla`` (on the loop; ``peer`` is its
        certificate's node)."""
        if key == OWN:
            return json.dumps(self.tree.own_breakdown(self.peers.now())).encode()
        if not key.startswith(MESSAGE) or len(key) > MAX_KEY:
            return None
        try:
            data = base64.b64decode(key[len(MESSAGE):], validate=True)
        except (binascii.Error, ValueError):
            self.traffic["malformed"] += 1
            return None
        self.traffic["messages_in"] += 1
        self.traffic["bytes_in"] += len(data)
        self._send_all(self.tree.on_message(peer, data, self.peers.now()))
        self._arm()
        return TAKEN

    # -- what the API and the metrics read (from any thread) -----------------------
    def snapshot(self, nodes: bool = True) -> dict[str, Any]:
        """The global view now (``SlaTree.snapshot``; ``nodes``: each row's
        breakdown is the record it comes from, see there)."""
        targets = self.targets()

        def take() -> dict[str, Any]:
            snap = self.tree.snapshot(self.peers.now(), targets, nodes=nodes)
            snap["traffic"] = dict(self.traffic)
            return snap

        return self.peers.on_loop(take)

    def breakdown(self, node: str | None = None) -> dict[str, Any]:
        """Each node's own part of the view, asked of it now (``node``: that one;
        else every live member, at most ``MAX_BREAKDOWN``):
        ``{"nodes": {node: [rows]}, "asked": n, "answered": n, "truncated": bool}``."""
        me = self.peers.node_id
        if node is not None:
            wanted = [node]
        else:
            wanted = list(self.peers.on_loop(lambda: self._members)) or [me]
        truncated = len(wanted) > MAX_BREAKDOWN
        wanted = sorted(wanted)[:MAX_BREAKDOWN]

        async def ask(n: str) -> tuple[str, list[dict[str, Any]] | None]:
            if n == me:
                return n, self.tree.own_breakdown(self.peers.now())["rows"]
            recent = self._recent(n)
            if recent is not None:
                return n, recent
            data, _ = await self.peers.fetch_detail(n, SECTION, OWN, BREAKDOWN_TIMEOUT_S)
            return n, _rows(n, data)

        async def gather() -> list[tuple[str, list[dict[str, Any]] | None]]:
            return list(await asyncio.gather(*(ask(n) for n in wanted)))

        loop = self.peers.on_loop(asyncio.get_running_loop)  # where the core runs
        got = asyncio.run_coroutine_threadsafe(gather(), loop).result(BREAKDOWN_TIMEOUT_S + 5)
        rows = {n: r for n, r in got if r is not None}
        answered = len(rows)
        rows.update(self._remember(rows, [n for n, r in got if r is None]))
        return {"nodes": rows, "asked": len(wanted), "answered": answered,
                "truncated": truncated}

    def _recent(self, node: str) -> list[dict[str, Any]] | None:
        """``node``'s answer if it is younger than ``REASK_S`` (aged): a node is
        asked at most that often, however often the API is."""
        with self._answers_lock:
            held = self._answers.get(node)
        if held is None or not 0 <= time.monotonic() - held[0] < REASK_S:
            return None
        since = time.monotonic() - held[0]
        return [_aged(r, since) for r in held[1]]

    def _remember(self, answers: Mapping[str, list[dict[str, Any]]],
                  silent: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Keeps the answers; gives, for the members that did not answer, their
        last answer aged and marked ``stale`` and ``answered: false``."""
        now = time.monotonic()
        members = set(self.peers.on_loop(lambda: self._members))
        with self._answers_lock:
            for n, r in answers.items():
                held = self._answers.get(n)
                if held is None or now - held[0] >= REASK_S:  # a fresh answer
                    self._answers[n] = (now, r)
            self._answers = {n: v for n, v in self._answers.items() if n in members}
            while len(self._answers) > 2 * MAX_BREAKDOWN:
                del self._answers[min(self._answers, key=lambda k: self._answers[k][0])]
            held_of = {n: self._answers.get(n) for n in silent}
        out = {}
        for n in silent:
            held = held_of[n]
            if held is None:
                continue
            since = now - held[0]
            out[n] = [{**_aged(r, since), "stale": True, "answered": False} for r in held[1]]
        return out


def _aged(row: dict[str, Any], since: float) -> dict[str, Any]:
    """A breakdown row ``since`` seconds later."""
    out = dict(row)
    for k in ("age_s", "sketch_age_s"):
        if isinstance(out.get(k), int | float):
            out[k] = round(float(out[k]) + since, 3)
    return out


def _rows(node: str, data: bytes | None) -> list[dict[str, Any]] | None:
    """A peer's answer to ``OWN``, read strictly enough to be shown (its rows
    name it: another name is not taken)."""
    if not data or len(data) > MAX_KEY:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("node") != node or not isinstance(obj.get("rows"),
                                                                              list):
        return None
    return [r for r in obj["rows"] if isinstance(r, dict) and r.get("node") == node]
