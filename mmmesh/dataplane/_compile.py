"""Policy (and overrides) -> the contents of the BPF maps and the HTB tree.

Pure functions, no kernel: the loader writes what they return.  The BPF
program's semantics for these tables are mirrored by
``mmmesh.policy.classify_reference``; tests run both on the same packets.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mmmesh import abi
from mmmesh.errors import DataplaneError
from mmmesh.policy.overrides import (
    PROTOCOLS,
    FlowOverride,
    Overrides,
    StageOverride,
    address,
    network,
)

from ..policy import MAX_WEIGHT, QUANTUM_UNIT, Policy, TrafficClass
from ._types import HtbClass, HtbClassStats, HtbSpec

_MAX_PRIO = 7  # HTB prios 0..7


@dataclass
class CompiledPolicy:
    config: abi.Config
    classes: dict[int, abi.ClassInfo]  # class id -> info (ids not here are invalid)
    modalities: dict[int, abi.ModalityInfo]
    sources: list[tuple[abi.SrcKey, abi.SrcInfo]] = field(default_factory=list)
    htb: HtbSpec | None = None


def src_key(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> abi.SrcKey:
    """LPM key: IPv4 networks become IPv4-mapped IPv6 (::ffff:a.b.c.d/96+len)."""
    if isinstance(net, ipaddress.IPv4Network):
        addr = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + net.network_address.packed)
        plen = 96 + net.prefixlen
    else:
        addr, plen = net.network_address, net.prefixlen
    k = abi.SrcKey()
    k.prefixlen = plen
    k.addr[:] = list(addr.packed)
    return k


# HTB token buckets.  The kernel's default bucket (tc's and pyroute2's
# rate/HZ + 1600 B, with HZ = 10^9 on high-resolution timers) holds one MTU:
# a class that sends near its ceil is throttled after every packet or two,
# and each throttle is a qdisc watchdog timer interrupt and a NET_TX softirq
# on whichever CPU armed it (a latency-sensitive sender's too).  The link
# class's buckets and every leaf's ceil bucket hold HTB_BURST_US at their
# rate instead: half the throttles under a flood (docs/benchmarks.md, "Voice
# at the kernel timestamp").  It is also the most the link class hands the
# device at once after an idle spell; leaves keep the default rate bucket, so
# guarantees are paced as before.  0: the kernel's default.
HTB_BURST_US = 1000
HTB_MIN_BURST = 1600  # bytes: the kernel default's floor
LEAF_LIMIT = 100  # packets in a leaf's queue: short queues keep a class's delay bounded


def htb_burst(rate_bps: int) -> int | None:
    """Bytes of a token bucket at ``rate_bps``: HTB_BURST_US of it, at least
    HTB_MIN_BURST; None (the kernel's default) when HTB_BURST_US is 0."""
    if HTB_BURST_US <= 0:
        return None
    return max(HTB_MIN_BURST, rate_bps * HTB_BURST_US // 8_000_000)


def compile_policy(policy: Policy, version: int = 0) -> CompiledPolicy:
    ranks = {c.name: i for i, c in enumerate(policy.ranked())}
    classes: dict[int, abi.ClassInfo] = {}
    for c in policy.classes:
        classes[c.id] = abi.ClassInfo(
            classid=c.classid, valid=1, rank=ranks[c.name], dscp=c.dscp_value
        )

    # modality -> (conditional rules in file order, fallback class id)
    rules: dict[int, list[abi.Rule]] = {}
    fallback: dict[int, int] = {}
    for c in policy.classes:
        if c.match is None:
            continue
        for m in c.match.modalities:
            cond = c.match.condition
            if cond is None:
                fallback.setdefault(int(m), c.id)
            else:
                rules.setdefault(int(m), []).append(
                    abi.Rule(meta=int(c.match.meta), class_id=c.id, min=cond.min, max=cond.max)
                )
    modalities: dict[int, abi.ModalityInfo] = {}
    for m in set(rules) | set(fallback):
        mi = abi.ModalityInfo(valid=1, default_class=fallback.get(m, 0))
        rs = rules.get(m, [])
        if len(rs) > abi.MAX_RULES:  # the schema refuses this; guard anyway
            raise ValueError(f"modality {m}: more than {abi.MAX_RULES} metadata rules")
        mi.nrules = len(rs)
        for i, r in enumerate(rs):
            mi.rules[i] = r
        modalities[m] = mi

    sources = []
    clamp_below = 0
    for rule in policy.source_rules:
        mc = policy.class_named(rule.max_class)
        r = ranks[mc.name]
        clamp_below = max(clamp_below, r)
        sources.append((src_key(rule.prefix), abi.SrcInfo(max_class=mc.id, max_rank=r)))

    config = abi.Config(
        policy_version=version & 0xFFFFFFFF,
        default_class=policy.default.id,
        flags=abi.CFG_HAS_SRC_RULES if sources else 0,
        clamp_below_rank=clamp_below,
    )
    link = int(policy.link.rate)
    htb = HtbSpec(
        link_bps=link,
        default_minor=policy.default.id,
        leaves=tuple(
            HtbClass(
                classid=c.classid, rate_bps=int(c.rate), ceil_bps=int(policy.ceil_of(c)),
                prio=c.priority, quantum=c.quantum, cburst=htb_burst(int(policy.ceil_of(c))),
            )
            for c in policy.classes
        ),
        leaf_limit=LEAF_LIMIT,
        link_burst=htb_burst(link),
    )
    return CompiledPolicy(config, classes, modalities, sources, htb)


# --------------------------------------------------------------------------
# Overrides -> boost leaves, map entries, HTB leaves (docs/dataplane.md,
# "Per-flow and per-stage overrides")
# --------------------------------------------------------------------------
MIN_RATE_BPS = 8000  # 1 kB/s: a leaf being emptied (far lower rates overflow tc's buffer)
HTB_PARENT = (abi.HTB_MAJOR << 16) | abi.MAX_CLASSES  # 1:40 (as _netlink.HTB_PARENT)


@dataclass(frozen=True)
class BoostLeaf:
    """Boost level ``level`` of class ``class_id``: its own HTB leaf."""

    class_id: int
    level: int
    weight: int
    prio: int

    @property
    def classid(self) -> int:
        return abi.boost_classid(self.class_id, self.level)


@dataclass
class CompiledOverrides:
    boosts: dict[tuple[int, int], BoostLeaf]  # (class id, level) -> leaf
    stages: list[tuple[abi.StageOvrKey, abi.OvrInfo]] = field(default_factory=list)
    flows: list[tuple[abi.FlowKey, abi.OvrInfo]] = field(default_factory=list)
    flags: int = 0  # CFG_STAGE_OVERRIDES | CFG_FLOW_OVERRIDES as needed
    dropped: list[str] = field(default_factory=list)  # drop_invalid: what was left out, why


def boost_class(classid: int) -> int | None:
    """The class id whose boost leaf ``classid`` is, None if it is no boost leaf."""
    minor = classid & 0xFFFF
    if classid >> 16 != abi.HTB_MAJOR or not abi.MAX_CLASSES < minor < abi.BOOST_MINOR_STEP \
            * (abi.MAX_BOOSTS + 1) or minor % abi.BOOST_MINOR_STEP == 0:
        return None
    return minor % abi.BOOST_MINOR_STEP


def _mapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return b"\0" * 10 + b"\xff\xff" + addr.packed if addr.version == 4 else addr.packed


def stage_key(class_id: int, prefix: str) -> abi.StageOvrKey:
    """stage_ovr_map key: the class byte (+ pad) then the prefix, IPv4 mapped."""
    net = network("prefix", prefix)
    k = abi.StageOvrKey(class_id=class_id)
    k.prefixlen = 32 + net.prefixlen + (96 if net.version == 4 else 0)
    k.addr[:] = list(_mapped(net.network_address))
    return k


def flow_key(o: FlowOverride) -> abi.FlowKey:
    """flow_map's key of an egress flow (ports be)."""
    k = abi.FlowKey(proto=PROTOCOLS[o.proto], dir=abi.DIR_EGRESS)
    k.saddr[:] = list(_mapped(address("src", o.src)))
    k.daddr[:] = list(_mapped(address("dst", o.dst)))
    k.sport = socket.htons(o.sport)
    k.dport = socket.htons(o.dport)
    return k


def _boost_errors(policy: Policy, bounds: Policy | None, c: TrafficClass, w: int, p: int
                  ) -> list[str]:
    """Why a boost (weight w, prio p) of class c is refused; [] when it is safe."""
    errs = []
    if not 1 <= w <= MAX_WEIGHT or not 0 <= p <= _MAX_PRIO:
        errs.append(f"weight {w} / priority {p} outside 1..{MAX_WEIGHT} / 0..{_MAX_PRIO}")
    if bounds is not None:
        try:
            bc = bounds.class_named(c.name)
        except KeyError:
            return [*errs, f"no class {c.name!r} in the bounds policy"]
        for knob, v, own in (("weight", w, bc.weight), ("priority", p, bc.priority)):
            rng = getattr(bc.adapt, knob) if bc.adapt is not None else None
            lo, hi = rng if rng is not None else (own, own)
            if not lo <= v <= hi:
                errs.append(f"{knob} {v} outside the class's adapt range [{lo}, {hi}]")
    if c.name == policy.default_class and (w > c.weight or p < c.priority):
        errs.append("the default class (traffic the mesh cannot read) may not gain")
    if p < c.priority:  # anti-escalation, on the boost itself (its rate <= the class's)
        for r in policy.source_rules:
            m = policy.class_named(r.max_class)
            if policy.rank(c) > policy.rank(m) and (p, -int(c.rate), c.id) <= (
                    m.priority, -int(m.rate), m.id):
                errs.append(f"priority {p} would let {c.name!r} outrank {m.name!r}, the "
                            f"max_class of source rule {r.prefix}")
    return errs


def _levels(wanted: dict[int, set[tuple[int, int]]],
            current: Mapping[tuple[int, int], tuple[int, int]]
            ) -> dict[tuple[int, tuple[int, int]], int]:
    """(class, (weight, prio)) -> level.  Stable: a boost the kernel has keeps
    its level; a new one takes a level whose boost goes away (changed in place:
    its flows stay in the same leaf), else a free one."""
    out: dict[tuple[int, tuple[int, int]], int] = {}
    for cid, pairs in wanted.items():
        cur = {lvl: wp for (c, lvl), wp in current.items() if c == cid}
        used: dict[tuple[int, int], int] = {}
        for wp in sorted(pairs):
            lvl = next((lv for lv, have in sorted(cur.items())
                        if have == wp and lv not in used.values()), None)
            if lvl is not None:
                used[wp] = lvl
        spare = [lv for lv in sorted(cur) if lv not in used.values()]
        spare += [lv for lv in range(1, abi.MAX_BOOSTS + 1) if lv not in cur]
        for wp in sorted(pairs - set(used)):
            used[wp] = spare.pop(0)
        for wp, lvl in used.items():
            out[(cid, wp)] = lvl
    return out


def compile_overrides(policy: Policy, overrides: Overrides, *, bounds: Policy | None = None,
                      current: Mapping[tuple[int, int], tuple[int, int]] | None = None,
                      drop_invalid: bool = False) -> CompiledOverrides:
    """Overrides -> boost leaves and map entries for ``policy`` (as applied).

    Every boost is checked: its class exists, weight 1..100 and prio 0..7,
    within the class's ``adapt`` ranges of ``bounds`` (the operator's policy;
    None: not checked, as when ``up`` keeps the kernel's overrides), the
    default class never gains, and a more urgent prio never lets the class
    outrank a source rule's max_class.  At most MAX_BOOSTS distinct boosts per
    class.  ``current`` ((class, level) -> (weight, prio)) keeps levels stable.
    A problem raises DataplaneError (EINVAL), or with ``drop_invalid`` leaves
    that override out (listed in ``dropped``)."""
    problems: list[str] = []
    by_name = {c.name: c for c in policy.classes}
    resolved: list[tuple[int, tuple[int, int], abi.StageOvrKey | abi.FlowKey]] = []
    seen: set[bytes] = set()
    every: list[tuple[str, StageOverride | FlowOverride]] = [
        *((f"stages[{i}]", o) for i, o in enumerate(overrides.stages)),
        *((f"flows[{i}]", o) for i, o in enumerate(overrides.flows))]
    for at, o in every:
        c = by_name.get(o.cls)
        if c is None:
            problems.append(f"{at}: no class {o.cls!r} in the policy")
            continue
        wp = (c.weight if o.boost.weight is None else o.boost.weight,
              c.priority if o.boost.priority is None else o.boost.priority)
        errs = _boost_errors(policy, bounds, c, *wp)
        key = stage_key(c.id, o.prefix) if isinstance(o, StageOverride) else flow_key(o)
        if bytes(key) in seen:
            errs.append("the same class and prefix (or flow) as an earlier override")
        problems += [f"{at}: {e}" for e in errs]
        if not errs:
            seen.add(bytes(key))
            resolved.append((c.id, wp, key))
    wanted: dict[int, set[tuple[int, int]]] = {}
    for cid, wp, _ in resolved:
        wanted.setdefault(cid, set()).add(wp)
    for cid, pairs in list(wanted.items()):
        if len(pairs) > abi.MAX_BOOSTS:
            problems.append(f"class id {cid}: {len(pairs)} different boosts, at most "
                            f"{abi.MAX_BOOSTS} (boost leaves per class)")
            del wanted[cid]
    if problems and not drop_invalid:
        raise DataplaneError(errno.EINVAL, "overrides: " + "; ".join(problems))
    levels = _levels(wanted, current or {})
    out = CompiledOverrides({}, dropped=problems)
    for cid, wp, key in resolved:
        if cid not in wanted:
            continue
        lvl = levels[(cid, wp)]
        out.boosts[(cid, lvl)] = BoostLeaf(cid, lvl, *wp)
        info = abi.OvrInfo(class_id=cid, level=lvl)
        if isinstance(key, abi.StageOvrKey):
            out.stages.append((key, info))
            out.flags |= abi.CFG_STAGE_OVERRIDES
        else:
            out.flows.append((key, info))
            out.flags |= abi.CFG_FLOW_OVERRIDES
    return out


def boosted_spec(spec: HtbSpec, boosts: Iterable[BoostLeaf]) -> HtbSpec:
    """``spec`` with the boost leaves, each class's rate (and, below the link,
    its ceil) split between its leaves in proportion to their weights: the
    class never gets more guarantee or ceiling than the policy gives it."""
    by_class: dict[int, list[BoostLeaf]] = {}
    for b in sorted(boosts, key=lambda b: (b.class_id, b.level)):
        by_class.setdefault(b.class_id, []).append(b)
    leaves: list[HtbClass] = []
    for leaf in spec.leaves:
        bl = by_class.get(leaf.classid & 0xFFFF)
        if not bl:
            leaves.append(leaf)
            continue
        total = max(1, leaf.quantum // QUANTUM_UNIT) + sum(b.weight for b in bl)
        split_ceil = leaf.ceil_bps < spec.link_bps
        extra: list[HtbClass] = []
        for b in bl:  # whole bytes/s, as the kernel keeps rates: the shares add up exactly
            rate = max(MIN_RATE_BPS, leaf.rate_bps * b.weight // total // 8 * 8)
            ceil = max(rate, leaf.ceil_bps * b.weight // total // 8 * 8) if split_ceil \
                else leaf.ceil_bps
            extra.append(dataclasses.replace(leaf, classid=b.classid, rate_bps=rate,
                                             ceil_bps=ceil, prio=b.prio,
                                             quantum=b.weight * QUANTUM_UNIT))
        rate = max(MIN_RATE_BPS, leaf.rate_bps - sum(x.rate_bps for x in extra))
        ceil = max(rate, leaf.ceil_bps - sum(x.ceil_bps for x in extra)) if split_ceil \
            else leaf.ceil_bps
        leaves += [dataclasses.replace(leaf, rate_bps=rate, ceil_bps=ceil), *extra]
    return dataclasses.replace(spec, leaves=tuple(leaves))


def transition_spec(final: HtbSpec, have: Mapping[int, HtbClassStats]) -> HtbSpec:
    """What to add before the maps change, so that every mix of old and new is
    safe: the leaves of ``final``; of a class with boost leaves (before or
    after), each existing leaf at the lower of its old and new rate and ceil;
    and every old boost leaf ``final`` drops, at the smallest rate, until
    nothing points at it.  The guarantees never sum above either state's."""
    boosted = {boost_class(c) for c in [*(x.classid for x in final.leaves), *have]} - {None}
    out: list[HtbClass] = []
    for leaf in final.leaves:
        cur = have.get(leaf.classid)
        cls = boost_class(leaf.classid) or leaf.classid & 0xFFFF
        if cur is not None and cls in boosted and cur.rate_Bps and cur.ceil_Bps:
            leaf = dataclasses.replace(leaf, rate_bps=min(leaf.rate_bps, cur.rate_Bps * 8),
                                       ceil_bps=min(leaf.ceil_bps, cur.ceil_Bps * 8))
        out.append(leaf)
    ids = {x.classid for x in final.leaves}
    for classid, cur in sorted(have.items()):
        if boost_class(classid) is not None and classid not in ids and cur.parent == HTB_PARENT:
            out.append(HtbClass(classid=classid, rate_bps=MIN_RATE_BPS,
                                ceil_bps=(cur.ceil_Bps or 0) * 8 or final.link_bps,
                                prio=cur.prio or 0, quantum=cur.quantum or QUANTUM_UNIT))
    return dataclasses.replace(final, leaves=tuple(out))
