"""The classifier's override step in Python, and fixtures for the override tests.

``mmmesh.policy.reference`` models which *class* a frame gets; this models
which *leaf* of that class it then goes to (docs/dataplane.md, "Per-flow
overrides"), as a separate step after it, so the BPF fuzz
(tests/system/dataplane/test_bpf_fuzz.py), tests/mmmesh/policy/test_overrides.py
and tests/system/dataplane/test_overrides_*.py can check the kernel's priority
frame by frame:

1. egress, a frame with a valid header, class C after the clamp: the level of
   a flow override of this 5-tuple for C, else of the longest stage override
   (C, prefix) holding the source address, else 0;
2. TCP: that level is the flow's until its next header (flow hits and
   malformed bytes in the flow take it), as long as the flow's class stands;
3. the priority is the boost leaf of (C, level) when level > 0 and the boost
   is loaded, else C's own HTB class.

The model is built from what the kernel reports back (``OverrideEntry``:
prefix or 5-tuple, class, level, leaf), so it checks matching, precedence
and the TCP rule, not the level numbering.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import yaml

from mmmesh.dataplane import Boost, FlowOverride, OverrideEntry, Overrides, StageOverride
from mmmesh.policy import Policy, parse_policy

MAPPED = b"\0" * 10 + b"\xff\xff"
PROTO = {"tcp": 6, "udp": 17}


def mapped16(addr: bytes | str) -> bytes:
    """An address as the flow key holds it (16 bytes, IPv4 mapped)."""
    if isinstance(addr, str):
        addr = ipaddress.ip_address(addr).packed
    return MAPPED + addr if len(addr) == 4 else addr


@dataclass
class OverrideModel:
    stages: list[tuple[ipaddress.IPv6Network, int, int]] = field(default_factory=list)
    flows: dict[tuple[bytes, bytes, int, int, int], tuple[int, int]] = field(default_factory=dict)
    leaves: dict[tuple[int, int], int] = field(default_factory=dict)  # (class, level) -> classid

    @classmethod
    def from_entries(cls, entries: list[OverrideEntry], policy: Policy) -> OverrideModel:
        ids = {c.name: c.id for c in policy.classes}
        m = cls()
        for e in entries:
            o, cid = e.override, ids[e.override.cls]
            m.leaves[(cid, e.level)] = e.classid
            if isinstance(o, StageOverride):
                net = ipaddress.ip_network(o.prefix)
                if net.version == 4:
                    net = ipaddress.IPv6Network((MAPPED + net.network_address.packed,
                                                 96 + net.prefixlen))
                assert isinstance(net, ipaddress.IPv6Network)
                m.stages.append((net, cid, e.level))
            else:
                m.flows[(mapped16(o.src), mapped16(o.dst), o.sport, o.dport,
                         PROTO[o.proto])] = (cid, e.level)
        return m

    def level(self, *, src16: bytes, dst16: bytes, sport: int, dport: int, proto: int,
              class_id: int) -> int:
        """Step 1: the boost level a header frame of class ``class_id`` takes (egress)."""
        f = self.flows.get((src16, dst16, sport, dport, proto))
        if f is not None and f[0] == class_id:
            return f[1]
        addr = ipaddress.IPv6Address(src16)
        best = (-1, 0)
        for net, cid, lvl in self.stages:
            if cid == class_id and addr in net and net.prefixlen > best[0]:
                best = (net.prefixlen, lvl)
        return best[1]

    def priority(self, class_classid: int, class_id: int, level: int, level_class: int) -> int:
        """Step 3: skb->priority for class ``class_id`` whose level was chosen for
        ``level_class`` (they differ when a clamp moved the flow since)."""
        if level and class_id == level_class and (class_id, level) in self.leaves:
            return self.leaves[(class_id, level)]
        return class_classid


# --------------------------------------------------------------------------
# The fuzz run's overrides: its policy (tests/bpf_fuzz_frames.fuzz_policy)
# with adapt ranges, stage overrides that nest (LPM), one the clamp makes
# dead (voice from the restricted 10.0.99.0/24 is video), IPv6, a priority
# boost, three boosts of one class, and flow overrides (TCP and UDP).
# --------------------------------------------------------------------------
FUZZ_ADAPT: dict[str, dict[str, list[int]]] = {
    "video": {"weight": [7, 20]},
    "lidar": {"weight": [5, 15]},
    "bulk": {"weight": [1, 3], "priority": [5, 6]},
    "voice-hq": {"weight": [1, 4]},
}

FUZZ_OVERRIDES = Overrides(
    stages=(
        StageOverride("voice", "10.0.1.0/24", Boost(weight=6)),
        StageOverride("voice", "10.0.1.5/32", Boost(weight=8)),
        StageOverride("voice", "10.0.99.0/24", Boost(weight=6)),  # dead: clamped to video
        StageOverride("video", "10.0.99.0/24", Boost(weight=10)),
        StageOverride("video", "::ffff:10.0.0.0/112", Boost(weight=12)),
        StageOverride("lidar", "fd00::/16", Boost(weight=8)),
        StageOverride("bulk", "::/0", Boost(weight=3, priority=5)),
        StageOverride("bulk", "0.0.0.0/0", Boost(weight=2)),
    ),
    flows=(
        FlowOverride("lidar", "10.0.1.5", 40001, "10.0.2.9", 7101, "tcp", Boost(weight=15)),
        FlowOverride("voice-hq", "fd00::1", 40002, "fd00::2", 7101, "tcp", Boost(weight=4)),
        FlowOverride("video", "10.0.2.77", 40003, "10.0.2.9", 7000, "udp", Boost(weight=20)),
        FlowOverride("voice", "10.0.1.5", 40004, "10.0.2.9", 7101, "tcp", Boost(weight=9)),
    ),
)


def with_adapt(policy: Policy, adapt: dict[str, dict[str, list[int]]]) -> Policy:
    """``policy`` with ``adapt`` ranges added to the named classes."""
    raw: dict[str, Any] = yaml.safe_load(policy.to_yaml())
    for c in raw["classes"]:
        if c["name"] in adapt:
            c["adapt"] = {**c.get("adapt", {}), **adapt[c["name"]]}
    return parse_policy(raw)
