"""Typed access to the classifier's maps, from fresh fds or from pins."""

from __future__ import annotations

import ctypes
import ipaddress
import os
from typing import Any

from mmmesh import abi as _abi
from mmmesh.failpoints import failpoint
from mmmesh.policy.overrides import PROTOCOLS, Boost, FlowOverride, OverrideEntry, StageOverride

from ..policy.egress import FQ_MIN_PACE_BPS as MIN_PACE_BPS
from ._bpf import Map, count_by_next_key, count_map_entries, obj_get
from ._compile import CompiledOverrides, CompiledPolicy, pace_horizon_us
from ._types import DirectionCounters, FlowCensus

USER_MAPS = tuple(m for m in _abi.MAPS if m.user)
_MAPPED = b"\0" * 10 + b"\xff\xff"
_PROTO_NAMES = {v: k for k, v in PROTOCOLS.items()}


def addr_text(raw: bytes) -> str:
    """A 16-byte map address as text (IPv4-mapped addresses as IPv4)."""
    if raw[:12] == _MAPPED:
        return str(ipaddress.IPv4Address(raw[12:]))
    return str(ipaddress.IPv6Address(raw))


def be16(v: int) -> int:
    """A ``be`` u16 map field read as a host-order (little-endian) integer."""
    return int.from_bytes(int(v).to_bytes(2, "little"), "big")


def prefix_text(k: _abi.StageOvrKey) -> str:
    """A stage override key's prefix as text (IPv4-mapped prefixes as IPv4)."""
    raw, plen = bytes(k.addr), int(k.prefixlen) - 32
    if raw[:12] == _MAPPED and plen >= 96:
        return str(ipaddress.IPv4Network((raw[12:], plen - 96)))
    return str(ipaddress.IPv6Network((raw, plen)))


class Maps:
    """The classifier's maps that user space reads and writes (``_abi.MAPS``
    with ``user`` set).  Takes ownership of the fds it is given."""

    def __init__(self, fds: dict[str, int]) -> None:
        self._maps: dict[str, Map] = {}
        try:
            for m in USER_MAPS:
                self._maps[m.name] = Map(fds.pop(m.name), m.key, m.value, m.name)
        except BaseException:
            self.close()
            for fd in fds.values():
                os.close(fd)
            raise
        for fd in fds.values():  # kernel-only maps: not ours to keep open
            os.close(fd)
        self.config = self._maps["config_map"]
        self.classes = self._maps["class_map"]
        self.modalities = self._maps["modality_map"]
        self.sources = self._maps["src_map"]
        self.flows = self._maps["flow_map"]
        self.stats = self._maps["stats_map"]
        self.meta = self._maps["meta_map"]
        self.boosts = self._maps["boost_map"]
        self.stage_ovr = self._maps["stage_ovr_map"]
        self.flow_ovr = self._maps["flow_ovr_map"]
        self.pace = self._maps["pace_map"]

    @classmethod
    def open_pinned(cls, pin_dir: str) -> Maps:
        fds: dict[str, int] = {}
        try:
            for m in USER_MAPS:
                fds[m.name] = obj_get(os.path.join(pin_dir, m.name))
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()

    def __enter__(self) -> Maps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- policy
    def write_policy(self, cp: CompiledPolicy) -> None:
        """Rewrites the policy maps in an order that never leaves a reference
        to a class that is not there: new classes first, then what points to
        them (modalities, source rules, config), then removals."""
        for cid, info in cp.classes.items():
            self.classes.update(cid, info)
        failpoint("maps.classes_written")
        for m in range(_abi.MAX_MODALITIES):
            want = cp.modalities.get(m)
            if want is not None:
                self.modalities.update(m, want)
        # Stale source prefixes go first, so a full swap never needs twice
        # the map's capacity (a source may briefly be unclamped, never
        # wrongly clamped).
        want_src = {bytes(k) for k, _ in cp.sources}
        for k in list(self.sources.keys()):
            if bytes(k) not in want_src:
                self.sources.delete(k)
        for k, v in cp.sources:
            self.sources.update(k, v)
        # the override switches belong to write_overrides: kept as they are
        cfg = _abi.Config.from_buffer_copy(cp.config)
        cfg.flags = (cfg.flags & ~_abi.CFG_OVERRIDES) | (self._config_flags() & _abi.CFG_OVERRIDES)
        self.config.update(0, cfg)
        failpoint("maps.refs_written")
        for m in range(_abi.MAX_MODALITIES):
            if m not in cp.modalities:
                cur = self.modalities.lookup(m)
                if cur is not None and cur.valid:
                    self.modalities.update(m, _abi.ModalityInfo())
        for cid in range(_abi.MAX_CLASSES):
            if cid not in cp.classes:
                cur = self.classes.lookup(cid)
                if cur is not None and cur.valid:
                    self.classes.update(cid, _abi.ClassInfo())

    # -------------------------------------------------------- overrides
    def _config_flags(self) -> int:
        cur = self.config.lookup(0)
        return int(cur.flags) if cur is not None else 0

    def _set_override_flags(self, flags: int) -> None:
        cfg = self.config.lookup(0) or _abi.Config()
        cfg.flags = (cfg.flags & ~_abi.CFG_OVERRIDES) | flags
        self.config.update(0, cfg)

    def read_boosts(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(class id, level) -> (weight, prio) of every valid boost."""
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for level in range(1, _abi.MAX_BOOSTS + 1):
            for cid in range(1, _abi.MAX_CLASSES):
                b = self.boosts.lookup(_abi.boost_slot(cid, level))
                if b is not None and b.valid:
                    out[(cid, level)] = (int(b.weight), int(b.prio))
        return out

    def read_boost_infos(self) -> dict[tuple[int, int], _abi.BoostInfo]:
        """(class id, level) -> boost_map value of every valid boost."""
        out: dict[tuple[int, int], _abi.BoostInfo] = {}
        for level in range(1, _abi.MAX_BOOSTS + 1):
            for cid in range(1, _abi.MAX_CLASSES):
                b = self.boosts.lookup(_abi.boost_slot(cid, level))
                if b is not None and b.valid:
                    out[(cid, level)] = b
        return out

    def read_overrides(self) -> list[tuple[_abi.StageOvrKey | _abi.FlowKey, _abi.OvrInfo]]:
        """Every stage and flow override entry (keys as the maps hold them)."""
        out: list[tuple[_abi.StageOvrKey | _abi.FlowKey, _abi.OvrInfo]] = []
        out += list(self.stage_ovr.items())
        out += list(self.flow_ovr.items())
        return out

    def override_entries(self, names: dict[int, str]) -> list[OverrideEntry]:
        """The override maps decoded (class names from ``names``, else the id)."""
        infos = self.read_boost_infos()
        out: list[OverrideEntry] = []
        for k, v in self.read_overrides():
            cid, lvl = int(v.class_id), int(v.level)
            b = infos.get((cid, lvl))
            boost = Boost(int(b.weight), int(b.prio)) if b is not None else Boost()
            classid = int(b.classid) if b is not None else _abi.boost_classid(cid, lvl)
            name = names.get(cid, str(cid))
            o: StageOverride | FlowOverride
            if isinstance(k, _abi.StageOvrKey):
                o = StageOverride(name, prefix_text(k), boost)
            else:
                o = FlowOverride(name, addr_text(bytes(k.saddr)), be16(k.sport),
                                 addr_text(bytes(k.daddr)), be16(k.dport),
                                 _PROTO_NAMES.get(int(k.proto), str(k.proto)), boost)
            out.append(OverrideEntry(o, lvl, classid, int(v.hits)))
        return out

    def write_overrides(self, co: CompiledOverrides) -> None:
        """Makes the override maps hold ``co``, in an order that never lets an
        entry point at a boost whose leaf is not there (the caller has created
        the leaves): boosts marked valid first, then the entries that use them
        (an unchanged entry keeps its hit count), then stale entries removed,
        then boosts nobody uses any more invalidated (their leaves can go)."""
        for (cid, lvl), b in co.boosts.items():
            info = co.infos.get((cid, lvl)) or _abi.BoostInfo(
                classid=b.classid, valid=1, weight=b.weight, prio=b.prio)
            self.boosts.update(_abi.boost_slot(cid, lvl), info)
        failpoint("maps.boosts_written")
        self._set_override_flags((self._config_flags() & _abi.CFG_OVERRIDES) | co.flags)
        for m, entries in ((self.stage_ovr, co.stages), (self.flow_ovr, co.flows)):
            for k, v in entries:
                cur = m.lookup(k)
                if cur is not None and (cur.class_id, cur.level) == (v.class_id, v.level):
                    continue
                m.update(k, v)
        failpoint("maps.overrides_written")
        for m, entries in ((self.stage_ovr, co.stages), (self.flow_ovr, co.flows)):
            want = {bytes(k) for k, _ in entries}
            for k in list(m.keys()):
                if bytes(k) not in want:
                    m.delete(k)
        self._set_override_flags(co.flags)
        for (cid, lvl) in self.read_boosts():
            if (cid, lvl) not in co.boosts:
                self.boosts.update(_abi.boost_slot(cid, lvl), _abi.BoostInfo())
        failpoint("maps.overrides_pruned")

    # ------------------------------------------------------- pacing (fq)
    def lower_pacers(self, classes: dict[int, tuple[int, int]],
                     boosts: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Egress mode fq, before anything else changes: every pacer the maps
        hold at the lower of its rate and the one it is to have (``classes``:
        class id -> (bytes/s, horizon us); ``boosts``: (class, level) -> the
        same; 0 bytes/s = not paced, as fast as the link), and a boost that
        goes at the slowest pace, so that a class's pacers never add up to
        more than either state's while the maps change."""
        def lower(cur: _abi.ClassInfo | _abi.BoostInfo, want: tuple[int, int] | None) -> bool:
            have = int(cur.pace_Bps)
            rate, horizon = want if want is not None else (MIN_PACE_BPS // 8, 0)
            if rate and (not have or rate < have):
                cur.pace_Bps = rate
                cur.horizon_us = horizon or pace_horizon_us(rate)
                return True
            return False

        for cid in range(1, _abi.MAX_CLASSES):
            cur = self.classes.lookup(cid)
            if cur is not None and cur.valid and cid in classes and lower(cur, classes[cid]):
                self.classes.update(cid, cur)
        for key, info in self.read_boost_infos().items():
            if info.pace_Bps and lower(info, boosts.get(key)):
                self.boosts.update(_abi.boost_slot(*key), info)

    def write_class_pacing(self, classes: dict[int, tuple[int, int, int]]) -> None:
        """Class id -> (skb->priority, bytes/s, horizon us) into class_map, the
        rest of each entry as it is (a set_overrides that re-splits classes)."""
        for cid, (slot, rate, horizon) in classes.items():
            cur = self.classes.lookup(cid)
            if cur is None or not cur.valid:
                continue
            if (int(cur.classid), int(cur.pace_Bps), int(cur.horizon_us)) != (slot, rate, horizon):
                cur.classid, cur.pace_Bps, cur.horizon_us = slot, rate, horizon
                self.classes.update(cid, cur)

    def set_pacing_flag(self, on: bool) -> None:
        cfg = self.config.lookup(0) or _abi.Config()
        flags = (cfg.flags | _abi.CFG_PACING) if on else (cfg.flags & ~_abi.CFG_PACING)
        if flags != cfg.flags:
            cfg.flags = flags
            self.config.update(0, cfg)

    def read_pacers(self) -> dict[tuple[int, int], tuple[int, int, int, int]]:
        """(class id, level) -> (bytes/s, horizon us, clock ns, frames over the
        horizon) of every paced class and boost."""
        out: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        leaves: list[tuple[tuple[int, int], Any]] = []
        for cid in range(1, _abi.MAX_CLASSES):
            cur = self.classes.lookup(cid)
            if cur is not None and cur.valid and cur.pace_Bps:
                leaves.append(((cid, 0), cur))
        leaves += [(k, v) for k, v in self.read_boost_infos().items() if v.pace_Bps]
        for (cid, lvl), info in leaves:
            st = self.pace.lookup(_abi.pace_slot(cid, lvl))
            out[(cid, lvl)] = (int(info.pace_Bps), int(info.horizon_us),
                               int(st.next_ns) if st is not None else 0,
                               int(st.over_horizon) if st is not None else 0)
        return out

    def policy_version(self) -> int:
        cfg = self.config.lookup(0)
        return int(cfg.policy_version) if cfg is not None else 0

    def write_meta(self, build_id: int = 0) -> None:
        self.meta.update(0, _abi.Meta(abi_version=_abi.ABI_VERSION, build_id=build_id))

    def abi_version(self) -> int:
        m = self.meta.lookup(0)
        return int(m.abi_version) if m is not None else 0

    def build_id(self) -> int:
        m = self.meta.lookup(0)
        return int(m.build_id) if m is not None else 0

    # ------------------------------------------------------------ stats
    def read_stats(self) -> dict[str, DirectionCounters]:
        out: dict[str, DirectionCounters] = {}
        for d, name in ((_abi.DIR_EGRESS, "egress"), (_abi.DIR_INGRESS, "ingress")):
            percpu: Any = self.stats.lookup(d) or []
            reasons = {r.name.lower(): sum(int(s.reason[r]) for s in percpu)
                       for r in _abi.Reason}
            classes: dict[int, tuple[int, int]] = {}
            for cid in range(_abi.MAX_CLASSES):
                pk = sum(int(s.cls[cid].packets) for s in percpu)
                by = sum(int(s.cls[cid].bytes) for s in percpu)
                if pk or by:
                    classes[cid] = (pk, by)
            out[name] = DirectionCounters(reasons, classes)
        return out

    def flow_census(self) -> FlowCensus:
        """Entries in the flow table and how many per class (batched reads)."""
        fm = self.flows
        ksz, vsz = ctypes.sizeof(fm.key_type), ctypes.sizeof(fm.value_type)
        if fm.percpu:
            return FlowCensus(count_by_next_key(fm.fd, ksz, fm.max_entries), fm.max_entries, None)
        n, by = count_map_entries(fm.fd, ksz, vsz, fm.max_entries,
                                  byte_offset=_abi.FlowInfo.class_id.offset)
        return FlowCensus(n, fm.max_entries, dict(by) if by is not None else None)
