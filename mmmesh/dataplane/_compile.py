"""Policy (and overrides) -> the contents of the BPF maps and the qdiscs:
the HTB tree (egress mode htb) or the sch_fq bands and the pacers (egress
mode fq, docs/dataplane.md "Egress modes").

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
from fractions import Fraction

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
from ..policy.egress import FQ_MIN_PACE_BPS, fq_band
from ._types import FqSpec, HtbClass, HtbClassStats, HtbSpec

_MAX_PRIO = 7  # HTB prios 0..7


@dataclass
class CompiledPolicy:
    config: abi.Config
    classes: dict[int, abi.ClassInfo]  # class id -> info (ids not here are invalid)
    modalities: dict[int, abi.ModalityInfo]
    sources: list[tuple[abi.SrcKey, abi.SrcInfo]] = field(default_factory=list)
    htb: HtbSpec | None = None  # egress mode htb
    fq: FqSpec | None = None  # egress mode fq (without boosts; fq_plan adds them)
    egress: str = "htb"


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


def compile_policy(policy: Policy, version: int = 0, *, egress: str = "htb") -> CompiledPolicy:
    """The maps and the qdiscs of ``policy`` in egress mode ``egress``
    ("htb": class_map holds HTB class ids; "fq": band slots and pacers)."""
    if egress not in ("htb", "fq"):
        raise ValueError(f"egress mode {egress!r}")
    ranks = {c.name: i for i, c in enumerate(policy.ranked())}
    classes: dict[int, abi.ClassInfo] = {}
    plan = fq_plan(policy, ()) if egress == "fq" else None
    for c in policy.classes:
        classes[c.id] = abi.ClassInfo(
            classid=c.classid, valid=1, rank=ranks[c.name], dscp=c.dscp_value
        )
        if plan is not None:
            set_pacing(classes[c.id], plan.leaves[(c.id, 0)])

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
        flags=(abi.CFG_HAS_SRC_RULES if sources else 0) | (plan.flags if plan else 0),
        clamp_below_rank=clamp_below,
    )
    if plan is not None:
        return CompiledPolicy(config, classes, modalities, sources, None, plan.spec, "fq")
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
    infos: dict[tuple[int, int], abi.BoostInfo] = field(default_factory=dict)  # boost_map values
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
                      drop_invalid: bool = False, egress: str = "htb") -> CompiledOverrides:
    """Overrides -> boost leaves and map entries for ``policy`` (as applied).

    Every boost is checked: its class exists, weight 1..100 and prio 0..7,
    within the class's ``adapt`` ranges of ``bounds`` (the operator's policy;
    None: not checked, as when ``up`` keeps the kernel's overrides), the
    default class never gains, and a more urgent prio never lets the class
    outrank a source rule's max_class.  At most MAX_BOOSTS distinct boosts per
    class.  ``current`` ((class, level) -> (weight, prio)) keeps levels stable.
    A problem raises DataplaneError (EINVAL), or with ``drop_invalid`` leaves
    that override out (listed in ``dropped``).  Egress mode fq also refuses
    an override whose boost changes nothing there (:func:`fq_inert`); its
    boost_map values are the boosts' bands and pacers (:func:`fq_plan`)."""
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
        if egress == "fq" and not errs:
            errs += fq_inert(policy, c, *wp)
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
        b = out.boosts[(cid, lvl)] = BoostLeaf(cid, lvl, *wp)
        out.infos[(cid, lvl)] = abi.BoostInfo(classid=b.classid, valid=1, weight=b.weight,
                                              prio=b.prio)
        info = abi.OvrInfo(class_id=cid, level=lvl)
        if isinstance(key, abi.StageOvrKey):
            out.stages.append((key, info))
            out.flags |= abi.CFG_STAGE_OVERRIDES
        else:
            out.flows.append((key, info))
            out.flags |= abi.CFG_FLOW_OVERRIDES
    if egress == "fq":
        plan = fq_plan(policy, out.boosts.values())
        out.infos = plan.boost_infos()
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


# --------------------------------------------------------------------------
# Egress mode fq: bands, band weights, pacers (docs/dataplane.md "Egress modes")
# --------------------------------------------------------------------------
FQ_MAX_WEIGHT = 0x7FFFFFFF  # sch_fq's band weights are s32
FQ_BASE_WEIGHT = 65536
"""The smallest band's weight: one full GSO packet.  sch_fq accepts 16384
(FQ_MIN_WEIGHT), but a band whose weight is below one packet needs several
refills per packet, which kernels before "sch_fq: fix incorrect behavior for
small weights" (6.11, stable) got wrong with BIG TCP; and 9 : 3 : 1 from
65536 is exactly sch_fq's default."""
FQ_BAND_FACTORS = (9, 3, 1)
"""The bands' shares when guarantees do not ask for more: sch_fq's own
default weights (589824 : 196608 : 65536, Google's production choice, and
Cilium's Network QoS)."""


@dataclass(frozen=True)
class FqLeaf:
    """A class's own pacer (level 0) or one of its boosts' in egress mode fq."""

    class_id: int
    level: int
    band: int
    rate_bps: int  # its share of the class's guarantee (what its band's weight counts)
    pace_Bps: int  # its share of the class's ceil, bytes/s; 0: not paced
    horizon_us: int = 0

    @property
    def slot(self) -> int:
        """Its skb->priority: the band's priomap slot."""
        return abi.FQ_PRIO_BASE + self.band


def pace_horizon_us(pace_Bps: int) -> int:
    """How far a pacer at ``pace_Bps`` may run ahead of now: the time of
    LEAF_LIMIT full frames at its rate (an HTB leaf's queue), within
    PACE_MIN_HORIZON_US .. PACE_MAX_HORIZON_US."""
    if pace_Bps <= 0:
        return 0
    t = LEAF_LIMIT * QUANTUM_UNIT * 1_000_000 // pace_Bps
    return max(abi.PACE_MIN_HORIZON_US, min(abi.PACE_MAX_HORIZON_US, t))


def set_pacing(info: abi.ClassInfo | abi.BoostInfo, leaf: FqLeaf) -> None:
    """A map value's skb->priority and pacer fields from ``leaf``."""
    info.classid = leaf.slot
    info.pace_Bps = leaf.pace_Bps
    info.horizon_us = leaf.horizon_us


def fq_band_weights(link_bps: int, leaves: Iterable[tuple[int, int]]) -> tuple[int, int, int]:
    """sch_fq's band weights (bytes per round) for leaves of (band, guaranteed
    rate): each band's share is FQ_BAND_FACTORS', raised where the sum of its
    guarantees needs more of the link (the others keep their ratios in what
    is left: water filling), the smallest used band at FQ_MIN_WEIGHT.  So
    under contention a band gets at least its guarantees, and the urgent
    bands' turns come after few bytes of the others (FQ_BASE_WEIGHT)."""
    need: dict[int, Fraction] = {}
    for band, rate in leaves:
        need[band] = need.get(band, Fraction(0)) + Fraction(int(rate), max(1, int(link_bps)))
    if not need:
        return (FQ_BASE_WEIGHT, FQ_BASE_WEIGHT, FQ_BASE_WEIGHT)
    fixed: dict[int, Fraction] = {}
    while True:
        free = [b for b in need if b not in fixed]
        room = max(Fraction(0), 1 - sum(fixed.values(), Fraction(0)))
        scale = room / sum(FQ_BAND_FACTORS[b] for b in free) if free else Fraction(0)
        more = [b for b in free if need[b] > scale * FQ_BAND_FACTORS[b]]
        if not more:
            break
        for b in more:
            fixed[b] = need[b]
    share = {b: fixed.get(b, scale * FQ_BAND_FACTORS[b]) for b in need}
    low = min(v for v in share.values() if v > 0)
    # the smallest band at FQ_BASE_WEIGHT; when that would overflow the
    # largest, the largest at the maximum instead and the smallest no lower
    # than the kernel's minimum (the small bands then get a little more than
    # their share: egress_errors refuses guarantees that need more of the link
    # than FQ_MAX_WEIGHT beside FQ_MIN_WEIGHTs gives)
    unit = min(Fraction(FQ_BASE_WEIGHT) / low, Fraction(FQ_MAX_WEIGHT) / max(share.values()))
    out = [FQ_BASE_WEIGHT] * abi.FQ_BANDS  # unused bands: carry nothing
    for b, v in share.items():
        out[b] = max(abi.FQ_MIN_WEIGHT, min(FQ_MAX_WEIGHT, int(v * unit)))
    return (out[0], out[1], out[2])


def fq_priomap(default_band: int) -> tuple[int, ...]:
    """skb->priority & 15 -> band: FQ_PRIO_BASE + b is band b (what the
    classifier writes); every other slot is the default class's band, so a
    frame the classifier did not mark (its program detached, a foreign
    priority) is best effort, never escalated."""
    out = [default_band] * abi.FQ_PRIO_SLOTS
    for b in range(abi.FQ_BANDS):
        out[abi.FQ_PRIO_BASE + b] = b
    return tuple(out)


@dataclass(frozen=True)
class FqPlan:
    """Everything egress mode fq writes for a policy and its boosts."""

    spec: FqSpec
    leaves: dict[tuple[int, int], FqLeaf]  # (class id, level) -> leaf; level 0: the class
    boosts: tuple[BoostLeaf, ...]
    flags: int  # CFG_PACING when some leaf is paced

    def boost_infos(self) -> dict[tuple[int, int], abi.BoostInfo]:
        out = {}
        for b in self.boosts:
            info = abi.BoostInfo(valid=1, weight=b.weight, prio=b.prio)
            set_pacing(info, self.leaves[(b.class_id, b.level)])
            out[(b.class_id, b.level)] = info
        return out


def fq_plan(policy: Policy, boosts: Iterable[BoostLeaf]) -> FqPlan:
    """The bands, band weights and pacers of ``policy`` with ``boosts``: each
    class is a leaf in the band of its priority; a class with a ceil below
    the link is paced at its ceil; a boost is a leaf in the band of its
    priority with a share of the class's guarantee and (when the class is
    paced) of its ceil in proportion to the weights, as HTB splits a class
    between its leaves: a boost never adds guarantee or ceiling."""
    by_class: dict[int, list[BoostLeaf]] = {}
    bl = sorted(boosts, key=lambda b: (b.class_id, b.level))
    for b in bl:
        by_class.setdefault(b.class_id, []).append(b)
    link = int(policy.link.rate)
    leaves: dict[tuple[int, int], FqLeaf] = {}
    min_Bps = -(-FQ_MIN_PACE_BPS // 8)
    for c in policy.classes:
        ceil = int(policy.ceil_of(c))
        paced = ceil < link
        mine = by_class.get(c.id, [])
        total = c.weight + sum(b.weight for b in mine)
        ceil_Bps = ceil // 8
        rates = pace = 0
        for b in mine:
            r = int(c.rate) * b.weight // total
            p = max(min_Bps, ceil_Bps * b.weight // total) if paced else 0
            leaves[(c.id, b.level)] = FqLeaf(c.id, b.level, fq_band(b.prio), r, p,
                                             pace_horizon_us(p))
            rates += r
            pace += p
        p = max(min_Bps, ceil_Bps - pace) if paced else 0
        leaves[(c.id, 0)] = FqLeaf(c.id, 0, fq_band(c.priority), int(c.rate) - rates, p,
                                   pace_horizon_us(p))
    default_band = fq_band(policy.default.priority)
    spec = FqSpec(fq_band_weights(link, ((x.band, x.rate_bps) for x in leaves.values())),
                  fq_priomap(default_band), abi.FQ_HORIZON_US, default_band)
    flags = abi.CFG_PACING if any(x.pace_Bps for x in leaves.values()) else 0
    return FqPlan(spec, leaves, tuple(bl), flags)


def fq_inert(policy: Policy, c: TrafficClass, weight: int, prio: int) -> list[str]:
    """Why a boost (weight, prio) of class ``c`` changes nothing in egress mode
    fq ([] when it changes something): its band is the class's and the class
    has no pacer to split (its ceil is the link's; sch_fq already shares a
    band per flow, so a weight alone has nothing to act on)."""
    if fq_band(prio) != fq_band(c.priority) or int(policy.ceil_of(c)) < int(policy.link.rate):
        return []
    return [(f"egress mode fq: a boost of {c.name!r} in its own band (priority {prio}) "
             f"needs the class to have a ceil below the link: weight {weight} would split "
             f"nothing (sch_fq shares a band per flow); give the boost a priority of "
             f"another band within the class's adapt range, or the class a ceil")]
