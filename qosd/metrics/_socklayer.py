"""The socket layer's node-wide counters and the SLA controller's kernel
writes, read at scrape time (qosd/socklayer.py, qosd/controller/kernel.py).

``mmmesh_socklayer_*`` come from ``SocketLayer.status()`` (one open of the
pinned maps, the per-CPU counters summed); they are there only when
``socket_layer.enabled``.  Series are bounded: events by the ABI's list,
modalities by the modality byte (at most 256, in practice the few the mesh
sends), replica weights by the configured stages (<= 64 x 8).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ._spec import Spec, new_families

if TYPE_CHECKING:
    from ..socklayer import SocketLayerHost

log = logging.getLogger("qosd.metrics")

SOCKLAYER_METRICS: Spec = {
    "mmmesh_socklayer_up": (
        "gauge", (), ("1 if the socket layer is enabled, pinned, both programs attached and "
        "its maps read")),
    "mmmesh_socklayer_flows": (
        "gauge", (), "Registered mesh sockets (the socket layer's registry)"),
    "mmmesh_socklayer_endpoints": (
        "gauge", (), "Mesh endpoints the socket layer knows (qosd.yaml socket_layer.stages)"),
    "mmmesh_socklayer_modality_frames_total": (
        "counter", ("modality",), ("Frames sk_msg read at a frame boundary, by modality, "
        "node-wide")),
    "mmmesh_socklayer_modality_bytes_total": (
        "counter", ("modality",), "Their bytes (header + payload), by modality, node-wide"),
    "mmmesh_socklayer_events_total": (
        "counter", ("event",), ("What the socket layer did (registered, redirected, passed, "
        "off, remote, peer_tcp, ...: docs/socklayer.md)")),
    "mmmesh_socklayer_replica_weight": (
        "gauge", ("stage", "replica"), ("The weight of a replica of a stage in the kernel "
        "(a share of its stage's frames: weight / sum of the stage's weights)")),
    "mmmesh_controller_kernel_writes_total": (
        "counter", ("target", "result"), ("The SLA controller's writes of stage overrides "
        "(target overrides) and replica weights (target replica_weights), by result (ok, "
        "error)")),
}


class KernelWrites(Protocol):
    """The SLA controller's kernel writes (qosd.controller.kernel.KernelWriter)."""

    @property
    def counts(self) -> Mapping[tuple[str, str], int]:
        """(target, ok|error) -> writes."""
        ...


class SocketLayerCollector(Collector):
    """Reads ``host`` (a SocketLayerHost) and ``kernel`` (the controller's
    KernelWriter) when Prometheus scrapes."""

    def __init__(self, host: SocketLayerHost, kernel: KernelWrites) -> None:
        self._host = host
        self._kernel = kernel

    def describe(self) -> Iterable[Metric]:
        return list(new_families(SOCKLAYER_METRICS).values())

    def collect(self) -> Iterable[Metric]:
        from ..socklayer import modality_name

        fams = new_families(SOCKLAYER_METRICS)
        for target in ("overrides", "replica_weights"):
            for result in ("ok", "error"):
                fams["mmmesh_controller_kernel_writes_total"].add_metric(
                    [target, result], float(self._kernel.counts.get((target, result), 0)))
        if not self._host.enabled:
            return list(fams.values())
        up = 0.0
        try:
            st = self._host.layer().status()
            if st.loaded:
                up = float(bool(st.attached) and all(st.attached.values()))
                fams["mmmesh_socklayer_flows"].add_metric([], float(st.flows))
                fams["mmmesh_socklayer_endpoints"].add_metric([], float(st.endpoints))
                names = {sid: name for name, sid in
                         ((s.name, s.id) for s in self._host.cfg.stages)}
                for sid, ws in sorted(st.weights.items()):
                    for r, w in enumerate(ws):
                        if w:
                            fams["mmmesh_socklayer_replica_weight"].add_metric(
                                [names.get(sid, str(sid)), str(r)], float(w))
                if st.stats is not None:
                    for m, (f, b) in sorted(st.stats.modalities.items()):
                        fams["mmmesh_socklayer_modality_frames_total"].add_metric(
                            [modality_name(m)], float(f))
                        fams["mmmesh_socklayer_modality_bytes_total"].add_metric(
                            [modality_name(m)], float(b))
                    for ev, n in sorted(st.stats.events.items()):
                        fams["mmmesh_socklayer_events_total"].add_metric([ev], float(n))
        except Exception:
            log.exception("metrics: reading the socket layer failed")
        fams["mmmesh_socklayer_up"].add_metric([], up)
        return list(fams.values())
