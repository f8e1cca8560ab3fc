"""The rollout table: every member's state for one mesh version, derived.

The table is never stored or replayed: it is computed each time from what
this node holds now (its membership view and the latest report of each
node), so it is the same on every node that holds the same reports.

For the table of version T (by default the desired version D), a member is

    gone        dead or left (not in the denominator)
    acked       its latest report is an ACK of T
    nacked      its latest report is a NACK of T (it stays on its previous version)
    superseded  its latest report is about a version above T, or T is below
                D and the member never answered T (it never will)
    pending     otherwise: no report yet, or only about versions below T
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qosd.mesh.membership.core import MemberInfo, State
from qosd.mesh.rollout.core._types import Announcement, MeshVersion, Report, RolloutTable, Row


def row_state(member: State, report: Report | None, target: Announcement | None,
              lost: bool) -> str:
    """The state of one member in the table of ``target`` (``lost``: target < D)."""
    if member >= State.DEAD:
        return "gone"
    if report is None or target is None:
        return "superseded" if lost else "pending"
    about = report.about(target)
    if about > 0:
        return "superseded"
    if about < 0:
        return "superseded" if lost else "pending"
    return "acked" if report.ok else "nacked"


def build_table(node: str, members: Iterable[MemberInfo], reports: Mapping[str, Report],
                desired: Announcement | None, version: MeshVersion | None = None,
                ) -> RolloutTable:
    """The table of ``version`` (default: the desired one) over ``members``."""
    if version is None or (desired is not None and version == desired.version):
        target = desired
    else:
        target = Announcement(version, "")  # any text of that version
    lost = (desired is not None and target is not None
            and target.version < desired.version)
    rows = []
    for m in sorted(members, key=lambda m: m.node):
        r = reports.get(m.node)
        rows.append(Row(
            m.node, row_state(m.state, r, target, lost), m.state.name,
            r.version if r else None, r.applied if r else None, r.reason if r else "",
            r.at if r else None))
    return RolloutTable(node, target.version if target else None, desired,
                        desired.version if lost and desired else None, tuple(rows))
