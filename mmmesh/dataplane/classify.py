"""Running packets through a private copy of the real classifier.

``Classifier`` compiles ``bpf/mm_tc.c`` exactly as ``up`` does, loads it
(without attaching or pinning anything), writes a policy (and overrides)
into its own maps and runs Ethernet frames through it with BPF_PROG_TEST_RUN.  TCP frames of
one Classifier share its flow table, in the order they are run.  The live
pinned dataplane is never touched.  ``egress="fq"`` writes the maps as egress
mode fq does (band slots, pacers): each verdict then has the frame's band
and the departure time its pacer gave it (``tstamp``, CLOCK_MONOTONIC ns).
"""

from __future__ import annotations

import errno
from dataclasses import asdict, dataclass
from typing import Any, Self

from mmmesh import abi
from mmmesh.errors import DataplaneError
from mmmesh.policy.overrides import OverrideEntry, Overrides

from ..policy import Policy
from . import _bpf
from ._bcc import compile_and_load
from ._compile import compile_overrides, compile_policy, fq_plan
from ._maps import Maps

TC_ACT_OK = 0
TC_ACT_NAMES = {0: "pass", 2: "drop", 7: "redirect", -1: "unspec"}


@dataclass(frozen=True)
class Verdict:
    """What the program decided for one frame; the fields of ``classify --json``
    (documented in docs/dataplane.md, "How a packet travels")."""

    verdict: str  # "pass" for TC_ACT_OK
    retval: int
    priority: int  # skb->priority after the program (the HTB class id), 0 on ingress
    classid: str | None  # "1:b"
    class_id: int  # policy class id (0 = none)
    class_: str | None  # class name
    modality: str | int | None  # name, number if unknown, None without header or flow
    reason: str  # parsed | flow_hit | not_mesh | malformed
    clamped: bool
    flow_learnt: bool
    dscp_rewritten: bool
    duration_ns: int
    packet: bytes  # the frame as the program left it
    boosted: bool = False  # an override put it in a boost leaf (priority is that leaf)
    band: int | None = None  # egress mode fq: the sch_fq band its priority selects
    tstamp: int = 0  # skb->tstamp after the program (egress mode fq: its departure time)
    paced: bool = False  # egress mode fq: its leaf's pacer gave it a slot
    over_horizon: bool = False  # ... too far ahead: stamped for the qdisc to drop

    def as_json(self, *, overrides: bool = False) -> dict[str, Any]:
        """The ``classify --json`` object (without ``index``); ``packet`` is the
        output frame as hex when the DSCP was rewritten, else None.  ``boosted``
        only with ``overrides`` (``classify --overrides``)."""
        d = asdict(self)
        d["class"] = d.pop("class_")
        d["packet"] = self.packet.hex() if self.dscp_rewritten else None
        if not overrides:
            del d["boosted"]
        if self.band is None:  # egress mode htb: the keys as they always were
            for k in ("band", "tstamp", "paced", "over_horizon"):
                del d[k]
        return d


def _modality(value: int) -> str | int | None:
    """cb's modality as ``classify`` reports it: like ``mmmesh wire decode``, the
    name of a known modality and the number of an unknown one."""
    if value == abi.NO_MODALITY:
        return None
    try:
        return abi.Modality(value).name.lower()
    except ValueError:
        return value


class Classifier:
    """A private, unattached copy of the classifier with ``policy`` loaded."""

    def __init__(self, policy: Policy, *, extra_cflags: list[str] | None = None,
                 tunables: dict[str, int] | None = None, overrides: Overrides | None = None,
                 bounds: Policy | None = None, egress: str = "htb") -> None:
        self.policy = policy
        self.egress = egress
        self._obj = compile_and_load(tunables, extra_cflags)
        fds = dict(self._obj.map_fds)
        self._obj.map_fds.clear()  # Maps owns them now
        self.maps = Maps(fds)
        self.maps.write_meta()
        self.maps.write_policy(compile_policy(policy, egress=egress))
        self._names = {c.id: c.name for c in policy.classes}
        if overrides:
            self.set_overrides(overrides, bounds=bounds)

    def set_overrides(self, overrides: Overrides, *, bounds: Policy | None = None) -> None:
        """Rewrites the override maps (checked as ``Dataplane.set_overrides``
        does, against ``bounds`` or the policy); no qdisc here, so boost
        leaves are only the priority values a packet gets (egress mode fq:
        the class's pacer is split with its boosts', as ``up`` splits it)."""
        co = compile_overrides(self.policy, overrides, bounds=bounds or self.policy,
                               current=self.maps.read_boosts(), egress=self.egress)
        self.maps.write_overrides(co)
        if self.egress == "fq":
            plan = fq_plan(self.policy, co.boosts.values())
            self.maps.write_class_pacing({cid: (x.slot, x.pace_Bps, x.horizon_us)
                                          for (cid, lvl), x in plan.leaves.items() if lvl == 0})

    def overrides(self) -> list[OverrideEntry]:
        """The overrides loaded, as the kernel holds them (with hit counts)."""
        return self.maps.override_entries(self._names)

    def close(self) -> None:
        """Close the maps and the programs (nothing was attached or pinned)."""
        self.maps.close()
        self._obj.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prog_fd(self, direction: str = "egress") -> int:
        """The fd of ``mm_egress`` or ``mm_ingress``."""
        return self._obj.prog_fds["mm_egress" if direction == "egress" else "mm_ingress"]

    def run(self, frame: bytes, direction: str = "egress", repeat: int = 1, *,
            tstamp: int = 0) -> Verdict:
        """Run one Ethernet frame through the program; TCP frames share the flow
        table.  ``tstamp``: the departure time the frame already has (a TCP
        sender's own EDT pacing), CLOCK_MONOTONIC ns."""
        if len(frame) < 14:
            raise DataplaneError(
                errno.EINVAL,
                f"frame of {len(frame)} bytes: BPF_PROG_TEST_RUN needs a whole Ethernet header",
            )
        ctx = _bpf.SkBuff()
        ctx.tstamp = tstamp
        res = _bpf.prog_test_run(self.prog_fd(direction), frame, repeat=repeat, ctx=ctx)
        cb = res.ctx.cb
        reason = abi.Reason(cb[abi.CB_REASON]).name.lower()
        cid = int(cb[abi.CB_CLASS])
        flags = int(cb[abi.CB_FLAGS])
        prio = int(res.ctx.priority)
        fq = self.egress == "fq"
        band = None
        if fq and direction == "egress":
            band = fq_plan(self.policy, ()).spec.priomap[prio & (abi.FQ_PRIO_SLOTS - 1)]
        return Verdict(
            verdict=TC_ACT_NAMES.get(res.retval, str(res.retval)),
            retval=res.retval,
            priority=prio,
            classid=f"{prio >> 16:x}:{prio & 0xFFFF:x}" if prio and not fq else None,
            class_id=cid,
            class_=self._names.get(cid),
            modality=_modality(int(cb[abi.CB_MODALITY])),
            reason=reason,
            clamped=bool(flags & abi.CBF_CLAMPED),
            flow_learnt=bool(flags & abi.CBF_FLOW_LEARNT),
            dscp_rewritten=bool(flags & abi.CBF_DSCP),
            duration_ns=res.duration_ns,
            packet=res.data,
            boosted=bool(flags & abi.CBF_BOOSTED),
            band=band,
            tstamp=int(res.ctx.tstamp),
            paced=bool(flags & abi.CBF_PACED),
            over_horizon=bool(flags & abi.CBF_OVER_HORIZON),
        )
