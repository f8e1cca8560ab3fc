"""What a node holds of the watched prefixes: a sans-I/O mirror of etcd.

The host lists ``P/policy/``, ``P/members/`` and ``P/sla/c/`` at one revision
(:meth:`Mirror.reset`), then feeds every watch batch after it
(:meth:`Mirror.apply`).  A reset after a compaction or a reconnect is a full
re-list: whatever the mirror held that is no longer in etcd is treated as
deleted, so no update is lost whatever the watch missed.  Members are the
nodes whose leased ``P/members/<node>`` key exists; a deleted one (its lease
expired, or it revoked it on leaving) is *gone*: kept as a tombstone for
``GONE_RETENTION_S`` so rollout tables show it as ``gone``.  The SLA class
records (one key per class, ``P/sla/c/``) go to ``records`` (the node's
``EtcdSla``): a dead node's share leaves them when its own windows' key
goes with its lease (sla.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from qosd.mesh.membership.core import MemberInfo, State
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


Records = Callable[[bytes, bytes | None, float], None]
"""``records(key, value or None when deleted, now)`` for each ``P/sla/c/`` key."""


class Mirror:
    """The desired policy, the members and (with ``records``) the SLA records."""

    def __init__(self, node_id: str, layout: Layout, records: Records | None = None) -> None:
        self.node_id = node_id
        self.layout = layout
        self.records = records
        self._record_keys: set[bytes] = set()
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
        seen_records: set[bytes] = set()
        policy: KeyValue | None = None
        for kv in kvs:
            if kv.key == self.layout.current:
                policy = kv
            elif (node := Layout.node_of(kv.key, self.layout.members)) is not None:
                seen_members.add(node)
                self._member(node, kv, now)
            elif kv.key.startswith(self.layout.sla_records):
                seen_records.add(kv.key)
                self._record(kv.key, kv.value, now)
        self._policy(policy)
        for node in set(self.members) - seen_members:
            self._member_gone(node, now)
        for key in self._record_keys - seen_records:  # records that went while we were away
            self._record(key, None, now)
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
            elif kv.key.startswith(self.layout.sla_records):
                self._record(kv.key, kv.value if e.type == "put" else None, now)
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
        self.members[node] = rec
        self.gone.pop(node, None)

    def _member_gone(self, node: str, now: float, *, left: bool = False,
                     last: MemberRecord | None = None) -> None:
        rec = self.members.pop(node, None) or last
        if rec is None:
            return
        if node not in self.gone or left:
            was_left = left or (node in self.gone and self.gone[node][1])
            self.gone[node] = (now, was_left, rec)
        self._trim(now)

    def _record(self, key: bytes, value: bytes | None, now: float) -> None:
        if value is None:
            self._record_keys.discard(key)
        else:
            self._record_keys.add(key)
        if self.records is not None:
            self.records(key, value, now)

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
