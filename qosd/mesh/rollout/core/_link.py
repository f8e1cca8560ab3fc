"""One mesh policy, every node's own link: the substitution a node makes
before it validates and applies a mesh-wide version.

Classes, objectives and source rules are mesh-wide; ``link`` is not: each
node shapes its own uplink, at its own rate.  A node with a link override
(qosd.yaml ``mesh_link: {device, rate}``) replaces the policy's ``link``
fields it names; a node without one applies the policy's ``link`` as
written (so the policy's link is the default for nodes without an override,
and must be valid as it stands).  Then the whole policy is validated again
on this node's link: guarantees that do not fit its rate are a NACK that
says so.  Class ceilings above the node's link rate are lowered to it (and so are
the ends of a class's ``adapt.ceil`` range): a ceiling is a cap, and no
class can send faster than its link anyway, so a policy written for a
10 Gbit/s node still fits a 1 Gbit/s one as long as the guarantees (and
the ``adapt.rate`` ranges, which must stay within the link) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmmesh.policy import Policy, Rate, parse_policy


@dataclass(frozen=True, slots=True)
class LinkOverride:
    """This node's uplink for mesh-wide policies; None fields keep the policy's."""

    device: str | None = None
    rate: int | None = None
    """bit/s"""

    def __str__(self) -> str:
        rate = str(Rate(self.rate)) if self.rate else "the policy's rate"
        return f"{self.device or 'the policy device'} at {rate}"


def localise_policy(text: str, link: LinkOverride | None,
                    source: str = "mesh policy") -> Policy:
    """The mesh policy ``text`` as this node applies it: its link replaced by
    ``link`` (see the module docstring).  Raises PolicyError listing every
    problem, the node's link named in each message's field path."""
    policy = parse_policy(text, source=source)
    if link is None or (link.device is None and link.rate is None):
        return policy
    data: dict[str, Any] = policy.model_dump(mode="json", by_alias=True, exclude_none=True)
    if link.device is not None:
        data["link"]["device"] = link.device
    if link.rate is not None:
        top = int(link.rate)
        data["link"]["rate"] = top
        for cls in data["classes"]:
            if "ceil" in cls:
                cls["ceil"] = min(int(Rate(cls["ceil"])), top)
            ceil_range = (cls.get("adapt") or {}).get("ceil")
            if ceil_range:  # the controller's ceiling range: capped the same way
                cls["adapt"]["ceil"] = [min(int(Rate(r)), top) for r in ceil_range]
    return parse_policy(data, source=source)
