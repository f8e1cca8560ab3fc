"""The contract between qosd's parts (read this before writing any of them).

``QosdService`` (qosd/service.py) is the one object the admin API
(qosd/api.py) and the metrics collector (qosd/metrics.py) talk to.  All its
methods are thread-safe and synchronous; the API calls them from a worker
thread (``run_in_threadpool``).  Errors are from qosd/errors.py or
mmmesh._errors.PolicyError and map to HTTP as:

    PolicyError        422  {"error": "invalid_policy", "message": str, "errors": [[field, msg], ...]}
    UnrealizableError  422  {"error": "unrealizable", "message": str, "errors": [[field, msg], ...]}
    ConflictError      409  {"error": "conflict", "message": str, "base_version": int, "current_version": int}
    NotFoundError      404  {"error": "not_found", "message": str}
    DataplaneError     503  {"error": "dataplane", "message": str}   (kernel side failed; last good state kept)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from mmmesh.policy import Policy


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


@dataclass
class ReconcileResult:
    ok: bool
    version: int  # policy version that is now in the kernel (last good on failure)
    started_at: float
    duration_s: float
    trigger: str  # "apply" | "rollback" | "resync" | "startup"
    repaired: list[str] = field(default_factory=list)  # drift found and fixed
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
        """{"node": str, "policy_version": int, "uplinks": {dev: loader.status(...)},
        "last_reconcile": ReconcileResult as dict | None, "store_problems": [str],
        "started_at": float, "adopted": bool}"""
        ...
    def top_flows(self, n: int = 20) -> list[FlowRow]: ...
    def report_sla(self, report: dict[str, Any]) -> int:
        """Keeps a sidecar's window (api.SlaReport as a dict); returns how many
        (class, modality) entries were taken."""
        ...
    def sla(self) -> dict[str, list[dict[str, Any]]]:
        """{"instances", "stages", "classes"}: an api.SlaView (qosd/slaboard.py)."""
        ...
    def healthy(self) -> bool: ...  # process is alive and serving
    def ready(self) -> bool: ...  # dataplane loaded and a policy reconciled
