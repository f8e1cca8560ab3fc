"""The policy this node runs, as an info series (read at scrape time).

    mmmesh_policy_info{version, mesh_version, sha256}   1
    mmmesh_policy_mesh_counter                          the counter of the mesh version
                                                        it runs (none: applied locally)

``version`` is the node's own store number (each node counts its own
history: comparing it across nodes says nothing), ``mesh_version`` the
mesh-wide version it realises (``"12@node-a"``; ``""`` when the policy was
applied on this node alone), ``sha256`` the first 16 hex digits of the
canonical policy text's SHA-256: two nodes run the same policy when it is
equal, whatever their numbers.  ``mmmesh_policy_mesh_counter`` is comparable
across nodes (mesh versions are ordered by their counter first): a node
below the maximum over the mesh runs an older mesh version
(``MmmeshPolicyVersionLagging``).  No series before the first policy."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from qosd.mesh.rollout.core import MeshVersion

from ._spec import Spec, new_families

__all__ = ["POLICY_METRICS", "PolicyCollector", "PolicySource"]

POLICY_METRICS: Spec = {
    "mmmesh_policy_info": (
        "gauge", ("version", "mesh_version", "sha256"),
        ("The policy this node runs, as 1: its local store version, the mesh version it "
         "realises (empty when applied locally) and the first 16 hex digits of its "
         "canonical text's SHA-256 (equal on nodes that run the same policy)")),
    "mmmesh_policy_mesh_counter": (
        "gauge", (), ("The counter of the mesh-wide policy version this node runs "
                      "(comparable across nodes; no series when its policy was applied locally)")),
}


class _Version(Protocol):
    @property
    def version(self) -> int: ...
    @property
    def note(self) -> str | None: ...
    @property
    def text(self) -> str: ...


class PolicySource(Protocol):
    def current(self) -> _Version | None: ...


class PolicyCollector(Collector):
    def __init__(self, source: PolicySource) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return list(new_families(POLICY_METRICS).values())

    def collect(self) -> Iterable[Metric]:
        fams = new_families(POLICY_METRICS)
        cur = self.source.current()
        if cur is not None:
            sha = hashlib.sha256(cur.text.encode()).hexdigest()[:16]
            mesh = MeshVersion.from_note(cur.note)
            fams["mmmesh_policy_info"].add_metric(
                [str(cur.version), str(mesh or ""), sha], 1.0)
            if mesh is not None:
                fams["mmmesh_policy_mesh_counter"].add_metric([], float(mesh.counter))
        return list(fams.values())
