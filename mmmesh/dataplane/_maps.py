"""Typed access to the classifier's maps, from fresh fds or from pins."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

from .. import _abi
from ._bpf import Map
from ._compile import CompiledPolicy

U32 = ctypes.c_uint32


@dataclass
class DirectionStats:
    reasons: dict[str, int] = field(default_factory=dict)
    classes: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (packets, bytes)


class Maps:
    """The classifier's maps.  Takes ownership of the fds it is given."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.config = Map(fds["config_map"], U32, _abi.Config, "config_map")
        self.classes = Map(fds["class_map"], U32, _abi.ClassInfo, "class_map")
        self.modalities = Map(fds["modality_map"], U32, _abi.ModalityInfo, "modality_map")
        self.sources = Map(fds["src_map"], _abi.SrcKey, _abi.SrcInfo, "src_map")
        self.flows = Map(fds["flow_map"], _abi.FlowKey, _abi.FlowInfo, "flow_map")
        self.stats = Map(fds["stats_map"], U32, _abi.Stats, "stats_map")
        self.meta = Map(fds["meta_map"], U32, _abi.Meta, "meta_map")
        self._extra = [fd for n, fd in fds.items() if n == "scratch_map"]

    @classmethod
    def open_pinned(cls, pin_dir: str) -> Maps:
        from ._bpf import obj_get

        names = ["config_map", "class_map", "modality_map", "src_map", "flow_map",
                 "stats_map", "meta_map"]
        fds: dict[str, int] = {}
        try:
            for n in names:
                fds[n] = obj_get(os.path.join(pin_dir, n))
            return cls(fds)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise

    def close(self) -> None:
        for m in (self.config, self.classes, self.modalities, self.sources, self.flows,
                  self.stats, self.meta):
            m.close()
        for fd in self._extra:
            os.close(fd)
        self._extra = []

    # ----------------------------------------------------------- policy
    def write_policy(self, cp: CompiledPolicy) -> None:
        """Rewrites the policy maps in an order that never leaves a reference
        to a class that is not there: new classes first, then what points to
        them (modalities, source rules, config), then removals."""
        for cid, info in cp.classes.items():
            self.classes.update(cid, info)
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
    def read_stats(self) -> dict[str, DirectionStats]:
        out: dict[str, DirectionStats] = {}
        for d, name in ((_abi.DIR_EGRESS, "egress"), (_abi.DIR_INGRESS, "ingress")):
            percpu: Any = self.stats.lookup(d) or []
            ds = DirectionStats()
            for r in _abi.Reason:
                ds.reasons[r.name.lower()] = sum(int(s.reason[r]) for s in percpu)
            for cid in range(_abi.MAX_CLASSES):
                pk = sum(int(s.cls[cid].packets) for s in percpu)
                by = sum(int(s.cls[cid].bytes) for s in percpu)
                if pk or by:
                    ds.classes[cid] = (pk, by)
            out[name] = ds
        return out

    def flow_count(self) -> int:
        return sum(1 for _ in self.flows.keys())
