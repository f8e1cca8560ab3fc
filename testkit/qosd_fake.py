"""A qosd without a kernel, for the API tests (tests/qosd/test_api.py,
tests/qosd/test_api_serving.py, tests/mmmeshctl/test_ctl.py) and bench/ctl_startup.py.

``StoreService`` implements the Service protocol of qosd/model.py on a real
:class:`qosd.store.local.PolicyStore`; "the kernel" is a no-op that can be told to
fail, and SLA reports go to a real :class:`qosd.sla.board.SlaBoard`.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
import warnings
from pathlib import Path
from typing import Any

import httpx

with warnings.catch_warnings():  # starlette's "install httpx2" notice
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from mmmesh.errors import DataplaneError
from mmmesh.policy import Policy, parse_policy
from mmmesh.sla.report import SlaReport
from qosd.errors import UnrealizableError
from qosd.identity import ADMIN, Peer, Sender, SenderResolver
from qosd.model import FlowRow, PolicyVersion, ReconcileResult, Service
from qosd.sla.board import SlaBoard
from qosd.store.local import PolicyStore

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "policy.yaml"

POLICY_A = EXAMPLE.read_text()
POLICY_B = POLICY_A.replace("rate: 150mbit", "rate: 160mbit")
POLICY_C = POLICY_A.replace("rate: 80mbit", "rate: 90mbit")
assert POLICY_A != POLICY_B != POLICY_C

BAD_POLICY = """\
apiVersion: mmmesh/v1
link: {device: eth0, rate: 1gbit}
classes:
  - {name: video, id: 1, rate: 150mbps}
  - {name: Voice, id: 2, rate: 1mbit}
default_class: best-effort
"""

TOKEN = "s3cret-token"  # the TCP listener's bearer token in these tests

UNREALIZABLE = POLICY_A.replace("device: eth0", "device: nosuch0")

FLOWS = [
    FlowRow(src="10.0.0.1", dst="10.0.0.2", sport=40000, dport=9000, proto="tcp",
            class_name="video", class_id=12, modality="video", packets=1000,
            bytes=1_500_000, idle_s=0.01, rate_bps=150e6),
    FlowRow(src="10.0.0.1", dst="10.0.0.3", sport=40001, dport=9001, proto="tcp",
            class_name="voice", class_id=11, modality="audio", packets=100,
            bytes=15_000, idle_s=0.02, rate_bps=1.2e6),
    FlowRow(src="10.0.99.7", dst="10.0.0.3", sport=40002, dport=9002, proto="tcp",
            class_name=None, class_id=0, modality=None, packets=3,
            bytes=180, idle_s=5.0, rate_bps=0.0),
]


class StoreService:
    """The Service protocol over a real PolicyStore; a pretend kernel."""

    devices = frozenset({"eth0", "lo"})

    def __init__(self, state_dir: Path) -> None:
        self.store = PolicyStore(state_dir)
        self.started_at = time.time()
        self.last: ReconcileResult | None = None
        self.kernel_fails = False  # next apply/rollback raises DataplaneError
        self.explode: str | None = None  # method name that raises RuntimeError
        self.flows = list(FLOWS)
        self.calls: list[str] = []
        self.sla_board = SlaBoard()  # the real one: the fake is only the dataplane
        self.sla_reports: list[SlaReport] = []

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.explode == name:
            raise RuntimeError(f"bug in {name}")

    def policy(self) -> PolicyVersion | None:
        self._enter("policy")
        return self.store.current()

    def validate(self, text: str) -> Policy:
        self._enter("validate")
        pol = parse_policy(text)
        if pol.link.device not in self.devices:
            raise UnrealizableError([("link.device", f"no device {pol.link.device!r} here")])
        return pol

    def _reconcile(self, pol: Policy, trigger: str) -> None:
        if self.kernel_fails:
            raise DataplaneError(f"{trigger}: the kernel said no (pretend)")

    def _result(self, pv: PolicyVersion, trigger: str) -> ReconcileResult:
        self.last = ReconcileResult(ok=True, version=pv.version, started_at=time.time(),
                                    duration_s=0.001, trigger=trigger)
        return self.last

    def apply(self, text: str, base_version: int | None = None, author: str | None = None
              ) -> tuple[PolicyVersion, ReconcileResult]:
        self._enter("apply")
        pol = self.validate(text)
        self._reconcile(pol, "apply")
        pv = self.store.commit(pol, base_version=base_version, author=author)
        return pv, self._result(pv, "apply")

    def diff(self, text: str) -> str:
        self._enter("diff")
        new = parse_policy(text).to_yaml()
        cur = self.store.current()
        old = cur.text if cur else ""
        return "".join(difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True),
            fromfile=f"version {cur.version}" if cur else "none", tofile="proposed"))

    def history(self) -> list[PolicyVersion]:
        self._enter("history")
        return self.store.history()

    def rollback(self, to_version: int, base_version: int | None = None,
                 author: str | None = None) -> tuple[PolicyVersion, ReconcileResult]:
        self._enter("rollback")
        old = self.store.get(to_version)
        self._reconcile(old.policy, "rollback")
        pv = self.store.commit(old.policy, base_version=base_version, author=author,
                               note=f"rollback to {to_version}")
        return pv, self._result(pv, "rollback")

    def status(self) -> dict[str, Any]:
        self._enter("status")
        cur = self.store.current()
        return {
            "node": "node-a",
            "policy_version": cur.version if cur else 0,
            "uplinks": {cur.policy.link.device: {"loaded": True, "flows": len(self.flows)}}
            if cur else {},
            "last_reconcile": dataclasses.asdict(self.last) if self.last else None,
            "store_problems": list(self.store.problems),
            "started_at": self.started_at,
            "adopted": False,
        }

    def top_flows(self, n: int = 20) -> list[FlowRow]:
        self._enter("top_flows")
        return sorted(self.flows, key=lambda r: r.rate_bps, reverse=True)[:n]

    def sla_sender(self, peer: Peer) -> Sender:
        self._enter("sla_sender")
        sender = SenderResolver().resolve(peer)  # the real /proc
        self.sla_board.admit(sender)
        return sender

    def report_sla(self, report: SlaReport, sender: Sender = ADMIN) -> int:
        self._enter("report_sla")
        assert isinstance(report, SlaReport), type(report)  # the validated model, not a dict
        self.sla_reports.append(report)
        return self.sla_board.report(report, sender)

    def sla(self) -> dict[str, Any]:
        self._enter("sla")
        return self.sla_board.view()

    def cluster_sla(self, nodes: bool = True) -> dict[str, Any]:
        """The global SLA view (GET /v1/cluster/sla) of a mesh of this node
        alone, from its real board through a real qosd.mesh.slaview.core."""
        self._enter("cluster_sla")
        from qosd.mesh.slaview.core import SlaView

        view, now = SlaView("node-a"), time.time()
        view.local_windows(self.sla_board.view(now), 0.0, wall=now, members=1)
        return view.snapshot(0.0, nodes=nodes)

    def cluster_rollout(self) -> Any:
        """The rollout provider (PUT /v1/cluster/policy, GET /v1/cluster/rollout)
        of a mesh of this node alone: a real qosd.mesh.rollout.core core over a
        real membership core; its realisations succeed without touching the
        store (only PUT /v1/policy and rollback move the node's version here)."""
        self._enter("cluster_rollout")
        provider = getattr(self, "_rollout", None)
        if provider is None:
            import random
            import threading

            from qosd.mesh.membership.core import Config, Membership
            from qosd.mesh.rollout.core import Realise, Rollout
            from qosd.mesh.rollout.provider import RolloutProvider, locked

            core = Rollout(Membership(Config(), "node-a", "127.0.0.1:7946", random.Random(0)),
                           random.Random(0))

            def host(actions: list[Any]) -> None:
                for a in actions:
                    if isinstance(a, Realise):
                        host(core.on_realised(a.version, True, "", time.monotonic()))

            provider = self._rollout = RolloutProvider(core, locked(threading.Lock()), host)
        return provider

    def healthy(self) -> bool:
        self._enter("healthy")
        return True

    def ready(self) -> bool:
        self._enter("ready")
        return self.store.current() is not None


def as_service(obj: Service) -> Service:  # mypy: StoreService fits the protocol
    return obj


def with_peer(app: Any, pid: int | None = None, uid: int | None = None,
              gid: int | None = None) -> Any:
    """``app`` seen through a transport that read these SO_PEERCRED
    credentials (default: this process's): what qosd's unix-socket server puts
    in every request's scope (qosd/identity.py)."""
    import os

    peer = {"pid": os.getpid() if pid is None else pid, "uid": os.getuid() if uid is None else uid,
            "gid": os.getgid() if gid is None else gid}

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}),
                                             "mmmesh.peer": dict(peer)}}
        await app(scope, receive, send)

    return wrapped


def put(client: TestClient, text: str, base: int | None = None, **kw: Any) -> httpx.Response:
    r: httpx.Response = client.put("/v1/policy",
                                   json={"yaml": text, "base_version": base, **kw})
    return r
