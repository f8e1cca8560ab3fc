"""Typed access to the classifier's maps, from fresh fds or from pins."""

from __future__ import annotations

import ctypes
import os
from typing import Any

from .. import _abi
from .._failpoints import failpoint
from ._bpf import Map, count_by_next_key, count_map_entries, obj_get
from ._compile import CompiledPolicy
from ._types import DirectionCounters, FlowCensus

USER_MAPS = tuple(m for m in _abi.MAPS if m.user)


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
        self.config.update(0, cp.config)
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
