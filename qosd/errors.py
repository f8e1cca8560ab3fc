"""qosd's errors, all under mmmesh's MeshError root (see mmmesh/errors.py).

    MeshError
    └── QosdError
        ├── ConflictError          base_version is not the current version
        ├── MeshManagedError       a node-local apply on a node that follows a mesh policy
        ├── NotFoundError          no such policy version
        ├── UnrealizableError      valid policy that this node cannot apply
        │                          (device missing, guarantees above link rate)
        └── StoreCorruptError      a state file failed its checks (never replaced silently)
"""

from __future__ import annotations

from mmmesh.errors import MeshError


class QosdError(MeshError):
    """Root of qosd's errors."""


class ConflictError(QosdError):
    def __init__(self, base_version: int, current_version: int) -> None:
        self.base_version = base_version
        self.current_version = current_version
        super().__init__(
            f"policy changed: your edit is based on version {base_version}, "
            f"the current version is {current_version}"
        )


class MeshManagedError(QosdError):
    """This node runs a mesh-wide policy (``mmmeshctl policy apply --cluster``):
    a node-local apply or rollback would be taken back by the next rollout
    step, so it is refused."""

    def __init__(self, mesh_version: str) -> None:
        self.mesh_version = mesh_version
        super().__init__(
            f"this node follows the mesh policy {mesh_version}: change it for the whole "
            "mesh (mmmeshctl policy apply --cluster), not on one node")


class NotFoundError(QosdError, KeyError):
    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(what)

    def __str__(self) -> str:
        return self.what


class UnrealizableError(QosdError, ValueError):
    """A valid policy this node cannot realise; ``errors`` as in PolicyError."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = list(errors)
        body = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in self.errors)
        super().__init__(f"policy cannot be applied on this node: {body}")


class StoreCorruptError(QosdError):
    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")
