"""The etcd back end's keys and values (no I/O).

Under the prefix ``P`` (qosd.yaml ``cluster.etcd.prefix``, default ``/mmmesh/``)::

    P/policy/current               the desired mesh version and its text      no lease
    P/policy/versions/<counter>    every version proposed (the last HISTORY)   no lease
    P/members/<node>               {"node", "addr", "since", "left"}           the node's lease
    P/acks/<node>                  its ACK/NACK report                          the node's lease
    P/sla/<node>                   its newest SLA bundle (windows + sketches)  the node's lease

Values reuse the gossip back end's codecs: a policy record is the rollout's
push-pull state with no rows (``{"v":1,"d":{announcement},"x":text,"r":[]}``),
a report is the rollout's ``ack/<node>`` payload, an SLA value is the SLA
view's push-pull state holding this node's bundle alone (0xD2 ...), so the
same strict readers check what comes out of etcd.  A key's ``mod_revision``
stands where gossip has a sequence number (last writer wins).
"""

from __future__ import annotations

import json
import time
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

__all__ = ["HISTORY", "READER", "Dropped", "Layout", "MemberRecord", "PolicyRecord"]

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

    def version_key(self, counter: int) -> bytes:
        return self.versions + f"{counter:016d}".encode()

    def member_key(self, node: str) -> bytes:
        return self.members + node.encode()

    def ack_key(self, node: str) -> bytes:
        return self.acks + node.encode()

    def sla_key(self, node: str) -> bytes:
        return self.sla + node.encode()

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
