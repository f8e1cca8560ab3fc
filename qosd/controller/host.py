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

``sla_controller_enabled: false`` turns it off: its first window takes back
what an earlier, enabled run left in the kernel (stage overrides, replica
weights), then a window is a no-op (no state read, decided, written or saved)
and ``explain`` shows the policy's values with a note saying so.
"""

from __future__ import annotations

import json
import logging
import threading
import time
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

__all__ = ["STATE_FILE", "Adapter", "ClusterSlaInput", "SlaController"]

log = logging.getLogger("qosd.controller.host")

STATE_FILE = "controller.json"


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

    def step(self) -> Decision | None:
        """One window: judge, decide, write what changed, keep the state
        (disabled: nothing, None)."""
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
            decision = ctrl.step(self._input(now))
            self.last = decision
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
            self.kernel.write(self._version, decision, now)
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
