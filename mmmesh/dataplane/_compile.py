"""Policy -> the contents of the BPF policy maps and the HTB tree.

Pure functions, no kernel: the loader writes what they return.  The BPF
program's semantics for these tables are mirrored by
``mmmesh.policy.classify_reference``; tests run both on the same packets.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from .. import _abi
from ..policy import Policy
from ._types import HtbClass, HtbSpec


@dataclass
class CompiledPolicy:
    config: _abi.Config
    classes: dict[int, _abi.ClassInfo]  # class id -> info (ids not here are invalid)
    modalities: dict[int, _abi.ModalityInfo]
    sources: list[tuple[_abi.SrcKey, _abi.SrcInfo]] = field(default_factory=list)
    htb: HtbSpec | None = None


def src_key(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> _abi.SrcKey:
    """LPM key: IPv4 networks become IPv4-mapped IPv6 (::ffff:a.b.c.d/96+len)."""
    if isinstance(net, ipaddress.IPv4Network):
        addr = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + net.network_address.packed)
        plen = 96 + net.prefixlen
    else:
        addr, plen = net.network_address, net.prefixlen
    k = _abi.SrcKey()
    k.prefixlen = plen
    k.addr[:] = list(addr.packed)
    return k


def compile_policy(policy: Policy, version: int = 0) -> CompiledPolicy:
    ranks = {c.name: i for i, c in enumerate(policy.ranked())}
    classes: dict[int, _abi.ClassInfo] = {}
    for c in policy.classes:
        classes[c.id] = _abi.ClassInfo(
            classid=c.classid, valid=1, rank=ranks[c.name], dscp=c.dscp_value
        )

    # modality -> (conditional rules in file order, fallback class id)
    rules: dict[int, list[_abi.Rule]] = {}
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
                    _abi.Rule(meta=int(c.match.meta), class_id=c.id, min=cond.min, max=cond.max)
                )
    modalities: dict[int, _abi.ModalityInfo] = {}
    for m in set(rules) | set(fallback):
        mi = _abi.ModalityInfo(valid=1, default_class=fallback.get(m, 0))
        rs = rules.get(m, [])
        if len(rs) > _abi.MAX_RULES:  # the schema refuses this; guard anyway
            raise ValueError(f"modality {m}: more than {_abi.MAX_RULES} metadata rules")
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
        sources.append((src_key(rule.prefix), _abi.SrcInfo(max_class=mc.id, max_rank=r)))

    config = _abi.Config(
        policy_version=version & 0xFFFFFFFF,
        default_class=policy.default.id,
        flags=_abi.CFG_HAS_SRC_RULES if sources else 0,
        clamp_below_rank=clamp_below,
    )
    link = int(policy.link.rate)
    htb = HtbSpec(
        link_bps=link,
        default_minor=policy.default.id,
        leaves=tuple(
            HtbClass(
                classid=c.classid, rate_bps=int(c.rate), ceil_bps=int(policy.ceil_of(c)),
                prio=c.priority, quantum=c.quantum,
            )
            for c in policy.classes
        ),
    )
    return CompiledPolicy(config, classes, modalities, sources, htb)
