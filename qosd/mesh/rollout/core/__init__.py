"""Mesh-wide policy rollout, as a sans-I/O state machine over the membership core.

Every node runs one :class:`Rollout` next to its ``Membership``.  An operator
proposes a policy on any node; the node gives it the next mesh version
``(counter, origin)`` (:class:`MeshVersion`: above every version it has
seen; the same order on every node), and gossips an announcement (version,
sha256, size, author: ~150 bytes) under the key ``policy``.  A node that
learns a desired version above its own gets the text (from the push-pull
state when it is small, else by asking a node that has it: :class:`Fetch`),
asks its host to realise it on its own link (:class:`Realise`; the policy's
``link`` replaced by the node's own, :func:`localise_policy`), and gossips
its ACK or NACK (key ``ack/<node>``; also sent straight to the origin,
:class:`SendReport`).  A NACK keeps that node on its previous version until
a newer version comes (xDS); the rollout table (:meth:`Rollout.table`) is
derived from the latest report of every member.  Push-pull carries the
desired version, its text (when small) and every node's latest report, so a
joining or returning node catches up in its join.

The core is level-triggered: after every input it compares desired and
applied and asks for what is missing (a text, a realisation, a report),
whatever woke it.  It owns no sockets, clocks, threads or randomness: the
host passes ``now`` and a ``random.Random``, carries out the actions
returned, and serialises calls with the ones it makes to its ``Membership``
(one lock or one task for both).  Peer input never raises; it is counted in
``stats.dropped`` when thrown away.  docs/cluster.md ("Policy rollout")
describes the protocol, the host API and the guarantees.

The modules, one role each::

    _rollout_types.py     versions, announcements, reports, actions, table, config, stats
    _rollout_codec.py     the payloads (JSON), read strictly
    _rollout_core.py      Rollout: the state machine
    _rollout_fetch.py     Fetcher: whom to ask for a text, and when
    _rollout_table.py     the table, derived from reports and membership
    _rollout_link.py      LinkOverride, localise_policy: one policy, each node's link
    _rollout_sim.py       RolloutSimulation: the cores on the virtual clock, hosts faked
"""

from __future__ import annotations

from qosd.mesh.rollout.core._core import Rollout
from qosd.mesh.rollout.core._link import LinkOverride, localise_policy
from qosd.mesh.rollout.core._table import build_table
from qosd.mesh.rollout.core._types import (
    ACK_PREFIX,
    NO_VERSION,
    POLICY_KEY,
    STATES,
    Action,
    Announcement,
    Fetch,
    Gossip,
    MeshVersion,
    NotSynced,
    Realise,
    Report,
    RolloutConfig,
    RolloutConflict,
    RolloutStats,
    RolloutTable,
    Row,
    SendReport,
    parse_base,
)

__all__ = [
    "ACK_PREFIX",
    "NO_VERSION",
    "POLICY_KEY",
    "STATES",
    "Action",
    "Announcement",
    "Fetch",
    "Gossip",
    "LinkOverride",
    "MeshVersion",
    "NotSynced",
    "Realise",
    "Report",
    "Rollout",
    "RolloutConfig",
    "RolloutConflict",
    "RolloutStats",
    "RolloutTable",
    "Row",
    "SendReport",
    "build_table",
    "localise_policy",
    "parse_base",
]
