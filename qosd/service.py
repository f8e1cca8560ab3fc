"""QosdService: the admin API's facade over the node's parts.

It answers the routes of qosd/api/ (the :class:`qosd.model.Service`
protocol and the optional cluster methods the routes look for) from the
parts qosd/daemon.py built and hands it: the policy store (reads), the
reconciler (what the kernel holds), the :class:`~qosd.applier.PolicyApplier`
(every write), the SLA board and the report senders, the SLA controller's
explanation, the socket layer's status and, in a mesh, the cluster store
and the peers.  It builds none of them and starts nothing.

A node-local apply or rollback is refused here while the node runs a
mesh-wide version (``MeshManagedError``); everything else is the applier's."""

from __future__ import annotations

import dataclasses
import difflib
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from mmmesh import abi
from mmmesh.errors import MeshError
from mmmesh.policy import Policy, parse_policy
from mmmesh.sla.report import SlaReport
from qosd.sla.board import SlaBoard
from qosd.store.base import ClusterStore
from qosd.store.local import PolicyStore

from .applier import PolicyApplier
from .errors import MeshManagedError
from .identity import ADMIN, Peer, ReportRefused, Sender, SenderResolver
from .model import FlowRow, PolicyVersion, ReconcileResult
from .reconciler import Reconciler

if TYPE_CHECKING:
    from qosd.mesh.membership.peers import Peers

__all__ = ["Explainer", "QosdService", "StatusSource"]


class Explainer(Protocol):
    """The SLA controller as the API shows it (qosd.controller.host.SlaController)."""

    def explain(self) -> dict[str, Any] | None: ...


class StatusSource(Protocol):
    """A part that reports its status (qosd.socklayer.SocketLayerHost)."""

    def status(self) -> dict[str, Any]: ...


class QosdService:
    def __init__(self, *, node_name: str, store: PolicyStore, reconciler: Reconciler,
                 applier: PolicyApplier, board: SlaBoard, senders: SenderResolver,
                 controller: Explainer, socket_layer: StatusSource,
                 cluster: ClusterStore | None = None, peers: Peers | None = None,
                 started_at: float | None = None) -> None:
        """``cluster``: the cluster store (None: this node runs alone);
        ``peers``: the gossip back end's membership (GET /v1/cluster/members);
        ``started_at``: when qosd started (default: now)."""
        self._node_name = node_name
        self._store = store
        self._reconciler = reconciler
        self._applier = applier
        self._board = board
        self._senders = senders
        self._controller = controller
        self._socket_layer = socket_layer
        self._cluster = cluster
        self._peers = peers
        self.started_at = time.time() if started_at is None else started_at
        self._flow_prev: dict[tuple[Any, ...], tuple[int, float]] = {}
        self._flow_lock = threading.Lock()

    @property
    def peers(self) -> Peers | None:
        """The membership GET /v1/cluster/members reads (qosd/api/cluster.py);
        None without a ``peers:`` section (or with the etcd back end)."""
        return self._peers

    # ----------------------------------------------------------- policy
    def policy(self) -> PolicyVersion | None:
        return self._store.current()

    def validate(self, text: str) -> Policy:
        pol = parse_policy(text)
        self._applier.check_realizable(pol)
        return pol

    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        self._refuse_if_mesh_managed()
        pol = self.validate(text)
        return self._applier.apply(pol, base_version=base_version, author=author)

    def _refuse_if_mesh_managed(self) -> None:
        store = self._cluster
        desired = store.mesh_desired() if store is not None else None
        if desired is not None:
            raise MeshManagedError(str(desired))

    def cluster_rollout(self) -> Any:
        """The rollout provider (PUT /v1/cluster/policy, GET /v1/cluster/rollout);
        None without a cluster store."""
        store = self._cluster
        return store.rollout() if store is not None else None

    def cluster_members(self) -> dict[str, Any] | None:
        """GET /v1/cluster/members from a back end other than gossip (None: the
        route reads ``peers``)."""
        store = self._cluster
        return store.members() if store is not None else None

    def diff(self, text: str) -> str:
        new = parse_policy(text).to_yaml()
        cur = self._store.current()
        old = cur.text if cur else ""
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"version {cur.version}" if cur else "none", tofile="proposed",
        ))

    def history(self) -> list[PolicyVersion]:
        return self._store.history()

    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        self._refuse_if_mesh_managed()
        return self._applier.rollback(to_version, base_version=base_version, author=author)

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        cur = self._store.current()
        uplinks: dict[str, Any] = {}
        if cur is not None:
            dev = cur.policy.link.device
            try:
                uplinks[dev] = self._reconciler.dataplane(dev).status(cur.policy).as_dict()
            except MeshError as e:
                uplinks[dev] = {"error": str(e)}
        last = self._reconciler.last_result
        return {
            "node": self._node_name,
            "policy_version": cur.version if cur else 0,
            "uplinks": uplinks,
            "last_reconcile": dataclasses.asdict(last) if last else None,
            "store_problems": list(self._store.problems),
            "started_at": self.started_at,
            "adopted": self._reconciler.adopted,
            "sla": self.sla(),  # {"instances", "stages", "classes"}
            # {"backend", "up", ...} (qosd/store); None: this node runs alone
            "cluster": self._cluster.status() if self._cluster is not None else None,
            # {"enabled", "cgroup", "loaded", "attached", "prog_ids", ...} (qosd/socklayer.py)
            "socket_layer": self._socket_layer.status(),
        }

    def top_flows(self, n: int = 20) -> list[FlowRow]:
        """The busiest flows, rates from the byte counts since the last call."""
        cur = self._store.current()
        if cur is None:
            return []
        names = {c.id: c.name for c in cur.policy.classes}
        try:
            flows = self._reconciler.dataplane(cur.policy.link.device).flows()
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
                    mod = abi.Modality(f.modality).name.lower()
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
            sender = self._senders.resolve(peer)
        except ReportRefused as e:
            self._board.refused(e.code)
            raise
        self._board.admit(sender)
        return sender

    def report_sla(self, report: SlaReport, sender: Sender = ADMIN) -> int:
        return self._board.report(report, sender)

    def sla(self) -> dict[str, Any]:
        """{"instances", "stages", "classes", "skipped"}: qosd/sla/board.py."""
        return self._board.view()

    def sla_explain(self) -> dict[str, Any] | None:
        """The SLA controller's explanation (GET /v1/sla/explain); None before a policy."""
        return self._controller.explain()

    def cluster_sla(self, nodes: bool = True) -> dict[str, Any] | None:
        """The global SLA view (GET /v1/cluster/sla); None without a cluster store."""
        store = self._cluster
        return store.sla(nodes) if store is not None else None

    def cluster_sla_breakdown(self, node: str | None = None) -> dict[str, Any] | None:
        """Each node's own part of the view, asked on demand (GET
        /v1/cluster/sla?nodes=true or ?node=X); None without a cluster store."""
        store = self._cluster
        return store.sla_breakdown(node) if store is not None else None

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._reconciler.last_good is not None
