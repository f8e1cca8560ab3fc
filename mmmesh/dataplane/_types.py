"""What the dataplane face returns: typed, plain values (no fds, no ctypes).

``as_dict()`` gives the JSON shape that the admin API and ``mmmesh dataplane
status --json`` print (documented in docs/dataplane.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def handle(classid: int) -> str:
    """``0x1000b`` -> ``"1:b"`` (tc's notation of an HTB class id)."""
    return f"{classid >> 16:x}:{classid & 0xFFFF:x}"


@dataclass(frozen=True)
class HtbClass:
    classid: int  # 0x1XXXX
    rate_bps: int  # guaranteed, bit/s
    ceil_bps: int  # bit/s
    prio: int  # 0..7
    quantum: int  # bytes
    cburst: int | None = None  # bytes in the ceil bucket; None: the kernel's default (~1 MTU)


@dataclass(frozen=True)
class HtbSpec:
    link_bps: int
    default_minor: int
    leaves: tuple[HtbClass, ...]
    leaf_limit: int = 100  # packets: short queues keep latency bounded
    link_burst: int | None = None  # bytes in the link class's buckets; None: kernel default


@dataclass(frozen=True)
class FqSpec:
    """Egress mode fq: what every sch_fq of the device gets (the same on each
    TX queue).  ``weights``: bytes per weighted-round-robin turn of bands 0..2;
    ``priomap``: skb->priority & 15 -> band."""

    weights: tuple[int, int, int]
    priomap: tuple[int, ...]  # 16 bands
    horizon_us: int  # sch_fq drops what is stamped further ahead (horizon_drop)
    default_band: int  # the default class's band: every priomap slot but ours

    def as_dict(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "priomap": list(self.priomap),
                "horizon_us": self.horizon_us, "default_band": self.default_band}


@dataclass(frozen=True)
class FqQdiscStats:
    """One sch_fq of the device as the kernel reports it (egress mode fq):
    the root's child on TX queue ``queue`` (a single-queue device: the root)."""

    queue: int
    handle: int
    parent: int
    weights: tuple[int, ...] | None = None  # None: a kernel without bands
    priomap: tuple[int, ...] | None = None
    horizon_us: int | None = None
    horizon_drop: bool | None = None
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    backlog: int = 0
    qlen: int = 0
    flows: int = 0
    throttled_flows: int = 0
    horizon_drops: int = 0  # frames past the horizon (the pacers' over-horizon frames)
    band_drops: tuple[int, ...] = ()
    band_pkt_count: tuple[int, ...] = ()  # packets queued now, per band

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out["handle"] = handle(self.handle)
        out["parent"] = handle(self.parent)
        return out


@dataclass(frozen=True)
class PacerState:
    """One pacer of egress mode fq (a class's own, or one of its boosts')."""

    class_id: int
    level: int  # 0: the class's own pacer
    rate_bps: int  # its rate as loaded, bit/s
    horizon_us: int
    ahead_ns: int  # how far its clock is ahead of now (0: idle)
    over_horizon: int  # frames it stamped for the qdisc to drop

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class UpResult:
    """What :meth:`Dataplane.up` did."""

    iface: str
    netns: str | None
    adopted: bool  # a pinned dataplane of the same ABI and build was kept
    prog_ids: dict[str, int] = field(default_factory=dict)  # direction -> BPF program id
    policy_version: int = 0


@dataclass(frozen=True)
class HtbClassStats:
    """One HTB class as the kernel reports it (rates in bytes/s, as tc stores them)."""

    classid: int
    parent: int
    prio: int | None = None
    quantum: int | None = None
    rate_Bps: int | None = None
    ceil_Bps: int | None = None
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    overlimits: int = 0
    backlog: int = 0  # bytes queued
    qlen: int = 0  # packets queued

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k != "classid" and v is not None}


@dataclass(frozen=True)
class DirectionCounters:
    """The classifier's counters for one direction, summed over CPUs."""

    reasons: dict[str, int]  # reason name (lowercase) -> packets
    classes: dict[int, tuple[int, int]]  # class id -> (packets, bytes); only non-zero ids


@dataclass(frozen=True)
class FlowCensus:
    """How full the flow table is, without reading it entry by entry."""

    count: int
    capacity: int
    by_class: dict[int, int] | None  # None when the kernel cannot batch-read the map


@dataclass(frozen=True)
class DataplaneStats:
    """Everything a metrics scrape needs from the maps, read in one go."""

    policy_version: int
    counters: dict[str, DirectionCounters]  # "egress" / "ingress"
    flows: FlowCensus


@dataclass(frozen=True)
class Flow:
    """One entry of the TCP flow table, decoded (addresses as text, ports in
    host order)."""

    src: str
    dst: str
    sport: int
    dport: int
    proto: int
    direction: str  # "egress" | "ingress"
    class_id: int
    modality: int
    packets: int
    bytes: int
    idle_s: float  # since the flow's last packet
    boost: int = 0  # boost level its messages take (0: its class's own leaf), see overrides

    @property
    def key(self) -> tuple[str, str, int, int, int, str]:
        return (self.src, self.dst, self.sport, self.dport, self.proto, self.direction)


@dataclass(frozen=True)
class ClassStatus:
    """One policy class as loaded: its map entry, counters and HTB class."""

    name: str
    id: int
    classid: int
    rank: int
    egress_packets: int
    egress_bytes: int
    ingress_packets: int
    ingress_bytes: int
    htb: HtbClassStats | None
    band: int | None = None  # egress mode fq: its sch_fq band (classid is then the priomap slot)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "classid": handle(self.classid), "rank": self.rank,
            "egress_packets": self.egress_packets, "egress_bytes": self.egress_bytes,
            "ingress_packets": self.ingress_packets, "ingress_bytes": self.ingress_bytes,
            "htb": self.htb.as_dict() if self.htb is not None else {},
        }
        if self.band is not None:
            del out["classid"], out["htb"]
            out["band"] = self.band
        return out


@dataclass(frozen=True)
class DataplaneStatus:
    """What is installed on a device (``loaded`` False: no pinned dataplane)."""

    iface: str
    netns: str | None
    pin_dir: str
    loaded: bool
    programs: dict[str, dict[str, Any]]  # direction -> {"name", "prog_id"} as attached
    htb: dict[int, HtbClassStats]
    abi_version: int = 0
    policy_version: int = 0
    flows: int = 0
    classes: list[ClassStatus] = field(default_factory=list)
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)  # direction -> counts
    egress: str = "htb"  # the egress mode the device runs: "htb" | "fq" | "none"
    fq: list[FqQdiscStats] = field(default_factory=list)  # egress mode fq: every sch_fq
    pacers: list[PacerState] = field(default_factory=list)  # egress mode fq: the paced leaves

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"iface": self.iface, "netns": self.netns, "pin_dir": self.pin_dir,
                               "programs": self.programs, "loaded": self.loaded}
        if self.egress == "fq":  # (an HTB device's JSON is as it always was)
            out["egress"] = "fq"
            out["fq"] = [q.as_dict() for q in self.fq]
            out["pacers"] = [p.as_dict() for p in self.pacers]
        if not self.loaded:
            out["htb"] = {handle(k): v.as_dict() for k, v in self.htb.items()}
            return out
        out.update(abi_version=self.abi_version, policy_version=self.policy_version,
                   flows=self.flows, classes={c.name: c.as_dict() for c in self.classes},
                   reasons=self.reasons)
        return out
