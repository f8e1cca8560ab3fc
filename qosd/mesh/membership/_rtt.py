"""Probe round-trip times, measured by the host from the packets it carries.

A ``Ping`` we send (our own probe, or one we relay for a ``PingReq``) is
remembered by its sequence number; the ``Ack`` with that number *from the
pinged node itself* gives one sample (a relayed ack comes from the relay and
is not one: the same rule as the core's smoothed ``MemberInfo.rtt_s``).
Samples go into a cumulative histogram for Prometheus.
"""

from __future__ import annotations

from qosd.mesh.membership.core import Ack, Packet, Ping

__all__ = ["BUCKETS", "RttRecorder"]

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_KEEP_S = 10.0  # a ping unanswered this long is forgotten
_MAX_PENDING = 4096


class RttRecorder:
    """Pending pings by sequence number and the histogram of their RTTs."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[str, float]] = {}
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0
        self.samples = 0

    def sent(self, packet: Packet, node: str, now: float) -> None:
        for msg in packet.msgs:
            if type(msg) is Ping:
                if len(self._pending) >= _MAX_PENDING:
                    self.prune(now)
                    if len(self._pending) >= _MAX_PENDING:
                        return
                self._pending[msg.seq] = (msg.target, now)

    def received(self, packet: Packet, now: float) -> None:
        for msg in packet.msgs:
            if type(msg) is Ack:
                pending = self._pending.pop(msg.seq, None)
                if pending is not None and pending[0] == packet.sender:
                    self.observe(now - pending[1])

    def observe(self, rtt: float) -> None:
        i = 0
        while i < len(BUCKETS) and rtt > BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.total += rtt
        self.samples += 1

    def prune(self, now: float) -> None:
        for seq in [s for s, (_, t) in self._pending.items() if now - t > _KEEP_S]:
            del self._pending[seq]

    def histogram(self) -> tuple[list[tuple[float, int]], float, int]:
        """Cumulative ``[(le, count), ...]`` (last le +Inf), sum and count."""
        out, acc = [], 0
        for le, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            acc += n
            out.append((le, acc))
        return out, self.total, self.samples
