"""Desired state (a policy version) -> kernel state (BPF maps, HTB tree).

Idempotent: ``apply`` calls the loader's ``up``, which adopts pinned
programs and rewrites maps and classes with replace verbs, so applying the
same version twice changes nothing.  ``resync`` compares the kernel with the
last good version and re-applies when it drifted (a class or filter deleted
by hand, programs detached).  A failed apply puts the last good version
back and is reported; the store only moves on success (see service.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from mmmesh._errors import DataplaneError, MeshError
from mmmesh.dataplane import loader
from mmmesh.dataplane._maps import Maps
from mmmesh.dataplane import _bpf
from mmmesh.dataplane._netlink import HTB_PARENT, HTB_ROOT, Netlink
from mmmesh.policy import Policy

from .config import QosdConfig
from .errors import UnrealizableError
from .model import PolicyVersion, ReconcileResult

log = logging.getLogger("qosd.reconciler")


def _pinned_prog_ids(pins: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, name in loader.PROGRAMS.items():
        try:
            fd = _bpf.obj_get(os.path.join(pins, name))
        except MeshError:
            continue
        try:
            out[d] = int(_bpf.prog_info(fd).id)
        finally:
            os.close(fd)
    return out


class Reconciler:
    def __init__(self, cfg: QosdConfig,
                 on_result: Callable[[ReconcileResult], None] | None = None,
                 on_adoption: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self._lock = threading.RLock()
        self.last_good: PolicyVersion | None = None
        self.last_result: ReconcileResult | None = None
        self.adopted: bool = False
        self._device: str | None = None  # device the last good version is on
        self._on_result = on_result
        self._on_adoption = on_adoption

    # ------------------------------------------------------------ checks
    def check_realizable(self, policy: Policy) -> None:
        """Raises UnrealizableError if this node cannot apply ``policy``."""
        errors: list[tuple[str, str]] = []
        dev = policy.link.device
        if self.cfg.uplinks and dev not in self.cfg.uplinks:
            errors.append(("link.device", f"{dev!r} is not an uplink of this node "
                                          f"(uplinks: {', '.join(self.cfg.uplinks)})"))
        else:
            try:
                with Netlink(self.cfg.netns) as nl:
                    if not nl.link_exists(dev):
                        where = f" in netns {self.cfg.netns}" if self.cfg.netns else ""
                        errors.append(("link.device", f"no device {dev!r} on this node{where}"))
            except DataplaneError as e:
                errors.append(("link.device", str(e)))
        total = sum(int(c.rate) for c in policy.classes)
        if total > int(policy.link.rate):  # the schema refuses this too; be sure
            errors.append(("classes", f"guarantees {total} bit/s exceed the link "
                                      f"rate {int(policy.link.rate)} bit/s"))
        if errors:
            raise UnrealizableError(errors)

    # ------------------------------------------------------------ apply
    def apply(self, pv: PolicyVersion, trigger: str) -> ReconcileResult:
        with self._lock:
            started = time.time()
            t0 = time.monotonic()
            try:
                self._up(pv)
            except MeshError as e:
                log.error("reconcile of version %d failed: %s", pv.version, e)
                restored = self._restore_last_good()
                res = ReconcileResult(
                    ok=False, version=self.last_good.version if self.last_good else 0,
                    started_at=started, duration_s=time.monotonic() - t0, trigger=trigger,
                    error=f"{e}{'; last good version restored' if restored else ''}",
                )
                self._record(res)
                raise
            self.last_good = pv
            res = ReconcileResult(ok=True, version=pv.version, started_at=started,
                                  duration_s=time.monotonic() - t0, trigger=trigger)
            self._record(res)
            return res

    def _up(self, pv: PolicyVersion) -> None:
        dev = pv.policy.link.device
        r = loader.up(pv.policy, dev, self.cfg.netns, version=pv.version)
        if self._on_adoption is not None and self.last_good is None:
            self._on_adoption("adopted" if r.adopted else "loaded")
        if self.last_good is None:
            self.adopted = r.adopted
        if self._device and self._device != dev:
            log.info("policy moved from %s to %s: removing mmmesh from %s",
                     self._device, dev, self._device)
            loader.down(self._device, self.cfg.netns)
        self._device = dev

    def _restore_last_good(self) -> bool:
        if self.last_good is None:
            return False
        try:
            self._up(self.last_good)
            return True
        except MeshError as e:  # pragma: no cover - double failure
            log.error("restoring version %d failed too: %s", self.last_good.version, e)
            return False

    def _record(self, res: ReconcileResult) -> None:
        self.last_result = res
        if self._on_result is not None:
            self._on_result(res)

    # ----------------------------------------------------------- resync
    def drift(self) -> list[str]:
        """What differs between the kernel and the last good version."""
        pv = self.last_good
        if pv is None:
            return []
        pol, dev, found = pv.policy, pv.policy.link.device, []
        pins = loader.pin_dir(dev, self.cfg.netns)
        if not os.path.isdir(pins):
            return ["pinned programs and maps missing"]
        with Netlink(self.cfg.netns) as nl:
            if not nl.link_exists(dev):
                return [f"device {dev} is gone"]
            idx = nl.ifindex(dev)
            filters = nl.bpf_filters(idx)
            pinned = _pinned_prog_ids(pins)
            for d in ("egress", "ingress"):
                if d not in filters:
                    found.append(f"{d} program detached")
                elif pinned.get(d) and filters[d].get("prog_id") != pinned[d]:
                    found.append(f"{d} hook runs program {filters[d].get('prog_id')}, "
                                 f"not ours ({pinned[d]})")
            if nl.root_qdisc(idx) != ("htb", HTB_ROOT):
                found.append("HTB root qdisc missing or replaced")
            elif nl.htb_default(idx) != pol.default.id:
                found.append("HTB default class changed")
            classes = nl.htb_classes(idx)
            link = int(pol.link.rate)
            for c in pol.classes:
                h = classes.get(c.classid)
                ceil = int(pol.ceil_of(c))
                if h is None:
                    found.append(f"HTB class {c.handle} ({c.name}) missing")
                elif (h.get("prio") != c.priority or h.get("quantum") != c.quantum
                      or h.get("rate_Bps") != int(c.rate) // 8
                      or h.get("ceil_Bps") != ceil // 8):
                    found.append(f"HTB class {c.handle} ({c.name}) changed")
            parent = classes.get(HTB_PARENT)
            if parent is None or parent.get("rate_Bps") != link // 8:
                found.append("HTB link class missing or changed")
        maps = Maps.open_pinned(pins)
        try:
            if maps.policy_version() != (pv.version & 0xFFFFFFFF):
                found.append(f"policy maps hold version {maps.policy_version()}, "
                             f"want {pv.version}")
        finally:
            maps.close()
        return found

    def resync(self) -> ReconcileResult | None:
        """Repairs drift; returns a result when it had to act."""
        with self._lock:
            if self.last_good is None:
                return None
            try:
                found = self.drift()
            except MeshError as e:
                found = [f"drift check failed: {e}"]
            if not found:
                return None
            log.warning("drift on %s: %s; repairing", self.last_good.policy.link.device,
                        "; ".join(found))
            try:
                res = self.apply(self.last_good, "resync")
            except MeshError:
                assert self.last_result is not None
                self.last_result.repaired = found
                return self.last_result
            res.repaired = found
            return res

    def cleanup(self, devices: list[str]) -> None:
        for dev in devices:
            try:
                loader.down(dev, self.cfg.netns)
            except MeshError as e:
                log.warning("cleanup of %s: %s", dev, e)
