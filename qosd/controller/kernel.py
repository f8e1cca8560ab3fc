"""The SLA controller's kernel side beyond the classes' HTB parameters
(docs/socklayer.md "qosd", docs/controller.md "The kernel side"):

* **stage overrides**: ``Decision.stage_weights`` ({class: {stage: weight}})
  with each stage's sender prefixes (qosd.yaml ``socket_layer.stages``)
  become ``Overrides.from_stage_weights(...)``, written through
  ``Reconciler.set_overrides`` (``Dataplane.set_overrides`` with the
  version's policy as bounds) when the kernel holds another set.  A stage the
  configuration does not name has no senders and gets no override.
* **replica weights**: with the socket layer on, every stage with two or
  more replicas gets weights from its replicas' own SLA windows (the board's
  ``instances`` rows whose ``instance``, the identity qosd tied the report
  to, is the one ``endpoints[].instance`` names), by
  :class:`qosd.controller.core.ReplicaWeights`, written with
  ``SocketLayer.set_weights`` when the kernel holds others.

Each write is level-triggered (compared with what the kernel holds every
window); a failure is logged (qosd's log limiter: once per call site per
10 s), counted (``mmmesh_controller_kernel_writes_total{target,result}``) and
tried again next window.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from mmmesh.abi import MAX_BOOSTS
from mmmesh.dataplane import Boost, Overrides, StageOverride
from qosd.config import SockStageConfig
from qosd.controller.core import Decision, Law, ReplicaWeights, replica_measures, weight_list
from qosd.model import BoardView, PolicySource

__all__ = ["KernelWriter", "OverrideWriter", "ReplicaWeightsHost", "render_kernel",
           "stage_overrides"]

log = logging.getLogger("qosd.controller.host")


class OverrideWriter(Protocol):
    """Where stage overrides go (qosd.reconciler.Reconciler.set_overrides)."""

    def set_overrides(self, version: int, overrides: Overrides) -> bool | None:
        """Writes ``overrides`` for ``version`` when the kernel holds others
        (True), leaves them (False); None when ``version`` is not the kernel's."""
        ...


class ReplicaWeightsHost(Protocol):
    """Where replica weights go (qosd.socklayer.SocketLayerHost)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def result(self) -> object | None:
        """The layer's last successful start (None: not up)."""
        ...
    def weights(self) -> dict[int, tuple[int, ...]]: ...
    def set_weights(self, stage: int, weights: list[int]) -> bool: ...


class KernelWriter:
    """Writes one decision's stage overrides (through ``overrides``) and the
    replica weights of ``stages`` (qosd.yaml ``socket_layer.stages``, through
    ``host``), judged from ``board``'s windows against ``policy``'s objectives."""

    def __init__(self, stages: Sequence[SockStageConfig], law: Law, *,
                 overrides: OverrideWriter, host: ReplicaWeightsHost, policy: PolicySource,
                 board: BoardView) -> None:
        self.overrides = overrides
        self.host = host
        self.policy = policy
        self.board = board
        self.senders = {st.name: st.sender_prefixes() for st in stages}
        self.weighted = {st.name: (st.id, sorted({e.replica for e in st.endpoints}))
                         for st in stages if len({e.replica for e in st.endpoints}) >= 2}
        self.who = {(st.name, e.instance): e.replica for st in stages for e in st.endpoints
                    if e.instance is not None}
        self.replicas = ReplicaWeights({n: rs for n, (_, rs) in self.weighted.items()}, law)
        self.desired = Overrides()
        self.counts: Counter[tuple[str, str]] = Counter()  # (target, ok|error) -> writes
        self.last_error: dict[str, str] = {}

    def write(self, version: int, decision: Decision, now: float) -> None:
        """The kernel side of one window; never raises."""
        self._overrides(version, decision)
        if self.host.enabled and self.weighted:
            self._replica_weights(now)

    def release(self, version: int) -> bool:
        """Takes back what the controller writes (stage overrides, replica
        weights: equal again), for a controller that is switched off; True once
        the kernel holds none of it.  Never raises."""
        ok = True
        self.desired = Overrides()
        try:
            done = self.overrides.set_overrides(version, self.desired)
            if done is None:  # not reconciled yet: again next window
                ok = False
            elif done:
                log.info("SLA controller (off): stage overrides removed")
        except Exception as e:  # noqa: BLE001 - counted and logged; tried again
            self._failed("overrides", e)
            ok = False
        if self.host.enabled and self.weighted:
            if self.host.result is None:
                return False  # not up (yet): again next window
            self.replicas = ReplicaWeights({n: rs for n, (_, rs) in self.weighted.items()},
                                           self.replicas.law)
            ok = self._push_weights() and ok
        return ok

    def _overrides(self, version: int, decision: Decision) -> None:
        self.desired = stage_overrides(decision.stage_weights, self.senders)
        try:
            wrote = self.overrides.set_overrides(version, self.desired)
        except Exception as e:  # noqa: BLE001 - counted and logged; the loop goes on
            self._failed("overrides", e)
            return
        if wrote:
            self.counts[("overrides", "ok")] += 1
            self.last_error.pop("overrides", None)
            log.info("SLA controller: stage overrides now %s",
                     _overrides_text(self.desired) or "none")

    def _replica_weights(self, now: float) -> None:
        cur = self.policy.current()
        if cur is None:
            return
        objectives = {c.name: c.sla for c in cur.policy.classes}
        rows = self.board.view(now)["instances"]
        changed = self.replicas.step(now, replica_measures(rows, self.who, now), objectives)
        if changed:
            log.info("SLA controller: replica weights %s: %s", ", ".join(changed),
                     self.replicas.weights())
        if self.host.result is None:
            return  # not up (yet): start/ensure report why
        self._push_weights()

    def _push_weights(self) -> bool:
        """Writes every weighted stage's replica weights where the kernel holds
        others; False if a write failed (counted and logged; tried again)."""
        ok = True
        for name, by_replica in self.replicas.weights().items():
            sid, reps = self.weighted[name]
            try:
                if self.host.set_weights(sid, weight_list(by_replica, reps)):
                    self.counts[("replica_weights", "ok")] += 1
                    self.last_error.pop("replica_weights", None)
            except Exception as e:  # noqa: BLE001 - counted and logged; the loop goes on
                self._failed("replica_weights", e, f" of stage {name} ({sid})")
                ok = False
        return ok

    def _failed(self, target: str, e: Exception, what: str = "") -> None:
        self.counts[(target, "error")] += 1
        self.last_error[target] = f"{type(e).__name__}: {e}"
        log.warning("SLA controller: writing %s%s failed: %s (tried again next window)",
                    target.replace("_", " "), what, e)

    def explain(self) -> dict[str, Any]:
        """``explain()["kernel"]``: the stage overrides wanted, the replica
        weights and their reasons, the kernel's weights, the write counters."""
        kernel_w: dict[int, tuple[int, ...]] = {}
        try:
            kernel_w = self.host.weights()
        except Exception as e:  # noqa: BLE001 - explain shows what it can
            self.last_error.setdefault("replica_weights", f"{type(e).__name__}: {e}")
        per = self.replicas.explain()
        return {
            "stage_overrides": [s.as_dict() for s in self.desired.stages],
            "stage_senders": self.senders,
            "socket_layer": self.host.enabled,
            "replicas": {name: {"stage_id": sid, "replicas": per.get(name, []),
                                "kernel": list(kernel_w.get(sid, ()))[: max(reps) + 1]
                                if sid in kernel_w else None}
                         for name, (sid, reps) in sorted(self.weighted.items())},
            "writes": {f"{t}/{r}": n for (t, r), n in sorted(self.counts.items())},
            "last_error": dict(self.last_error),
        }


def stage_overrides(stage_weights: Any, senders: dict[str, list[str]]) -> Overrides:
    """``Overrides.from_stage_weights`` made writable as one set: a prefix two
    stages share (two stages at one address) keeps the larger weight, and a
    class keeps at most ``MAX_BOOSTS`` different weights (its boost leaves):
    a weight below the largest ``MAX_BOOSTS`` is lowered to the next kept one,
    or left out below them all.  The kernel refuses the whole set otherwise,
    window after window."""
    best: dict[tuple[str, str], int] = {}
    for s in Overrides.from_stage_weights(stage_weights, senders).stages:
        w = int(s.boost.weight or 0)
        best[(s.cls, s.prefix)] = max(w, best.get((s.cls, s.prefix), w))
    kept: dict[str, list[int]] = {}
    for (cls, _), w in best.items():
        kept.setdefault(cls, []).append(w)
    top = {c: sorted(set(ws), reverse=True)[:MAX_BOOSTS] for c, ws in kept.items()}
    out = []
    for (cls, prefix), w in sorted(best.items()):
        fit = [k for k in top[cls] if k <= w]
        if fit:
            out.append(StageOverride(cls, prefix, Boost(weight=fit[0])))
    return Overrides(stages=tuple(out))


def _overrides_text(o: Overrides) -> str:
    return ", ".join(f"{s.cls} from {s.prefix} -> weight {s.boost.weight}" for s in o.stages)


def render_kernel(k: dict[str, Any]) -> str:
    """The kernel part of ``mmmeshctl sla explain``'s text."""
    lines = ["", "kernel:"]
    ovr = k.get("stage_overrides") or []
    lines.append("  stage overrides: " + (", ".join(
        f"{o['class']} from {o['prefix']} -> weight {o.get('weight')}" for o in ovr) or "none"))
    if not k.get("stage_senders"):
        lines.append("    (no stages in qosd.yaml socket_layer.stages: stage weights have no "
                     "senders to steer)")
    if not k.get("socket_layer"):
        lines.append("  replica weights: socket layer off")
    for name, st in (k.get("replicas") or {}).items():
        lines.append(f"  replica weights of {name} (stage {st['stage_id']}), kernel "
                     f"{st['kernel']}:")
        for r in st["replicas"]:
            last = r["history"][-1] if r["history"] else None
            lines.append(f"    replica {r['replica']}: weight {r['weight']} (share "
                         f"{r['share']:.2f}), {r['verdict'] or 'not judged yet'}"
                         + (f": {r['why']}" if r["why"] else "")
                         + (f"; {r['note']}" if r["note"] else "")
                         + (f"; last {last['change']}: {last['why']}" if last else ""))
    for t, e in sorted((k.get("last_error") or {}).items()):
        lines.append(f"  last {t} error: {e}")
    return "\n".join(lines) + "\n"
