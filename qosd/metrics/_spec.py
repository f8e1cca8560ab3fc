"""What each collector exports, as one table per collector, and the
Prometheus families built from such a table.

A table maps a metric's name to ``(type, label names, HELP)``; the type is
``counter``, ``gauge``, ``histogram`` or ``info``.  The collectors build their
families from their table and nothing else, so the tables are the one list of
what qosd exports (tests compare scrapes and the dashboard against them)."""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

Spec = dict[str, tuple[str, tuple[str, ...], str]]
Family = CounterMetricFamily | GaugeMetricFamily


def new_families(spec: Spec) -> dict[str, Family]:
    """Empty counter and gauge families for every entry of ``spec``."""
    fams: dict[str, Family] = {}
    for name, (kind, labels, doc) in spec.items():
        if kind == "counter":
            fams[name] = CounterMetricFamily(name, doc, labels=list(labels))
        elif kind == "gauge":
            fams[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        else:
            raise ValueError(f"{name}: a collector builds counters and gauges, not {kind}")
    return fams


def sample_names(spec: Spec) -> set[str]:
    """Every sample name the families of ``spec`` can produce (``_bucket``,
    ``_sum``, ``_count`` of histograms; ``_created`` of counters and
    histograms, which prometheus_client's own metrics add)."""
    out: set[str] = set()
    for name, (kind, _, _) in spec.items():
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        elif kind == "counter":
            out.add(f"{name.removesuffix('_total')}_created")
    return out
