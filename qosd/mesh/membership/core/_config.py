"""Protocol parameters and the formulas that scale them with the cluster size.

Every default is memberlist's ``DefaultLANConfig`` unless the field says
otherwise; the formulas are memberlist's ``util.go`` (``suspicionTimeout``,
``retransmitLimit``, ``pushPullScale``) written down once, here, next to the
constants they scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from mmmesh.errors import MeshError


class ClusterError(MeshError, ValueError):
    """An invalid cluster configuration or a misuse of the membership core."""


@dataclass(frozen=True)
class Config:
    """Tunables of the membership core.  Times are seconds."""

    probe_interval_s: float = 1.0
    """One failure-detector probe per interval (scaled up by local health)."""
    probe_timeout_s: float = 0.5
    """Wait this long for a direct ack before asking ``indirect_checks`` peers."""
    indirect_checks: int = 3
    """Members asked to ping a target that missed its direct ack."""
    indirect_nack_s: float = 0.4
    """A relay that got no ack from the target within this time sends a nack.
    Not in memberlist (which uses the probe timeout, so its nacks arrive after
    the prober's 1 s deadline): 0.5 + 0.4 s lets the nack arrive in time."""
    gossip_interval_s: float = 0.2
    gossip_nodes: int = 3
    """Random members each gossip round sends to (only when there is news)."""
    gossip_to_the_dead_s: float = 30.0
    """Dead members stay gossip targets this long, so a live one learns and refutes."""
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6
    retransmit_mult: int = 4
    push_pull_interval_s: float = 30.0
    push_pull_scale_threshold: int = 32
    awareness_max_multiplier: int = 8
    """Local health score is kept in [0, this - 1]; the probe interval is
    multiplied by score + 1."""
    packet_budget: int = 1400
    """Bytes per message (estimated encoded size) that piggybacked gossip may fill."""
    join_fanout: int = 3
    """Seeds contacted per join attempt (memberlist contacts every address)."""
    join_retry_s: float = 2.0
    """Join again (other random seeds) while no seed has answered and no member is known."""
    reconnect_interval_s: float = 30.0
    """Serf's reconnect: push-pull with a random dead member, so partitions heal."""
    reconnect_timeout_s: float = 86400.0
    """Dead members are retried (and remembered) this long, then forgotten."""
    left_retention_s: float = 300.0
    """Left members are remembered this long (a late stale alive cannot revive them)."""
    dead_node_reclaim_s: float = 30.0
    """A dead member may come back with another address after this long (a left one
    at once).  memberlist forgets dead nodes after gossip_to_the_dead (30 s), which
    has the same effect."""
    max_queued_broadcasts: int = 4096
    """The oldest-most-sent broadcasts are dropped beyond this many."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not value > 0:
                raise ClusterError(f"config.{f.name} must be > 0 (got {value!r})")
        if self.probe_timeout_s >= self.probe_interval_s:
            raise ClusterError("config.probe_timeout_s must be below probe_interval_s")
        if self.suspicion_mult < 2:
            raise ClusterError("config.suspicion_mult must be >= 2")
        if self.packet_budget < 256:
            raise ClusterError("config.packet_budget must be >= 256 bytes")

    # -- formulas ---------------------------------------------------------------
    def suspicion_min_s(self, n: int) -> float:
        """``suspicion_mult x max(1, log10(n)) x probe_interval`` (memberlist's
        ``suspicionTimeout``, n = members known including this one)."""
        scale = max(1.0, math.log10(max(1, n)))
        return self.suspicion_mult * scale * self.probe_interval_s

    def suspicion_max_s(self, n: int) -> float:
        """The Lifeguard maximum: ``suspicion_max_timeout_mult x`` the minimum."""
        return self.suspicion_max_timeout_mult * self.suspicion_min_s(n)

    def suspicion_k(self, n: int) -> int:
        """Independent confirmations that drive the timer to its minimum:
        ``suspicion_mult - 2``, or 0 when fewer than that many other members
        (besides this one and the suspect) exist."""
        k = self.suspicion_mult - 2
        return 0 if n - 2 < k else k

    def retransmit_limit(self, n: int) -> int:
        """Transmissions per broadcast: ``retransmit_mult x ceil(log10(n + 1))``."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))

    def push_pull_s(self, n: int) -> float:
        """The push-pull interval, unchanged up to ``push_pull_scale_threshold``
        members and then multiplied by ``ceil(log2(n) - log2(threshold)) + 1``."""
        if n <= self.push_pull_scale_threshold:
            return self.push_pull_interval_s
        mult = math.ceil(math.log2(n) - math.log2(self.push_pull_scale_threshold)) + 1
        return mult * self.push_pull_interval_s
