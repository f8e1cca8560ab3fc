"""The dataplane's counters, read from the kernel when Prometheus scrapes.

:class:`DataplaneCollector` reads nothing on a timer: every scrape opens each
target's pinned maps and asks netlink for its HTB classes (through
:class:`mmmesh.dataplane.Dataplane`: ``stats()`` gives the counters, the
policy version and a census of the flow table from one map open;
``htb_classes()`` the HTB leaves), so what Prometheus sees is what the kernel
holds at that moment.  A target whose dataplane is not loaded (no pins,
wrong ABI, device or netns gone) reports ``mmmesh_dataplane_up 0`` and the
scrape goes on.

``class`` is the policy's class name (``Target.class_names``), the decimal
class id when the id is not in it.  The HTB parent class ``1:40`` (the whole
link) is not exported: the leaves sum to it, and ``sum by (iface)`` stays
right.  Targets must have distinct ``iface`` names (a repeated one is
skipped).

The classifier runs at TC, where one packet is one skb: a GSO/TSO
super-packet of up to 64 KiB counts once, however many wire packets the NIC
makes of it.  Its reasons ``parsed``, ``flow_hit``, ``not_mesh`` and
``malformed`` partition what it saw (each packet has exactly one, and exactly
one class); ``clamped``, ``flow_new``, ``flow_update`` and ``dscp_rewrite``
are events some packets also cause, exported apart so that a sum over
``reason`` is the number of packets.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mmmesh import abi as _abi
from mmmesh.dataplane import Dataplane, DataplaneStats, HtbClassStats
from mmmesh.errors import DataplaneError

from ._spec import Family, Spec, new_families

log = logging.getLogger("qosd.metrics")

HTB_LINK_CLASS = (_abi.HTB_MAJOR << 16) | _abi.MAX_CLASSES  # 1:40, the whole link
# One per packet (they sum to the packets seen) / extra events on top.
PARTITION_REASONS: tuple[str, ...] = tuple(r.name.lower() for r in _abi.PRIMARY_REASONS)
CLASSIFIER_EVENTS: tuple[str, ...] = tuple(
    r.name.lower() for r in _abi.Reason if r not in _abi.PRIMARY_REASONS)

_GSO = "(one per skb at TC: a GSO super-packet counts once, not per wire packet)"

DATAPLANE_METRICS: Spec = {
    "mmmesh_dataplane_up": (
        "gauge", ("iface",),
        "1 if the pinned dataplane maps of the device opened and read, else 0"),
    "mmmesh_dataplane_policy_version": (
        "gauge", ("iface",), "Policy version written in the dataplane's config map"),
    "mmmesh_classifier_class_packets_total": (
        "counter", ("iface", "direction", "class"),
        f"Packets the BPF classifier put in a class {_GSO}"),
    "mmmesh_classifier_class_bytes_total": (
        "counter", ("iface", "direction", "class"), "Bytes the BPF classifier put in a class"),
    "mmmesh_classifier_packets_total": (
        "counter", ("iface", "direction", "reason"),
        (f"Packets seen by the BPF classifier {_GSO}, by how it classified them: "
         f"{', '.join(PARTITION_REASONS)}. One reason per packet: the sum over reason is every "
         "packet it saw (events are in mmmesh_classifier_events_total)")),
    "mmmesh_classifier_events_total": (
        "counter", ("iface", "direction", "event"),
        (f"Events of the BPF classifier ({', '.join(CLASSIFIER_EVENTS)}), counted on top of "
         f"the packets that caused them {_GSO}")),
    "mmmesh_htb_class_bytes_total": (
        "counter", ("iface", "class"), "Bytes sent by the HTB leaf class"),
    "mmmesh_htb_class_packets_total": (
        "counter", ("iface", "class"), "Packets sent by the HTB leaf class (skbs, as above)"),
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


@dataclass
class Target:
    """One device whose dataplane is scraped."""

    iface: str
    netns: str | None = None
    class_names: dict[int, str] = field(default_factory=dict)  # class id -> name (policy)


class DataplaneReader(Protocol):
    """What the collector reads of a dataplane (:class:`Dataplane` is one)."""

    pin_dir: str

    def stats(self) -> DataplaneStats: ...

    def htb_classes(self) -> Mapping[int, HtbClassStats]: ...


DataplaneFactory = Callable[[str, str | None], DataplaneReader]


def _class_label(names: dict[int, str], cid: int) -> str:
    return names.get(cid, str(cid))


class DataplaneCollector(Collector):
    """Reads every target's dataplane when Prometheus scrapes (``collect``).

    ``dataplane(iface, netns)`` opens one (default :class:`Dataplane`; tests
    pass a fake, so that the collector runs without the kernel)."""

    def __init__(self, targets: Callable[[], Iterable[Target]] | Sequence[Target],
                 dataplane: DataplaneFactory = Dataplane) -> None:
        if callable(targets):
            self._targets: Callable[[], Iterable[Target]] = targets
        else:
            fixed = list(targets)
            self._targets = lambda: fixed
        self._dataplane = dataplane
        # The HTTP exporter serves each scrape in its own thread: one at a time.
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        # Names only: registering must not read the kernel.
        return list(new_families(DATAPLANE_METRICS).values())

    def collect(self) -> Iterable[Metric]:
        fams = new_families(DATAPLANE_METRICS)
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
                dp = self._dataplane(t.iface, t.netns)
                up = self._collect_maps(dp, t, fams)
                fams["mmmesh_dataplane_up"].add_metric([t.iface], 1.0 if up else 0.0)
                self._collect_htb(dp, t, fams)
        return list(fams.values())

    # ------------------------------------------------------------ per target
    @staticmethod
    def _collect_maps(dp: DataplaneReader, t: Target, fams: dict[str, Family]) -> bool:
        try:
            st = dp.stats()
        except (DataplaneError, OSError) as e:
            lvl = logging.DEBUG if getattr(e, "errno", None) == errno.ENOENT else logging.WARNING
            log.log(lvl, "metrics: no dataplane at %s: %s", dp.pin_dir, e)
            return False
        names = t.class_names
        for direction, ds in st.counters.items():
            for reason, n in ds.reasons.items():
                fam = ("mmmesh_classifier_packets_total" if reason in PARTITION_REASONS
                       else "mmmesh_classifier_events_total")
                fams[fam].add_metric([t.iface, direction, reason], float(n))
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

    @staticmethod
    def _collect_htb(dp: DataplaneReader, t: Target, fams: dict[str, Family]) -> None:
        try:
            classes = dp.htb_classes()
        except Exception as e:  # noqa: BLE001 - no HTB there (yet): the scrape goes on
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
