"""The reference classifier: in Python, what the BPF program decides for a frame.

:func:`reference_verdict` states what ``bpf/lib/classify.h`` does with a frame
whose MMH header it read, and which step chose the class;
:func:`classify_reference` is the same, the class alone.  Tests run this and
the BPF program on the same packets and compare.  docs/policy.md
("Classification order") describes the same steps.
"""

from __future__ import annotations

import ipaddress
from typing import Literal, NamedTuple, TypedDict, Unpack

from ._schema import Policy, TrafficClass
from ._types import ipv4_mapped

__all__ = ["HeaderFacts", "Verdict", "classify_reference", "reference_verdict"]

Via = Literal["claim", "rule", "fallback", "default"]
Address = str | ipaddress.IPv4Address | ipaddress.IPv6Address


class Verdict(NamedTuple):
    """What :func:`reference_verdict` decided and why.

    ``via`` is ``"claim"`` (header's sla_class), ``"rule"`` (a metadata rule),
    ``"fallback"`` (the modality's condition-less class) or ``"default"``;
    ``clamped`` is True when a source rule lowered the class (CBF_CLAMPED).
    """

    cls: TrafficClass
    via: Via
    clamped: bool


class HeaderFacts(TypedDict, total=False):
    """The keyword arguments of :func:`reference_verdict` (and so of
    :func:`classify_reference`); one left out or None is absent from the frame."""

    fps: int | None
    bitrate: int | None
    density: int | None
    src_ip: Address | None


def reference_verdict(
    policy: Policy,
    modality: int,
    sla_class: int = 0,
    *,
    fps: int | None = None,
    bitrate: int | None = None,
    density: int | None = None,
    src_ip: Address | None = None,
) -> Verdict:
    """The class the dataplane gives a frame whose MMH header it read, and why.

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
    claimed = policy.class_by_id(sla_class) if sla_class else None
    via: Via
    if claimed is not None:
        chosen, via = claimed, "claim"
    else:
        chosen, via = _by_modality(policy, modality, fps=fps, bitrate=bitrate, density=density)
    lowered = _clamp(policy, chosen, src_ip) if src_ip is not None else None
    return Verdict(chosen if lowered is None else lowered, via, lowered is not None)


def classify_reference(
    policy: Policy, modality: int, sla_class: int = 0, **header: Unpack[HeaderFacts]
) -> TrafficClass:
    """The class :func:`reference_verdict` gives the frame, for the same arguments."""
    return reference_verdict(policy, modality, sla_class, **header).cls


def _by_modality(
    policy: Policy, modality: int, *, fps: int | None, bitrate: int | None, density: int | None
) -> tuple[TrafficClass, Via]:
    """Step 2: the first metadata rule that holds, else the fallback, else the default."""
    # Modality is an IntEnum: a header byte equals its member; unknown bytes equal none
    matches = [
        (c, c.match)
        for c in policy.classes
        if c.match is not None and modality in c.match.modalities
    ]
    for c, match in matches:
        if match.condition is not None and match.holds(fps=fps, bitrate=bitrate, density=density):
            return c, "rule"
    for c, match in matches:
        if match.condition is None:
            return c, "fallback"
    return policy.default, "default"


def _clamp(policy: Policy, cls: TrafficClass, src_ip: Address) -> TrafficClass | None:
    """Step 3: the ``max_class`` that ``cls`` is lowered to for ``src_ip``; None: unchanged."""
    addr = ipv4_mapped(ipaddress.ip_address(src_ip))
    containing = [r for r in policy.source_rules if addr in r.lpm_prefix]
    if not containing:
        return None
    # prefixes are unique (the schema refuses duplicates): at most one per length
    longest = max(containing, key=lambda r: r.lpm_prefix.prefixlen)
    if policy.rank(cls) < policy.rank(longest.max_class):
        return policy.class_named(longest.max_class)
    return None
