"""Prometheus metrics: the dataplane's counters, read at scrape time, and qosd's own.

``DataplaneCollector`` reads nothing on a timer: every scrape opens each
target's pinned maps and asks netlink for its HTB classes, so what Prometheus
sees is what the kernel holds at that moment.  A target whose dataplane is not
loaded (no pins, wrong ABI, device or netns gone) reports
``mmmesh_dataplane_up 0`` and the scrape goes on.

Exported by the collector (counters end in ``_total``)::

    mmmesh_dataplane_up{iface}                                 1 if the pinned maps opened and read
    mmmesh_dataplane_policy_version{iface}                     policy version in the config map
    mmmesh_classifier_class_packets_total{iface,direction,class}   BPF per-class counters
    mmmesh_classifier_class_bytes_total{iface,direction,class}
    mmmesh_classifier_packets_total{iface,direction,reason}    parsed/flow_hit/not_mesh/malformed
                                                               partition the packets; clamped,
                                                               flow_new, flow_update, dscp_rewrite
                                                               are extra events on top
    mmmesh_htb_class_{bytes,packets,drops,overlimits}_total{iface,class}
    mmmesh_htb_class_backlog_bytes{iface,class}, mmmesh_htb_class_queue_packets{iface,class}
    mmmesh_flows{iface}                                        entries in the flow table
    mmmesh_flows_capacity{iface}                               its size (LRU: full = evicting)
    mmmesh_class_flows{iface,class}                            flow-table entries by class

``class`` is the policy's class name (``Target.class_names``), the decimal
class id when the id is not in it.  The HTB parent class ``1:40`` (the whole
link) is not exported: the leaves sum to it, and ``sum by (iface)`` stays
right.  Targets must have distinct ``iface`` names (a repeated one is skipped).

Everything is read through :class:`mmmesh.dataplane.Dataplane` (``stats()``:
counters, policy version and a census of the flow table from one map open,
counted with batched lookups; ``htb_classes()``).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mmmesh import _abi
from mmmesh._errors import DataplaneError
from mmmesh._net import parse_hostport
from mmmesh.dataplane import Dataplane

from .model import ReconcileResult

log = logging.getLogger("qosd.metrics")

HTB_LINK_CLASS = (_abi.HTB_MAJOR << 16) | _abi.MAX_CLASSES  # 1:40, the whole link


@dataclass
class Target:
    """One device whose dataplane is scraped."""

    iface: str
    netns: str | None = None
    class_names: dict[int, str] = field(default_factory=dict)  # class id -> name (policy)


# name -> (type, labels, help).  The one list of what the collector exports.
DATAPLANE_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "mmmesh_dataplane_up": (
        "gauge", ("iface",),
        "1 if the pinned dataplane maps of the device opened and read, else 0"),
    "mmmesh_dataplane_policy_version": (
        "gauge", ("iface",), "Policy version written in the dataplane's config map"),
    "mmmesh_classifier_class_packets_total": (
        "counter", ("iface", "direction", "class"), "Packets the BPF classifier put in a class"),
    "mmmesh_classifier_class_bytes_total": (
        "counter", ("iface", "direction", "class"), "Bytes the BPF classifier put in a class"),
    "mmmesh_classifier_packets_total": (
        "counter", ("iface", "direction", "reason"),
        "Packets seen by the BPF classifier by reason: parsed, flow_hit, not_mesh and malformed "
        "partition the packets; clamped, flow_new, flow_update and dscp_rewrite count extra "
        "events"),
    "mmmesh_htb_class_bytes_total": (
        "counter", ("iface", "class"), "Bytes sent by the HTB leaf class"),
    "mmmesh_htb_class_packets_total": (
        "counter", ("iface", "class"), "Packets sent by the HTB leaf class"),
    "mmmesh_htb_class_drops_total": (
        "counter", ("iface", "class"), "Packets dropped in the HTB leaf class"),
    "mmmesh_htb_class_overlimits_total": (
        "counter", ("iface", "class"), "Times the HTB leaf class was over its rate"),
    "mmmesh_htb_class_backlog_bytes": (
        "gauge", ("iface", "class"), "Bytes queued in the HTB leaf class"),
    "mmmesh_htb_class_queue_packets": (
        "gauge", ("iface", "class"), "Packets queued in the HTB leaf class"),
    "mmmesh_flows": (
        "gauge", ("iface",), "Entries in the dataplane's TCP flow table"),
    "mmmesh_flows_capacity": (
        "gauge", ("iface",), "Size of the flow table (an LRU: when full, old flows are evicted)"),
    "mmmesh_class_flows": (
        "gauge", ("iface", "class"), "Entries in the flow table by class"),
}

QOSD_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "mmmesh_policy_version": ("gauge", (), "Policy version qosd has reconciled into the kernel"),
    "mmmesh_reconcile_duration_seconds": ("histogram", (), "Time one reconcile took"),
    "mmmesh_reconcile_errors_total": ("counter", (), "Reconciles that failed"),
    "mmmesh_reconciles_total": ("counter", ("trigger",), "Reconciles run, by trigger"),
    "mmmesh_adoptions_total": (
        "counter", ("result",),
        "Dataplane start-ups: adopted (pinned one kept), loaded (none was there), "
        "replaced (an incompatible one was)"),
    "mmmesh_drift_repairs_total": ("counter", (), "Drifted kernel objects found and repaired"),
    "mmmesh_reconcile_last_success_timestamp_seconds": (
        "gauge", (), "Unix time the last successful reconcile finished"),
}

RECONCILE_TRIGGERS = ("apply", "rollback", "resync", "startup", "restore")
ADOPTION_RESULTS = ("adopted", "loaded", "replaced")
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def exported_names() -> set[str]:
    """Every sample name the collector and QosdMetrics can export."""
    out: set[str] = set()
    for name, (kind, _, _) in {**DATAPLANE_METRICS, **QOSD_METRICS}.items():
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        elif kind == "counter":
            out.add(f"{name.removesuffix('_total')}_created")
    return out


Family = CounterMetricFamily | GaugeMetricFamily


def _families() -> dict[str, Family]:
    fams: dict[str, Family] = {}
    for name, (kind, labels, doc) in DATAPLANE_METRICS.items():
        if kind == "counter":
            fams[name] = CounterMetricFamily(name, doc, labels=list(labels))
        else:
            fams[name] = GaugeMetricFamily(name, doc, labels=list(labels))
    return fams


# --------------------------------------------------------------------------
# The scrape-time collector
# --------------------------------------------------------------------------
def _class_label(names: dict[int, str], cid: int) -> str:
    return names.get(cid, str(cid))


class DataplaneCollector(Collector):
    """Reads every target's dataplane when Prometheus scrapes (``collect``)."""

    def __init__(self, targets: Callable[[], Iterable[Target]] | Sequence[Target]) -> None:
        if callable(targets):
            self._targets: Callable[[], Iterable[Target]] = targets
        else:
            fixed = list(targets)
            self._targets = lambda: fixed
        # The HTTP exporter serves each scrape in its own thread: one at a time.
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        # Names only: registering must not read the kernel.
        return list(_families().values())

    def collect(self) -> Iterable[Metric]:
        fams = _families()
        try:
            targets = list(self._targets())
        except Exception:
            log.exception("metrics: listing the targets failed")
            targets = []
        seen: set[str] = set()
        with self._lock:
            for t in targets:
                if t.iface in seen:
                    log.warning("metrics: target %s listed twice (netns %s): skipped",
                                t.iface, t.netns)
                    continue
                seen.add(t.iface)
                self._collect_target(t, fams)
        return list(fams.values())

    # ------------------------------------------------------------ per target
    def _collect_target(self, t: Target, fams: dict[str, Family]) -> None:
        up = self._collect_maps(t, fams)
        fams["mmmesh_dataplane_up"].add_metric([t.iface], 1.0 if up else 0.0)
        self._collect_htb(t, fams)

    def _collect_maps(self, t: Target, fams: dict[str, Family]) -> bool:
        dp = Dataplane(t.iface, t.netns)
        try:
            st = dp.stats()
        except (DataplaneError, OSError) as e:
            lvl = logging.DEBUG if getattr(e, "errno", None) == errno.ENOENT else logging.WARNING
            log.log(lvl, "metrics: no dataplane at %s: %s", dp.pin_dir, e)
            return False
        names = t.class_names
        for direction, ds in st.counters.items():
            for reason, n in ds.reasons.items():
                fams["mmmesh_classifier_packets_total"].add_metric(
                    [t.iface, direction, reason], float(n))
            for cid in sorted(set(ds.classes) | set(names)):
                pk, by = ds.classes.get(cid, (0, 0))
                label = [t.iface, direction, _class_label(names, cid)]
                fams["mmmesh_classifier_class_packets_total"].add_metric(label, float(pk))
                fams["mmmesh_classifier_class_bytes_total"].add_metric(label, float(by))
        fams["mmmesh_dataplane_policy_version"].add_metric([t.iface], float(st.policy_version))
        fams["mmmesh_flows"].add_metric([t.iface], float(st.flows.count))
        fams["mmmesh_flows_capacity"].add_metric([t.iface], float(st.flows.capacity))
        if st.flows.by_class is not None:
            for cid in sorted(set(st.flows.by_class) | set(names)):
                fams["mmmesh_class_flows"].add_metric(
                    [t.iface, _class_label(names, cid)], float(st.flows.by_class.get(cid, 0)))
        return True

    def _collect_htb(self, t: Target, fams: dict[str, Family]) -> None:
        try:
            classes = Dataplane(t.iface, t.netns).htb_classes()
        except Exception as e:
            log.debug("metrics: HTB classes of %s (netns %s): %s", t.iface, t.netns, e)
            return
        for classid, st in sorted(classes.items()):
            if classid == HTB_LINK_CLASS:
                continue
            label = [t.iface, _class_label(t.class_names, classid & 0xFFFF)]
            for name, value in (("mmmesh_htb_class_bytes_total", st.bytes),
                                ("mmmesh_htb_class_packets_total", st.packets),
                                ("mmmesh_htb_class_drops_total", st.drops),
                                ("mmmesh_htb_class_overlimits_total", st.overlimits),
                                ("mmmesh_htb_class_backlog_bytes", st.backlog),
                                ("mmmesh_htb_class_queue_packets", st.qlen)):
                fams[name].add_metric(label, float(value))


# --------------------------------------------------------------------------
# qosd's own metrics
# --------------------------------------------------------------------------
class QosdMetrics:
    """qosd's metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def doc(name: str) -> str:
            return QOSD_METRICS[name][2]

        self.policy_version = Gauge("mmmesh_policy_version", doc("mmmesh_policy_version"),
                                    registry=registry)
        self.reconcile_duration = Histogram(
            "mmmesh_reconcile_duration_seconds", doc("mmmesh_reconcile_duration_seconds"),
            buckets=RECONCILE_BUCKETS, registry=registry)
        self.reconcile_errors = PromCounter(
            "mmmesh_reconcile_errors_total", doc("mmmesh_reconcile_errors_total"),
            registry=registry)
        self.reconciles = PromCounter(
            "mmmesh_reconciles_total", doc("mmmesh_reconciles_total"), ["trigger"],
            registry=registry)
        self.adoptions = PromCounter(
            "mmmesh_adoptions_total", doc("mmmesh_adoptions_total"), ["result"],
            registry=registry)
        self.drift_repairs = PromCounter(
            "mmmesh_drift_repairs_total", doc("mmmesh_drift_repairs_total"), registry=registry)
        self.last_success = Gauge(
            "mmmesh_reconcile_last_success_timestamp_seconds",
            doc("mmmesh_reconcile_last_success_timestamp_seconds"), registry=registry)
        # Known label values exist from the start (at 0), so rate() sees the first one.
        for trig in RECONCILE_TRIGGERS:
            self.reconciles.labels(trigger=trig)
        for res in ADOPTION_RESULTS:
            self.adoptions.labels(result=res)

    def observe_reconcile(self, result: ReconcileResult) -> None:
        self.reconcile_duration.observe(max(0.0, result.duration_s))
        self.reconciles.labels(trigger=result.trigger).inc()
        if not result.ok:
            self.reconcile_errors.inc()
        else:
            self.last_success.set(result.started_at + result.duration_s)
        if result.repaired:
            self.drift_repairs.inc(len(result.repaired))
        self.policy_version.set(result.version)

    def adoption(self, result: str) -> None:
        if result not in ADOPTION_RESULTS:
            raise ValueError(f"adoption result {result!r} not in {ADOPTION_RESULTS}")
        self.adoptions.labels(result=result).inc()

    def set_policy_version(self, version: int) -> None:
        self.policy_version.set(version)


def make_registry(targets: Callable[[], Iterable[Target]] | Sequence[Target],
                  qosd_metrics: bool = True) -> tuple[CollectorRegistry, QosdMetrics | None]:
    """A registry with the dataplane collector and (optionally) qosd's metrics."""
    registry = CollectorRegistry()
    registry.register(DataplaneCollector(targets))
    return registry, (QosdMetrics(registry) if qosd_metrics else None)


# --------------------------------------------------------------------------
# HTTP exporter
# --------------------------------------------------------------------------
class MetricsServer:
    """The running exporter; ``shutdown()`` (or ``close()``) stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self.server = server
        self.thread = thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(timeout=5)
        self.server.server_close()

    close = shutdown

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve_metrics(registry: CollectorRegistry, addr: str) -> MetricsServer:
    """Serves ``registry`` over HTTP at ``addr`` (host:port; port 0 = any free
    one, see ``.port``) from a daemon thread."""
    host, port = parse_hostport(addr, default_host="0.0.0.0", what="metrics address")
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


def iter_samples(registry: CollectorRegistry) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample, for tests and debugging."""
    for fam in registry.collect():
        for s in fam.samples:
            yield s.name, dict(s.labels), float(s.value)


__all__ = [
    "ADOPTION_RESULTS", "DATAPLANE_METRICS", "DataplaneCollector", "MetricsServer",
    "QOSD_METRICS", "QosdMetrics", "RECONCILE_TRIGGERS", "Target",
    "exported_names", "make_registry", "serve_metrics",
]
