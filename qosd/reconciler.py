"""Desired state (a policy version) -> kernel state (BPF maps, HTB tree).

Idempotent: ``apply`` brings the dataplane up (``Dataplane.up`` adopts pinned
programs and rewrites maps and classes with replace verbs), so applying the
same version twice changes nothing.  ``resync`` asks the dataplane what
drifted from the last good version (a class or filter deleted by hand,
programs detached) and re-applies it.  A failed apply puts the last good
version back and is reported.

The reconciler is the one owner of ``last_good`` (the version the kernel
holds): only ``apply`` and ``revert`` change it.  A ``ReconcileResult`` is
complete (frozen) before anybody sees it, so ``on_result`` (the metrics)
counts what really happened, repairs included."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mmmesh.dataplane import Dataplane, FlowOverride, Overrides, StageOverride, link_exists
from mmmesh.errors import DataplaneError, MeshError
from mmmesh.policy import Policy

from .config import QosdConfig
from .errors import UnrealizableError
from .model import PolicyVersion, ReconcileResult

log = logging.getLogger("qosd.reconciler")


def override_key(o: StageOverride | FlowOverride) -> tuple[object, ...]:
    """What tells two overrides apart for the controller: the class, the key
    and the weight (a priority left to the class is filled in by the kernel)."""
    where: tuple[object, ...] = ((o.prefix,) if isinstance(o, StageOverride)
                                 else (o.src, o.sport, o.dst, o.dport, o.proto))
    return (type(o).__name__, o.cls, *where, o.boost.weight)


class Reconciler:
    def __init__(self, cfg: QosdConfig,
                 on_result: Callable[[ReconcileResult], None] | None = None,
                 on_adoption: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self._lock = threading.RLock()
        self._last_good: PolicyVersion | None = None
        # the SLA controller's adapted parameters for the last good version:
        # what the kernel holds instead of the version's own (docs/controller.md)
        self._adapted: tuple[int, Policy] | None = None
        self.last_result: ReconcileResult | None = None
        self.adopted: bool = False
        self._device: str | None = None  # device the last good version is on
        self._on_result = on_result
        self._on_adoption = on_adoption
        self._left_out: list[str] = []  # overrides the egress mode cannot realise (logged once)

    @property
    def last_good(self) -> PolicyVersion | None:
        """The version the kernel holds (None before the first success)."""
        return self._last_good

    def kernel_policy(self, pv: PolicyVersion) -> Policy:
        """What the kernel should hold for ``pv``: the controller's adapted
        parameters when they are for this version, else its own."""
        adapted = self._adapted
        return adapted[1] if adapted is not None and adapted[0] == pv.version else pv.policy

    def adapt(self, version: int, effective: Policy | None) -> ReconcileResult | None:
        """The SLA controller's parameters for ``version`` (None: the policy's
        own): written to the kernel now if ``version`` is the last good one
        (the store does not change; a new version starts from its own)."""
        with self._lock:
            good = self._last_good
            if good is None or good.version != version:
                return None
            self._adapted = (version, effective) if effective is not None else None
            return self.apply(good, "adapt")

    def set_overrides(self, version: int, overrides: Overrides) -> bool | None:
        """The SLA controller's stage overrides for ``version``: written when
        the kernel holds another set (True), left when it holds this one
        (False); None when ``version`` is not the last good one.  Boosts are
        checked against the version's own policy (its adapt ranges) and split
        the classes as the kernel holds them (``kernel_policy``).  Those the
        egress mode cannot realise (fq: a boost that changes nothing there,
        ``Dataplane.realisable``) are left out, and logged when they change."""
        with self._lock:
            good = self._last_good
            if good is None or good.version != version:
                return None
            dp = self.dataplane(good.policy.link.device)
            applied = self.kernel_policy(good)
            overrides, left_out = dp.realisable(overrides, applied)
            if left_out and left_out != self._left_out:
                log.info("egress mode %s: overrides left out: %s", dp.egress_mode(),
                         "; ".join(left_out))
            self._left_out = left_out
            have = {override_key(e.override) for e in dp.overrides(applied)}
            want = ({override_key(o) for o in overrides.stages}
                    | {override_key(o) for o in overrides.flows})
            if have == want:
                return False
            dp.set_overrides(overrides, applied, bounds=good.policy)
            return True

    def dataplane(self, device: str) -> Dataplane:
        return Dataplane(device, self.cfg.netns, egress=self.cfg.egress.mode)

    # ------------------------------------------------------------ checks
    def check_realizable(self, policy: Policy) -> None:
        """Raises UnrealizableError if this node cannot apply ``policy``."""
        errors: list[tuple[str, str]] = []
        dev = policy.link.device
        if self.cfg.uplinks and dev not in self.cfg.uplinks:
            errors.append(("link.device", (f"{dev!r} is not an uplink of this node "
                                           f"(uplinks: {', '.join(self.cfg.uplinks)})")))
        else:
            try:
                if not link_exists(dev, self.cfg.netns):
                    where = f" in netns {self.cfg.netns}" if self.cfg.netns else ""
                    errors.append(("link.device", f"no device {dev!r} on this node{where}"))
            except DataplaneError as e:
                errors.append(("link.device", str(e)))
            else:
                if not errors:  # what this device's egress mode cannot realise, field named
                    try:
                        errors += self.dataplane(dev).check(policy)
                    except DataplaneError as e:
                        errors.append(("link.device", str(e)))
        total = sum(int(c.rate) for c in policy.classes)
        if total > int(policy.link.rate):  # the schema refuses this too; be sure
            errors.append(("classes", (f"guarantees {total} bit/s exceed the link "
                                       f"rate {int(policy.link.rate)} bit/s")))
        if errors:
            raise UnrealizableError(errors)

    # ------------------------------------------------------------ apply
    def apply(self, pv: PolicyVersion, trigger: str,
              repaired: tuple[str, ...] = ()) -> ReconcileResult:
        """Puts ``pv`` into the kernel; on failure restores the last good
        version and raises.  ``repaired``: the drift this apply repairs."""
        with self._lock:
            started = time.time()
            t0 = time.monotonic()
            try:
                self._up(pv)
            except MeshError as e:
                log.error("reconcile of version %d failed: %s", pv.version, e)
                restored = self._restore_last_good()
                good = self._last_good
                self._record(ReconcileResult(
                    ok=False, version=good.version if good else 0, started_at=started,
                    duration_s=time.monotonic() - t0, trigger=trigger, repaired=repaired,
                    error=f"{e}{'; last good version restored' if restored else ''}",
                ))
                raise
            self._last_good = pv
            return self._record(ReconcileResult(
                ok=True, version=pv.version, started_at=started,
                duration_s=time.monotonic() - t0, trigger=trigger, repaired=repaired))

    def revert(self, previous: PolicyVersion | None) -> None:
        """The version just applied was not kept (its store commit failed): the
        kernel goes back to ``previous``.  With no previous version the
        dataplane is left as it is but no longer counts as good."""
        with self._lock:
            if previous is None:
                self._last_good = None
                return
            self.apply(previous, "restore")

    def _up(self, pv: PolicyVersion) -> None:
        dev = pv.policy.link.device
        r = self.dataplane(dev).up(self.kernel_policy(pv), version=pv.version)
        if self._last_good is None:
            self.adopted = r.adopted
            if self._on_adoption is not None:
                self._on_adoption("adopted" if r.adopted else "loaded")
        if self._device and self._device != dev:
            log.info("policy moved from %s to %s: removing mmmesh from %s",
                     self._device, dev, self._device)
            self.dataplane(self._device).down()
        self._device = dev

    def _restore_last_good(self) -> bool:
        if self._last_good is None:
            return False
        try:
            self._up(self._last_good)
            return True
        except MeshError as e:  # pragma: no cover - double failure
            log.error("restoring version %d failed too: %s", self._last_good.version, e)
            return False

    def _record(self, res: ReconcileResult) -> ReconcileResult:
        self.last_result = res
        if self._on_result is not None:
            self._on_result(res)
        return res

    # ----------------------------------------------------------- resync
    def drift(self) -> list[str]:
        """What differs between the kernel and the last good version."""
        pv = self._last_good
        if pv is None:
            return []
        return self.dataplane(pv.policy.link.device).drift(self.kernel_policy(pv), pv.version)

    def resync(self) -> ReconcileResult | None:
        """Repairs drift; returns a result when it had to act."""
        with self._lock:
            good = self._last_good
            if good is None:
                return None
            try:
                found = self.drift()
            except MeshError as e:
                found = [f"drift check failed: {e}"]
            if not found:
                return None
            log.warning("drift on %s: %s; repairing", good.policy.link.device, "; ".join(found))
            try:
                return self.apply(good, "resync", repaired=tuple(found))
            except MeshError:
                assert self.last_result is not None
                return self.last_result

    def cleanup(self, devices: list[str]) -> None:
        for dev in devices:
            try:
                self.dataplane(dev).down()
            except MeshError as e:
                log.warning("cleanup of %s: %s", dev, e)
