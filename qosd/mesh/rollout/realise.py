"""Realising a mesh version on this node: the rollout's one path, whichever
cluster back end carries it (gossip: qosd/mesh/rollout/host.py; etcd:
qosd/store/etcd/store.py).

localise the text to this node's link (qosd.yaml ``mesh_link``), check it
is realisable here, apply it through the node's :class:`MeshApplier`
(qosd.applier.PolicyApplier: store prepare -> kernel -> activate) with the
mesh version in the version's note.  The outcome is an ACK, or a NACK whose
reason is the error (xDS: a NACK keeps the previous version).  Runs in a
worker thread; never raises.
"""

from __future__ import annotations

import logging
from typing import Protocol

from mmmesh.errors import MeshError
from mmmesh.policy import Policy
from qosd.config import QosdConfig
from qosd.mesh.rollout.core import LinkOverride, MeshVersion, localise_policy
from qosd.model import PolicySource, PolicyVersion

log = logging.getLogger("qosd.store.cluster")  # the name these lines have always had

__all__ = ["MeshApplier", "applied_version", "link_override", "realise"]


class MeshApplier(Protocol):
    """Where a mesh version is applied on this node (qosd.applier.PolicyApplier)."""

    def check_realizable(self, policy: Policy) -> None:
        """Raises UnrealizableError if this node cannot apply ``policy``."""
        ...

    def apply_mesh(self, policy: Policy, note: str, author: str) -> PolicyVersion:
        """Applies ``policy`` as a new local version noted ``note``."""
        ...


def link_override(cfg: QosdConfig) -> LinkOverride | None:
    """This node's ``mesh_link`` as the rollout's LinkOverride (None without one)."""
    link = cfg.mesh_link
    if link is None:
        return None
    return LinkOverride(link.device, int(link.rate) if link.rate else None)


def applied_version(policy: PolicySource) -> MeshVersion | None:
    """The mesh version the node runs (from its current version's note)."""
    cur = policy.current()
    return MeshVersion.from_note(cur.note) if cur is not None else None


def realise(applier: MeshApplier, link: LinkOverride | None, version: MeshVersion, text: str,
            author: str) -> tuple[bool, str]:
    """Localise, check and apply ``text`` as mesh ``version``: (ok, reason)."""
    ok, reason = True, ""
    try:
        pol = localise_policy(text, link)
        applier.check_realizable(pol)
        applier.apply_mesh(pol, version.note(), author or "mesh")
    except MeshError as e:
        ok, reason = False, str(e)
    except Exception as e:  # never leave the rollout waiting
        log.exception("rollout: realising %s failed", version)
        ok, reason = False, f"internal error: {e}"
    log.info("rollout: %s %s%s", version, "ACK" if ok else "NACK",
             f": {reason}" if reason else "")
    return ok, reason
