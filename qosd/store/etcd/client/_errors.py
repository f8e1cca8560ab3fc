"""The client's errors: one tree under :class:`mmmesh.errors.MeshError`::

    EtcdError              anything etcd refused or that went wrong talking to it
    +-- Unavailable        no answer (no member reachable, no leader, timeout): retry later;
    |                      a write that ended so may or may not have been applied
    +-- Compacted          the revision asked for is below etcd's compaction: re-list
    +-- LeaseNotFound      the lease expired (or was revoked): keys bound to it are gone
"""

from __future__ import annotations

from mmmesh.errors import MeshError

__all__ = ["Compacted", "EtcdError", "LeaseNotFound", "Unavailable"]


class EtcdError(MeshError):
    """etcd refused a request, or talking to it failed."""


class Unavailable(EtcdError):
    """No member answered in time (down, partitioned, no leader): retry later.
    A write that ends with this may or may not have been applied."""


class Compacted(EtcdError):
    """The revision asked for was compacted away; ``revision`` is the
    compaction's: list again (a watch cannot resume below it)."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted (compaction at {revision}): list again")
        self.revision = revision


class LeaseNotFound(EtcdError):
    """The lease is gone (expired or revoked), and every key bound to it."""
