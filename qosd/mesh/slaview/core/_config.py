"""The global SLA view's law and bounds (:class:`SlaViewConfig`) and its
counters (:class:`SlaViewStats`), in one place next to the formulas; the view
itself is ``qosd/mesh/slaview/core/__init__.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from mmmesh.sla import check_positive
from qosd.mesh.membership.core import ClusterError, Config
from qosd.mesh.slaview.core._codec import MAX_WINDOWS, Limits

__all__ = ["SlaViewConfig", "SlaViewStats"]


@dataclass(frozen=True)
class SlaViewConfig:
    """The view's law and bounds, in one place.  Times are seconds.

    Digest interval (a guard rail on gossip bandwidth): each digest of ``w``
    bytes on the wire is sent ``retransmit_limit(n)`` times by each of ``n``
    members, so with one digest per member per interval every member sends
    ``n x w x retransmit_limit(n) / interval`` bytes of digests a second::

        digest_interval_s(n, w) = max(min_interval_s,
                                      n x w x retransmit_limit(n) / gossip_share_bps)

    Staleness: a window is stale (listed, not merged) when older than
    ``stale_windows x max(window, origin's digest interval)``.  A sketch
    travels by push-pull, from relay to relay: measured in the simulator
    (16, 40, 100 members) the oldest one held anywhere is ``(log2 n + 1)``
    push-pull intervals old, so one may serve the quantiles while younger than
    ``max(that stale limit, push_pull_s(n) x (log2 n + sketch_rounds))``.
    Data is forgotten at ``forget_factor`` times the window's stale limit
    (sketches with it), and at once when its member is declared dead or
    leaves."""

    cluster: Config = field(default_factory=Config)
    """The membership core's config (retransmit limit, push-pull interval, packet)."""
    min_interval_s: float = 5.0
    """Never more than one digest per this (a sidecar's window)."""
    gossip_share_bps: float = 16000.0
    """Bytes per second per member the digests may cost (128 kbit/s)."""
    digest_max_bytes: int = 640
    """A digest's payload; windows beyond are left to the push-pull."""
    stale_windows: float = 3.0
    sketch_rounds: float = 2.0
    """Push-pull rounds of margin over log2(n) a sketch may be old."""
    forget_factor: float = 2.0
    max_sketch_bins: int = 512
    """Per sketch (wider ones collapse their lowest bins)."""
    max_sketches: int = 32
    """Per bundle (node-wide class windows first)."""
    max_bundle_bytes: int = 4096
    """One node's publication with its sketches."""
    max_state_bytes: int = 65536
    """The whole push-pull app state (own bundle plus relayed ones)."""
    max_origins: int = 2048
    """Nodes whose data is held (the stalest go first)."""

    def __post_init__(self) -> None:
        check_positive(self, "slaview", error=ClusterError, skip=("cluster",))
        if not 64 <= self.digest_max_bytes <= self.cluster.packet_budget // 2:
            raise ClusterError("slaview.digest_max_bytes must be within 64 and half a packet "
                               f"({self.cluster.packet_budget // 2})")
        if not 256 <= self.max_bundle_bytes <= self.max_state_bytes - 300:
            raise ClusterError("slaview.max_bundle_bytes must be >= 256 and leave room in "
                               "max_state_bytes")
        if self.max_sketch_bins > 4097 or self.max_sketches > MAX_WINDOWS:
            raise ClusterError("slaview.max_sketch_bins <= 4097, max_sketches <= 255")

    def digest_interval_s(self, members: int, wire: int) -> float:
        """Seconds between two digests of ``wire`` bytes among ``members``."""
        n = max(1, members)
        spend = n * wire * self.cluster.retransmit_limit(n) / self.gossip_share_bps
        return max(self.min_interval_s, spend)

    def stale_s(self, window_s: float, interval_s: float) -> float:
        return self.stale_windows * max(window_s, interval_s)

    def sketch_stale_s(self, window_s: float, interval_s: float, members: int) -> float:
        n = max(1, members)
        rounds = math.log2(n) + self.sketch_rounds
        return max(self.stale_s(window_s, interval_s), self.cluster.push_pull_s(n) * rounds)

    def limits(self) -> Limits:
        """What a bundle may hold (decoding and encoding)."""
        return Limits(self.max_bundle_bytes, self.max_sketches, self.max_sketch_bins)


@dataclass
class SlaViewStats:
    """Counters since start (for metrics; never reset)."""

    published: int = 0
    """Digests handed to the host to broadcast."""
    windows_left_out: int = 0
    """Windows that did not fit a digest (they travel in the push-pull only), or
    this node's bundle (counted each time the state is made)."""
    sketches_left_out: int = 0
    """Sketches that did not fit this node's bundle."""
    local_skipped: int = 0
    """Board rows that could not be read (names or numbers out of bounds)."""
    received: int = 0
    """Publications received (gossip digests and push-pull bundles)."""
    accepted: int = 0
    """Received publications newer than what was known."""
    older: int = 0
    """Received publications not newer than what was known (last writer wins)."""
    malformed: int = 0
    """Digests, states or bundles refused (bytes or bounds): dropped."""
    from_gone: int = 0
    """Publications of members known dead or left: dropped."""
    expired: int = 0
    """Nodes forgotten because all they sent was stale."""
    evicted: int = 0
    """Nodes forgotten to stay within ``max_origins``."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
