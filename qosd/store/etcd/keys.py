"""The etcd back end's keys and values (no I/O).

Under the prefix ``P`` (qosd.yaml ``cluster.etcd.prefix``, default ``/mmmesh/``)::

    P/policy/current               the desired mesh version and its text      no lease
    P/policy/versions/<counter>    every version proposed (the last HISTORY)   no lease
    P/members/<node>               {"node", "addr", "since", "left"}           the node's lease
    P/acks/<node>                  its ACK/NACK report                          the node's lease
    P/sla/n/<bucket>/<node>        its newest SLA windows (with sketches)      the node's lease
    P/sla/p/<class>/<K>/<k>        shard k of K: the sum of its nodes'         its aggregator's
    P/sla/c/<class>                the class's record: the sum of the shards   its root's lease

``<bucket>`` is two hex digits of the node's position (the trees' hash of
its id), so a shard, buckets [k x 256/K, (k+1) x 256/K), is one key range;
``<class>`` is the class name quoted (``~`` the census).  Values reuse the
gossip back end's codecs: a policy record is the rollout's push-pull state
with no rows (``{"v":1,"d":{announcement},"x":text,"r":[]}``), a report is
the rollout's ``ack/<node>`` payload, a node's SLA value is the per-node
view's push-pull state holding its bundle alone (0xD2 ...), a shard's value
the trees' partial (``Up``, 0xA1 ...) and a class's the trees' record
(``Down``, 0xA2 ...), so the same strict readers check what comes out of
etcd.  A key's ``mod_revision`` stands where gossip has a sequence number
(last writer wins).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from dataclasses import dataclass

from qosd.mesh.rollout.core import Announcement, Report, RolloutConfig
from qosd.mesh.rollout.core.codec import (
    Dropped,
    Reader,
    decode_report,
    decode_state,
    encode_report,
    encode_state,
)
from qosd.mesh.slaview.core import position

__all__ = ["CENSUS_SEGMENT", "HISTORY", "READER", "Dropped", "Layout", "MemberRecord",
           "PolicyRecord", "class_of_segment", "class_segment"]

CENSUS_SEGMENT = "~"
"""The census's ``<class>`` in the SLA keys (a quoted class name never is)."""


def class_segment(cls: str) -> str:
    """A class name as one key segment (the census, "", as ``~``)."""
    return CENSUS_SEGMENT if not cls else urllib.parse.quote(cls, safe="").replace("~", "%7E")


def class_of_segment(seg: str) -> str | None:
    """The class a segment names (None: not one)."""
    if seg == CENSUS_SEGMENT:
        return ""
    if not seg or "/" in seg:
        return None
    cls = urllib.parse.unquote(seg)
    return cls if 0 < len(cls) <= 64 else None

HISTORY = 50
"""Versions kept under ``P/policy/versions/`` (older ones are deleted by the
transaction that adds a new one)."""
READER = Reader(RolloutConfig(inline_text_bytes=1 << 20))
"""Texts up to 1 MiB inline (etcd's default request limit is 1.5 MiB)."""


class Layout:
    """The keys under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        p = self.prefix.encode()
        self.policy_dir = p + b"policy/"
        self.current = p + b"policy/current"
        self.versions = p + b"policy/versions/"
        self.members = p + b"members/"
        self.acks = p + b"acks/"
        self.sla = p + b"sla/"
        self.sla_nodes = p + b"sla/n/"
        self.sla_partials = p + b"sla/p/"
        self.sla_records = p + b"sla/c/"

    def version_key(self, counter: int) -> bytes:
        return self.versions + f"{counter:016d}".encode()

    def member_key(self, node: str) -> bytes:
        return self.members + node.encode()

    def ack_key(self, node: str) -> bytes:
        return self.acks + node.encode()

    def sla_key(self, node: str) -> bytes:
        """``P/sla/n/<bucket>/<node>``: its windows."""
        bucket = position("", node) >> 56
        return self.sla_nodes + f"{bucket:02x}/".encode() + node.encode()

    def sla_node_of(self, key: bytes) -> str | None:
        """The node a ``P/sla/n/`` key names."""
        if not key.startswith(self.sla_nodes):
            return None
        rest = key[len(self.sla_nodes):]
        if len(rest) < 4 or rest[2:3] != b"/":
            return None
        return Layout.node_of(rest[3:], b"")

    def shard_range(self, shards: int, k: int) -> tuple[bytes, bytes]:
        """The node keys of shard ``k`` of ``shards`` (a power of two <= 256)."""
        per = 256 // shards
        start = self.sla_nodes + f"{k * per:02x}/".encode()
        end = self.sla_nodes + (f"{(k + 1) * per:02x}/".encode() if k + 1 < shards else b"\xff")
        return start, end

    def partial_prefix(self, cls: str) -> bytes:
        return self.sla_partials + class_segment(cls).encode() + b"/"

    def partial_key(self, cls: str, shards: int, k: int) -> bytes:
        return self.partial_prefix(cls) + f"{shards:03d}/{k:03d}".encode()

    def record_key(self, cls: str) -> bytes:
        return self.sla_records + class_segment(cls).encode()

    def record_class(self, key: bytes) -> str | None:
        """The class a ``P/sla/c/`` key names (``""``: the census)."""
        if not key.startswith(self.sla_records):
            return None
        try:
            return class_of_segment(key[len(self.sla_records):].decode())
        except UnicodeDecodeError:
            return None

    @staticmethod
    def node_of(key: bytes, under: bytes) -> str | None:
        """The node a key under ``under`` names (None: not such a key)."""
        if not key.startswith(under) or len(key) == len(under):
            return None
        try:
            node = key[len(under):].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return node if "/" not in node and len(node) <= 253 else None


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """``P/policy/current``: the desired version, its announcement and text."""

    ann: Announcement
    text: str

    def encode(self) -> bytes:
        return encode_state(self.ann, self.text, [])

    @classmethod
    def decode(cls, data: bytes) -> PolicyRecord:
        ann, text, _ = decode_state(READER, data)
        if ann is None or text is None:
            raise Dropped("malformed", "a policy record without a version or text")
        return cls(ann, text)


def encode_ack(report: Report) -> bytes:
    return encode_report(report)


def decode_ack(node: str, mod_revision: int, data: bytes) -> Report:
    """A node's report (its key's revision as the sequence); Dropped if unreadable."""
    return decode_report(READER, node, mod_revision, data)


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """``P/members/<node>``: who holds a lease, since when (unix s), and
    whether it is leaving (written just before it revokes its lease)."""

    node: str
    addr: str = ""
    since: float = 0.0
    left: bool = False
    create_revision: int = 0
    """The key's creation revision: each registration gets a higher one (the
    members table's incarnation)."""

    def encode(self) -> bytes:
        return json.dumps({"v": 1, "node": self.node, "addr": self.addr,
                           "since": round(self.since, 3), "left": self.left},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, node: str, data: bytes, create_revision: int) -> MemberRecord:
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            obj = None
        if not isinstance(obj, dict):  # a member is its lease: an odd value still counts
            return cls(node, since=time.time(), create_revision=create_revision)
        addr, since = obj.get("addr"), obj.get("since")
        return cls(node, addr[:300] if isinstance(addr, str) else "",
                   float(since) if isinstance(since, int | float) else 0.0,
                   obj.get("left") is True, create_revision)
