"""The etcd back end in qosd: an :class:`EtcdNode` bound to the node's parts.

The node realises versions through :func:`qosd.mesh.rollout.realise.realise`
(the gossip host's path) on the applier it is given, reads what it runs from
the policy source (the node's store), publishes the SLA board's windows and
answers the API from its mirror.  API calls come from worker threads and hop
onto qosd's loop (:meth:`EtcdNode.call`).
"""

from __future__ import annotations

import time
from typing import Any

from mmmesh.policy import parse_policy
from qosd.config import QosdConfig
from qosd.mesh.rollout.core import NO_VERSION, MeshVersion, parse_base
from qosd.mesh.rollout.realise import MeshApplier, applied_version, link_override, realise
from qosd.model import BoardView, PolicySource, p99_targets
from qosd.store.etcd.client import EtcdClient, EtcdConfig
from qosd.store.etcd.keys import Layout
from qosd.store.etcd.node import EtcdNode

__all__ = ["EtcdStore"]


class EtcdRollout:
    """``propose`` / ``table`` in the API's JSON shapes (RolloutProviderLike)."""

    def __init__(self, node: EtcdNode) -> None:
        self.node = node

    def propose(self, text: str, base_version: str | None = None,
                author: str | None = None) -> dict[str, Any]:
        canonical = parse_policy(text, source="mesh policy").to_yaml()
        base = parse_base(base_version)
        t = self.node.call(lambda: self.node.propose(canonical, base, author))
        return t.as_dict()

    def table(self, version: str | None = None) -> dict[str, Any] | None:
        wanted = None if version is None else parse_base(version)
        t = self.node.call(lambda: self.node.table(None if wanted == NO_VERSION else wanted))
        return None if t.version is None else t.as_dict()


class EtcdStore:
    backend = "etcd"

    def __init__(self, cfg: QosdConfig, *, applier: MeshApplier, policy: PolicySource,
                 board: BoardView) -> None:
        """``cfg.cluster.etcd`` says where; mesh versions are applied through
        ``applier``, ``policy`` is what the node runs, ``board`` the windows
        it publishes."""
        if cfg.cluster is None or cfg.cluster.etcd is None:
            raise ValueError("the etcd back end needs qosd.yaml cluster.etcd")
        e = cfg.cluster.etcd
        client = EtcdClient(EtcdConfig(tuple(e.endpoints), e.ca_file, e.cert_file, e.key_file,
                                       e.server_name, e.timeout_s))
        link = link_override(cfg)
        self.policy = policy
        self.node = EtcdNode(
            cfg.node_name, client, Layout(e.prefix),
            realiser=lambda v, text, author: realise(applier, link, v, text, author),
            applied=lambda: applied_version(policy), lease_ttl_s=e.lease_ttl_s,
            sla_source=board.view, sla_period_s=e.sla_period_s,
            addr=e.advertise or "")
        self.provider = EtcdRollout(self.node)

    async def start(self) -> None:
        await self.node.start()

    async def stop(self) -> None:
        await self.node.stop(leave=True)

    def rollout(self) -> EtcdRollout:
        return self.provider

    def sla(self, nodes: bool) -> dict[str, Any] | None:
        targets = p99_targets(self.policy)

        async def take() -> dict[str, Any]:
            return self.node.sla_snapshot(targets, nodes)

        return self.node.call(take)

    def sla_breakdown(self, node: str | None) -> dict[str, Any] | None:
        async def take() -> dict[str, Any]:
            return await self.node.sla_breakdown(node)

        return self.node.call(take)

    def members(self) -> dict[str, Any]:
        async def take() -> dict[str, Any]:
            n = self.node
            now, wall = time.monotonic(), time.time()
            rows = [{"node": m.node, "addr": m.addr, "state": m.state.name.lower(),
                     "incarnation": m.incarnation, "since_s": round(now - m.since, 3),
                     "last_ack_s": None, "rtt_s": None}
                    for m in n.mirror.member_infos(now, wall)]
            me = n.mirror.members.get(n.node_id)
            return {"node": n.node_id, "addr": n.addr,
                    "incarnation": me.create_revision if me else 0,
                    "health_score": 0 if n.up else 7, "members": rows,
                    "stats": dict(sorted(n.counters.items())),
                    "traffic": {"requests": dict(n.client.requests),
                                "failures": dict(n.client.failures)},
                    "backend": self.backend, "store": self.status()}

        return self.node.call(take)

    def mesh_desired(self) -> MeshVersion | None:
        d = self.node.mirror.desired
        return d.ann.version if d is not None else None

    def suspect_share(self) -> float:
        return 0.0  # a member is alive (its lease) or gone: none is suspected

    def status(self) -> dict[str, Any]:
        n = self.node
        d = n.mirror.desired
        return {"backend": self.backend, "up": n.up, "since": n.since,
                "last_error": n.last_error or None, "revision": n.mirror.revision,
                "lease": f"{n.lease:x}" if n.lease else None,
                "members": len(n.mirror.members),
                "desired": str(d.ann.version) if d else None,
                "applied": str(v) if (v := applied_version(self.policy)) else None}

    def counters(self) -> dict[str, dict[str, int]]:
        n = self.node
        return {"operations": dict(n.counters), "requests": dict(n.client.requests),
                "failures": dict(n.client.failures)}
