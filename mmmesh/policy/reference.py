"""The reference classifier: in Python, what the BPF program decides for a frame.

:func:`classify_reference` states what ``bpf/lib/classify.h`` does with a frame
whose MMH header it read; :func:`reference_verdict` also tells which step chose
the class.  Tests run both this and the BPF program on the same packets and
compare.  docs/policy.md ("Classification order") describes the same steps.
"""

from __future__ import annotations

import ipaddress
from typing import Literal, NamedTuple

from .._abi import Modality
from ._schema import Policy, SourceRule, TrafficClass

__all__ = ["Verdict", "classify_reference", "reference_verdict"]


class Verdict(NamedTuple):
    """What :func:`reference_verdict` decided and why.

    ``via`` is ``"claim"`` (header's sla_class), ``"rule"`` (a metadata rule),
    ``"fallback"`` (the modality's condition-less class) or ``"default"``;
    ``clamped`` is True when a source rule lowered the class (CBF_CLAMPED).
    """

    cls: TrafficClass
    via: Literal["claim", "rule", "fallback", "default"]
    clamped: bool


def reference_verdict(
    policy: Policy,
    modality: int,
    sla_class: int = 0,
    *,
    fps: int | None = None,
    bitrate: int | None = None,
    density: int | None = None,
    src_ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address | None = None,
) -> Verdict:
    """Like :func:`classify_reference`, also telling which step chose the class."""
    via: Literal["claim", "rule", "fallback", "default"] = "default"
    chosen: TrafficClass | None = policy.class_by_id(sla_class) if sla_class else None
    if chosen is not None:
        via = "claim"
    else:
        mod = Modality(modality) if modality in Modality._value2member_map_ else None
        takers = [
            c
            for c in policy.classes
            if mod is not None and c.match is not None and mod in c.match.modalities
        ]
        for c in takers:
            assert c.match is not None
            if c.match.condition is not None and c.match.holds(
                fps=fps, bitrate=bitrate, density=density
            ):
                chosen, via = c, "rule"
                break
        else:
            for c in takers:
                assert c.match is not None
                if c.match.condition is None:
                    chosen, via = c, "fallback"
                    break
    if chosen is None:
        chosen = policy.default
    clamped = False
    if src_ip is not None and policy.source_rules:
        addr = ipaddress.ip_address(src_ip)
        if isinstance(addr, ipaddress.IPv4Address):
            addr = ipaddress.IPv6Address((0xFFFF << 32) | int(addr))
        best: SourceRule | None = None
        for r in policy.source_rules:
            key = r.lpm_prefix
            if addr in key and (best is None or key.prefixlen > best.lpm_prefix.prefixlen):
                best = r
        if best is not None and policy.rank(chosen) < policy.rank(best.max_class):
            chosen, clamped = policy.class_named(best.max_class), True
    return Verdict(chosen, via, clamped)


def classify_reference(
    policy: Policy,
    modality: int,
    sla_class: int = 0,
    *,
    fps: int | None = None,
    bitrate: int | None = None,
    density: int | None = None,
    src_ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address | None = None,
) -> TrafficClass:
    """The class the dataplane gives a frame whose MMH header it read.

    ``modality`` and ``sla_class`` are the header bytes; ``fps``, ``bitrate``,
    ``density`` the metadata TLVs (None = not in the header); ``src_ip`` the
    packet's source address (None = no source rule applies).

    1. ``sla_class`` that is the id of a class in the policy: that class.
    2. Otherwise the first class, in file order, whose match lists the modality
       and whose metadata condition holds; then the modality's condition-less
       class (its fallback); then ``default_class``.
    3. Clamp: the source rule with the longest prefix containing ``src_ip``
       (IPv4 compared IPv4-mapped, as the LPM trie does) lowers the class to
       its ``max_class`` when the class's rank is lower (better) than that of
       ``max_class``.
    """
    return reference_verdict(
        policy, modality, sla_class, fps=fps, bitrate=bitrate, density=density, src_ip=src_ip
    ).cls
