"""qosd's peers: this node as a member of the mesh, over gRPC with mutual TLS.

The membership protocol is ``qosd.mesh.membership.core`` (a sans-I/O SWIM + Lifeguard
core); this package is its host in qosd (docs/cluster.md, "Transport")::

    _host.py       Peers: drives the core on the event loop, seeds (DNS), leave,
                   the applications' hooks (broadcast, push-pull sections, fetch)
    _transport.py  the gRPC server (authenticate, limit, decode) and channel pool
    _identity.py   node ids bound to certificates; credentials; seed identification
    _wire.py       core messages <-> proto/qosd/mesh/protocol/peer.proto bytes
    _limits.py     per-peer token buckets
    _rtt.py        probe round-trip histogram
    _metrics.py    the Prometheus collector

:func:`start_peers` is what the daemon calls.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qosd.metrics.peers import PeersCollector

from ._host import Peers, Section, resolve
from ._identity import PeersError, node_of_uri, spiffe_id, valid_node_id

__all__ = ["Peers", "PeersCollector", "PeersError", "Section", "node_of_uri", "resolve",
           "spiffe_id", "start_peers", "valid_node_id"]

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from qosd.config import QosdConfig

log = logging.getLogger("qosd.mesh.membership.peers")


async def start_peers(cfg: QosdConfig, registry: CollectorRegistry | None) -> Peers | None:
    """Starts the peers of ``cfg.peers`` (None without that section) and puts
    their collector in ``registry``; the caller hands them to whoever needs
    them (qosd/store/cluster.py: the gossip back end, the API's
    /v1/cluster/members).  A configuration that cannot work stops qosd (exit 2)."""
    if cfg.peers is None:
        return None
    try:
        peers = Peers(cfg.peers, cfg.node_name)
        await peers.start()
    except (PeersError, OSError) as e:
        log.error("%s", e)
        raise SystemExit(2) from e
    if registry is not None:
        registry.register(PeersCollector(peers))
    return peers
