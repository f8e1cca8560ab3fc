"""The SLA controller in qosd: ``qosd.controller.core.Controller`` fed once a
window and its decisions written to the kernel (docs/controller.md).

Input: the global SLA view when the node is in a mesh (the cluster store's
``sla``: every node's windows, merged), else the node's own board.  Both hold only
windows that qosd tied to their sender (docs/operations.md, "SLA reports"),
or that came from a peer over mutual TLS; and whatever they say, the
controller moves a class only inside the bounds its policy allows.

Output: when a decision changes a class's parameters, the reconciler writes
``effective_policy(policy, decision.classes)`` to the kernel under the same
store version (``Reconciler.adapt``: drift repair then keeps the adapted
values, and a new version starts from its own).  Then, every window, the
kernel side (qosd/controller/kernel.py): the stage weights become stage
overrides (``Dataplane.set_overrides`` with the policy's adapt ranges as
bounds, keyed by each stage's sender prefixes from qosd.yaml
``socket_layer.stages``), and with the socket layer on, each stage's
replicas get weights from their own reports (``ReplicaWeights``,
``SocketLayer.set_weights``).  Both are written only when the kernel holds
something else; a failed write is logged (rate-limited), counted and tried
again next window, never stopping the loop.  ``explain`` shows both.

The state survives a restart: it is written (atomically) to
``state_dir/controller.json`` after every window and taken back at start if
it still applies (same policy, same law, not older than the expiry horizon:
``Controller.restore`` says why not otherwise).

When: the controller is woken by new windows, not by a timer of its own
(docs/controller.md, "The loop's delay").  Windows close on the wall clock's
multiples of the period (the sidecars close theirs there), so :meth:`tick`
runs from the start of each window: it reads the view and steps as soon as
every class with an objective has its new window in it (``Controller.waiting``)
or ``HOLD`` of the window has passed, whichever comes first, once a window.
:meth:`run` is the loop: a report to the node's board wakes it at once
(``SlaBoard.subscribe``); the global view has no such signal, so while a
window is due and not all in, the view is read again every ``POLL_S``.
``explain()["loop"]`` times the last steps (woken, read, decided, written,
and the data time of every class's window).

``sla_controller_enabled: false`` turns it off: its first window takes back
what an earlier, enabled run left in the kernel (stage overrides, replica
weights), then a window is a no-op (no state read, decided, written or saved)
and ``explain`` shows the policy's values with a note saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from mmmesh.errors import MeshError
from mmmesh.files import write_atomic
from mmmesh.policy import Policy
from qosd.controller.core import (
    Controller,
    Decision,
    Law,
    SlaInput,
    effective_policy,
    from_board,
    from_cluster,
    render,
)
from qosd.controller.kernel import KernelWriter, render_kernel
from qosd.model import BoardView, PolicySource, ReconcileResult

__all__ = ["HOLD", "POLL_S", "STATE_FILE", "Adapter", "ClusterSlaInput", "NewWindows",
           "SlaController"]

log = logging.getLogger("qosd.controller.host")

STATE_FILE = "controller.json"
HOLD = 0.9
"""Of a window: how long a step waits for every class's new window (then it
steps with what it has; a window that comes later is judged the next time)."""
POLL_S = 0.2
"""While a window is due and not all in: how often the global view is read
again (it has no new-window signal; the board does)."""
MIN_GAP_S = 0.05
"""Checks closer than this are one (a burst of reports at a window's close)."""


class Adapter(Protocol):
    """Where a window's class parameters go (qosd.reconciler.Reconciler.adapt)."""

    def adapt(self, version: int, effective: Policy | None) -> ReconcileResult | None:
        """Writes ``effective`` for ``version`` when the kernel holds that version."""
        ...


class ClusterSlaInput(Protocol):
    """The mesh's global SLA view (qosd.store.base.ClusterStore)."""

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        """Every node's windows, merged (None: not available now)."""
        ...

    def suspect_share(self) -> float:
        """The share of the live members that are suspected (0 .. 1)."""
        ...


class NewWindows(Protocol):
    """Who tells the controller a window came (qosd.sla.board.SlaBoard)."""

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """``callback()`` after every new window; returns the unsubscribe."""
        ...


class SlaController:
    """One controller for the node's current version of ``policy``: judged
    from ``cluster``'s global view (in a mesh) or ``board``'s windows, the
    class parameters written through ``adapter``, the rest through
    ``kernel``; its state kept in ``state_dir/controller.json``."""

    def __init__(self, law: Law, *, policy: PolicySource, adapter: Adapter,
                 kernel: KernelWriter, board: BoardView, cluster: ClusterSlaInput | None = None,
                 state_dir: Path | str, enabled: bool = True) -> None:
        """``law``: the one ``kernel`` was built with (its period: qosd.yaml
        ``sla_controller_period_s``); ``enabled``: ``sla_controller_enabled``."""
        self.policy = policy
        self.adapter = adapter
        self.board = board
        self.cluster = cluster
        self.path = Path(state_dir) / STATE_FILE
        self._lock = threading.Lock()
        self._ctrl: Controller | None = None
        self._version = 0
        self.last: Decision | None = None
        self.note = ""
        self.law = law
        self.enabled = enabled
        self.kernel = kernel
        self._released = False  # disabled: the kernel holds nothing the controller wrote
        self.loop: deque[dict[str, Any]] = deque(maxlen=8)  # the last steps' timing (explain)
        self._stepped: int | None = None  # the grid window of the last step (tick)
        self._due_since: float | None = None  # the first check of the window being waited for
        self._checked = -math.inf  # the last check (tick)
        self.waiting: tuple[str, ...] = ()  # the classes the last check waited for

    @property
    def period_s(self) -> float:
        return self.law.period_s

    def _controller(self, now: float) -> Controller | None:
        """The controller of the current version (restored, new or kept)."""
        cur = self.policy.current()
        if cur is None:
            return None
        if self._ctrl is not None and self._version == cur.version:
            return self._ctrl
        if self._ctrl is None:
            saved: Any = None
            try:
                saved = json.loads(self.path.read_text())
            except (OSError, ValueError):
                pass
            self._ctrl, self.note = Controller.restore(cur.policy, saved, now, self.law)
            log.info("SLA controller: %s", self.note)
        else:
            self._ctrl.set_policy(cur.policy)
            self.note = f"policy version {cur.version}: started from its own values"
        self._version = cur.version
        return self._ctrl

    def _input(self, now: float) -> SlaInput:
        view = self.cluster.sla(True) if self.cluster is not None else None
        if view is not None and self.cluster is not None:
            return from_cluster(view, now, self.cluster.suspect_share())
        return from_board(self.board.view(), now)

    # -- when -----------------------------------------------------------------------
    def tick(self, now: float | None = None) -> float:
        """One wake-up of the loop: steps if this window's step is due (every
        class's new window is in, or ``HOLD`` of the window passed; an empty
        view waits for the hold) and not done yet; returns the seconds until
        the next wake-up unless a new window comes first."""
        now = time.time() if now is None else now
        w = self.period_s
        k = math.floor(now / w)
        boundary = (k + 1) * w - now + 0.001
        if self._stepped == k:
            return boundary
        if now - self._checked < MIN_GAP_S:
            return MIN_GAP_S - (now - self._checked)
        self._checked = now
        if not self.enabled:
            self.step()
            self._stepped = k
            return boundary
        deadline = k * w + HOLD * w
        with self._lock:
            ctrl = self._controller(now)
            if ctrl is None:
                self._stepped = k
                return boundary
            if self._due_since is None or self._due_since < k * w:
                self._due_since = now
            inp = self._input(now)
            # an empty view (qosd just started, no window reported yet) is waited for too
            self.waiting = ((ctrl.waiting(inp) or (() if inp.classes else ("*",)))
                            if now < deadline else ())
            if self.waiting:
                return min(deadline - now, POLL_S if self.cluster is not None else deadline - now)
            self._step(ctrl, inp, now, self._due_since)
            self._stepped = k
        return boundary

    async def run(self, stop: asyncio.Event,
                  run_sync: Callable[[Callable[[], float]], Awaitable[float]],
                  windows: NewWindows | None = None) -> None:
        """The loop until ``stop``: :meth:`tick` (through ``run_sync``, e.g.
        a thread pool: it reads the view and writes the kernel) whenever it
        asked to be woken, or ``windows`` says a window came."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def came() -> None:  # in the reporting thread
            loop.call_soon_threadsafe(wake.set)

        unsubscribe = windows.subscribe(came) if windows is not None else None
        try:
            while not stop.is_set():
                wake.clear()
                try:
                    delay = await run_sync(self.tick)
                except Exception:  # keep the loop alive, report
                    log.exception("SLA controller step failed")
                    delay = self.period_s
                waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
                await asyncio.wait(waits, timeout=max(0.0, delay),
                                   return_when=asyncio.FIRST_COMPLETED)
                for t in waits:
                    t.cancel()
        finally:
            if unsubscribe is not None:
                unsubscribe()

    # -- what ------------------------------------------------------------------------
    def step(self) -> Decision | None:
        """One window now, whatever has come: judge, decide, write what changed,
        keep the state (disabled: nothing, None)."""
        if not self.enabled:
            # what an earlier, enabled run wrote (stage overrides and replica weights
            # outlive a restart: the kernel keeps them) is taken back once
            cur = self.policy.current()
            if not self._released and cur is not None:
                with self._lock:
                    self._released = self.kernel.release(cur.version)
            return None
        with self._lock:
            now = time.time()
            ctrl = self._controller(now)
            if ctrl is None:
                return None
            return self._step(ctrl, self._input(now), now, now)

    def _step(self, ctrl: Controller, inp: SlaInput, now: float, due: float) -> Decision:
        """The step on ``inp`` (read at ``now``; the window due since ``due``), under the lock."""
        read = time.time()
        window = ctrl.window
        decision = ctrl.step(inp)
        self.last = decision
        decided = time.time()
        cur = self.policy.current()
        if decision.changed and cur is not None:
            try:
                self.adapter.adapt(
                    self._version, effective_policy(cur.policy, decision.classes))
                log.info("SLA controller: window %d: %s", decision.window,
                         ", ".join(decision.changed))
            except MeshError as e:
                log.error("SLA controller: writing window %d failed: %s",
                          decision.window, e)
        adapted = time.time()
        self.kernel.write(self._version, decision, now)
        if decision.window != window:  # a new window (not a repeated call)
            self.loop.append({
                "window": decision.window, "due": round(due, 3), "woke": round(now, 3),
                "read": round(read, 3), "decided": round(decided, 3),
                "written": round(adapted, 3), "done": round(time.time(), 3),
                "changed": list(decision.changed),
                "data": {c: round(now - m.oldest, 3) for c, m in inp.classes.items()}})
        try:
            write_atomic(self.path, json.dumps(ctrl.snapshot()), mode=0o600)
        except OSError as e:
            log.warning("SLA controller: state not saved: %s", e)
        return decision

    def explain(self) -> dict[str, Any] | None:
        """``explain()`` of the controller (None before any policy), with the
        restore note and the text ``mmmeshctl sla explain`` prints."""
        if not self.enabled:
            return self._explain_disabled()
        with self._lock:
            if self._ctrl is None:
                return None
            data = self._ctrl.explain()
            data["note"] = self.note
            data["loop"] = list(self.loop)
            data["kernel"] = self.kernel.explain()
            data["text"] = render(data) + render_kernel(data["kernel"])
            return data

    def _explain_disabled(self) -> dict[str, Any] | None:
        """The policy's values as a controller that never steps shows them."""
        cur = self.policy.current()
        if cur is None:
            return None
        data = Controller(cur.policy, self.law).explain()
        data["note"] = ("disabled (sla_controller_enabled: false): the kernel keeps the "
                        "policy's values")
        data["enabled"] = False
        data["text"] = render(data)
        return data
