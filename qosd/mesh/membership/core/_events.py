"""What the core tells its host: events, member snapshots and counters."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ._messages import State


@dataclass(frozen=True, slots=True)
class MemberChanged:
    """A member was seen for the first time (``previous`` None) or changed
    state: suspect, dead, left, or alive again."""

    node: str
    addr: str
    state: State
    incarnation: int
    previous: State | None


@dataclass(frozen=True, slots=True)
class AppMessage:
    """An application broadcast newer than any seen before for (origin, key)."""

    origin: str
    key: str
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class AppStateReceived:
    """Application state a peer attached to a push-pull exchange."""

    peer: str
    data: bytes
    join: bool


@dataclass(frozen=True, slots=True)
class Joined:
    """A seed answered our join: ``members`` are now known (this one included)."""

    peer: str
    members: int


Event = MemberChanged | AppMessage | AppStateReceived | Joined


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """A snapshot of one member as this one sees it.  ``last_ack`` and ``rtt_s``
    come from this member's own probes (None before the first direct ack);
    ``rtt_s`` is smoothed like TCP's SRTT (7/8 old + 1/8 new)."""

    node: str
    addr: str
    state: State
    incarnation: int
    since: float
    last_ack: float | None
    rtt_s: float | None


@dataclass
class Stats:
    """Counters since start (for metrics; never reset by the core)."""

    probes: int = 0
    probe_failures: int = 0
    indirect_probes: int = 0
    nacks_received: int = 0
    suspicions: int = 0
    """Suspicions this member started holding (first heard or raised)."""
    confirmations: int = 0
    refutations: int = 0
    deaths_declared: int = 0
    """Members this member's own suspicion timer declared dead."""
    push_pulls: int = 0
    reconnects: int = 0
    conflicts: int = 0
    """Alive updates that named another address for a live member (ignored)."""
    packets_sent: int = 0
    bytes_sent: int = 0
    packets_received: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
