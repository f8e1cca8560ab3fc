"""The protocol's messages: plain frozen dataclasses, with a size estimate.

The core never encodes bytes; a host (gRPC, the simulator) carries these
objects.  Each message has ``body_size()``, the length its protobuf encoding
would have (proto3: a field at its default value costs nothing, a string or
bytes field costs tag + length varint + bytes, an integer tag + varint), and
``wire``, computed once at construction: the bytes it adds to a ``Packet``
(body plus the framing of one entry of the repeated ``oneof`` envelope; for a
``MemberRow``, of one entry of ``PushPull.rows``).  ``wire`` is not part of
equality and need not be passed.  The estimates are deterministic; they drive
the gossip byte budget and the bandwidth figures of ``bench/cluster.py``.

Every message travels inside a ``Packet`` naming its sender (node id and
advertised address): replies go to ``sender_addr``, never to a transport's
source port, and a host with mTLS checks ``sender`` against the peer's
certificate before ``Membership.handle``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class State(IntEnum):
    """A member's state.  The value is its rank in the update order
    (``_rules.precedence``): at one incarnation, later states win."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


def varint_len(v: int) -> int:
    """Bytes of ``v`` as a protobuf varint (v >= 0)."""
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


def _str(s: str) -> int:
    if not s:
        return 0
    n = len(s) if s.isascii() else len(s.encode())
    return 1 + varint_len(n) + n


def _bytes(b: bytes) -> int:
    return 1 + varint_len(len(b)) + len(b) if b else 0


def _int(v: int) -> int:
    return 1 + varint_len(v) if v else 0


def _sub(n: int) -> int:
    """An embedded message of n bytes as a field: tag + length + body."""
    return 1 + varint_len(n) + n


def framed_size(body: int) -> int:
    """Bytes a message whose body is ``body`` bytes adds to a ``Packet``: the
    oneof field inside the envelope, the envelope inside ``Packet.msgs``."""
    env = 1 + varint_len(body) + body
    return 1 + varint_len(env) + env


@dataclass(frozen=True, slots=True)
class _Sized:
    """Base of the messages: ``wire`` is filled in from ``body_size``."""

    wire: int = field(default=0, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if not self.wire:
            object.__setattr__(self, "wire", self._frame(self.body_size()))

    def body_size(self) -> int:
        raise NotImplementedError

    @staticmethod
    def _frame(body: int) -> int:
        return framed_size(body)


@dataclass(frozen=True, slots=True)
class Ping(_Sized):
    """Are you alive?  ``target`` is the node id the prober means (a ping for
    another id, e.g. after an address moved, is not answered)."""

    seq: int
    target: str

    def body_size(self) -> int:
        return _int(self.seq) + _str(self.target)


@dataclass(frozen=True, slots=True)
class Ack(_Sized):
    """Answer to a ``Ping`` (or relayed answer to a ``PingReq``) with its seq."""

    seq: int

    def body_size(self) -> int:
        return _int(self.seq)


@dataclass(frozen=True, slots=True)
class Nack(_Sized):
    """A relay of a ``PingReq`` (with ``nack=True``) heard nothing from the target."""

    seq: int

    def body_size(self) -> int:
        return _int(self.seq)


@dataclass(frozen=True, slots=True)
class PingReq(_Sized):
    """Ping ``target`` at ``target_addr`` for me and relay its ack under ``seq``."""

    seq: int
    target: str
    target_addr: str
    nack: bool = True

    def body_size(self) -> int:
        return _int(self.seq) + _str(self.target) + _str(self.target_addr) + 2 * self.nack


@dataclass(frozen=True, slots=True)
class Alive(_Sized):
    """``node`` is alive at ``addr`` with ``incarnation``."""

    node: str
    addr: str
    incarnation: int

    def body_size(self) -> int:
        return _str(self.node) + _str(self.addr) + _int(self.incarnation)


@dataclass(frozen=True, slots=True)
class _Accusation(_Sized):
    node: str
    incarnation: int
    accuser: str

    def body_size(self) -> int:
        return _str(self.node) + _int(self.incarnation) + _str(self.accuser)


@dataclass(frozen=True, slots=True)
class Suspect(_Accusation):
    """``accuser`` could not reach ``node`` (at ``incarnation``)."""


@dataclass(frozen=True, slots=True)
class Dead(_Accusation):
    """``accuser``'s suspicion timer for ``node`` ran out."""


@dataclass(frozen=True, slots=True)
class Leave(_Sized):
    """``node`` leaves on purpose (sent by itself; not a failure)."""

    node: str
    incarnation: int

    def body_size(self) -> int:
        return _str(self.node) + _int(self.incarnation)


@dataclass(frozen=True, slots=True)
class AppBroadcast(_Sized):
    """An application payload gossiped to every member.  Per (origin, key) a
    higher ``seq`` replaces a lower one."""

    origin: str
    key: str
    seq: int
    payload: bytes

    def body_size(self) -> int:
        return _str(self.origin) + _str(self.key) + _int(self.seq) + _bytes(self.payload)


@dataclass(frozen=True, slots=True)
class MemberRow(_Sized):
    """One member in a push-pull state exchange."""

    node: str
    addr: str
    incarnation: int
    state: State

    def body_size(self) -> int:
        return _str(self.node) + _str(self.addr) + _int(self.incarnation) + _int(self.state)

    @staticmethod
    def _frame(body: int) -> int:
        return _sub(body)


@dataclass(frozen=True, slots=True)
class PushPull(_Sized):
    """A full state exchange.  ``reply`` is False on the request, True on the
    answer; ``join`` marks the exchange of a joining member."""

    join: bool
    reply: bool
    rows: tuple[MemberRow, ...]
    app_state: bytes = b""

    def body_size(self) -> int:
        rows = sum(r.wire for r in self.rows)
        return 2 * self.join + 2 * self.reply + rows + _bytes(self.app_state)


Message = Ping | Ack | Nack | PingReq | Alive | Suspect | Dead | Leave | AppBroadcast | PushPull
Update = Alive | Suspect | Dead | Leave


def packet_header_size(sender: str, sender_addr: str) -> int:
    """Bytes of a ``Packet`` without its messages."""
    return _str(sender) + _str(sender_addr)


@dataclass(frozen=True, slots=True)
class Packet:
    """One message on the wire: a primary message and piggybacked gossip.

    ``size`` is the estimated encoded size; the core fills it in (computed here
    when left at 0)."""

    sender: str
    sender_addr: str
    msgs: tuple[Message, ...]
    size: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.size == 0:
            total = packet_header_size(self.sender, self.sender_addr)
            total += sum(m.wire for m in self.msgs)
            object.__setattr__(self, "size", total)


@dataclass(frozen=True, slots=True)
class Send:
    """Deliver ``packet`` to ``to`` (an address).  ``node`` is the node id the
    core expects there ("" for a seed address it has not met yet): a host with
    mTLS checks the peer's certificate against it."""

    to: str
    node: str
    packet: Packet
