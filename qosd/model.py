"""The contract between qosd's parts (read this before writing any of them).

qosd/daemon.py builds the parts and hands each the narrow interfaces it
needs; the ones several parts share are here: a :class:`PolicySource` (the
version the node runs: the policy store) and a :class:`BoardView` (the
sidecars' windows: the SLA board).  The others live next to the part that
asks for them (qosd/mesh/rollout/realise.py ``MeshApplier``,
qosd/controller/host.py and kernel.py, qosd/store/base.py ``ClusterStore``).

``QosdService`` (qosd/service.py, the :class:`Service` below) is the one
object the HTTP APIs (qosd/api/) talk to.  All its methods are thread-safe
and synchronous; the APIs call them from a worker thread
(``run_in_threadpool``).  Which endpoint calls which method:

    GET  /v1/policy                           policy()
    GET  /v1/policy/versions/{version}        history()
    POST /v1/policy/validate                  validate()
    PUT  /v1/policy                           apply()
    POST /v1/policy/diff                      diff()
    GET  /v1/policy/history                   history()
    POST /v1/policy/rollback                  rollback()
    GET  /v1/status                           status()
    GET  /v1/flows/top                        top_flows()
    POST /v1/sla                              sla_sender() (sla.sock only), report_sla()
    GET  /v1/sla                              sla()
    GET  /v1/sla/explain                      sla_explain()
    GET  /v1/cluster/members                  cluster_members(), else peers.snapshot()
    PUT  /v1/cluster/policy                   cluster_rollout().propose()
    GET  /v1/cluster/rollout                  cluster_rollout().table()
    GET  /v1/cluster/sla                      cluster_sla()
    GET  /healthz, /readyz                    healthy(), ready()

(the /v1/cluster routes answer 404 ``not_found`` when the node runs alone:
no ``peers:`` section and no etcd back end).

Errors are qosd/errors.py's or mmmesh/errors.py's (PolicyError,
DataplaneError); the table in qosd/api/errors.py says what each becomes in
HTTP (e.g. PolicyError 422 "invalid_policy" with [[field, message], ...],
ConflictError 409 with base_version and current_version, DataplaneError 503
when the kernel side failed and the last good state is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mmmesh.policy import Policy
from mmmesh.sla.report import SlaReport

from .identity import ADMIN, Peer, Sender

MAX_YAML_BYTES = 1 << 20
"""A policy document, UTF-8 (the API refuses a longer one, naming the field)."""
MAX_BODY_BYTES = 6 * MAX_YAML_BYTES + 64 * 1024
"""A request body: one holding the largest policy, even fully \\u-escaped, stays
below it.  The HTTP server (qosd/httpd) refuses a longer body before reading it."""


@dataclass(frozen=True)
class PolicyVersion:
    """One accepted policy.  ``text`` is canonical YAML (``policy.to_yaml()``)."""

    version: int
    policy: Policy
    text: str
    sha256: str  # of text (utf-8)
    created_at: float  # unix seconds
    author: str | None = None
    note: str | None = None  # e.g. "rollback to 3"


@dataclass(frozen=True)
class ReconcileResult:
    """One reconcile, complete before anybody sees it (the reconciler builds it)."""

    ok: bool
    version: int  # policy version that is now in the kernel (last good on failure)
    started_at: float
    duration_s: float
    trigger: str  # "apply" | "rollback" | "resync" | "startup" | "restore"
    repaired: tuple[str, ...] = ()  # drift this reconcile found and (if ok) fixed
    error: str | None = None


@dataclass(frozen=True)
class FlowRow:
    src: str
    dst: str
    sport: int
    dport: int
    proto: str  # "tcp"
    class_name: str | None
    class_id: int
    modality: str | None
    packets: int
    bytes: int
    idle_s: float  # since last packet
    rate_bps: float  # estimated from two samples, 0 on the first call


class PolicySource(Protocol):
    """The policy version the node runs (qosd.store.local.PolicyStore)."""

    def current(self) -> PolicyVersion | None:
        """The current version; None before the first policy."""
        ...


def p99_targets(source: PolicySource) -> dict[str, float] | None:
    """Each class's p99 objective (ms) in ``source``'s current policy (None before one)."""
    cur = source.current()
    return cur.policy.p99_targets() if cur is not None else None


class BoardView(Protocol):
    """The sidecars' latest SLA windows (qosd.sla.board.SlaBoard)."""

    def view(self, now: float | None = None) -> dict[str, Any]:
        """{"instances", "stages", "classes", "skipped"}: the body of ``GET /v1/sla``."""
        ...


class Service(Protocol):
    def policy(self) -> PolicyVersion | None: ...
    def validate(self, text: str) -> Policy:
        """Parses and checks a policy (schema + realisable on this node).
        Raises PolicyError or UnrealizableError; changes nothing."""
        ...
    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        """Validates, stores as a new version, reconciles the kernel.  On a
        kernel failure the store is not changed and the kernel is put back to
        the last good version (DataplaneError raised)."""
        ...
    def diff(self, text: str) -> str:
        """Unified diff (canonical YAML) from the current policy to ``text``."""
        ...
    def history(self) -> list[PolicyVersion]: ...  # newest first
    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]: ...
    def status(self) -> dict[str, Any]:
        """{"node": str, "policy_version": int, "uplinks": {dev: Dataplane.status(...)
        as dict}, "last_reconcile": ReconcileResult as dict | None, "store_problems":
        [str], "started_at": float, "adopted": bool, "sla": sla(), "cluster":
        ClusterStore.status() | None, "socket_layer": SocketLayerHost.status()}"""
        ...
    def top_flows(self, n: int = 20) -> list[FlowRow]: ...
    def sla_sender(self, peer: Peer) -> Sender:
        """Who is sending on sla.sock (qosd/identity.py), from the connection's
        credentials.  Raises qosd.identity.ReportRefused (403) for a sender
        that may report nothing; called before the body is validated.  (The
        admin socket's sender is qosd.identity.ADMIN.)"""
        ...
    def report_sla(self, report: SlaReport, sender: Sender = ADMIN) -> int:
        """Keeps a sender's windows (the validated body of ``POST /v1/sla``);
        returns how many (class, modality) windows were kept.  Raises
        ReportRefused: 403 (that stage is not the sender's), 429 (rate or
        quota)."""
        ...
    def sla(self) -> dict[str, Any]:
        """{"instances", "stages", "classes", "skipped"}: a
        mmmesh.sla.report.SlaView (qosd/sla/board.py), the body of ``GET /v1/sla``."""
        ...
    def healthy(self) -> bool: ...  # process is alive and serving
    def ready(self) -> bool: ...  # dataplane loaded and a policy reconciled
