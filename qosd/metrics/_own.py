"""qosd's own metrics: what it reconciled, how long that took, whether it is
still alive, and what build it is.

``mmmesh_reconcile_last_success_timestamp_seconds`` only moves when a
reconcile runs, and in steady state nothing needs one: it cannot tell a
healthy idle qosd from a stuck one.  The heartbeat
``mmmesh_resync_last_run_timestamp_seconds`` can: it is set after every
periodic resync pass, whether the pass found drift or not, so
``time() - heartbeat > 3 * mmmesh_resync_interval_seconds + 60`` means the
resync loop has stopped (docs/grafana/mmmesh-alerts.yaml).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram, Info
from prometheus_client import Counter as PromCounter

from mmmesh import abi as _abi

from ..model import ReconcileResult
from ._spec import Spec

RECONCILE_TRIGGERS = ("apply", "rollback", "resync", "startup", "restore", "adapt", "cluster")
ADOPTION_RESULTS = ("adopted", "loaded", "replaced")
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BUILD_LABELS = ("version", "abi", "bpf_build", "python", "node")

QOSD_METRICS: Spec = {
    "mmmesh_build_info": (
        "info", BUILD_LABELS,
        ("qosd's build: mmmesh version, dataplane ABI version, BPF build id (of the default "
         "tunables), Python version, and the node name it runs as (always 1)")),
    "mmmesh_policy_version": ("gauge", (), "Policy version qosd has reconciled into the kernel"),
    "mmmesh_reconcile_duration_seconds": ("histogram", (), "Time one reconcile took"),
    "mmmesh_reconcile_last_duration_seconds": (
        "gauge", (), "Time the last reconcile took (exact, also when few have run)"),
    "mmmesh_reconcile_errors_total": ("counter", (), "Reconciles that failed"),
    "mmmesh_reconciles_total": ("counter", ("trigger",), "Reconciles run, by trigger"),
    "mmmesh_adoptions_total": (
        "counter", ("result",),
        ("Dataplane start-ups: adopted (pinned one kept), loaded (none was there), "
         "replaced (an incompatible one was)")),
    "mmmesh_drift_repairs_total": ("counter", (), "Drifted kernel objects found and repaired"),
    "mmmesh_reconcile_last_success_timestamp_seconds": (
        "gauge", (), ("Unix time the last successful reconcile finished (still while nothing "
                      "needs one: alert on the heartbeat instead)")),
    "mmmesh_resync_last_run_timestamp_seconds": (
        "gauge", (), ("Heartbeat: unix time the last periodic resync pass finished, whether or "
                      "not it repaired anything (qosd's start until the first pass)")),
    "mmmesh_resync_interval_seconds": (
        "gauge", (), "Configured time between resync passes (resync_interval_s)"),
}


@functools.cache
def build_labels() -> dict[str, str]:
    """The build's labels but ``node`` (computed once: the BPF build id hashes
    the program's source)."""
    try:
        version = importlib.metadata.version("mmmesh")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    try:
        from mmmesh.dataplane import build_id  # hashes the source; bcc is not imported

        bpf_build = f"{build_id():016x}"
    except Exception:  # noqa: BLE001 - no BPF source shipped: the rest still says enough
        bpf_build = "unknown"
    return {"version": version, "abi": str(_abi.ABI_VERSION), "bpf_build": bpf_build,
            "python": platform.python_version()}


class QosdMetrics:
    """qosd's metrics, registered in ``registry``.  ``node`` goes into
    ``mmmesh_build_info``; ``resync_interval_s`` is exported for the
    heartbeat's alert."""

    def __init__(self, registry: CollectorRegistry, *, node: str = "",
                 resync_interval_s: float | None = None) -> None:
        def doc(name: str) -> str:
            return QOSD_METRICS[name][2]

        self.build_info = Info("mmmesh_build", doc("mmmesh_build_info"), registry=registry)
        self.build_info.info({**build_labels(), "node": node})
        self.policy_version = Gauge("mmmesh_policy_version", doc("mmmesh_policy_version"),
                                    registry=registry)
        self.reconcile_duration = Histogram(
            "mmmesh_reconcile_duration_seconds", doc("mmmesh_reconcile_duration_seconds"),
            buckets=RECONCILE_BUCKETS, registry=registry)
        self.last_duration = Gauge(
            "mmmesh_reconcile_last_duration_seconds",
            doc("mmmesh_reconcile_last_duration_seconds"), registry=registry)
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
        self.heartbeat = Gauge(
            "mmmesh_resync_last_run_timestamp_seconds",
            doc("mmmesh_resync_last_run_timestamp_seconds"), registry=registry)
        self.heartbeat.set(time.time())
        self.resync_interval = Gauge(
            "mmmesh_resync_interval_seconds", doc("mmmesh_resync_interval_seconds"),
            registry=registry)
        if resync_interval_s is not None:
            self.resync_interval.set(resync_interval_s)
        # Known label values exist from the start (at 0), so rate() sees the first one.
        for trig in RECONCILE_TRIGGERS:
            self.reconciles.labels(trigger=trig)
        for res in ADOPTION_RESULTS:
            self.adoptions.labels(result=res)

    def observe_reconcile(self, result: ReconcileResult) -> None:
        duration = max(0.0, result.duration_s)
        self.reconcile_duration.observe(duration)
        self.last_duration.set(duration)
        self.reconciles.labels(trigger=result.trigger).inc()
        if not result.ok:
            self.reconcile_errors.inc()
        else:
            self.last_success.set(result.started_at + result.duration_s)
        if result.repaired:
            self.drift_repairs.inc(len(result.repaired))
        self.policy_version.set(result.version)

    def resync_ran(self, now: float | None = None) -> None:
        """The heartbeat: a periodic resync pass finished (found drift or not)."""
        self.heartbeat.set(time.time() if now is None else now)

    def adoption(self, result: str) -> None:
        if result not in ADOPTION_RESULTS:
            raise ValueError(f"adoption result {result!r} not in {ADOPTION_RESULTS}")
        self.adoptions.labels(result=result).inc()

    def set_policy_version(self, version: int) -> None:
        self.policy_version.set(version)
