"""PolicyApplier: the node's policy core, the store and the kernel moved together.

Applying a policy is: the store prepares a version (its number is taken, it
is not current) -> reconcile the kernel -> the store activates it, one write
at a time.  The store only moves when the kernel took the policy, so the
current version in the store is the version in the kernel (after a failure
both stay at the last good one; the prepared version is abandoned).

Whoever applies goes through here: the admin API's facade (qosd/service.py:
apply, rollback, after its own checks), and a mesh-wide rollout
(``apply_mesh``: qosd/mesh/rollout/realise.py, for both cluster back ends).
It knows neither of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from mmmesh.errors import MeshError
from mmmesh.failpoints import failpoint
from mmmesh.policy import Policy
from qosd.store.local import PolicyStore

from .errors import StoreCorruptError
from .model import PolicyVersion, ReconcileResult
from .reconciler import Reconciler

__all__ = ["PolicyApplier"]

log = logging.getLogger("qosd.service")  # the name qosd's start-up lines have always had


class PolicyApplier:
    """``store`` and ``reconciler`` under one write lock; ``initial_policy``
    (qosd.yaml) is applied at start when the store holds no version yet."""

    def __init__(self, store: PolicyStore, reconciler: Reconciler, *,
                 initial_policy: Path | None = None) -> None:
        self._store = store
        self._reconciler = reconciler
        self._initial_policy = initial_policy
        self._write_lock = threading.Lock()

    def current(self) -> PolicyVersion | None:
        """The version the node runs (the store's current one)."""
        return self._store.current()

    # ---------------------------------------------------------- startup
    def start(self) -> ReconcileResult | None:
        """Adopts or loads the dataplane for the current version (or the
        initial policy when the store is empty).  If that fails (an uplink not
        up yet at boot), every resync tries again.

        A version still pending from before (qosd died during an apply: the
        kernel may hold part of it) is undone first: the current version is
        re-applied over it, or, with no current version, the dataplane it
        was being applied to is taken down; then it is abandoned."""
        cur = self._store.current()
        with self._write_lock:
            pending = self._store.pending()
            for pv in pending:
                dev = pv.policy.link.device
                if cur is None or cur.policy.link.device != dev:
                    log.warning("version %d was being applied to %s when qosd stopped: "
                                "removing it from the kernel", pv.version, dev)
                    try:
                        self._reconciler.dataplane(dev).down()
                    except MeshError as e:
                        log.warning("removing version %d from %s: %s", pv.version, dev, e)
        res: ReconcileResult | None = None
        if cur is None and self._initial_policy is not None:
            from mmmesh.policy import load_policy

            pol = load_policy(self._initial_policy)
            self._reconciler.check_realizable(pol)
            _, res = self.apply(pol, author="qosd", note="initial policy", trigger="startup")
        elif cur is None:
            log.info("no policy yet: waiting for one (mmmeshctl policy apply)")
        else:
            if pending:
                log.warning("version(s) %s were being applied when qosd stopped: putting "
                            "version %d back", ", ".join(str(p.version) for p in pending),
                            cur.version)
            res = self._reconciler.apply(cur, "startup")
        for pv in pending:
            self._abandon(pv)
        return res

    def resync(self) -> ReconcileResult | None:
        """Repairs drift; before the first good reconcile, starts again."""
        if self._reconciler.last_good is None and (
                self._store.current() is not None or self._initial_policy is not None):
            try:
                return self.start()
            except MeshError as e:
                log.warning("start-up reconcile still failing: %s", e)
                return None
        return self._reconciler.resync()

    # ----------------------------------------------------------- apply
    def check_realizable(self, policy: Policy) -> None:
        """Raises UnrealizableError if this node cannot apply ``policy``."""
        self._reconciler.check_realizable(policy)

    def apply(self, policy: Policy, *, base_version: int | None = None,
              author: str | None = None, note: str | None = None,
              trigger: str = "apply") -> tuple[PolicyVersion, ReconcileResult]:
        """Stores ``policy`` as a new version and puts it into the kernel
        (checked by the caller: ``check_realizable``).  ConflictError when
        ``base_version`` is given and not current; on a kernel failure the
        store does not move and the kernel is back at the last good version."""
        with self._write_lock:
            # The store hands out the number (ConflictError here changes nothing).
            pv = self._store.prepare(policy, base_version=base_version, author=author,
                                     note=note)
            previous = self._reconciler.last_good
            try:
                res = self._reconciler.apply(pv, trigger)
            except BaseException:
                self._abandon(pv)
                raise
            failpoint("service.apply.reconciled")
            try:
                pv = self._store.activate(pv, base_version=base_version)
            except BaseException:
                # The store did not take it: put the kernel back where the store
                # is, so that the store's current version is the kernel's.
                log.error("policy store refused version %d; restoring version %s in the kernel",
                          pv.version, previous.version if previous else "none")
                self._abandon(pv)
                self._reconciler.revert(previous)
                raise
            return pv, res

    def apply_mesh(self, policy: Policy, note: str, author: str) -> PolicyVersion:
        """Applies a mesh-wide version (localised and checked by the rollout):
        like ``apply``, with the mesh version in the version's note."""
        pv, _ = self.apply(policy, author=author, note=note, trigger="cluster")
        return pv

    def rollback(self, to_version: int, *, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        """Applies stored version ``to_version`` again, as a new version
        (NotFoundError when it is not stored)."""
        old = self._store.get(to_version)
        self._reconciler.check_realizable(old.policy)
        return self.apply(old.policy, base_version=base_version, author=author,
                          note=f"rollback to {to_version}", trigger="rollback")

    def _abandon(self, pv: PolicyVersion) -> None:
        with contextlib.suppress(StoreCorruptError):
            self._store.abandon(pv)
