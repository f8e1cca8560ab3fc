"""Realising a mesh version on this node: the one path both back ends take.

localise the text to this node's link (qosd.yaml ``mesh_link``), check it
is realisable here, apply it through the store (prepare -> kernel ->
activate) with the mesh version in the version's note.  The outcome is an
ACK, or a NACK whose reason is the error (xDS: a NACK keeps the previous
version).  Runs in a worker thread; never raises.
"""

from __future__ import annotations

import logging
from typing import Any

from mmmesh.errors import MeshError
from qosd.mesh.rollout.core import LinkOverride, MeshVersion, localise_policy

log = logging.getLogger("qosd.store.cluster")

__all__ = ["applied_version", "link_override", "realise"]


def link_override(cfg: Any) -> LinkOverride | None:
    """This node's ``mesh_link`` as the rollout's LinkOverride (None without one)."""
    link = cfg.mesh_link
    if link is None:
        return None
    return LinkOverride(link.device, int(link.rate) if link.rate else None)


def applied_version(service: Any) -> MeshVersion | None:
    """The mesh version the node's store runs (from its current version's note)."""
    cur = service.store.current()
    return MeshVersion.from_note(cur.note) if cur is not None else None


def realise(service: Any, link: LinkOverride | None, version: MeshVersion, text: str,
            author: str) -> tuple[bool, str]:
    """Localise, check and apply ``text`` as mesh ``version``: (ok, reason)."""
    ok, reason = True, ""
    try:
        pol = localise_policy(text, link)
        service.reconciler.check_realizable(pol)
        service.apply_mesh(pol, version.note(), author or "mesh")
    except MeshError as e:
        ok, reason = False, str(e)
    except Exception as e:  # never leave the rollout waiting
        log.exception("rollout: realising %s failed", version)
        ok, reason = False, f"internal error: {e}"
    log.info("rollout: %s %s%s", version, "ACK" if ok else "NACK",
             f": {reason}" if reason else "")
    return ok, reason
