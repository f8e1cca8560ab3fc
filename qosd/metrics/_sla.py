"""The SLA board's node-wide view and its own counters, read at scrape time.

:class:`SlaBoardCollector` asks the board (qosd/sla/board.py) for ``view()``
and ``stats()`` on every scrape.  From the view it exports the ``classes``
rows: per (class, modality), every fresh window of every stage and sender on
this node merged (attainment frame-weighted, latency quantiles from the
merged DDSketches).  There is no per-sender or per-stage label: the number of
series is classes x modalities, and the board's own row limit
(``sla_limits.board_rows``) bounds even a node whose sidecars report classes
the policy does not know.  Windows that went stale are not merged; when every
window of a (class, modality) is stale its series disappear.

The ``mmmesh_sla_window_*`` gauges are sums over the current windows (not
counters): to weigh attainment across nodes, multiply by
``mmmesh_sla_window_frames`` and divide by its sum.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from qosd.identity import REFUSAL_CODES

from ._spec import Family, Spec, new_families

log = logging.getLogger("qosd.metrics")

_CM = ("class", "modality")
SLA_PERCENTILES = ("p50", "p90", "p99")  # the keys of the view's e2e_ms, as GET /v1/sla
# SlaBoard.stats() keys of evicted windows -> the cause label.
_EVICTIONS = {"evicted_own": "own", "expired": "expired"}

SLA_METRICS: Spec = {
    "mmmesh_sla_attainment_ratio": (
        "gauge", _CM,
        ("Share of frames within their deadline in the current SLA windows of this node, all "
         "stages and senders merged (frame-weighted; 1 when there were no frames)")),
    "mmmesh_sla_window_frames": (
        "gauge", _CM, "Frames in the current SLA windows of this node (all stages merged)"),
    "mmmesh_sla_window_deadline_misses": (
        "gauge", _CM, "Frames past their deadline in the current SLA windows of this node"),
    "mmmesh_sla_window_drops": (
        "gauge", _CM, "Frames dropped in the current SLA windows of this node"),
    "mmmesh_sla_window_errors": (
        "gauge", _CM, "Frames that ended in an error in the current SLA windows of this node"),
    "mmmesh_sla_window_sources": (
        "gauge", _CM, "Fresh windows (stage x sender) merged into the class's row"),
    "mmmesh_sla_e2e_latency_seconds": (
        "gauge", (*_CM, "percentile"),
        ("End-to-end latency percentiles (p50, p90, p99) of the current SLA windows of this "
         "node, from the merged DDSketches (not an average of the senders' percentiles)")),
    "mmmesh_sla_board_rows": (
        "gauge", (), "SLA windows the board keeps (fresh and stale)"),
    "mmmesh_sla_board_bytes": (
        "gauge", (), "Bytes the board's windows take, as its quota counts them"),
    "mmmesh_sla_board_senders": (
        "gauge", (), "Senders with at least one window on the board"),
    "mmmesh_sla_reports_accepted_total": (
        "counter", (), "SLA reports the board took"),
    "mmmesh_sla_reports_refused_total": (
        "counter", ("code",),
        ("SLA reports refused, by the refusal's code (not_allowed, stage_not_allowed, "
         "rate_limited, sender_quota, board_full, invalid_request, ...)")),
    "mmmesh_sla_board_evictions_total": (
        "counter", ("cause",),
        ("SLA windows the board dropped: own (a sender's oldest windows made room for its "
         "new ones), expired (not refreshed for sla_limits.keep_s)")),
    "mmmesh_sla_board_skipped_reads_total": (
        "counter", (), "Windows left out of a read of the board because they could not be read"),
}


class BoardReader(Protocol):
    """What the collector reads of the board (:class:`qosd.sla.board.SlaBoard`)."""

    def view(self, now: float | None = None) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...


class SlaBoardCollector(Collector):
    """Reads ``board`` when Prometheus scrapes."""

    def __init__(self, board: BoardReader) -> None:
        self._board = board

    def describe(self) -> Iterable[Metric]:
        return list(new_families(SLA_METRICS).values())

    def collect(self) -> Iterable[Metric]:
        fams = new_families(SLA_METRICS)
        try:
            classes = self._board.view()["classes"]
        except Exception:  # the board promises not to raise; the scrape goes on if it does
            log.exception("metrics: reading the SLA board failed")
            classes = []
        for row in classes:
            _add_class_row(fams, row)
        # after view(): it counts the rows it skipped
        _add_board_stats(fams, self._board.stats())
        return list(fams.values())


def _add_class_row(fams: dict[str, Family], row: Mapping[str, Any]) -> None:
    labels = [str(row.get("sla_class")), str(row.get("modality"))]
    for name, key in (("mmmesh_sla_attainment_ratio", "attainment"),
                      ("mmmesh_sla_window_frames", "frames"),
                      ("mmmesh_sla_window_deadline_misses", "deadline_misses"),
                      ("mmmesh_sla_window_drops", "drops"),
                      ("mmmesh_sla_window_errors", "errors"),
                      ("mmmesh_sla_window_sources", "sources")):
        fams[name].add_metric(labels, float(row.get(key) or 0.0))
    e2e = row.get("e2e_ms") or {}
    for key in SLA_PERCENTILES:
        if e2e.get(key) is not None:
            fams["mmmesh_sla_e2e_latency_seconds"].add_metric(
                [*labels, key], float(e2e[key]) / 1e3)


def _add_board_stats(fams: dict[str, Family], st: Mapping[str, Any]) -> None:
    for name, key in (("mmmesh_sla_board_rows", "rows"), ("mmmesh_sla_board_bytes", "bytes"),
                      ("mmmesh_sla_board_senders", "senders"),
                      ("mmmesh_sla_reports_accepted_total", "accepted"),
                      ("mmmesh_sla_board_skipped_reads_total", "skipped_reads")):
        fams[name].add_metric([], float(st.get(key, 0)))
    for key, cause in _EVICTIONS.items():
        fams["mmmesh_sla_board_evictions_total"].add_metric([cause], float(st.get(key, 0)))
    refused = {code: 0.0 for code in REFUSAL_CODES}  # every code from the start, at 0
    for key, n in st.items():
        if key.startswith("refused:"):
            refused[key.removeprefix("refused:")] = float(n)
    for code, n in sorted(refused.items()):
        fams["mmmesh_sla_reports_refused_total"].add_metric([code], n)
