"""QosdService: the node daemon's core, behind the admin API and metrics.

It owns the policy store and the reconciler.  Applying a policy is
validate -> realisable on this node? -> the store prepares a version (its
number is taken, it is not current) -> reconcile the kernel -> the store
activates it.  The store only moves when the kernel took the policy, so the
current version in the store is the version in the kernel (after a failure
both stay at the last good one; the prepared version is abandoned)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import threading
import time
from typing import Any

from mmmesh import abi as _abi
from mmmesh.errors import MeshError
from mmmesh.failpoints import failpoint
from mmmesh.policy import Policy, parse_policy
from mmmesh.sla.report import SlaReport
from qosd.sla.board import SlaBoard
from qosd.store.local import PolicyStore

from .config import QosdConfig
from .errors import MeshManagedError, StoreCorruptError
from .identity import ADMIN, Peer, ReportRefused, Sender, SenderResolver
from .model import FlowRow, PolicyVersion, ReconcileResult
from .reconciler import Reconciler

log = logging.getLogger("qosd.service")


class QosdService:
    def __init__(self, cfg: QosdConfig, metrics: Any | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics  # qosd.metrics.QosdMetrics or None
        self.started_at = time.time()
        self.store = PolicyStore(cfg.state_dir, history_limit=cfg.history_limit)
        self.reconciler = Reconciler(cfg, on_result=self._observe, on_adoption=self._adoption)
        self._write_lock = threading.Lock()
        self._flow_prev: dict[tuple[Any, ...], tuple[int, float]] = {}
        self._flow_lock = threading.Lock()
        self.sla_senders = SenderResolver()
        from qosd.controller.host import SlaController

        from .socklayer import SocketLayerHost

        self.socket_layer = SocketLayerHost(cfg.socket_layer)  # off unless socket_layer.enabled

        self.sla_controller = SlaController(self)
        self.sla_board = SlaBoard(cfg.sla_limits, cfg.sla_reporters)
        self.peers: Any = None  # qosd.mesh.membership.peers.Peers with a peers: section (qosd/mesh/membership: start_peers)
        self.cluster_sla_app: Any = None  # qosd.mesh.slaview.host.ClusterSla, with the peers
        self.cluster_rollout_app: Any = None  # qosd.mesh.rollout.host.ClusterRollout, likewise
        # the back end of both (qosd/store: gossip or etcd); None: this node runs alone
        self.cluster_store: Any = None

    # ---------------------------------------------------------- startup
    def start(self) -> ReconcileResult | None:
        """Adopts or loads the dataplane for the current version (or the
        initial policy when the store is empty).  If that fails (an uplink not
        up yet at boot), every resync tries again.

        A version still pending from before (qosd died during an apply: the
        kernel may hold part of it) is undone first: the current version is
        re-applied over it, or, with no current version, the dataplane it
        was being applied to is taken down; then it is abandoned."""
        cur = self.store.current()
        with self._write_lock:
            pending = self.store.pending()
            for pv in pending:
                dev = pv.policy.link.device
                if cur is None or cur.policy.link.device != dev:
                    log.warning("version %d was being applied to %s when qosd stopped: "
                                "removing it from the kernel", pv.version, dev)
                    try:
                        self.reconciler.dataplane(dev).down()
                    except MeshError as e:
                        log.warning("removing version %d from %s: %s", pv.version, dev, e)
        res: ReconcileResult | None = None
        if cur is None and self.cfg.initial_policy is not None:
            from mmmesh.policy import load_policy

            pol = load_policy(self.cfg.initial_policy)
            self.reconciler.check_realizable(pol)
            _, res = self._apply_policy(pol, None, "qosd", "initial policy", "startup")
        elif cur is None:
            log.info("no policy yet: waiting for one (mmmeshctl policy apply)")
        else:
            if pending:
                log.warning("version(s) %s were being applied when qosd stopped: putting "
                            "version %d back", ", ".join(str(p.version) for p in pending),
                            cur.version)
            res = self.reconciler.apply(cur, "startup")
        for pv in pending:
            self._abandon(pv)
        return res

    def resync(self) -> ReconcileResult | None:
        self.socket_layer.ensure()  # up again if it failed, was unpinned or detached
        if self.reconciler.last_good is None and (
                self.store.current() is not None or self.cfg.initial_policy is not None):
            try:
                return self.start()
            except MeshError as e:
                log.warning("start-up reconcile still failing: %s", e)
                return None
        return self.reconciler.resync()

    def _observe(self, res: ReconcileResult) -> None:
        if self.metrics is not None:
            self.metrics.observe_reconcile(res)

    def _adoption(self, how: str) -> None:
        if self.metrics is not None:
            self.metrics.adoption(how)

    # ----------------------------------------------------------- policy
    def policy(self) -> PolicyVersion | None:
        return self.store.current()

    def validate(self, text: str) -> Policy:
        pol = parse_policy(text)
        self.reconciler.check_realizable(pol)
        return pol

    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        self._refuse_if_mesh_managed()
        pol = self.validate(text)
        return self._apply_policy(pol, base_version, author, None, "apply")

    def _apply_policy(self, pol: Policy, base_version: int | None, author: str | None,
                      note: str | None, trigger: str) -> tuple[PolicyVersion, ReconcileResult]:
        with self._write_lock:
            # The store hands out the number (ConflictError here changes nothing).
            pv = self.store.prepare(pol, base_version=base_version, author=author, note=note)
            previous = self.reconciler.last_good
            try:
                res = self.reconciler.apply(pv, trigger)
            except BaseException:
                self._abandon(pv)
                raise
            failpoint("service.apply.reconciled")
            try:
                pv = self.store.activate(pv, base_version=base_version)
            except BaseException:
                # The store did not take it: put the kernel back where the store
                # is, so that the store's current version is the kernel's.
                log.error("policy store refused version %d; restoring version %s in the kernel",
                          pv.version, previous.version if previous else "none")
                self._abandon(pv)
                self.reconciler.revert(previous)
                raise
            return pv, res

    def apply_mesh(self, pol: Policy, note: str, author: str) -> PolicyVersion:
        """Applies a mesh-wide version (localised and checked by the rollout
        host): like ``apply``, with the mesh version in the version's note."""
        pv, _ = self._apply_policy(pol, None, author, note, "cluster")
        return pv

    def _refuse_if_mesh_managed(self) -> None:
        store = self.cluster_store
        desired = store.mesh_desired() if store is not None else None
        if desired is not None:
            raise MeshManagedError(str(desired))

    def cluster_rollout(self) -> Any:
        """The rollout provider (PUT /v1/cluster/policy, GET /v1/cluster/rollout);
        None without a cluster store."""
        store = self.cluster_store
        return store.rollout() if store is not None else None

    def cluster_members(self) -> dict[str, Any] | None:
        """GET /v1/cluster/members from a back end other than gossip (None: the
        route reads ``peers``)."""
        store = self.cluster_store
        return store.members() if store is not None else None

    def _abandon(self, pv: PolicyVersion) -> None:
        with contextlib.suppress(StoreCorruptError):
            self.store.abandon(pv)

    def diff(self, text: str) -> str:
        new = parse_policy(text).to_yaml()
        cur = self.store.current()
        old = cur.text if cur else ""
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"version {cur.version}" if cur else "none", tofile="proposed",
        ))

    def history(self) -> list[PolicyVersion]:
        return self.store.history()

    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        self._refuse_if_mesh_managed()
        old = self.store.get(to_version)
        self.reconciler.check_realizable(old.policy)
        return self._apply_policy(old.policy, base_version, author, f"rollback to {to_version}",
                                  "rollback")

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        cur = self.store.current()
        uplinks: dict[str, Any] = {}
        if cur is not None:
            dev = cur.policy.link.device
            try:
                uplinks[dev] = self.reconciler.dataplane(dev).status(cur.policy).as_dict()
            except MeshError as e:
                uplinks[dev] = {"error": str(e)}
        last = self.reconciler.last_result
        return {
            "node": self.cfg.node_name,
            "policy_version": cur.version if cur else 0,
            "uplinks": uplinks,
            "last_reconcile": dataclasses.asdict(last) if last else None,
            "store_problems": list(self.store.problems),
            "started_at": self.started_at,
            "adopted": self.reconciler.adopted,
            "sla": self.sla(),  # {"instances", "stages", "classes"}
            # {"backend", "up", ...} (qosd/store); None: this node runs alone
            "cluster": self.cluster_store.status() if self.cluster_store is not None else None,
            # {"enabled", "cgroup", "loaded", "attached", "prog_ids", ...} (qosd/socklayer.py)
            "socket_layer": self.socket_layer.status(),
        }

    def top_flows(self, n: int = 20) -> list[FlowRow]:
        """The busiest flows, rates from the byte counts since the last call."""
        cur = self.store.current()
        if cur is None:
            return []
        names = {c.id: c.name for c in cur.policy.classes}
        try:
            flows = self.reconciler.dataplane(cur.policy.link.device).flows()
        except MeshError:
            return []
        now = time.monotonic()
        rows: list[FlowRow] = []
        with self._flow_lock:
            prev_all, seen = self._flow_prev, {}
            for f in flows:
                prev = prev_all.get(f.key)
                rate = 0.0
                if prev is not None and now > prev[1]:
                    rate = max(0.0, (f.bytes - prev[0]) * 8 / (now - prev[1]))
                seen[f.key] = (f.bytes, now)
                try:
                    mod = _abi.Modality(f.modality).name.lower()
                except ValueError:
                    mod = str(f.modality)
                rows.append(FlowRow(
                    src=f.src, dst=f.dst, sport=f.sport, dport=f.dport,
                    proto="tcp" if f.proto == 6 else str(f.proto),
                    class_name=names.get(f.class_id), class_id=f.class_id, modality=mod,
                    packets=f.packets, bytes=f.bytes, idle_s=f.idle_s, rate_bps=rate,
                ))
            self._flow_prev = seen
        rows.sort(key=lambda r: (r.rate_bps, r.bytes), reverse=True)
        return rows[: max(0, n)]

    # -------------------------------------------------------------- SLA
    def sla_sender(self, peer: Peer) -> Sender:
        """The sender behind sla.sock credentials, if it may report at all
        (qosd/identity.py, qosd/sla/reporters.py; ReportRefused 403 otherwise)."""
        try:
            sender = self.sla_senders.resolve(peer)
        except ReportRefused as e:
            self.sla_board.refused(e.code)
            raise
        self.sla_board.admit(sender)
        return sender

    def report_sla(self, report: SlaReport, sender: Sender = ADMIN) -> int:
        return self.sla_board.report(report, sender)

    def sla(self) -> dict[str, Any]:
        """{"instances", "stages", "classes", "skipped"}: qosd/sla/board.py."""
        return self.sla_board.view()

    def sla_explain(self) -> dict[str, Any] | None:
        """The SLA controller's explanation (GET /v1/sla/explain); None before a policy."""
        return self.sla_controller.explain()

    def p99_targets(self) -> dict[str, float] | None:
        """Each class's p99 objective (ms) in the current policy."""
        cur = self.store.current()
        return cur.policy.p99_targets() if cur is not None else None

    def cluster_sla(self, nodes: bool = True) -> dict[str, Any] | None:
        """The global SLA view (GET /v1/cluster/sla); None without a cluster store."""
        store = self.cluster_store
        return store.sla(nodes) if store is not None else None

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.reconciler.last_good is not None
