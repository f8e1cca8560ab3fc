"""Named crash points for testing crash consistency (as etcd's gofail or
FoundationDB's BUGGIFY, much smaller): ``failpoint("store.activate.current")``
kills the process with SIGKILL right there when ``MMMESH_FAILPOINTS`` (read
once, at import) names that point: ``name`` kills the first time it is
reached, ``name@k`` the k-th time (qosd's start-up reconcile passes the
dataplane's points once before any apply).  Unset, a failpoint is one dict
lookup.

The points are listed in ``POINTS`` (a test checks that every point in the
code is listed and that every listed point is reached by an apply); the
tests in tests/system/qosd/test_crash_apply.py kill qosd at each of them during an apply
and check what the kernel and the store hold afterwards.
"""

from __future__ import annotations

import os
import signal

# name -> where it is (in the order an apply reaches them)
POINTS: dict[str, str] = {
    "store.prepare.written": "qosd/store/local.py: the pending version file is on disk",
    "dataplane.up.pinned": "dataplane/_handle.py: programs and maps pinned (or adopted)",
    "dataplane.up.htb_added": ("dataplane/_handle.py: the new policy's HTB classes and boost "
                               "leaves exist (set_overrides passes it too)"),
    "maps.classes_written": "dataplane/_maps.py: class_map holds the new classes",
    "maps.refs_written": "dataplane/_maps.py: modalities, sources and config point at them",
    "dataplane.up.maps_written": "dataplane/_handle.py: the maps hold the new policy",
    "maps.boosts_written": "dataplane/_maps.py: boost_map marks the new boost leaves valid",
    "maps.overrides_written": "dataplane/_maps.py: stage/flow overrides point at them",
    "maps.overrides_pruned": "dataplane/_maps.py: stale overrides and unused boosts removed",
    "dataplane.up.htb_pruned": ("dataplane/_handle.py: classes of the old policy and unused "
                                "boost leaves deleted"),
    "dataplane.up.attached": "dataplane/_handle.py: programs attached",
    "service.apply.reconciled": "qosd/applier.py: the kernel holds the new version",
    "store.activate.current": "qosd/store/local.py: current.json names the new version",
    "store.activate.renamed": "qosd/store/local.py: the version file is no longer pending",
}

def _armed(spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in spec.split(","):
        name, _, nth = item.strip().partition("@")
        if name:
            out[name] = int(nth) if nth.isdigit() else 1
    return out


_ARMED = _armed(os.environ.get("MMMESH_FAILPOINTS", ""))


def failpoint(name: str) -> None:
    """SIGKILL this process if ``name`` is armed and reached for the armed
    time (no cleanup, like a crash)."""
    left = _ARMED.get(name)
    if left is None:
        return
    if left <= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _ARMED[name] = left - 1
