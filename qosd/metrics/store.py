"""Prometheus collector of the cluster store (read at scrape time).

    mmmesh_cluster_store_up{backend}                 1 while the store answers (etcd:
                                                     a watch runs), 0 while it is down
    mmmesh_cluster_store_operations_total{op}        lists, relists after a compaction,
                                                     watch events, leases lost, writes...
    mmmesh_cluster_store_requests_total{kind}        requests to etcd by kind
    mmmesh_cluster_store_request_failures_total{error}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["StoreCollector", "StoreStats"]


class StoreStats(Protocol):
    """What the collector reads of a cluster store (qosd.store.base.ClusterStore)."""

    backend: str

    def status(self) -> dict[str, Any]: ...
    def counters(self) -> dict[str, dict[str, int]]: ...


class StoreCollector:
    def __init__(self, store: StoreStats) -> None:
        self.store = store

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        st = self.store.status()
        up = GaugeMetricFamily("mmmesh_cluster_store_up", "1 while the cluster store answers, "
                               "0 while it is down (qosd keeps its last good policy)",
                               labels=["backend"])
        up.add_metric([self.store.backend], 1.0 if st.get("up") else 0.0)
        yield up
        counters = self.store.counters()
        for name, part, label, what in (
                ("operations", "operations", "op", "cluster store operations"),
                ("requests", "requests", "kind", "requests to the cluster store"),
                ("request_failures", "failures", "error", "failed store requests")):
            fam = CounterMetricFamily(f"mmmesh_cluster_store_{name}", what, labels=[label])
            for key, value in sorted(counters.get(part, {}).items()):
                fam.add_metric([key], float(value))
            yield fam
