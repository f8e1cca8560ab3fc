"""The rollout's value types: the mesh version order, announcements, reports,
the actions a host carries out, the table, the tunables and the counters.

All are plain frozen dataclasses; nothing here does I/O.  The order of
versions is stated once, here, in :class:`MeshVersion`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from qosd.mesh.membership.core import ClusterError, MemberInfo

POLICY_KEY = "policy"
"""The gossip key of announcements (one per origin: a newer one replaces it)."""
ACK_PREFIX = "ack/"
"""``ack/<node>``: the gossip key of a node's report."""
MAX_COUNTER = 2**53 - 1
"""Counters stay exact in JSON numbers everywhere."""
SHA_PREFIX = 16
"""Hex digits of a version's sha256 that reports carry in push-pull rows."""
_NOTE_PREFIX = "mesh "


@dataclass(frozen=True, order=True, slots=True)
class MeshVersion:
    """A mesh-wide policy version: ``(counter, origin)``, compared
    lexicographically (counter first, then the origin node id as a string).

    A node that proposes a policy takes ``counter = 1 +`` the highest counter
    it has seen, so its version is above every version it knows; two nodes
    that propose concurrently get versions that every node orders the same
    way.  Spelt ``"<counter>@<origin>"``."""

    counter: int
    origin: str

    def __str__(self) -> str:
        return f"{self.counter}@{self.origin}"

    @classmethod
    def parse(cls, text: str) -> MeshVersion:
        """``"12@node-a"`` -> MeshVersion(12, "node-a"); ValueError otherwise."""
        counter, sep, origin = text.partition("@")
        if not sep or not origin or not counter.isascii() or not counter.isdigit():
            raise ValueError(f"{text!r} is not a mesh version (write <counter>@<node>)")
        value = int(counter)
        if not 1 <= value <= MAX_COUNTER:
            raise ValueError(f"{text!r}: the counter must be 1..{MAX_COUNTER}")
        return cls(value, origin)

    def note(self) -> str:
        """How the node's policy store records it (the version's note)."""
        return f"{_NOTE_PREFIX}{self}"

    @classmethod
    def from_note(cls, note: str | None) -> MeshVersion | None:
        """The mesh version a store note names (:meth:`note`), None for others."""
        if not note or not note.startswith(_NOTE_PREFIX):
            return None
        try:
            return cls.parse(note[len(_NOTE_PREFIX):].split()[0])
        except (ValueError, IndexError):
            return None


NO_VERSION = MeshVersion(0, "")
"""As ``base`` of ``Rollout.propose``: "no mesh policy yet"."""


class Gossip(Protocol):
    """What the rollout needs of the membership core (``Membership`` is one;
    a host that shares the push-pull state with other users passes an
    adapter whose ``set_app_state`` stores the rollout's section)."""

    @property
    def node_id(self) -> str: ...
    def broadcast(self, key: str, payload: bytes) -> int: ...
    def set_app_state(self, data: bytes) -> None: ...
    def members(self) -> list[MemberInfo]: ...


def version_text(v: MeshVersion | None) -> str | None:
    return None if v is None else str(v)


@dataclass(frozen=True, slots=True)
class Announcement:
    """The desired mesh version as gossiped: everything but the policy text.

    ``key`` is the total order used everywhere: the version, then the sha256
    (two texts under one version cannot come from a correct origin; if they
    ever do, every node keeps the same one)."""

    version: MeshVersion
    sha256: str
    """Of the text; only its first :data:`SHA_PREFIX` digits when learnt from a
    report (a *hint*, completed when the text or the announcement comes)."""
    size: int = 0
    """Bytes of the text (UTF-8); 0 when learnt from a report."""
    author: str = ""
    proposed_at: float = 0.0
    """The origin's wall clock when it proposed (display only)."""

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.version.counter, self.version.origin, self.sha256[:SHA_PREFIX])

    @property
    def hint(self) -> bool:
        return len(self.sha256) < 64

    def completed(self, other: Announcement) -> Announcement:
        """This announcement with what ``other`` (the same key) knows more."""
        return Announcement(self.version, other.sha256 if self.hint else self.sha256,
                            self.size or other.size, self.author or other.author,
                            self.proposed_at or other.proposed_at)


@dataclass(frozen=True, slots=True)
class Report:
    """A node's latest word on the rollout: ACK or NACK of ``version``.

    ``seq`` is the sequence number of the node's gossip broadcast that carried
    it (increasing across restarts when the host seeds the membership core's
    ``app_seq_start`` from the wall clock): a higher one replaces a lower one.
    ``sha`` is the first :data:`SHA_PREFIX` hex digits of the version's sha256."""

    node: str
    seq: int
    version: MeshVersion
    sha: str
    ok: bool
    reason: str
    applied: MeshVersion | None
    """What the node runs after this report (its previous version after a NACK)."""
    at: float
    """The reporter's wall clock (display only)."""

    def about(self, ann: Announcement) -> int:
        """-1, 0 or 1: this report is about an older, the same or a newer
        version than ``ann`` (in the order of ``Announcement.key``; an
        announcement with an empty sha256 stands for any text of its version)."""
        if self.version != ann.version:
            return -1 if self.version < ann.version else 1
        theirs = ann.sha256[:SHA_PREFIX]
        if not theirs or self.sha == theirs:
            return 0
        return -1 if self.sha < theirs else 1


@dataclass(frozen=True, slots=True)
class Realise:
    """Host: localise, validate and apply ``text`` on this node (recording
    ``version.note()`` and ``author`` with the store's version), then call
    ``Rollout.on_realised(version, ok, reason, now)``, also when it failed."""

    version: MeshVersion
    text: str
    sha256: str
    author: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Fetch:
    """Host: ask ``peer`` for the text of ``version`` (item ``key`` of the
    ``rollout`` section: the transport's ``Fetch`` RPC, which the peer's host
    answers with ``Rollout.serve_fetch(key)``), then call
    ``Rollout.on_fetch_reply(version, data, now)`` with the bytes, or None
    when the peer had nothing or did not answer."""

    version: MeshVersion
    sha256: str
    peer: str

    @property
    def key(self) -> str:
        return str(self.version)


@dataclass(frozen=True, slots=True)
class SendReport:
    """Host: deliver ``data`` (this node's latest report) to ``peer``, the
    origin of the version reported on, as a one-way call in the ``rollout``
    section; the peer's host checks that the caller's certificate names the
    reporting node and calls ``Rollout.on_peer_report(node, data, now)``.
    Best effort (the same report is gossiped): it makes the origin's table,
    the one ``mmmeshctl policy apply --cluster`` waits on, complete sooner."""

    peer: str
    data: bytes


Action = Realise | Fetch | SendReport

STATES = ("pending", "acked", "nacked", "superseded", "gone")


@dataclass(frozen=True, slots=True)
class Row:
    """One member in the rollout table of a version."""

    node: str
    state: str
    """pending | acked | nacked | superseded | gone (see docs/cluster.md)."""
    member: str
    """The member's state as this node sees it (ALIVE, SUSPECT, DEAD, LEFT)."""
    reported: MeshVersion | None
    applied: MeshVersion | None
    reason: str
    at: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "state": self.state, "member": self.member,
                "version": version_text(self.reported), "applied": version_text(self.applied),
                "reason": self.reason, "time": self.at}


@dataclass(frozen=True, slots=True)
class RolloutTable:
    """The rollout of ``version`` as one node sees it."""

    node: str
    version: MeshVersion | None
    desired: Announcement | None
    superseded_by: MeshVersion | None
    """The desired version, when the table's version lost to it."""
    rows: tuple[Row, ...]

    def count(self, state: str) -> int:
        return sum(1 for r in self.rows if r.state == state)

    @property
    def live(self) -> int:
        """The denominator: members not gone."""
        return sum(1 for r in self.rows if r.state != "gone")

    @property
    def complete(self) -> bool:
        """Every live member has answered (or the version lost): nothing will change."""
        return self.version is not None and all(r.state != "pending" for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        d = self.desired
        mine = d is not None and d.version == self.version
        return {
            "node": self.node,
            "version": version_text(self.version),
            "desired": version_text(d.version) if d else None,
            "superseded_by": version_text(self.superseded_by),
            "sha256": d.sha256 if mine and d else None,
            "author": (d.author or None) if mine and d else None,
            "proposed_at": (d.proposed_at or None) if mine and d else None,
            "complete": self.complete,
            "live": self.live,
            "counts": {s: self.count(s) for s in STATES},
            "rows": [r.as_dict() for r in self.rows],
        }


class NotSynced(ClusterError):
    """This node has not exchanged state with the mesh yet, so it cannot know
    the highest version: proposing now could reuse a version number."""


class RolloutConflict(ClusterError):
    """``base`` is not the desired mesh version any more (``current``)."""

    def __init__(self, base: MeshVersion | None, current: MeshVersion | None) -> None:
        self.base, self.current = base, current
        super().__init__(f"the mesh policy changed: your edit is based on version "
                         f"{base or 'none'}, the desired version is {current or 'none'}")


@dataclass(frozen=True)
class RolloutConfig:
    """Tunables of the rollout core.  Sizes are bytes, times seconds."""

    max_text_bytes: int = 1 << 20
    """A policy text (UTF-8) may be this long (the admin API's limit too)."""
    inline_text_bytes: int = 64 * 1024
    """Texts up to this size also ride in push-pull app state, so a node that
    missed the fetch (or whose transport has no FetchPolicy) still gets it."""
    max_reason_bytes: int = 400
    """A NACK reason is cut to this (it must fit one gossip packet)."""
    max_author_bytes: int = 64
    max_node_id_bytes: int = 253
    """A node id (DNS name length): longer ones in peer input are malformed."""
    max_rows: int = 65536
    """Rows taken from one push-pull state (more: the state is malformed)."""
    max_state_bytes: int = 8 << 20
    """A peer's push-pull section larger than this is dropped (oversize)."""
    fetch_timeout_s: float = 5.0
    """A fetch with no answer after this long is tried at another peer."""
    state_flush_s: float = 5.0
    """Report changes reach the push-pull state at most this often (a new
    desired version at once)."""
    reannounce_gap_s: float = 5.0
    """The origin of the desired version gossips it again when a member comes
    back alive, at most this often."""
    roll_call_s: float = 1.0
    """The origin of the desired version, while its table has pending members,
    gossips it again naming them (they repeat their reports) after this long,
    then after twice as long each time, up to ``roll_call_max_s``."""
    roll_call_max_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ClusterError(f"rollout config.{f.name} must be > 0")
        if self.inline_text_bytes > self.max_text_bytes:
            raise ClusterError("rollout config.inline_text_bytes must be <= max_text_bytes")


@dataclass
class RolloutStats:
    """Counters since start (for metrics; never reset by the core)."""

    proposals: int = 0
    announcements: int = 0
    """Announcements received (gossip) that were well-formed."""
    reports: int = 0
    """Reports (ACK/NACK) received that were newer than the one held."""
    roll_calls: int = 0
    """Roll calls this node sent (as the origin of the desired version)."""
    superseded: int = 0
    """Times the desired version was replaced by a higher one."""
    realise_requests: int = 0
    acks_sent: int = 0
    nacks_sent: int = 0
    fetches: int = 0
    fetch_failures: int = 0
    states_merged: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Peer input thrown away, by reason: malformed, impersonation, oversize,
    sha_mismatch, stale."""

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dropped"] = dict(self.dropped)
        return out


def parse_base(text: str | None) -> MeshVersion | None:
    """``base_version`` of ``PUT /v1/cluster/policy``: None (no check), "0" (no
    mesh policy yet) or ``<counter>@<node>``; ClusterError otherwise."""
    if text is None:
        return None
    if text == "0":
        return NO_VERSION
    try:
        return MeshVersion.parse(text)
    except ValueError as e:
        raise ClusterError(str(e)) from None
