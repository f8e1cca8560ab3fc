"""Per-peer rate limits: two token buckets (packets, bytes) per peer identity.

The identity is the node id of the peer's certificate, not its address, so a
peer cannot dodge its limit by reconnecting.  A packet passes when both
buckets hold enough; otherwise it is dropped and nothing is taken.  At most
``max_peers`` identities are tracked (the longest idle is forgotten first,
which only ever gives a peer a full bucket again).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["PeerLimiter", "TokenBucket"]


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full."""

    rate: float
    burst: float
    tokens: float = -1.0
    stamp: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)


class PeerLimiter:
    """``allow(peer, nbytes, now)`` for each packet; counts refusals."""

    def __init__(self, packets_per_s: float, burst_packets: float, bytes_per_s: float,
                 burst_bytes: float, *, max_peers: int = 4096) -> None:
        self._spec = (packets_per_s, burst_packets, bytes_per_s, burst_bytes)
        self._buckets: OrderedDict[str, tuple[TokenBucket, TokenBucket]] = OrderedDict()
        self._limited_at: dict[str, float] = {}
        self.max_peers = max_peers
        self.refused = 0

    def allow(self, peer: str, nbytes: int, now: float) -> bool:
        pair = self._buckets.get(peer)
        if pair is None:
            pps, bp, bps, bb = self._spec
            pair = (TokenBucket(pps, bp, stamp=now), TokenBucket(bps, bb, stamp=now))
            self._buckets[peer] = pair
            if len(self._buckets) > self.max_peers:
                old, _ = self._buckets.popitem(last=False)
                self._limited_at.pop(old, None)
        else:
            self._buckets.move_to_end(peer)
        packets, octets = pair
        packets.refill(now)
        octets.refill(now)
        if packets.tokens < 1 or octets.tokens < nbytes:
            self.refused += 1
            self._limited_at[peer] = now
            return False
        packets.tokens -= 1
        octets.tokens -= nbytes
        return True

    def limited_peers(self, now: float, window_s: float = 60.0) -> int:
        """Peers refused at least once in the last ``window_s`` seconds."""
        for peer in [p for p, t in self._limited_at.items() if now - t > window_s]:
            del self._limited_at[peer]
        return len(self._limited_at)
