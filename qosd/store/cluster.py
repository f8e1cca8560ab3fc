"""The cluster store of qosd: one interface, two back ends (docs/cluster.md,
"Choosing a back end").

    base.py          ClusterStore: what the API's facade and the SLA controller use
    gossip.py        GossipStore: the peers, the rollout host, the SLA view (qosd/mesh/membership,
                     qosd/mesh/rollout/host.py, qosd/mesh/slaview/host.py)
    etcd/store.py    EtcdStore: an EtcdNode bound to the node's parts
    etcd/node.py     EtcdNode: lease, list + watch, realise, report, SLA, propose (CAS)
    etcd/mirror.py   Mirror: what a node holds of etcd (sans-I/O)
    etcd/keys.py     the keys under the prefix and their values (the gossip codecs)
    qosd/metrics/store.py  StoreCollector (mmmesh_cluster_store_*)

Both back ends realise a mesh version through qosd/mesh/rollout/realise.py
(localise, check, apply on the node's applier).

:func:`start_cluster_store` is what the daemon calls: it builds the back end
qosd.yaml names from the node's parts it is handed, and starts it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qosd.config import QosdConfig
from qosd.metrics.store import StoreCollector
from qosd.model import BoardView, PolicySource, p99_targets
from qosd.store.base import ClusterStore
from qosd.store.etcd.node import EtcdNode, StoreUnavailable
from qosd.store.etcd.store import EtcdStore
from qosd.store.gossip import GossipStore

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from qosd.mesh.membership.peers import Peers
    from qosd.mesh.rollout.host import ClusterRollout
    from qosd.mesh.rollout.realise import MeshApplier
    from qosd.mesh.slaview.host import ClusterSla

__all__ = ["Cluster", "ClusterStore", "EtcdNode", "EtcdStore", "GossipStore", "StoreCollector",
           "StoreUnavailable", "start_cluster_store"]

log = logging.getLogger("qosd.store.cluster")


@dataclass(frozen=True)
class Cluster:
    """What :func:`start_cluster_store` started: the store, and with the gossip
    back end the parts behind it that the API and the metrics read."""

    store: ClusterStore
    peers: Peers | None = None  # GET /v1/cluster/members; the peers' collector is registered
    rollout_app: ClusterRollout | None = None  # mmmesh_rollout_* (ClusterAppsCollector)
    sla_app: ClusterSla | None = None  # mmmesh_cluster_sla_* (ClusterAppsCollector)


def policy_classes(source: PolicySource) -> list[str]:
    """The class names of ``source``'s current policy: the SLA view's trees a
    node takes part in from the start (no class: none before a policy)."""
    cur = source.current()
    return [c.name for c in cur.policy.classes] if cur is not None else []


async def start_cluster_store(cfg: QosdConfig, *, applier: MeshApplier, policy: PolicySource,
                              board: BoardView, registry: CollectorRegistry | None = None,
                              ) -> Cluster | None:
    """The back end ``cfg`` names, built and started (its collector in
    ``registry``); None when this node runs alone (gossip without a
    ``peers:`` section).  Mesh versions are applied through ``applier``;
    ``policy`` is what the node runs; ``board`` the windows it publishes.
    The etcd back end starts whether or not etcd answers (qosd keeps its last
    good policy meanwhile)."""
    backend = cfg.cluster.backend if cfg.cluster is not None else "gossip"
    cluster: Cluster
    if backend == "etcd":
        cluster = Cluster(EtcdStore(cfg, applier=applier, policy=policy, board=board))
        etcd = cfg.cluster.etcd if cfg.cluster is not None else None
        if etcd is not None:
            log.info("cluster store: etcd at %s, prefix %s", ", ".join(etcd.endpoints),
                     etcd.prefix)
    else:
        from qosd.mesh.membership.peers import (
            start_peers,  # the mesh (gRPC): exits 2 on an unusable peers: section
        )
        from qosd.mesh.rollout.host import ClusterRollout  # mesh-wide policy (section "rollout")
        from qosd.mesh.rollout.realise import link_override
        from qosd.mesh.slaview.host import ClusterSla  # the global SLA view (section "sla")

        peers = await start_peers(cfg, registry)  # None without a peers: section
        if peers is None:
            return None
        sla_app = ClusterSla(peers, board, lambda: p99_targets(policy),
                             lambda: policy_classes(policy))
        rollout_app = ClusterRollout(peers, applier, policy, link_override(cfg))
        cluster = Cluster(GossipStore(peers, rollout_app, sla_app), peers, rollout_app, sla_app)
    await cluster.store.start()
    if registry is not None:
        registry.register(StoreCollector(cluster.store))
    return cluster
