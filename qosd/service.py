"""QosdService: the node daemon's core, behind the admin API and metrics.

It owns the policy store and the reconciler.  Applying a policy is
validate -> realisable on this node? -> reconcile the kernel -> commit to
the store.  The store only moves when the kernel took the policy, so the
current version in the store is always the version in the kernel (after a
failure both stay at the last good one)."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import threading
import time
from typing import Any

from mmmesh import _abi
from mmmesh._errors import MeshError
from mmmesh.dataplane import loader
from mmmesh.dataplane._maps import Maps
from mmmesh.policy import Policy, parse_policy

from .config import QosdConfig
from .errors import ConflictError
from .model import FlowRow, PolicyVersion, ReconcileResult
from .reconciler import Reconciler
from .slaboard import SlaBoard
from .store import PolicyStore

log = logging.getLogger("qosd.service")


def _addr(raw: Any) -> str:
    b = bytes(raw)
    if b[:12] == b"\0" * 10 + b"\xff\xff":
        return str(ipaddress.IPv4Address(b[12:]))
    return str(ipaddress.IPv6Address(b))


class QosdService:
    def __init__(self, cfg: QosdConfig, metrics: Any | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics  # qosd.metrics.QosdMetrics or None
        self.started_at = time.time()
        self.store = PolicyStore(cfg.state_dir, history_limit=cfg.history_limit)
        self.reconciler = Reconciler(cfg, on_result=self._observe, on_adoption=self._adoption)
        self._write_lock = threading.Lock()
        self._flow_prev: dict[bytes, tuple[int, float]] = {}
        self._flow_lock = threading.Lock()
        self.sla_board = SlaBoard()

    # ---------------------------------------------------------- startup
    def start(self) -> ReconcileResult | None:
        """Adopts or loads the dataplane for the current version (or the
        initial policy when the store is empty).  If that fails (an uplink not
        up yet at boot), every resync tries again."""
        cur = self.store.current()
        if cur is None and self.cfg.initial_policy is not None:
            from mmmesh.policy import load_policy

            pol = load_policy(self.cfg.initial_policy)
            self.reconciler.check_realizable(pol)
            _, res = self._apply_policy(pol, None, "qosd", "initial policy", "startup")
            return res
        if cur is None:
            log.info("no policy yet: waiting for one (mmmeshctl policy apply)")
            return None
        return self.reconciler.apply(cur, "startup")

    def resync(self) -> ReconcileResult | None:
        if self.reconciler.last_good is None and (
                self.store.current() is not None or self.cfg.initial_policy is not None):
            try:
                return self.start()
            except MeshError as e:
                log.warning("start-up reconcile still failing: %s", e)
                return None
        res = self.reconciler.resync()
        if res is not None and self.metrics is not None and res.repaired:
            self.metrics.drift_repairs.inc(len(res.repaired))
        return res

    def _observe(self, res: ReconcileResult) -> None:
        if self.metrics is not None:
            self.metrics.observe_reconcile(res)

    def _adoption(self, how: str) -> None:
        if self.metrics is not None:
            self.metrics.adoption(how)

    # ----------------------------------------------------------- policy
    def policy(self) -> PolicyVersion | None:
        return self.store.current()

    def validate(self, text: str) -> Policy:
        pol = parse_policy(text)
        self.reconciler.check_realizable(pol)
        return pol

    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        pol = self.validate(text)
        return self._apply_policy(pol, base_version, author, None, "apply")

    def _apply_policy(self, pol: Policy, base_version: int | None, author: str | None,
                      note: str | None, trigger: str) -> tuple[PolicyVersion, ReconcileResult]:
        with self._write_lock:
            if base_version is not None and base_version != self.store.version:
                raise ConflictError(base_version, self.store.version)
            # Reconcile first with the number the version will get; commit
            # only if the kernel took it.
            candidate = PolicyVersion(
                version=self.store.version + 1, policy=pol, text=pol.to_yaml(),
                sha256="", created_at=time.time(), author=author, note=note,
            )
            previous = self.reconciler.last_good
            res = self.reconciler.apply(candidate, trigger)
            try:
                pv = self.store.commit(pol, base_version=base_version, author=author, note=note)
            except BaseException:
                # The store did not take it: put the kernel back where the store
                # is, so that the store's current version is the kernel's.
                log.error("policy store refused the commit; restoring version %s in the kernel",
                          previous.version if previous else "none")
                if previous is not None:
                    self.reconciler.apply(previous, "restore")
                else:
                    self.reconciler.last_good = None
                raise
            if pv.version != candidate.version:  # pragma: no cover - store raced
                res = self.reconciler.apply(pv, trigger)
            else:
                self.reconciler.last_good = pv
            return pv, res

    def diff(self, text: str) -> str:
        new = parse_policy(text).to_yaml()
        cur = self.store.current()
        old = cur.text if cur else ""
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"version {cur.version}" if cur else "none", tofile="proposed",
        ))

    def history(self) -> list[PolicyVersion]:
        return self.store.history()

    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        old = self.store.get(to_version)
        self.reconciler.check_realizable(old.policy)
        return self._apply_policy(old.policy, base_version, author, f"rollback to {to_version}",
                                  "rollback")

    # ----------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        cur = self.store.current()
        uplinks: dict[str, Any] = {}
        if cur is not None:
            dev = cur.policy.link.device
            try:
                uplinks[dev] = loader.status(dev, self.cfg.netns, cur.policy)
            except MeshError as e:
                uplinks[dev] = {"error": str(e)}
        last = self.reconciler.last_result
        return {
            "node": self.cfg.node_name,
            "policy_version": cur.version if cur else 0,
            "uplinks": uplinks,
            "last_reconcile": dataclasses.asdict(last) if last else None,
            "store_problems": list(self.store.problems),
            "started_at": self.started_at,
            "adopted": self.reconciler.adopted,
            "sla": self.sla(),  # {"instances", "stages", "classes"}
        }

    def top_flows(self, n: int = 20) -> list[FlowRow]:
        cur = self.store.current()
        if cur is None:
            return []
        names = {c.id: c.name for c in cur.policy.classes}
        try:
            maps = Maps.open_pinned(loader.pin_dir(cur.policy.link.device, self.cfg.netns))
        except MeshError:
            return []
        now_wall = time.monotonic()
        ktime_now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        rows: list[FlowRow] = []
        seen: dict[bytes, tuple[int, float]] = {}
        try:
            with self._flow_lock:
                for k, v in maps.flows.items():
                    kb = bytes(k)
                    prev = self._flow_prev.get(kb)
                    rate = 0.0
                    if prev is not None and now_wall > prev[1]:
                        rate = max(0.0, (int(v.bytes) - prev[0]) * 8 / (now_wall - prev[1]))
                    seen[kb] = (int(v.bytes), now_wall)
                    try:
                        mod = _abi.Modality(int(v.modality)).name.lower()
                    except ValueError:
                        mod = str(int(v.modality))
                    rows.append(FlowRow(
                        src=_addr(k.saddr), dst=_addr(k.daddr),
                        sport=int.from_bytes(int(k.sport).to_bytes(2, "little"), "big"),
                        dport=int.from_bytes(int(k.dport).to_bytes(2, "little"), "big"),
                        proto="tcp" if k.proto == 6 else str(int(k.proto)),
                        class_name=names.get(int(v.class_id)), class_id=int(v.class_id),
                        modality=mod, packets=int(v.packets), bytes=int(v.bytes),
                        idle_s=max(0.0, (ktime_now - int(v.last_seen_ns)) / 1e9),
                        rate_bps=rate,
                    ))
                self._flow_prev = seen
        finally:
            maps.close()
        rows.sort(key=lambda r: (r.rate_bps, r.bytes), reverse=True)
        return rows[: max(0, n)]

    # -------------------------------------------------------------- SLA
    def report_sla(self, report: dict[str, Any]) -> int:
        return self.sla_board.report(report)

    def sla(self) -> dict[str, list[dict[str, Any]]]:
        """{"instances", "stages", "classes"}: qosd/slaboard.py."""
        return self.sla_board.view()

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.reconciler.last_good is not None
