"""Prometheus metrics of the mesh's applications, read at scrape time: the
policy rollout (qosd/mesh/rollout/host.py) and the global SLA view
(qosd/mesh/slaview/host.py).  The membership's own are ``_metrics.py``'s.

Exported (counters end in ``_total``; no per-peer labels)::

    mmmesh_rollout_desired_info{version}           1: the desired mesh version (the highest
                                                   this node has heard of), "<counter>@<origin>"
    mmmesh_rollout_applied_info{version}           1: the mesh version this node runs
    mmmesh_rollout_behind                          1 while this node does not run the desired
                                                   version (realising it, or it NACKed)
    mmmesh_rollout_members{state}                  the desired version's rollout table as this
                                                   node sees it: pending, acked, nacked,
                                                   superseded, gone (a partition of the members)
    mmmesh_rollout_<stat>_total                    the core's counters (ROLLOUT_COUNTERS)
    mmmesh_rollout_dropped_total{reason}           peer input refused: malformed, oversize,
                                                   impersonation, sha_mismatch, stale
    mmmesh_cluster_sla_nodes_{known,reporting,with_sketches}
                                                   nodes in this node's global view (the
                                                   census tree's record): that contributed,
                                                   with a fresh window, with a fresh sketch
    mmmesh_cluster_sla_{attainment_ratio,p99_seconds,frames}{class,modality}
                                                   the global view per class (every node's
                                                   fresh windows; p99 of the merged sketches)
    mmmesh_cluster_sla_{nodes,age_seconds,oldest_age_seconds}{class,modality}
                                                   per class: nodes merged, how old the newest
                                                   and the oldest window merged are
    mmmesh_cluster_sla_publications_received_total{result}
                                                   tree messages from peers: accepted, older,
                                                   malformed, from_gone (0: the trees take no
                                                   data by membership; kept for dashboards)
    mmmesh_cluster_sla_inputs_total{result}        the same, finer: accepted, older, late,
                                                   malformed, misrouted, oversized, unsolicited
    mmmesh_cluster_sla_digests_published_total     this node's own contributions (per tree, round)
    mmmesh_cluster_sla_records_total{how}          records taken: received, published (a root)
    mmmesh_cluster_sla_forwards_total{complete}    partials sent up as an aggregator (yes / no:
                                                   at the deadline, an input missing)
    mmmesh_cluster_sla_aggregator_roles            tree nodes this member aggregates now
    mmmesh_cluster_sla_tree_messages_total{direction}, _tree_bytes_total{direction}
    mmmesh_cluster_sla_tree_send_failures_total, _retargets_total, _receipt_mismatches_total
    mmmesh_cluster_sla_left_out_total{what}        rows (over max_rows) and sketches not sent
    mmmesh_cluster_sla_nodes_forgotten_total{cause}  expired records, evicted
    mmmesh_cluster_sla_local_skipped_total         board rows this node could not publish

The global view's class series are the same on every node once the view
has converged: a dashboard takes one node's (or the max over nodes), never
their sum.  Without peers there is nothing to export; the families are
still described.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..metrics._spec import Family, Spec, new_families

if TYPE_CHECKING:
    from qosd.mesh.rollout.core import Rollout

__all__ = ["CLUSTER_SLA_METRICS", "ROLLOUT_COUNTERS", "ROLLOUT_METRICS", "ROLLOUT_STATES",
           "ClusterAppsCollector", "RolloutApp", "SlaViewApp"]

T = TypeVar("T")


class OnLoop(Protocol):
    """Runs a function where the cores run (``Peers.on_loop``)."""

    def on_loop(self, fn: Callable[[], T]) -> T: ...


class RolloutApp(Protocol):
    """The rollout host as read here (qosd.mesh.rollout.host.ClusterRollout)."""

    @property
    def rollout(self) -> Rollout: ...
    @property
    def peers(self) -> OnLoop: ...


class SlaViewApp(Protocol):
    """The global SLA view's host as read here (qosd.mesh.slaview.host.ClusterSla)."""

    def snapshot(self, nodes: bool = True) -> dict[str, Any]: ...

log = logging.getLogger("qosd.mesh.membership.peers")

_CM = ("class", "modality")
ROLLOUT_STATES = ("pending", "acked", "nacked", "superseded", "gone")
ROLLOUT_COUNTERS = {  # RolloutStats field -> (metric, HELP)
    "proposals": ("mmmesh_rollout_proposals_total", "Mesh versions this node proposed"),
    "announcements": ("mmmesh_rollout_announcements_total",
                      "Well-formed announcements of a desired version received"),
    "reports": ("mmmesh_rollout_reports_total",
                "Members' ACK/NACK reports received that were newer than the one held"),
    "roll_calls": ("mmmesh_rollout_roll_calls_total",
                   "Roll calls this node sent as the origin of the desired version"),
    "superseded": ("mmmesh_rollout_superseded_total",
                   "Times the desired version was replaced by a higher one"),
    "realise_requests": ("mmmesh_rollout_realisations_total",
                         "Mesh versions this node set out to realise (check and apply)"),
    "acks_sent": ("mmmesh_rollout_acks_total", "ACKs this node reported"),
    "nacks_sent": ("mmmesh_rollout_nacks_total", "NACKs this node reported"),
    "fetches": ("mmmesh_rollout_fetches_total", "Policy texts asked of a peer"),
    "fetch_failures": ("mmmesh_rollout_fetch_failures_total",
                       "Policy text fetches that failed (another peer is asked)"),
    "states_merged": ("mmmesh_rollout_states_merged_total",
                      "Push-pull rollout sections merged"),
}
ROLLOUT_METRICS: Spec = {
    "mmmesh_rollout_desired_info": (
        "gauge", ("version",),
        "The desired mesh policy version (the highest this node has heard of), as 1"),
    "mmmesh_rollout_applied_info": (
        "gauge", ("version",), "The mesh policy version this node runs, as 1"),
    "mmmesh_rollout_behind": (
        "gauge", (), "1 while this node does not run the desired mesh version, else 0"),
    "mmmesh_rollout_members": (
        "gauge", ("state",),
        ("Members in the desired version's rollout table by state as this node sees it "
         "(pending, acked, nacked, superseded, gone)")),
    **{name: ("counter", (), text) for name, text in ROLLOUT_COUNTERS.values()},
    "mmmesh_rollout_dropped_total": (
        "counter", ("reason",),
        ("Rollout input from peers thrown away, by reason (malformed, oversize, "
         "impersonation, sha_mismatch, stale)")),
}
SLA_RESULTS = ("accepted", "older", "malformed", "from_gone")
INPUT_RESULTS = ("accepted", "older", "late", "malformed", "misrouted", "oversized",
                 "unsolicited")
CLUSTER_SLA_METRICS: Spec = {
    "mmmesh_cluster_sla_nodes_known": (
        "gauge", (), "Nodes whose SLA windows this node's global view holds"),
    "mmmesh_cluster_sla_nodes_reporting": (
        "gauge", (), "Nodes with at least one fresh window in this node's global view"),
    "mmmesh_cluster_sla_nodes_with_sketches": (
        "gauge", (), "Nodes with at least one fresh sketch in this node's global view"),
    "mmmesh_cluster_sla_attainment_ratio": (
        "gauge", _CM,
        "Share of frames within their deadline over every node's fresh windows (global view)"),
    "mmmesh_cluster_sla_p99_seconds": (
        "gauge", _CM,
        "p99 end-to-end latency of the global view: every node's sketches merged, not averaged"),
    "mmmesh_cluster_sla_frames": (
        "gauge", _CM, "Frames in every node's fresh windows (global view)"),
    "mmmesh_cluster_sla_nodes": (
        "gauge", _CM, "Nodes whose fresh window of the class is merged (global view)"),
    "mmmesh_cluster_sla_age_seconds": (
        "gauge", _CM, "How old the newest window merged into the class's record is"),
    "mmmesh_cluster_sla_oldest_age_seconds": (
        "gauge", _CM, "How old the oldest window merged into the class's record is"),
    "mmmesh_cluster_sla_inputs_total": (
        "counter", ("result",),
        ("Aggregation tree messages from peers by what became of them: accepted, older, late, "
         "malformed, misrouted, oversized, unsolicited")),
    "mmmesh_cluster_sla_records_total": (
        "counter", ("how",),
        "Per-class records this node took: received (from its parent), published (as a root)"),
    "mmmesh_cluster_sla_forwards_total": (
        "counter", ("complete",),
        "Partial sums this node sent up as an aggregator (complete=no: at the deadline)"),
    "mmmesh_cluster_sla_aggregator_roles": (
        "gauge", (), "Aggregation tree nodes this member aggregates now (all trees)"),
    "mmmesh_cluster_sla_tree_messages_total": (
        "counter", ("direction",), "Aggregation tree messages sent (out) and taken (in)"),
    "mmmesh_cluster_sla_tree_bytes_total": (
        "counter", ("direction",), "Bytes of aggregation tree messages, out and in"),
    "mmmesh_cluster_sla_tree_send_failures_total": (
        "counter", (), "Aggregation tree messages that could not be delivered"),
    "mmmesh_cluster_sla_retargets_total": (
        "counter", (), "Partials sent again to a node's backup after a failed send"),
    "mmmesh_cluster_sla_receipt_mismatches_total": (
        "counter", (),
        "Receipts that did not match what this node sent (its parent is avoided for a while)"),
    "mmmesh_cluster_sla_publications_received_total": (
        "counter", ("result",),
        ("SLA messages from peers (aggregation tree inputs and records), by what became of "
         "them: accepted, older, malformed, from_gone")),
    "mmmesh_cluster_sla_digests_published_total": (
        "counter", (), "SLA contributions this node made (its windows, per tree and round)"),
    "mmmesh_cluster_sla_left_out_total": (
        "counter", ("what",),
        "Rows of this node beyond a class's max_rows (windows), and sketches, not sent"),
    "mmmesh_cluster_sla_nodes_forgotten_total": (
        "counter", ("cause",),
        "Data dropped from the view: expired (records too old), evicted"),
    "mmmesh_cluster_sla_local_skipped_total": (
        "counter", (), "Rows of this node's board that could not be published"),
}


class ClusterAppsCollector(Collector):
    """Reads the rollout host and the global SLA view's host (the gossip back
    end's, qosd/store/cluster.py; None with etcd) at each scrape."""

    def __init__(self, rollout: RolloutApp | None, sla: SlaViewApp | None) -> None:
        self.rollout = rollout
        self.sla = sla

    def describe(self) -> Iterable[Metric]:
        return list(new_families({**ROLLOUT_METRICS, **CLUSTER_SLA_METRICS}).values())

    def collect(self) -> Iterable[Metric]:
        fams = new_families({**ROLLOUT_METRICS, **CLUSTER_SLA_METRICS})
        if self.rollout is not None:
            _read(self.rollout, _rollout, fams)
        if self.sla is not None:
            _read(self.sla, _sla_view, fams)
        return list(fams.values())


A = TypeVar("A")


def _read(app: A, read: Callable[[A, dict[str, Family]], None], fams: dict[str, Family]) -> None:
    try:
        read(app, fams)
    except Exception:  # a scrape never fails for one application
        log.exception("metrics: reading %s failed", type(app).__name__)


def _rollout(app: RolloutApp, fams: dict[str, Family]) -> None:
    """The rollout core's state and counters (read on the peers' loop)."""
    def take() -> tuple[Any, Any, dict[str, int], dict[str, Any]]:
        core = app.rollout
        table = core.table() if core.desired is not None else None  # no mesh version: no table
        return (core.desired, core.applied,
                {s: table.count(s) if table is not None else 0 for s in ROLLOUT_STATES},
                core.stats.as_dict())

    desired, applied, counts, stats = app.peers.on_loop(take)
    if desired is not None:
        fams["mmmesh_rollout_desired_info"].add_metric([str(desired.version)], 1)
    if applied is not None:
        fams["mmmesh_rollout_applied_info"].add_metric([str(applied)], 1)
    behind = desired is not None and applied != desired.version
    fams["mmmesh_rollout_behind"].add_metric([], 1 if behind else 0)
    for state in ROLLOUT_STATES:
        fams["mmmesh_rollout_members"].add_metric([state], counts[state])
    for key, (name, _) in ROLLOUT_COUNTERS.items():
        fams[name].add_metric([], float(stats.get(key, 0)))
    for reason, n in sorted((stats.get("dropped") or {}).items()):
        fams["mmmesh_rollout_dropped_total"].add_metric([reason], float(n))


def _sla_view(app: SlaViewApp, fams: dict[str, Family]) -> None:
    """The global view's classes and the view's counters (the aggregation
    trees' view, ``SlaTree.snapshot``; a per-node ``SlaView``'s reads the same)."""
    view = app.snapshot(nodes=False)
    for name, key in (("mmmesh_cluster_sla_nodes_known", "nodes_known"),
                      ("mmmesh_cluster_sla_nodes_reporting", "nodes_reporting"),
                      ("mmmesh_cluster_sla_nodes_with_sketches", "nodes_with_sketches")):
        fams[name].add_metric([], float(view.get(key) or 0))
    for row in view.get("classes") or []:
        _add_class(fams, row)
    c: Mapping[str, int] = view.get("counters") or {}

    def n(*keys: str) -> float:
        return float(sum(int(c.get(k, 0) or 0) for k in keys))

    received = {"accepted": n("accepted"), "older": n("older", "late"),
                "malformed": n("malformed", "misrouted", "oversized", "unsolicited"),
                "from_gone": n("from_gone")}
    for result in SLA_RESULTS:
        fams["mmmesh_cluster_sla_publications_received_total"].add_metric(
            [result], received[result])
    fams["mmmesh_cluster_sla_digests_published_total"].add_metric(
        [], n("sampled") if "sampled" in c else n("published"))
    for what, keys in (("windows", ("windows_left_out", "rows_left_out")),
                       ("sketches", ("sketches_left_out",))):
        fams["mmmesh_cluster_sla_left_out_total"].add_metric([what], n(*keys))
    for cause, keys in (("expired", ("expired", "records_expired")), ("evicted", ("evicted",))):
        fams["mmmesh_cluster_sla_nodes_forgotten_total"].add_metric([cause], n(*keys))
    fams["mmmesh_cluster_sla_local_skipped_total"].add_metric([], n("local_skipped"))
    if "sampled" not in c:
        return  # a per-node view: no trees
    for result in INPUT_RESULTS:
        fams["mmmesh_cluster_sla_inputs_total"].add_metric([result], n(result))
    fams["mmmesh_cluster_sla_records_total"].add_metric(["received"], n("records_received"))
    fams["mmmesh_cluster_sla_records_total"].add_metric(["published"], n("published"))
    complete = n("forwarded") - n("forwarded_incomplete")
    fams["mmmesh_cluster_sla_forwards_total"].add_metric(["yes"], max(0.0, complete))
    fams["mmmesh_cluster_sla_forwards_total"].add_metric(["no"], n("forwarded_incomplete"))
    agg = view.get("aggregation") or {}
    fams["mmmesh_cluster_sla_aggregator_roles"].add_metric(
        [], float(sum(int(t.get("aggregates") or 0) for t in agg.get("trees") or [])))
    traffic: Mapping[str, int] = view.get("traffic") or {}
    for direction in ("out", "in"):
        fams["mmmesh_cluster_sla_tree_messages_total"].add_metric(
            [direction], float(traffic.get(f"messages_{direction}", 0)))
        fams["mmmesh_cluster_sla_tree_bytes_total"].add_metric(
            [direction], float(traffic.get(f"bytes_{direction}", 0)))
    fams["mmmesh_cluster_sla_tree_send_failures_total"].add_metric(
        [], float(traffic.get("send_failures", 0)))
    fams["mmmesh_cluster_sla_retargets_total"].add_metric([], n("retargets"))
    fams["mmmesh_cluster_sla_receipt_mismatches_total"].add_metric([], n("receipt_mismatches"))


def _add_class(fams: dict[str, Family], row: Mapping[str, Any]) -> None:
    labels = [str(row.get("sla_class")), str(row.get("modality"))]
    if not row.get("nodes"):  # every node's window of it went stale: no series
        return
    fams["mmmesh_cluster_sla_frames"].add_metric(labels, float(row.get("frames") or 0))
    fams["mmmesh_cluster_sla_nodes"].add_metric(labels, float(row.get("nodes") or 0))
    for name, key in (("mmmesh_cluster_sla_age_seconds", "age_s"),
                      ("mmmesh_cluster_sla_oldest_age_seconds", "oldest_age_s")):
        if row.get(key) is not None:
            fams[name].add_metric(labels, float(row[key]))
    attainment = row.get("attainment")
    fams["mmmesh_cluster_sla_attainment_ratio"].add_metric(
        labels, 1.0 if attainment is None else float(attainment))
    if row.get("p99_ms") is not None:
        fams["mmmesh_cluster_sla_p99_seconds"].add_metric(labels, float(row["p99_ms"]) / 1e3)
