"""Per-flow and per-stage overrides: what qosd asks of the kernel, as plain values.

An override sends some frames of a class into a *boost leaf* of that class:
an extra HTB leaf beside the class's own, with a higher weight (and/or a more
urgent priority) inside the class's adapt bounds.  It never changes a frame's
class: the source-rule clamp runs first, and an override of another class
does nothing (docs/dataplane.md, "Per-flow and per-stage overrides").

* :class:`StageOverride`: every frame of a class sent from inside a prefix,
  the addresses of a stage's pods (one stage per pod address, as the socket
  layer's ``Endpoint(addr, 0, stage)``).  Works at the uplink for local and
  forwarded traffic alike: the source address survives the veth.
* :class:`FlowOverride`: one egress flow by its 5-tuple; the fallback that
  always works (two stages behind one address, one flow of a stage).

``Overrides`` is the whole desired set; ``Dataplane.set_overrides`` makes the
kernel hold exactly it.  ``Overrides.from_dict`` reads the JSON/YAML shape
that ``mmmesh dataplane classify --overrides FILE`` takes.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmmesh.errors import DataplaneError

PROTOCOLS = {"tcp": 6, "udp": 17}
_PROTO_NAMES = {v: k for k, v in PROTOCOLS.items()}


@dataclass(frozen=True)
class Boost:
    """A boost leaf's HTB weight (quantum = weight x 1514 bytes) and prio; None:
    the class's own value as applied."""

    weight: int | None = None
    priority: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in (("weight", self.weight), ("priority", self.priority))
                if v is not None}


@dataclass(frozen=True)
class StageOverride:
    """Frames of class ``cls`` whose source address is inside ``prefix``."""

    cls: str  # class name
    prefix: str  # IPv4 or IPv6 network ("10.1.0.7/32"); host bits are cleared
    boost: Boost = field(default_factory=Boost)

    def as_dict(self) -> dict[str, Any]:
        return {"class": self.cls, "prefix": self.prefix, **self.boost.as_dict()}


@dataclass(frozen=True)
class FlowOverride:
    """Frames of class ``cls`` of one egress flow (addresses as text, ports host order)."""

    cls: str
    src: str
    sport: int
    dst: str
    dport: int
    proto: str = "tcp"  # "tcp" | "udp"
    boost: Boost = field(default_factory=Boost)

    def as_dict(self) -> dict[str, Any]:
        return {"class": self.cls, "src": self.src, "sport": self.sport, "dst": self.dst,
                "dport": self.dport, "proto": self.proto, **self.boost.as_dict()}


@dataclass(frozen=True)
class Overrides:
    """The whole set of overrides a device should hold (empty: none)."""

    stages: tuple[StageOverride, ...] = ()
    flows: tuple[FlowOverride, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stages or self.flows)

    def as_dict(self) -> dict[str, Any]:
        return {"stages": [s.as_dict() for s in self.stages],
                "flows": [f.as_dict() for f in self.flows]}

    @classmethod
    def from_dict(cls, data: Any) -> Overrides:
        """Reads ``{stages: [{class, prefix, weight?, priority?}], flows: [{class,
        src, sport, dst, dport, proto?, weight?, priority?}]}``; DataplaneError
        (EINVAL) names the first bad field.  Whether the classes and boosts fit
        a policy is checked when they are compiled against it."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise _bad("overrides", "a mapping with 'stages' and/or 'flows'")
        extra = set(data) - {"stages", "flows"}
        if extra:
            raise _bad(min(map(str, extra)), "unknown field")
        stages = tuple(_stage(f"stages[{i}]", s) for i, s in enumerate(_list(data, "stages")))
        flows = tuple(_flow(f"flows[{i}]", f) for i, f in enumerate(_list(data, "flows")))
        return cls(stages, flows)

    @classmethod
    def from_stage_weights(cls, stage_weights: Mapping[str, Mapping[str, int]],
                           senders: Mapping[str, Iterable[str]]) -> Overrides:
        """Stage overrides from the controller's ``Decision.stage_weights``
        (``{class: {stage: weight}}``) and each stage's sender prefixes (its pods'
        addresses, e.g. from the socket layer's endpoints).  A stage without
        senders is left out."""
        out = [StageOverride(c, p, Boost(weight=int(w)))
               for c, by_stage in sorted(stage_weights.items())
               for stage, w in sorted(by_stage.items())
               for p in sorted(senders.get(stage, ()))]
        return cls(stages=tuple(out))


@dataclass(frozen=True)
class OverrideEntry:
    """One override as the kernel holds it: the boost as its leaf has it, the
    leaf, and how often it chose a leaf (TCP: per message, UDP: per datagram)."""

    override: StageOverride | FlowOverride
    level: int  # 1..MAX_BOOSTS
    classid: int  # the boost leaf's HTB class id
    hits: int

    @property
    def kind(self) -> str:
        return "stage" if isinstance(self.override, StageOverride) else "flow"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.override.as_dict(), "level": self.level,
                "classid": f"{self.classid >> 16:x}:{self.classid & 0xFFFF:x}",
                "hits": self.hits}


# ---------------------------------------------------------------- parsing
def _bad(at: str, why: str) -> DataplaneError:
    return DataplaneError(errno.EINVAL, f"overrides: {at}: {why}")


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    v = data.get(key) or []
    if not isinstance(v, list):
        raise _bad(key, "a list")
    return v


def _fields(at: str, item: Any, required: tuple[str, ...], optional: tuple[str, ...]
            ) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise _bad(at, "a mapping")
    for k in required:
        if k not in item:
            raise _bad(f"{at}.{k}", "missing")
    for k in item:
        if k not in required and k not in optional:
            raise _bad(f"{at}.{k}", "unknown field")
    return item


def _int(at: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(at, f"an integer {lo}..{hi}")
    return v


def _boost(at: str, item: Mapping[str, Any]) -> Boost:
    w, p = item.get("weight"), item.get("priority")
    return Boost(None if w is None else _int(f"{at}.weight", w, 1, 100),
                 None if p is None else _int(f"{at}.priority", p, 0, 7))


def _str(at: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(at, "a non-empty string")
    return v


def _stage(at: str, item: Any) -> StageOverride:
    d = _fields(at, item, ("class", "prefix"), ("weight", "priority"))
    return StageOverride(_str(f"{at}.class", d["class"]), str(network(f"{at}.prefix",
                                                                       d["prefix"])),
                         _boost(at, d))


def _flow(at: str, item: Any) -> FlowOverride:
    d = _fields(at, item, ("class", "src", "sport", "dst", "dport"),
                ("proto", "weight", "priority"))
    proto = d.get("proto", "tcp")
    if isinstance(proto, int) and not isinstance(proto, bool):
        proto = _PROTO_NAMES.get(proto, proto)
    if proto not in PROTOCOLS:
        raise _bad(f"{at}.proto", "tcp or udp")
    return FlowOverride(_str(f"{at}.class", d["class"]), str(address(f"{at}.src", d["src"])),
                        _int(f"{at}.sport", d["sport"], 0, 65535),
                        str(address(f"{at}.dst", d["dst"])),
                        _int(f"{at}.dport", d["dport"], 0, 65535), str(proto), _boost(at, d))


def network(at: str, v: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A prefix (host bits cleared); DataplaneError naming ``at`` if it is none."""
    try:
        return ipaddress.ip_network(str(v), strict=False)
    except ValueError as e:
        raise _bad(at, str(e)) from None


def address(at: str, v: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address; IPv4-mapped IPv6 addresses come back as IPv4 (as the kernel keys them)."""
    try:
        a = ipaddress.ip_address(str(v))
    except ValueError as e:
        raise _bad(at, str(e)) from None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a
