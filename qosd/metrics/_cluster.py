"""What the mesh's collectors export, as tables: qosd/metrics/peers.py
(membership, transport; it builds its families by hand, so this table is
checked against a scrape of it by tests/system/qosd/test_metrics_cluster.py) and, re-exported,
qosd/metrics/cluster_apps.py's own tables (rollout, global SLA view).

Imported lazily by :func:`qosd.metrics.exported_names`: qosd.mesh.membership.peers pulls in
gRPC, which a reader of the node's metrics does not need."""

from __future__ import annotations

from ._spec import Spec

# But the membership core's counters, mmmesh_cluster_<CORE_COUNTERS>_total:
# cluster_specs() adds them from qosd/metrics/peers.py itself.
PEERS_METRICS: Spec = {
    "mmmesh_cluster_members": ("gauge", ("state",),
                               "Members known by state (this node included)"),
    "mmmesh_cluster_health_score": ("gauge", (), "Lifeguard local health score (0 = healthy)"),
    "mmmesh_cluster_incarnation": ("gauge", (), "This node's incarnation number"),
    "mmmesh_cluster_queued_broadcasts": ("gauge", (), "Gossip items waiting to be sent"),
    "mmmesh_cluster_packets_total": ("counter", ("direction",), "Peer RPCs by direction"),
    "mmmesh_cluster_bytes_total": ("counter", ("direction",),
                                   "Encoded bytes of peer RPCs by direction"),
    "mmmesh_cluster_dropped_packets_total": ("counter", ("reason",),
                                             "Incoming peer packets refused, by reason"),
    "mmmesh_cluster_send_failures_total": ("counter", ("reason",),
                                           "Outgoing peer packets that failed, by reason"),
    "mmmesh_cluster_rate_limited_peers": ("gauge", (),
                                          "Peers refused by their rate limit in the last 60 s"),
    "mmmesh_cluster_channels": ("gauge", (), "Open outgoing gRPC channels to peers"),
    "mmmesh_cluster_probe_rtt_seconds": ("histogram", (),
                                         "Round trip of a ping to the pinged member's ack"),
    "mmmesh_cluster_cert_expiry_timestamp_seconds": (
        "gauge", (), "notAfter of this node's peer certificate (unix time)"),
}


def cluster_specs() -> dict[str, Spec]:
    """Every table of the mesh's metrics by collector (imports qosd.mesh.membership.peers)."""
    from qosd.metrics.cluster_apps import CLUSTER_SLA_METRICS, ROLLOUT_METRICS
    from qosd.metrics.peers import CORE_COUNTERS

    core: Spec = {f"mmmesh_cluster_{k}_total": ("counter", (), v)
                  for k, v in CORE_COUNTERS.items()}
    return {"peers": {**PEERS_METRICS, **core}, "rollout": ROLLOUT_METRICS,
            "cluster_sla": CLUSTER_SLA_METRICS}
