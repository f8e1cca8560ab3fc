"""The core's messages (qosd.mesh.membership.core) to and from the bytes of
proto/qosd/mesh/protocol/peer.proto.

Each core dataclass maps to the proto message of the same name, field for
field (``AppBroadcast`` is the ``app`` case of ``Message.kind``); the table
:data:`_KINDS` is the one list of that mapping.  ``decode`` never trusts its
input: a message case it does not know (a newer peer) is skipped, and so is a
member row with an unknown state; bytes that do not parse raise
:class:`DecodeError`.  The decoded ``Packet.size`` is the real length of the
bytes, so the core's byte counters count what crossed the wire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from google.protobuf.message import DecodeError as _ProtoDecodeError

import qosd.mesh.membership.core as mc
from qosd.mesh.membership.core import MemberRow, Message, Packet, PushPull, State
from qosd.mesh.protocol import peer_pb2

__all__ = ["DecodeError", "decode", "decode_app_state", "encode", "encode_app_state"]

# core class -> its case in peer_pb2.Message.kind
_KINDS: dict[type[Message], str] = {
    mc.Ping: "ping", mc.Ack: "ack", mc.Nack: "nack", mc.PingReq: "ping_req", mc.Alive: "alive",
    mc.Suspect: "suspect", mc.Dead: "dead", mc.Leave: "leave", mc.AppBroadcast: "app",
    PushPull: "push_pull",
}
_CLASSES = {kind: cls for cls, kind in _KINDS.items()}
# the proto fields of each flat message: the dataclass fields but ``wire``
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls) if f.name != "wire")
           for cls in _KINDS if cls is not PushPull}
_STATES = frozenset(int(s) for s in State)


class DecodeError(ValueError):
    """Bytes that are not a ``mmmesh.peer.v1.Packet``."""


def encode(packet: Packet) -> bytes:
    """``packet`` as the bytes of a ``mmmesh.peer.v1.Packet``."""
    out = peer_pb2.Packet(sender=packet.sender, sender_addr=packet.sender_addr)
    for msg in packet.msgs:
        env = out.msgs.add()
        sub = getattr(env, _KINDS[type(msg)])
        sub.SetInParent()  # a message at its defaults (Ack seq 0) still counts
        if isinstance(msg, PushPull):
            sub.join, sub.reply, sub.app_state = msg.join, msg.reply, msg.app_state
            for row in msg.rows:
                sub.rows.add(node=row.node, addr=row.addr, incarnation=row.incarnation,
                             state=int(row.state))
        else:
            for name in _FIELDS[type(msg)]:
                setattr(sub, name, getattr(msg, name))
    return out.SerializeToString()


def _push_pull(sub: peer_pb2.PushPull) -> PushPull:
    rows = tuple(MemberRow(r.node, r.addr, r.incarnation, State(r.state))
                 for r in sub.rows if r.state in _STATES)
    return PushPull(sub.join, sub.reply, rows, sub.app_state)


def decode(data: bytes) -> Packet:
    """The core ``Packet`` in ``data`` (raises :class:`DecodeError`)."""
    try:
        pb = peer_pb2.Packet.FromString(data)
    except (_ProtoDecodeError, ValueError) as e:
        raise DecodeError(f"not a mmmesh.peer.v1.Packet: {e}") from e
    msgs: list[Message] = []
    for env in pb.msgs:
        kind = env.WhichOneof("kind")
        if kind is None:
            continue  # a case this version does not know
        sub = getattr(env, kind)
        cls = _CLASSES[kind]
        if cls is PushPull:
            msgs.append(_push_pull(sub))
        else:
            msgs.append(cls(*(getattr(sub, name) for name in _FIELDS[cls])))
    return Packet(pb.sender, pb.sender_addr, tuple(msgs), len(data))


def encode_app_state(parts: Mapping[str, bytes]) -> bytes:
    """The application state parts as the bytes of a ``mmmesh.peer.v1.AppState``
    (empty when there is none, so a push-pull without state carries nothing)."""
    if not parts:
        return b""
    return peer_pb2.AppState(parts=dict(parts)).SerializeToString(deterministic=True)


def decode_app_state(data: bytes) -> dict[str, bytes]:
    """The parts of an encoded ``AppState`` (raises :class:`DecodeError`)."""
    try:
        return dict(peer_pb2.AppState.FromString(data).parts)
    except (_ProtoDecodeError, ValueError) as e:
        raise DecodeError(f"not a mmmesh.peer.v1.AppState: {e}") from e
