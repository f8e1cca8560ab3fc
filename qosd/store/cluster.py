"""The cluster store of qosd: one interface, two back ends (docs/cluster.md,
"Choosing a back end").

    _base.py         ClusterStore: what the service and the API use
    _gossip.py       GossipStore: the peers, the rollout host, the SLA view (qosd/mesh/membership,
                     qosd/mesh/rollout/host.py, qosd/mesh/slaview/host.py)
    _etcd.py         EtcdStore: an EtcdNode bound to the service
    _etcd_node.py    EtcdNode: lease, list + watch, realise, report, SLA, propose (CAS)
    _etcd_mirror.py  Mirror: what a node holds of etcd (sans-I/O)
    _etcd_keys.py    the keys under the prefix and their values (the gossip codecs)
    _realise.py      realise(): localise, check, apply a mesh version (both back ends)
    _metrics.py      StoreCollector (mmmesh_cluster_store_*)

:func:`start_cluster_store` is what the daemon calls.
"""

from __future__ import annotations

import logging
from typing import Any

from qosd.metrics.store import StoreCollector
from qosd.store.base import ClusterStore
from qosd.store.etcd.node import EtcdNode, StoreUnavailable
from qosd.store.etcd.store import EtcdStore
from qosd.store.gossip import GossipStore

__all__ = ["ClusterStore", "EtcdNode", "EtcdStore", "GossipStore", "StoreCollector",
           "StoreUnavailable", "start_cluster_store"]

log = logging.getLogger("qosd.store.cluster")


async def start_cluster_store(cfg: Any, service: Any, registry: Any) -> ClusterStore | None:
    """The back end ``cfg`` names, started and put on ``service.cluster_store``
    (its collector in ``registry``); None when this node runs alone (gossip
    without a ``peers:`` section).  The etcd back end starts whether or not
    etcd answers (qosd keeps its last good policy meanwhile)."""
    backend = cfg.cluster.backend if cfg.cluster is not None else "gossip"
    store: ClusterStore
    if backend == "etcd":
        store = EtcdStore(cfg, service)
        log.info("cluster store: etcd at %s, prefix %s", ", ".join(cfg.cluster.etcd.endpoints),
                 cfg.cluster.etcd.prefix)
    else:
        from qosd.mesh.membership.peers import (
            start_peers,  # the mesh (gRPC): exits 2 on an unusable peers: section
        )

        peers = await start_peers(cfg, service, registry)  # None without a peers: section
        if peers is None:
            return None
        store = GossipStore(peers, service)
    service.cluster_store = store
    await store.start()
    if registry is not None:
        registry.register(StoreCollector(store))
    return store
