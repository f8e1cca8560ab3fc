"""qosd's Prometheus metrics: collectors read the kernel and the SLA board
when Prometheus scrapes; qosd's own metrics are set as things happen.

Exported (counters end in ``_total``; every series of one qosd carries the
scrape's ``instance`` label, which tells the nodes apart)::

    dataplane (_dataplane.py, read at scrape time through mmmesh.dataplane.Dataplane)
    mmmesh_dataplane_up{iface}                         1 if the pinned maps opened and read
    mmmesh_dataplane_policy_version{iface}             policy version in the config map
    mmmesh_classifier_class_{packets,bytes}_total{iface,direction,class}
    mmmesh_classifier_packets_total{iface,direction,reason}
                                 reason: parsed|flow_hit|not_mesh|malformed, a partition
    mmmesh_classifier_events_total{iface,direction,event}
                                 event: clamped|flow_new|flow_update|dscp_rewrite
    mmmesh_htb_class_{bytes,packets,drops,overlimits}_total{iface,class}
    mmmesh_htb_class_backlog_bytes{iface,class}, mmmesh_htb_class_queue_packets{iface,class}
    mmmesh_flows{iface}, mmmesh_flows_capacity{iface}, mmmesh_class_flows{iface,class}

    SLA board (_sla.py, read at scrape time from qosd/sla/board.py)
    mmmesh_sla_attainment_ratio{class,modality}        node-wide, all stages merged
    mmmesh_sla_window_{frames,deadline_misses,drops,errors,sources}{class,modality}
    mmmesh_sla_e2e_latency_seconds{class,modality,percentile}  p50|p90|p99, merged sketches
    mmmesh_sla_board_{rows,bytes,senders}
    mmmesh_sla_reports_accepted_total, mmmesh_sla_reports_refused_total{code}
    mmmesh_sla_board_evictions_total{cause}, mmmesh_sla_board_skipped_reads_total

    socket layer and the controller's kernel writes (_socklayer.py; mmmesh_socklayer_* only
    with socket_layer.enabled)
    mmmesh_socklayer_up, mmmesh_socklayer_flows, mmmesh_socklayer_endpoints
    mmmesh_socklayer_modality_{frames,bytes}_total{modality}   node-wide, from sk_msg
    mmmesh_socklayer_events_total{event}, mmmesh_socklayer_replica_weight{stage,replica}
    mmmesh_controller_kernel_writes_total{target,result}  overrides|replica_weights x ok|error

    qosd (_own.py)
    mmmesh_build_info{version,abi,bpf_build,python,node} 1
    mmmesh_policy_version, mmmesh_reconciles_total{trigger}, mmmesh_reconcile_errors_total,
    mmmesh_reconcile_duration_seconds (histogram), mmmesh_reconcile_last_duration_seconds,
    mmmesh_drift_repairs_total, mmmesh_adoptions_total{result},
    mmmesh_reconcile_last_success_timestamp_seconds,
    mmmesh_resync_last_run_timestamp_seconds (heartbeat), mmmesh_resync_interval_seconds
    process_* (prometheus_client's ProcessCollector: RSS, open fds, CPU, start time)

    the mesh (with a peers: section; qosd/metrics/peers.py, qosd/metrics/cluster_apps.py;
    the tables in _cluster.py)
    mmmesh_cluster_members{state}, mmmesh_cluster_<membership and transport counters>,
    mmmesh_cluster_probe_rtt_seconds (histogram), mmmesh_cluster_cert_expiry_timestamp_seconds
    mmmesh_rollout_{desired,applied}_info{version}, mmmesh_rollout_behind,
    mmmesh_rollout_members{state}, mmmesh_rollout_<core counters>_total,
    mmmesh_rollout_dropped_total{reason}
    mmmesh_cluster_sla_{attainment_ratio,p99_seconds,frames}{class,modality} (global view),
    mmmesh_cluster_sla_nodes_{known,reporting,with_sketches},
    mmmesh_cluster_sla_publications_received_total{result}, ... (the view's counters)

The classifier counts skbs as TC sees them: a GSO super-packet is one packet
however many wire packets it becomes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector

from mmmesh.dataplane import Dataplane

from ._dataplane import (
    CLASSIFIER_EVENTS,
    DATAPLANE_METRICS,
    PARTITION_REASONS,
    DataplaneCollector,
    DataplaneFactory,
    DataplaneReader,
    Target,
)
from ._http import MetricsServer, iter_samples, serve_metrics
from ._own import ADOPTION_RESULTS, QOSD_METRICS, RECONCILE_TRIGGERS, QosdMetrics
from ._policy import POLICY_METRICS, PolicyCollector, PolicySource
from ._sla import SLA_METRICS, BoardReader, SlaBoardCollector
from ._socklayer import SOCKLAYER_METRICS, SocketLayerCollector
from ._spec import sample_names

PROCESS_METRICS = ("process_resident_memory_bytes", "process_open_fds", "process_max_fds",
                   "process_cpu_seconds_total", "process_start_time_seconds")


def exported_names(cluster: bool = True) -> set[str]:
    """Every sample name qosd's registry can export (but ``process_*``); with
    ``cluster``, the mesh's too (``mmmesh_cluster_*``, ``mmmesh_rollout_*``:
    exported with a ``peers:`` section; this imports qosd.mesh.membership.peers)."""
    names = (sample_names(DATAPLANE_METRICS) | sample_names(QOSD_METRICS)
             | sample_names(POLICY_METRICS)
             | sample_names(SLA_METRICS) | sample_names(SOCKLAYER_METRICS))
    if cluster:
        from ._cluster import cluster_specs

        for spec in cluster_specs().values():
            names |= sample_names(spec)
    return names


def make_registry(targets: Callable[[], Iterable[Target]] | Sequence[Target],
                  qosd_metrics: bool = True, *, sla_board: BoardReader | None = None,
                  process: bool = True, node: str = "",
                  resync_interval_s: float | None = None,
                  dataplane: DataplaneFactory = Dataplane,
                  policy: PolicySource | None = None,
                  ) -> tuple[CollectorRegistry, QosdMetrics | None]:
    """A registry with the dataplane collector, the SLA board's (with
    ``sla_board``), the process collector (``process``) and qosd's own
    metrics (``qosd_metrics``; ``node`` and ``resync_interval_s`` for the
    build info and the heartbeat), the policy's info series (``policy``: the
    node's store).  More collectors can be registered later
    (qosd registers the board's once its service exists)."""
    registry = CollectorRegistry()
    registry.register(DataplaneCollector(targets, dataplane))
    if sla_board is not None:
        registry.register(SlaBoardCollector(sla_board))
    if policy is not None:
        registry.register(PolicyCollector(policy))
    if process:
        ProcessCollector(registry=registry)
    qm = QosdMetrics(registry, node=node, resync_interval_s=resync_interval_s) \
        if qosd_metrics else None
    return registry, qm


__all__ = [
    "ADOPTION_RESULTS",
    "CLASSIFIER_EVENTS",
    "DATAPLANE_METRICS",
    "PARTITION_REASONS",
    "POLICY_METRICS",
    "PROCESS_METRICS",
    "QOSD_METRICS",
    "RECONCILE_TRIGGERS",
    "SLA_METRICS",
    "SOCKLAYER_METRICS",
    "BoardReader",
    "DataplaneCollector",
    "DataplaneFactory",
    "DataplaneReader",
    "MetricsServer",
    "QosdMetrics",
    "SlaBoardCollector",
    "SocketLayerCollector",
    "Target",
    "exported_names",
    "iter_samples",
    "make_registry",
    "serve_metrics",
]
