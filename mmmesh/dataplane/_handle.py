"""``Dataplane``: the one way into the kernel for one device.

Everything outside ``mmmesh.dataplane`` (qosd, the demo, the benches) brings
the classifier up or down, sets its per-flow and per-stage overrides, reads
its state and checks it for drift through a ``Dataplane`` handle; the modules behind it (``_pins``, ``_maps``, ``_bpf``,
``_netlink``, ``_bcc``) are private.  A handle holds no kernel resources
between calls: each call opens what it needs and closes it again, so handles
are cheap and safe to share between threads.

A handle has an egress mode (``egress=``: "htb", "fq" or "auto", resolved by
:meth:`Dataplane.egress_mode`; docs/dataplane.md "Egress modes"): the same
face, the same maps and programs, another qdisc tree.  ``up``,
``set_overrides``, ``drift``, ``status`` and ``down`` do what the mode needs.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import TYPE_CHECKING

from mmmesh import abi
from mmmesh.errors import DataplaneError
from mmmesh.failpoints import failpoint
from mmmesh.policy.overrides import FlowOverride, OverrideEntry, Overrides, StageOverride

from ..policy import Policy
from ..policy.egress import egress_errors
from . import _bpf, _pins
from ._compile import (
    BoostLeaf,
    CompiledOverrides,
    CompiledPolicy,
    boosted_spec,
    compile_overrides,
    compile_policy,
    fq_inert,
    fq_plan,
    transition_spec,
)
from ._egress import EGRESS_CHOICES, choose_egress, fq_drift, installed_egress
from ._maps import Maps, addr_text, be16
from ._types import (
    ClassStatus,
    DataplaneStats,
    DataplaneStatus,
    Flow,
    FqQdiscStats,
    HtbClassStats,
    PacerState,
    UpResult,
    handle,
)

if TYPE_CHECKING:
    from ._netlink import Netlink

log = logging.getLogger("mmmesh.dataplane")

_DIRECTIONS = {abi.DIR_EGRESS: "egress", abi.DIR_INGRESS: "ingress"}
DRAIN_S = 1.0  # how long a boost leaf that goes away may take to send what it holds


def _kept_overrides(maps: Maps, policy: Policy, egress: str = "htb") -> CompiledOverrides:
    """The kernel's overrides that still hold under ``policy`` (their class is
    still there, their boost still safe, in egress mode fq still doing
    something); the others are left out."""
    names = {c.id: c.name for c in policy.classes}
    held = maps.override_entries(names)
    entries = [e.override for e in held if e.override.cls in names.values()]
    kept = Overrides(tuple(o for o in entries if isinstance(o, StageOverride)),
                     tuple(o for o in entries if isinstance(o, FlowOverride)))
    co = compile_overrides(policy, kept, current=maps.read_boosts(), drop_invalid=True,
                           egress=egress)
    if len(held) != len(co.stages) + len(co.flows):
        log.warning("overrides no longer valid under the new policy were removed: %s",
                    "; ".join(co.dropped) or "their class is gone")
    return co


def _drain(nl: Netlink, idx: int, classids: set[int]) -> None:
    """Waits (at most DRAIN_S) until the HTB leaves ``classids`` hold nothing:
    deleting a class drops what it holds."""
    deadline = time.monotonic() + DRAIN_S
    while classids:
        have = nl.htb_classes(idx)
        if all(have[c].qlen == 0 for c in classids if c in have):
            return
        if time.monotonic() > deadline:
            log.warning("boost leaves still hold packets after %.1f s; deleting them", DRAIN_S)
            return
        time.sleep(0.01)


def _not_applied(nl: Netlink, idx: int, maps: Maps, policy: Policy, egress: str) -> str | None:
    """Why ``policy`` is not what the device runs, None when it is (our HTB
    root with its default class, or egress mode fq's root; the same classes
    in class_map, with the priority values of the mode)."""
    from ._netlink import HTB_ROOT

    if egress == "htb":
        spec = compile_policy(policy).htb
        assert spec is not None
        if nl.root_qdisc(idx) != ("htb", HTB_ROOT) or nl.htb_default(idx) != spec.default_minor:
            return "the device's HTB root is not the one up() made for this policy"
        want = {c.id: c.classid for c in policy.classes}
    else:
        if installed_egress(nl.root_qdisc(idx)) != "fq":
            return "the device does not run egress mode fq's qdiscs"
        slots = fq_plan(policy, ()).leaves
        want = {c.id: slots[(c.id, 0)].slot for c in policy.classes}
    for cid in range(1, abi.MAX_CLASSES):
        info = maps.classes.lookup(cid)
        have = int(info.classid) if info is not None and info.valid else None
        if have != want.get(cid):
            return f"class id {cid} differs between the maps and the policy"
    return None


def link_exists(iface: str, netns: str | None = None) -> bool:
    """Whether ``iface`` exists (in ``netns``; DataplaneError if that netns does not)."""
    from ._netlink import Netlink

    with Netlink(netns) as nl:
        return nl.link_exists(iface)


class Dataplane:
    """The classifier on one device (``iface``, in network namespace ``netns``),
    in egress mode ``egress`` ("htb", "fq", or "auto": :meth:`egress_mode`)."""

    def __init__(self, iface: str, netns: str | None = None, *, egress: str = "htb") -> None:
        if egress not in EGRESS_CHOICES:
            raise ValueError(f"egress mode {egress!r}: one of {', '.join(EGRESS_CHOICES)}")
        self.iface = iface
        self.netns = netns
        self.egress = egress
        self.pin_dir = _pins.pin_dir(iface, netns)

    def __repr__(self) -> str:
        return f"Dataplane({self.iface!r}, netns={self.netns!r}, egress={self.egress!r})"

    # -------------------------------------------------------------- mode
    def egress_mode(self) -> str:
        """The egress mode ``up`` applies: ``egress`` as given, or for "auto"
        :func:`choose_egress` of this kernel and device (fq when the device
        has more than one TX queue and the kernel has sch_fq with bands)."""
        from ._netlink import Netlink, probe_fq_bands

        if self.egress != "auto":
            return self.egress
        with Netlink(self.netns) as nl:
            queues = nl.tx_queues(nl.ifindex(self.iface))
        return choose_egress("auto", tx_queues=queues, fq_bands=probe_fq_bands() if queues > 1
                             else False)

    def check(self, policy: Policy, *, egress: str | None = None) -> list[tuple[str, str]]:
        """What this device's egress mode (or ``egress``) cannot realise of
        ``policy``, as (field path, message); [] when it realises all of it
        (:func:`mmmesh.policy.egress.egress_errors` with the device's line rate)."""
        from ._netlink import line_rate_bps

        return egress_errors(policy, egress or self.egress_mode(),
                             line_rate_bps=line_rate_bps(self.iface, self.netns))

    def realisable(self, overrides: Overrides, policy: Policy) -> tuple[Overrides, list[str]]:
        """``overrides`` without those this device's egress mode cannot realise
        (egress mode fq: a boost that changes nothing, ``fq_inert``), and why
        each was left out; htb: all of them.  What the SLA controller's writes
        go through (qosd's reconciler), so that a whole set is not refused
        window after window for one boost fq has no use for."""
        if self.egress_mode() != "fq":
            return overrides, []
        by_name = {c.name: c for c in policy.classes}
        dropped: list[str] = []

        def keep(at: str, o: StageOverride | FlowOverride) -> bool:
            c = by_name.get(o.cls)
            if c is None:
                return True  # refused by set_overrides, as in htb
            why = fq_inert(policy, c, c.weight if o.boost.weight is None else o.boost.weight,
                           c.priority if o.boost.priority is None else o.boost.priority)
            dropped.extend(f"{at}: {w}" for w in why)
            return not why

        stages = tuple(o for i, o in enumerate(overrides.stages) if keep(f"stages[{i}]", o))
        flows = tuple(o for i, o in enumerate(overrides.flows) if keep(f"flows[{i}]", o))
        return Overrides(stages, flows), dropped

    # ------------------------------------------------------------- write
    def up(self, policy: Policy, *, version: int = 0, force: bool = False,
           tunables: dict[str, int] | None = None, ingress: bool = True) -> UpResult:
        """Loads (or adopts) the classifier on the device and applies ``policy``.

        Idempotent: run it again with a new policy and it rewrites the maps and
        reconciles the qdiscs (the HTB tree, or egress mode fq's mq and fq
        qdiscs) in place.  A pinned dataplane of the same ABI version and
        build is adopted (programs keep their ids, the flow table its
        entries); anything else pinned there is replaced.  ``force`` replaces
        a root qdisc that mmmesh did not create.  A policy the egress mode
        cannot realise (:meth:`check`), or egress mode fq on a kernel without
        sch_fq bands, is refused (DataplaneError) before anything changes."""
        from ._bcc import build_id  # source hashing only; bcc is not imported
        from ._netlink import Netlink, probe_fq

        mode = self.egress_mode()
        refused = self.check(policy, egress=mode)
        if refused:
            raise DataplaneError(errno.EINVAL, f"egress mode {mode} cannot realise the "
                                 "policy: " + "; ".join(f"{f}: {m}" for f, m in refused))
        if mode == "fq" and not probe_fq()[0]:
            raise DataplaneError(errno.EOPNOTSUPP, "egress mode fq needs sch_fq with priority "
                                 f"bands (Linux >= 6.7); the probe found: {probe_fq()[1]}; "
                                 "use egress mode htb")
        compiled = compile_policy(policy, version, egress=mode)
        _pins.ensure_bpffs()
        with Netlink(self.netns) as nl:
            idx = nl.ifindex(self.iface)
            build = build_id(tunables)
            state = _pins.pinned_state(self.pin_dir, build)
            if state != "adopt":
                if state == "replace":
                    log.warning("replacing the pinned dataplane at %s (other ABI or build, or "
                                "incomplete)", self.pin_dir)
                _pins.load_and_pin(self.pin_dir, tunables, build)
            failpoint("dataplane.up.pinned")
            with Maps.open_pinned(self.pin_dir) as maps:
                co = _kept_overrides(maps, policy, mode)
                self._converge(nl, idx, maps, policy, co, compiled, force=force)
            nl.ensure_clsact(idx)
            attached = nl.bpf_filters(idx)
            prog_ids: dict[str, int] = {}
            for direction, prog in abi.PROGRAMS.items():
                if direction == "ingress" and not ingress:
                    nl.detach_bpf(idx, direction)
                    continue
                fd = _bpf.obj_get(os.path.join(self.pin_dir, prog))
                try:
                    pid = int(_bpf.prog_info(fd).id)
                    if attached.get(direction, {}).get("prog_id") != pid:
                        nl.attach_bpf(idx, direction, fd, prog)
                    prog_ids[direction] = pid
                finally:
                    os.close(fd)
            failpoint("dataplane.up.attached")
        return UpResult(self.iface, self.netns, state == "adopt", prog_ids, version)

    def set_overrides(self, overrides: Overrides, policy: Policy, *,
                      bounds: Policy | None = None) -> list[OverrideEntry]:
        """Makes the device hold exactly ``overrides`` (empty: none): boost
        leaves created, changed or deleted, the override maps rewritten.

        ``policy`` is the policy the last :meth:`up` applied (the controller's
        effective one); its class values are what a boost's ``None`` fields
        take and what the boost leaves split.  Boosts must lie within the
        ``adapt`` ranges of ``bounds`` (the operator's policy; default:
        ``policy``).  Crash-safe like ``up``: leaves exist before an entry
        points at them, entries go before their leaves.  Returns the entries
        as loaded.  DataplaneError: no dataplane, another policy applied, or
        an override refused (EINVAL, every problem named)."""
        from ._netlink import Netlink

        if not self.loaded():
            raise DataplaneError(errno.ENOENT, f"no dataplane on {self.iface}: run up first")
        mode = self.egress_mode()
        with Netlink(self.netns) as nl, Maps.open_pinned(self.pin_dir) as maps:
            idx = nl.ifindex(self.iface)
            problem = _not_applied(nl, idx, maps, policy, mode)
            if problem:
                raise DataplaneError(errno.ESTALE, f"{problem}: pass the policy up() applied")
            co = compile_overrides(policy, overrides, bounds=bounds or policy,
                                   current=maps.read_boosts(), egress=mode)
            self._converge(nl, idx, maps, policy, co, egress=mode)
            return maps.override_entries({c.id: c.name for c in policy.classes})

    def _converge(self, nl: Netlink, idx: int, maps: Maps, policy: Policy,
                  co: CompiledOverrides, compiled: CompiledPolicy | None = None, *,
                  force: bool = False, egress: str | None = None) -> None:
        """Qdiscs and maps to ``policy`` + ``co`` (+ the policy maps of
        ``compiled``), in egress mode ``egress`` (default: ``compiled``'s).
        The order keeps every mix of old and new safe (a crash can stop it
        anywhere).  htb: the new leaves exist before the maps point at them,
        the old ones go only after nothing points at them; a class's leaves
        take the lower of their old and new rates until then, so guarantees
        never sum above either state's.  fq: every pacer first at the lower
        of its old and new rate; the maps (the bands' priority slots) before
        the qdiscs, so that a device switching from htb sends frames with fq
        slots to HTB's default class meanwhile (demoted, never escalated:
        slots 13..15 name no HTB class), never HTB class ids to fq bands;
        the pacers raised to their final rates last."""
        from ._netlink import HTB_ROOT

        mode = egress or (compiled.egress if compiled is not None else "htb")
        if mode == "htb":
            spec = compiled.htb if compiled is not None else compile_policy(policy).htb
            assert spec is not None
            final = boosted_spec(spec, co.boosts.values())
            ours = nl.root_qdisc(idx) == ("htb", HTB_ROOT)
            trans = transition_spec(final, nl.htb_classes(idx) if ours else {})
            nl.add_htb(idx, trans, force=force)
        else:
            plan = fq_plan(policy, co.boosts.values())
            pace = {cid: (x.pace_Bps, x.horizon_us) for (cid, lvl), x in plan.leaves.items()
                    if lvl == 0}
            maps.lower_pacers(pace, {k: (x.pace_Bps, x.horizon_us)
                                     for k, x in plan.leaves.items() if k[1]})
            if compiled is not None:
                compiled = _with_lowered_pacers(compiled, maps)
        failpoint("dataplane.up.htb_added")
        if compiled is not None:
            maps.write_policy(compiled)
            failpoint("dataplane.up.maps_written")
        if mode == "fq":
            nl.add_fq(idx, plan.spec, force=force)
        maps.write_overrides(co)
        if mode == "htb":
            _drain(nl, idx, {c.classid for c in trans.leaves} - {c.classid for c in final.leaves})
            nl.prune_htb(idx, final)
        else:
            maps.write_class_pacing({cid: (x.slot, x.pace_Bps, x.horizon_us)
                                     for (cid, lvl), x in plan.leaves.items() if lvl == 0})
            maps.set_pacing_flag(bool(plan.flags & abi.CFG_PACING))
        failpoint("dataplane.up.htb_pruned")
        if mode == "htb" and trans != final:
            nl.add_htb(idx, final)

    def down(self, *, unpin: bool = True) -> None:
        """Detaches and unpins everything ``up`` installed; the device is left
        as it was before (our HTB root removed, clsact removed when empty).
        ``unpin=False`` keeps the programs and maps pinned (the next ``up``
        adopts them)."""
        from ._netlink import Netlink

        with Netlink(self.netns) as nl:
            if nl.link_exists(self.iface):
                idx = nl.ifindex(self.iface)
                for direction in abi.PROGRAMS:
                    nl.detach_bpf(idx, direction)
                nl.remove_clsact_if_empty(idx)
                nl.remove_htb(idx)
                nl.remove_fq(idx)
        if unpin:
            _pins.unpin(self.pin_dir)

    # -------------------------------------------------------------- read
    def loaded(self) -> bool:
        """Whether a dataplane is pinned for the device."""
        return os.path.isdir(self.pin_dir)

    def htb_classes(self) -> dict[int, HtbClassStats]:
        """The device's HTB classes (ours: major 1) with live statistics
        (egress mode fq: none)."""
        from ._netlink import Netlink

        with Netlink(self.netns) as nl:
            return nl.htb_classes(nl.ifindex(self.iface))

    def fq_qdiscs(self) -> list[FqQdiscStats]:
        """Egress mode fq's sch_fq of every TX queue, with live statistics (by
        queue; htb: none)."""
        from ._netlink import Netlink

        with Netlink(self.netns) as nl:
            _, ours, _ = nl.fq_qdiscs(nl.ifindex(self.iface))
        return [ours[q] for q in sorted(ours)]

    def pacers(self) -> list[PacerState]:
        """Egress mode fq: every paced class and boost, its rate, horizon and
        how far its clock runs ahead of now."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # bpf_ktime_get_ns's clock
        with Maps.open_pinned(self.pin_dir) as maps:
            return [PacerState(cid, lvl, rate * 8, horizon, max(0, nxt - now), over)
                    for (cid, lvl), (rate, horizon, nxt, over) in sorted(maps.read_pacers().items())]

    def policy_version(self) -> int:
        """The policy version written in the pinned config map."""
        with Maps.open_pinned(self.pin_dir) as maps:
            return maps.policy_version()

    def stats(self) -> DataplaneStats:
        """Counters, policy version and flow-table census, from one map open."""
        with Maps.open_pinned(self.pin_dir) as maps:
            return DataplaneStats(maps.policy_version(), maps.read_stats(), maps.flow_census())

    def overrides(self, policy: Policy | None = None) -> list[OverrideEntry]:
        """The overrides the kernel holds, with their hit counts (class names
        from ``policy``, else class ids as text)."""
        names = {c.id: c.name for c in policy.classes} if policy else {}
        with Maps.open_pinned(self.pin_dir) as maps:
            return maps.override_entries(names)

    def flows(self) -> list[Flow]:
        """Every entry of the TCP flow table, decoded (at most its capacity)."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # bpf_ktime_get_ns's clock
        out: list[Flow] = []
        with Maps.open_pinned(self.pin_dir) as maps:
            for k, v in maps.flows.items():
                out.append(Flow(
                    src=addr_text(bytes(k.saddr)), dst=addr_text(bytes(k.daddr)),
                    sport=be16(k.sport), dport=be16(k.dport), proto=int(k.proto),
                    direction=_DIRECTIONS.get(int(k.dir), str(int(k.dir))),
                    class_id=int(v.class_id), modality=int(v.modality),
                    packets=int(v.packets), bytes=int(v.bytes),
                    idle_s=max(0.0, (now - int(v.last_seen_ns)) / 1e9), boost=int(v.boost),
                ))
        return out

    def status(self, policy: Policy | None = None) -> DataplaneStatus:
        """What is installed: attached programs, HTB classes and, when pinned,
        the map contents and counters (class names from ``policy``)."""
        from ._netlink import Netlink

        with Netlink(self.netns) as nl:
            idx = nl.ifindex(self.iface)
            programs = nl.bpf_filters(idx)
            htb = nl.htb_classes(idx)
            root, fqs, _ = nl.fq_qdiscs(idx)
        mode = installed_egress(root) or "none"
        fq = [fqs[q] for q in sorted(fqs)]
        if not self.loaded():
            return DataplaneStatus(self.iface, self.netns, self.pin_dir, False, programs, htb,
                                   egress=mode, fq=fq)
        names = {c.id: c.name for c in policy.classes} if policy else {}
        with Maps.open_pinned(self.pin_dir) as maps:
            stats = maps.read_stats()
            classes: list[ClassStatus] = []
            for cid in range(1, abi.MAX_CLASSES):
                info = maps.classes.lookup(cid)
                if info is None or not info.valid:
                    continue
                eg = stats["egress"].classes.get(cid, (0, 0))
                ig = stats["ingress"].classes.get(cid, (0, 0))
                slot = int(info.classid)
                band = slot - abi.FQ_PRIO_BASE if mode == "fq" and slot >> 16 == 0 else None
                classes.append(ClassStatus(
                    name=names.get(cid, str(cid)), id=cid, classid=slot,
                    rank=int(info.rank), egress_packets=eg[0], egress_bytes=eg[1],
                    ingress_packets=ig[0], ingress_bytes=ig[1], htb=htb.get(slot), band=band,
                ))
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            pacers = [PacerState(c, lvl, rate * 8, hz, max(0, nxt - now), over)
                      for (c, lvl), (rate, hz, nxt, over) in sorted(maps.read_pacers().items())]
            return DataplaneStatus(
                self.iface, self.netns, self.pin_dir, True, programs, htb,
                abi_version=maps.abi_version(), policy_version=maps.policy_version(),
                flows=maps.flow_census().count, classes=classes,
                reasons={d: s.reasons for d, s in stats.items()},
                egress=mode, fq=fq, pacers=pacers if mode == "fq" else [],
            )

    def drift(self, policy: Policy, version: int) -> list[str]:
        """What differs between the kernel and ``policy`` at ``version`` as
        ``up`` would leave it: pins, attached programs, the egress mode's
        qdiscs (htb: the root, default, link and leaf classes; fq: the root,
        an fq with the plan's bands on every TX queue), the pacers, the policy
        version in the maps.  Empty: none."""
        from ._netlink import HTB_PARENT, HTB_ROOT, Netlink

        if not self.loaded():
            return ["pinned programs and maps missing"]
        mode = self.egress_mode()
        if mode == "fq":
            return self._drift_fq(policy, version)
        spec = compile_policy(policy, version).htb
        assert spec is not None
        by_id = {c.id: c for c in policy.classes}
        try:
            with Maps.open_pinned(self.pin_dir) as maps:
                boosts = [BoostLeaf(c, lvl, w, p) for (c, lvl), (w, p) in maps.read_boosts().items()
                          if c in by_id]
        except DataplaneError:
            boosts = []
        spec = boosted_spec(spec, boosts)
        names = {c.classid: c.name for c in policy.classes}
        names.update({b.classid: f"{by_id[b.class_id].name} boost {b.level}" for b in boosts})
        found: list[str] = []
        with Netlink(self.netns) as nl:
            if not nl.link_exists(self.iface):
                return [f"device {self.iface} is gone"]
            idx = nl.ifindex(self.iface)
            found += self._programs_drift(nl, idx)
            if nl.root_qdisc(idx) != ("htb", HTB_ROOT):
                found.append("HTB root qdisc missing or replaced" + (
                    " (the device runs egress mode fq)"
                    if installed_egress(nl.root_qdisc(idx)) == "fq" else ""))
            elif nl.htb_default(idx) != spec.default_minor:
                found.append("HTB default class changed")
            have = nl.htb_classes(idx)
        for leaf in spec.leaves:
            h = have.get(leaf.classid)
            what = f"HTB class {handle(leaf.classid)} ({names.get(leaf.classid, '?')})"
            if h is None:
                found.append(f"{what} missing")
            elif (h.prio != leaf.prio or h.quantum != leaf.quantum
                  or h.rate_Bps != leaf.rate_bps // 8 or h.ceil_Bps != leaf.ceil_bps // 8):
                found.append(f"{what} changed")
        parent = have.get(HTB_PARENT)
        if parent is None or parent.rate_Bps != spec.link_bps // 8:
            found.append("HTB link class missing or changed")
        try:
            in_maps = self.policy_version()
        except DataplaneError as e:
            return [*found, f"policy maps unreadable: {e}"]
        if in_maps != (version & 0xFFFFFFFF):
            found.append(f"policy maps hold version {in_maps}, want {version}")
        return found

    def _programs_drift(self, nl: Netlink, idx: int) -> list[str]:
        found = []
        filters = nl.bpf_filters(idx)
        pinned = _pins.pinned_prog_ids(self.pin_dir)
        for d in abi.PROGRAMS:
            if d not in filters:
                found.append(f"{d} program detached")
            elif pinned.get(d) and filters[d].get("prog_id") != pinned[d]:
                found.append(f"{d} hook runs program {filters[d].get('prog_id')}, "
                             f"not ours ({pinned[d]})")
        return found

    def _drift_fq(self, policy: Policy, version: int) -> list[str]:
        from ._netlink import Netlink

        found: list[str] = []
        by_id = {c.id: c for c in policy.classes}
        try:
            with Maps.open_pinned(self.pin_dir) as maps:
                infos = maps.read_boost_infos()
                classes = {cid: maps.classes.lookup(cid) for cid in range(1, abi.MAX_CLASSES)}
                in_maps = maps.policy_version()
                cfg = maps.config.lookup(0)
        except DataplaneError as e:
            return [f"policy maps unreadable: {e}"]
        boosts = [BoostLeaf(c, lvl, int(b.weight), int(b.prio)) for (c, lvl), b in infos.items()
                  if c in by_id]
        plan = fq_plan(policy, boosts)
        with Netlink(self.netns) as nl:
            if not nl.link_exists(self.iface):
                return [f"device {self.iface} is gone"]
            idx = nl.ifindex(self.iface)
            found += self._programs_drift(nl, idx)
            root, ours, other = nl.fq_qdiscs(idx)
            queues = nl.tx_queues(idx)
        found += fq_drift(plan.spec, root, ours, other, queues)
        names = {c.id: c.name for c in policy.classes}
        for (cid, lvl), leaf in sorted(plan.leaves.items()):
            what = names.get(cid, str(cid)) + (f" boost {lvl}" if lvl else "")
            have = classes.get(cid) if lvl == 0 else infos.get((cid, lvl))
            if have is None or not have.valid:
                found.append(f"{what} missing from the maps")
            elif (int(have.classid), int(have.pace_Bps)) != (leaf.slot, leaf.pace_Bps):
                found.append(f"{what}: band or pacer changed (slot {int(have.classid)}, "
                             f"{int(have.pace_Bps) * 8} bit/s; want {leaf.slot}, "
                             f"{leaf.pace_Bps * 8} bit/s)")
        if cfg is not None and bool(cfg.flags & abi.CFG_PACING) != bool(plan.flags):
            found.append("pacing switched " + ("off" if plan.flags else "on") + " in the maps")
        if in_maps != (version & 0xFFFFFFFF):
            found.append(f"policy maps hold version {in_maps}, want {version}")
        return found


def _with_lowered_pacers(compiled: CompiledPolicy, maps: Maps) -> CompiledPolicy:
    """``compiled`` whose classes keep the pacer the maps hold where it is
    slower than the new one (lower_pacers ran): raised at the end."""
    import copy

    out = copy.copy(compiled)
    out.classes = {}
    for cid, info in compiled.classes.items():
        new = abi.ClassInfo.from_buffer_copy(info)
        cur = maps.classes.lookup(cid)
        if (cur is not None and cur.valid and cur.pace_Bps
                and (not new.pace_Bps or cur.pace_Bps < new.pace_Bps)):
            new.pace_Bps, new.horizon_us = cur.pace_Bps, cur.horizon_us
        out.classes[cid] = new
    return out
