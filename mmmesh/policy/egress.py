"""Egress modes: what a policy's fields mean in each, and what a mode refuses.

A node realises the same policy in one of two egress modes (qosd.yaml
``egress.mode``; docs/dataplane.md "Egress modes" has the whole table):

* ``htb``: one root HTB on the uplink: every class a leaf with its guaranteed
  ``rate``, its ``ceil``, its ``weight`` (quantum) and its ``priority``
  (HTB prio).  Hard guarantees, but one root qdisc lock for every TX queue.
* ``fq``: no root shaper.  A root ``mq`` with one ``sch_fq`` per TX queue
  (3 priority bands, weighted round robin between them) and, for a class
  with a ``ceil`` below the link, an EDT pacer in the classifier (every
  frame gets its departure time; sch_fq holds it until then).  The class's
  ``priority`` picks its band (:func:`fq_band`); ``ceil`` is its pacing
  rate, across every CPU and queue; ``rate`` holds per band: the band
  weights give every band at least the sum of its classes' guarantees
  under contention; ``weight`` splits a class's ceil between it and its
  boosts; flows of one band share it per flow (sch_fq), not per class.

:func:`egress_errors` lists what a mode cannot realise, each as
``(field path, message)`` like the schema's own errors; :func:`check_egress`
raises them as one :class:`~mmmesh.errors.PolicyError`.  ``htb`` realises
every valid policy.  ``fq`` refuses:

* ``link.rate`` below the device's line rate, when the device reports one:
  fq does not shape the device below what it can send;
* a ``ceil`` (or the low end of ``adapt.ceil``) too low to pace a full frame
  within the longest pacing horizon (:data:`FQ_MIN_PACE_BPS`);
* guarantees that give one band more of the link than sch_fq's weights can
  (the largest weight, 2^31 - 1 bytes, beside the smallest, 16384, for every
  other band in use: 99.998 % with three bands): ``classes``.

Anti-escalation holds in both: :func:`fq_band` never decreases with the
priority number, so a class that ranks below another never gets a better
band, and a clamped frame takes its ``max_class``'s band and pacer.
"""

from __future__ import annotations

from typing import Literal

from mmmesh.abi import FQ_BANDS, FQ_MIN_WEIGHT, PACE_MAX_HORIZON_US
from mmmesh.errors import PolicyError

from ._schema import Policy
from ._types import format_rate

__all__ = ["EGRESS_MODES", "FQ_BAND_OF_PRIORITY", "FQ_MIN_PACE_BPS", "EgressMode",
           "check_egress", "egress_errors", "fq_band"]

EgressMode = Literal["htb", "fq"]
EGRESS_MODES: tuple[EgressMode, ...] = ("htb", "fq")

FQ_BAND_OF_PRIORITY = (0, 0, 1, 1, 2, 2, 2, 2)
"""Egress mode fq: a class's ``priority`` (0..7) -> its sch_fq band (0..2):
0-1 band 0, 2-3 band 1, 4-7 band 2 (as Cilium's guaranteed / burstable /
best effort).  Monotone: a less urgent priority never gets a better band."""

FRAME_BYTES = 1514  # a full Ethernet frame (the HTB quantum unit)
FQ_MAX_WEIGHT = 0x7FFFFFFF  # sch_fq's band weights are s32 bytes per round
FQ_MIN_PACE_BPS = -(-FRAME_BYTES * 8 * 1_000_000 // PACE_MAX_HORIZON_US)
"""The lowest ceil egress mode fq paces: one full frame per longest horizon
(12112 bit/s with a 1 s horizon); below it every frame would wait longer
than the class's backlog may."""

assert max(FQ_BAND_OF_PRIORITY) == FQ_BANDS - 1
assert list(FQ_BAND_OF_PRIORITY) == sorted(FQ_BAND_OF_PRIORITY)


def fq_band(priority: int) -> int:
    """The sch_fq band of a class (or boost) of this priority in egress mode fq."""
    return FQ_BAND_OF_PRIORITY[priority]


def _mode(mode: str) -> EgressMode:
    if mode not in EGRESS_MODES:
        raise ValueError(f"egress mode {mode!r}: one of {', '.join(EGRESS_MODES)}")
    return mode


def egress_errors(policy: Policy, mode: str, *, line_rate_bps: int | None = None
                  ) -> list[tuple[str, str]]:
    """What ``mode`` cannot realise of ``policy`` on a device whose line rate is
    ``line_rate_bps`` (None or 0: unknown); [] when it realises all of it."""
    if _mode(mode) == "htb":
        return []
    errors: list[tuple[str, str]] = []
    link = int(policy.link.rate)
    if line_rate_bps and link < line_rate_bps:
        errors.append(("link.rate", (
            f"egress mode fq does not shape the device below its line rate "
            f"{format_rate(line_rate_bps)}: link.rate {format_rate(link)} cannot be "
            f"realised; set it to the line rate (and give classes a ceil), or use egress "
            f"mode htb")))
    need: dict[int, int] = {}
    for c in policy.classes:
        need[fq_band(c.priority)] = need.get(fq_band(c.priority), 0) + int(c.rate)
    top = max(need, key=lambda b: need[b])
    most = FQ_MAX_WEIGHT / (FQ_MAX_WEIGHT + FQ_MIN_WEIGHT * (len(need) - 1))
    if need[top] > most * link:
        errors.append(("classes", (
            f"egress mode fq: the guarantees of band {top} ({format_rate(need[top])}) need more "
            f"of the link than its weight can give beside the other bands' smallest weights "
            f"({most:.4%}); use egress mode htb")))
    for i, c in enumerate(policy.classes):
        ceil = int(policy.ceil_of(c))
        if ceil < link and ceil < FQ_MIN_PACE_BPS:
            errors.append((f"classes[{i}].ceil", (
                f"egress mode fq paces a ceil with departure times: {format_rate(ceil)} is below "
                f"{format_rate(FQ_MIN_PACE_BPS)}, one full frame per pacing horizon "
                f"({PACE_MAX_HORIZON_US // 1000} ms)")))
        rng = c.adapt.ceil if c.adapt is not None else None
        if rng is not None and int(rng[0]) < FQ_MIN_PACE_BPS:
            errors.append((f"classes[{i}].adapt.ceil", (
                f"egress mode fq: the range's low end {format_rate(int(rng[0]))} is below "
                f"{format_rate(FQ_MIN_PACE_BPS)}, the lowest ceil it paces")))
    return errors


def check_egress(policy: Policy, mode: str, *, line_rate_bps: int | None = None) -> None:
    """Raises PolicyError (every problem, fields named) if ``mode`` cannot
    realise ``policy``."""
    errors = egress_errors(policy, mode, line_rate_bps=line_rate_bps)
    if errors:
        raise PolicyError(errors)
