"""What a node holds of the watched prefixes: a sans-I/O mirror of etcd.

The host lists ``P/policy/``, ``P/members/`` and ``P/sla/`` at one revision
(:meth:`Mirror.reset`), then feeds every watch batch after it
(:meth:`Mirror.apply`).  A reset after a compaction or a reconnect is a full
re-list: whatever the mirror held that is no longer in etcd is treated as
deleted, so no update is lost whatever the watch missed.  Members are the
nodes whose leased ``P/members/<node>`` key exists; a deleted one (its lease
expired, or it revoked it on leaving) is *gone*: kept as a tombstone for
``GONE_RETENTION_S`` so rollout tables show it as ``gone``, and its SLA
windows leave the view at once (``SlaView.on_member_gone``), as a dead
member's do with gossip.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from qosd.mesh.membership.core import MemberInfo, State
from qosd.mesh.slaview.core import SlaView
from qosd.store.etcd.client import KeyValue, WatchEvent
from qosd.store.etcd.keys import Dropped, Layout, MemberRecord, PolicyRecord

log = logging.getLogger("qosd.store.cluster")

GONE_RETENTION_S = 300.0
MAX_GONE = 4096


@dataclass
class MirrorStats:
    events: int = 0
    resets: int = 0
    malformed: dict[str, int] = field(default_factory=dict)

    def bad(self, what: str) -> None:
        self.malformed[what] = self.malformed.get(what, 0) + 1


class Mirror:
    """The desired policy, the members and (with a view) everyone's SLA windows."""

    def __init__(self, node_id: str, layout: Layout, view: SlaView | None = None) -> None:
        self.node_id = node_id
        self.layout = layout
        self.view = view
        self.revision = 0
        self.desired: PolicyRecord | None = None
        self.members: dict[str, MemberRecord] = {}
        self.gone: dict[str, tuple[float, bool, MemberRecord]] = {}  # node -> (at, left, last)
        self.stats = MirrorStats()

    # -- input ---------------------------------------------------------------------
    def reset(self, revision: int, kvs: Iterable[KeyValue], now: float) -> None:
        """Everything under the watched prefixes at ``revision`` (a full list)."""
        self.stats.resets += 1
        seen_members: set[str] = set()
        seen_sla: set[str] = set()
        policy: KeyValue | None = None
        for kv in kvs:
            if kv.key == self.layout.current:
                policy = kv
            elif (node := Layout.node_of(kv.key, self.layout.members)) is not None:
                seen_members.add(node)
                self._member(node, kv, now)
            elif (node := Layout.node_of(kv.key, self.layout.sla)) is not None:
                seen_sla.add(node)
                self._sla(node, kv.value, now)
        self._policy(policy)
        for node in set(self.members) - seen_members:
            self._member_gone(node, now)
        if self.view is not None:  # windows of nodes whose key went while we were away
            for node in self._view_origins() - seen_sla - {self.node_id}:
                self.view.on_member_gone(node)
                self.view.on_member_alive(node)
        self.revision = revision

    def apply(self, revision: int, events: Iterable[WatchEvent], now: float) -> None:
        """One watch batch (all of a revision or more)."""
        for e in events:
            self.stats.events += 1
            kv = e.kv
            if kv.key == self.layout.current:
                self._policy(kv if e.type == "put" else None)
            elif (node := Layout.node_of(kv.key, self.layout.members)) is not None:
                if e.type == "put":
                    self._member(node, kv, now)
                else:
                    self._member_gone(node, now)
            elif (node := Layout.node_of(kv.key, self.layout.sla)) is not None:
                if e.type == "put":
                    self._sla(node, kv.value, now)
                elif self.view is not None and node != self.node_id:
                    self.view.on_member_gone(node)
                    if node in self.members:
                        self.view.on_member_alive(node)
        self.revision = max(self.revision, revision)

    def _policy(self, kv: KeyValue | None) -> None:
        if kv is None:
            self.desired = None
            return
        try:
            rec = PolicyRecord.decode(kv.value)
        except Dropped as e:
            log.warning("etcd: %s is unreadable (%s): keeping %s", kv.key.decode(errors="replace"),
                        e, self.desired.ann.version if self.desired else "no version")
            self.stats.bad("policy")
            return
        self.desired = rec

    def _member(self, node: str, kv: KeyValue, now: float) -> None:
        rec = MemberRecord.decode(node, kv.value, kv.create_revision)
        if rec.left:  # written just before its lease is revoked: it is leaving
            self._member_gone(node, now, left=True, last=rec)
            return
        fresh = node not in self.members
        self.members[node] = rec
        self.gone.pop(node, None)
        if fresh and self.view is not None:
            self.view.on_member_alive(node)

    def _member_gone(self, node: str, now: float, *, left: bool = False,
                     last: MemberRecord | None = None) -> None:
        rec = self.members.pop(node, None) or last
        if rec is None:
            return
        if node not in self.gone or left:
            was_left = left or (node in self.gone and self.gone[node][1])
            self.gone[node] = (now, was_left, rec)
        if self.view is not None:
            self.view.on_member_gone(node)
        self._trim(now)

    def _sla(self, node: str, data: bytes, now: float) -> None:
        if self.view is None or node == self.node_id:
            return
        if self.view.on_app_state(node, data, now) == 0 and data[:1] != b"\xd2":
            self.stats.bad("sla")

    def _view_origins(self) -> set[str]:
        assert self.view is not None
        return {o for o in self.members | dict.fromkeys(self.gone)
                if self.view.known(o) != (None, None)}

    def _trim(self, now: float) -> None:
        for node in [n for n, (at, _, _) in self.gone.items() if now - at > GONE_RETENTION_S]:
            del self.gone[node]
        while len(self.gone) > MAX_GONE:
            del self.gone[next(iter(self.gone))]

    # -- output --------------------------------------------------------------------
    def member_infos(self, now: float, wall: float) -> list[MemberInfo]:
        """Members (alive) and the recently gone (left or dead), for tables."""
        self._trim(now)
        out = [MemberInfo(r.node, r.addr, State.ALIVE, r.create_revision,
                          now - max(0.0, wall - r.since) if r.since else now, None, None)
               for r in self.members.values()]
        out += [MemberInfo(node, rec.addr, State.LEFT if left else State.DEAD,
                           rec.create_revision, at, None, None)
                for node, (at, left, rec) in self.gone.items() if node not in self.members]
        return sorted(out, key=lambda m: m.node)
