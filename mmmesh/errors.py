"""The mmmesh exception tree.  Everything mmmesh raises on purpose is a MeshError.

    MeshError                      root; catch this to catch everything of ours
    ├── WireError(ValueError)      malformed MMH bytes: .offset, .reason
    ├── PolicyError(ValueError)    invalid policy, refused whole: .errors [(field, message)]
    ├── DataplaneError(OSError)    kernel side failed (BPF load, map op, netlink)
    │   └── NotSupportedError      the kernel or machine lacks something we need
    └── ClusterError(ValueError)   a mesh membership config or input the core refuses
                                   (qosd/mesh/membership/core/_config.py)
"""

from __future__ import annotations

from collections.abc import Sequence


class MeshError(Exception):
    """Root of every error mmmesh raises on purpose."""


class WireError(MeshError, ValueError):
    """Malformed MMH input.  ``offset`` is the byte where reading failed."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"malformed MMH at byte {offset}: {reason}")


class PolicyError(MeshError, ValueError):
    """A policy was refused whole.  ``errors`` lists (field path, message)."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = list(errors)
        body = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in self.errors)
        super().__init__(f"invalid policy: {body}")


class DataplaneError(MeshError, OSError):
    """A kernel operation (BPF load, map access, netlink) failed."""


class NotSupportedError(DataplaneError):
    """The kernel or machine lacks a feature mmmesh needs."""


def field_path(parts: Sequence[object]) -> str:
    """A validation error location as one field name:
    ``("classes", 0, "rate")`` -> ``"classes[0].rate"``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
