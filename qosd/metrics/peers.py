"""Prometheus metrics of this node's membership, read at scrape time.

Exported (counters end in ``_total``; no per-peer labels)::

    mmmesh_cluster_members{state}                  members known by state (this one included)
    mmmesh_cluster_health_score                    Lifeguard local health (0 healthy .. 7)
    mmmesh_cluster_incarnation                     this node's incarnation (refutations raise it)
    mmmesh_cluster_queued_broadcasts               gossip waiting to be sent
    mmmesh_cluster_<stat>_total                    the core's counters: probes, probe_failures,
                                                   indirect_probes, nacks_received, suspicions,
                                                   confirmations, refutations, deaths_declared,
                                                   push_pulls, reconnects, conflicts
    mmmesh_cluster_packets_total{direction}        peer RPCs in / out
    mmmesh_cluster_bytes_total{direction}          their encoded bytes (gossip, push-pull, fetch)
    mmmesh_cluster_dropped_packets_total{reason}   incoming packets refused (qosd/mesh/membership/_transport.py)
    mmmesh_cluster_send_failures_total{reason}     outgoing packets that did not arrive
    mmmesh_cluster_rate_limited_peers              peers refused by their rate limit in the last 60 s
    mmmesh_cluster_channels                        open outgoing gRPC channels
    mmmesh_cluster_probe_rtt_seconds               histogram of ping -> ack round trips
    mmmesh_cluster_cert_expiry_timestamp_seconds   notAfter of this node's peer certificate
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from qosd.mesh.membership.core import State

__all__ = ["CORE_COUNTERS", "PeersCollector"]

CORE_COUNTERS = {
    "probes": "Probes started", "probe_failures": "Probes that got no ack (direct or relayed)",
    "indirect_probes": "Probes that asked members to ping for us",
    "nacks_received": "Nacks from relays that heard nothing",
    "suspicions": "Suspicions this node started holding",
    "confirmations": "Independent confirmations of suspicions (Lifeguard)",
    "refutations": "Times this node refuted a suspicion about itself",
    "deaths_declared": "Members this node's own suspicion timer declared dead",
    "push_pulls": "Push-pull state exchanges (requests sent and answered)",
    "reconnects": "Push-pulls with dead members (partition healing)",
    "conflicts": "Alive news naming another address for a live member (ignored)",
}


class PeersSnapshot(Protocol):
    """What the collector reads (qosd.mesh.membership.peers.Peers)."""

    def snapshot(self) -> dict[str, Any]: ...


class PeersCollector:
    """Reads ``peers.snapshot()`` (on the event loop) at each scrape."""

    def __init__(self, peers: PeersSnapshot) -> None:
        self.peers = peers

    def describe(self) -> list[Metric]:
        return []  # dynamic: no registration-time collect

    def collect(self) -> Iterator[Metric]:
        s = self.peers.snapshot()
        p = "mmmesh_cluster_"
        members = GaugeMetricFamily(p + "members", "Members known by state (this node included)",
                                    labels=["state"])
        for state in State:
            n = sum(1 for m in s["members"] if m.state == state)
            members.add_metric([state.name.lower()], n)
        yield members
        yield GaugeMetricFamily(p + "health_score", "Lifeguard local health score (0 = healthy)",
                                value=s["health_score"])
        yield GaugeMetricFamily(p + "incarnation", "This node's incarnation number",
                                value=s["incarnation"])
        yield GaugeMetricFamily(p + "queued_broadcasts", "Gossip items waiting to be sent",
                                value=s["queued_broadcasts"])
        for name, text in CORE_COUNTERS.items():
            yield CounterMetricFamily(p + name, text, value=s["stats"][name])
        for name, key, text in (("packets", "packets", "Peer RPCs by direction"),
                                ("bytes", "bytes", "Encoded bytes of peer RPCs by direction")):
            fam = CounterMetricFamily(p + name, text, labels=["direction"])
            for direction in ("in", "out"):
                fam.add_metric([direction], s[key].get(direction, 0))
            yield fam
        for name, key, text in (
                ("dropped_packets", "dropped", "Incoming peer packets refused, by reason"),
                ("send_failures", "send_failures", "Outgoing peer packets that failed, by reason")):
            fam = CounterMetricFamily(p + name, text, labels=["reason"])
            for reason, n in sorted(s[key].items()):
                fam.add_metric([reason], n)
            yield fam
        yield GaugeMetricFamily(p + "rate_limited_peers",
                                "Peers refused by their rate limit in the last 60 s",
                                value=s["rate_limited_peers"])
        yield GaugeMetricFamily(p + "channels", "Open outgoing gRPC channels to peers",
                                value=s["channels"])
        buckets, total, _count = s["rtt"]
        hist = HistogramMetricFamily(p + "probe_rtt_seconds",
                                     "Round trip of a ping to the pinged member's ack")
        hist.add_metric([], [("+Inf" if le == float("inf") else repr(le), n) for le, n in buckets],
                        total)
        yield hist
        if s["cert_not_after"] is not None:
            yield GaugeMetricFamily(p + "cert_expiry_timestamp_seconds",
                                    "notAfter of this node's peer certificate (unix time)",
                                    value=s["cert_not_after"])
