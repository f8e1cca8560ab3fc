"""qosd.mesh.membership.core: the mesh's membership and gossip, as sans-I/O cores.

``Membership`` is one member of a SWIM + Lifeguard cluster (memberlist's
protocol and LAN defaults) with a generic piggyback broadcast layer.  It owns
no sockets, threads, clocks or randomness: the host passes ``now`` and a
``random.Random``, calls ``tick`` / ``handle`` / ``join`` / ``leave``, sends the
``Send`` objects they return and reads ``events()``.  The same core runs over
gRPC in qosd, in ``bench/cluster.py`` on a virtual clock and in the tests.
``docs/cluster.md`` describes the protocol.

Public names::

    core        Membership, Config, ClusterError
    messages    Packet, Send, Ping, Ack, Nack, PingReq, Alive, Suspect, Dead,
                Leave, AppBroadcast, PushPull, MemberRow, Message, State
    events      Event, MemberChanged, AppMessage, AppStateReceived, Joined
    snapshots   MemberInfo, Stats
    units       Suspicion, suspicion_timeout, Awareness, BroadcastQueue,
                overrides, precedence
"""

from __future__ import annotations

from ._awareness import Awareness
from ._config import ClusterError, Config
from ._dissemination import BroadcastQueue
from ._events import (
    AppMessage,
    AppStateReceived,
    Event,
    Joined,
    MemberChanged,
    MemberInfo,
    Stats,
)
from ._membership import Membership
from ._messages import (
    Ack,
    Alive,
    AppBroadcast,
    Dead,
    Leave,
    MemberRow,
    Message,
    Nack,
    Packet,
    Ping,
    PingReq,
    PushPull,
    Send,
    State,
    Suspect,
)
from ._rules import overrides, precedence
from ._suspicion import Suspicion, suspicion_timeout

__all__ = [
    "Ack",
    "Alive",
    "AppBroadcast",
    "AppMessage",
    "AppStateReceived",
    "Awareness",
    "BroadcastQueue",
    "ClusterError",
    "Config",
    "Dead",
    "Event",
    "Joined",
    "Leave",
    "MemberChanged",
    "MemberInfo",
    "MemberRow",
    "Membership",
    "Message",
    "Nack",
    "Packet",
    "Ping",
    "PingReq",
    "PushPull",
    "Send",
    "State",
    "Stats",
    "Suspect",
    "Suspicion",
    "overrides",
    "precedence",
    "suspicion_timeout",
]
