"""Egress modes: which one a device gets (the ``auto`` rule), which one it
runs, and egress mode fq's drift (docs/dataplane.md "Egress modes").

Pure functions over what the netlink layer reports; no kernel here.
"""

from __future__ import annotations

from mmmesh import abi

from ._types import FqQdiscStats, FqSpec

EGRESS_CHOICES = ("auto", "htb", "fq")
_FQ_ROOT = abi.FQ_ROOT_MAJOR << 16
_HTB_ROOT = abi.HTB_MAJOR << 16


def choose_egress(requested: str, *, tx_queues: int, fq_bands: bool) -> str:
    """The egress mode for a device: ``htb`` or ``fq`` as requested; ``auto``:
    fq when the device has more than one TX queue (a root HTB would put all
    of them behind one qdisc lock) and the kernel has sch_fq with priority
    bands (Linux >= 6.7), else htb (one queue: nothing to scale, and HTB's
    guarantees are hard)."""
    if requested not in EGRESS_CHOICES:
        raise ValueError(f"egress mode {requested!r}: one of {', '.join(EGRESS_CHOICES)}")
    if requested != "auto":
        return requested
    return "fq" if tx_queues > 1 and fq_bands else "htb"


def installed_egress(root: tuple[str | None, int]) -> str | None:
    """The egress mode a device's root qdisc (kind, handle) is mmmesh's for:
    "htb", "fq", or None (somebody else's, or the kernel's default)."""
    if root == ("htb", _HTB_ROOT):
        return "htb"
    if root in (("mq", _FQ_ROOT), ("fq", _FQ_ROOT)):
        return "fq"
    return None


def fq_drift(spec: FqSpec, root: tuple[str | None, int], ours: dict[int, FqQdiscStats],
             other: dict[int, str], tx_queues: int) -> list[str]:
    """What differs between the device's egress qdiscs and egress mode fq's
    ``spec``: the root (mq on a multiqueue device, fq on one queue), an fq of
    ours on every TX queue under it, each with the spec's bands."""
    want_root = ("mq", _FQ_ROOT) if tx_queues > 1 else ("fq", _FQ_ROOT)
    if root != want_root:
        runs = installed_egress(root)
        return [f"egress mode fq's root qdisc ({want_root[0]} 4d4d:) missing or replaced"
                + (f" (the device runs egress mode {runs})" if runs else "")]
    found = [f"TX queue {q} runs {kind}, not egress mode fq's fq" for q, kind in sorted(
        other.items())]
    if not ours and not other:
        found.append("no fq under the mq root")
    for q, st in sorted(ours.items()):
        if st.weights is None or st.priomap is None:
            found.append(f"TX queue {q}: fq without priority bands")
        elif st.weights != tuple(spec.weights) or st.priomap != tuple(spec.priomap):
            found.append(f"TX queue {q}: fq band weights or priomap changed "
                         f"({list(st.weights)}, want {list(spec.weights)})")
        elif st.horizon_us != spec.horizon_us or st.horizon_drop is not True:
            found.append(f"TX queue {q}: fq horizon changed")
    return found
