"""proto/mmmesh/v1: the generated code is fresh, and the core's messages map
onto it exactly (values and sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import qosd.mesh.membership.core as mc
from qosd.mesh.membership._wire import (
    _KINDS,
    DecodeError,
    decode,
    decode_app_state,
    encode,
    encode_app_state,
)
from qosd.mesh.membership.core import MemberRow, Message, Packet, PushPull, State
from qosd.mesh.protocol import peer_pb2

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """scripts/gen_proto.py into a temporary directory gives the checked-in bytes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert gen_proto.stale() == [], "qosd/mesh/protocol is stale: run scripts/gen_proto.py"
    written = gen_proto.generate(tmp_path)
    assert sorted(p.name for p in written) == [
        "__init__.py", "peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py"]
    # the one command, as documented
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_every_core_message_has_its_case() -> None:
    cases = {f.name for f in peer_pb2.Message.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert set(_KINDS.values()) == cases
    assert set(_KINDS) == set(Message.__args__)  # type: ignore[attr-defined]
    names = {m.name for m in peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods}
    assert names == {"Gossip", "PushPull", "Fetch"}
    # the states' numbers are the core's ranks
    assert {s.name: int(s) for s in State} == {
        v.name.removeprefix("MEMBER_STATE_"): v.number
        for v in peer_pb2.MemberState.DESCRIPTOR.values}


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
ints = st.integers(0, 2**64 - 1)
rows = st.builds(MemberRow, names, names, ints, st.sampled_from(list(State)))
messages = st.one_of(
    st.builds(mc.Ping, ints, names), st.builds(mc.Ack, ints), st.builds(mc.Nack, ints),
    st.builds(mc.PingReq, ints, names, names, st.booleans()),
    st.builds(mc.Alive, names, names, ints), st.builds(mc.Suspect, names, ints, names),
    st.builds(mc.Dead, names, ints, names), st.builds(mc.Leave, names, ints),
    st.builds(mc.AppBroadcast, names, names, ints, st.binary(max_size=300)),
    st.builds(PushPull, st.booleans(), st.booleans(), st.lists(rows, max_size=20).map(tuple),
              st.binary(max_size=300)),
)


@settings(max_examples=300, deadline=None)
@given(names, names, st.lists(messages, max_size=12).map(tuple))
def test_round_trip_and_the_size_estimate_is_exact(sender: str, addr: str,
                                                   msgs: tuple[Message, ...]) -> None:
    """decode(encode(p)) == p, and the core's estimate (``Packet.size``, the sum of
    ``.wire``) is the encoded length to the byte, for every message kind: the
    gossip budget of 1400 bytes is 1400 bytes on the wire."""
    packet = Packet(sender, addr, msgs)
    data = encode(packet)
    assert len(data) == packet.size
    back = decode(data)
    assert (back.sender, back.sender_addr, back.msgs) == (sender, addr, msgs)
    assert back.size == len(data)


def test_a_full_gossip_packet_and_a_1000_member_push_pull() -> None:
    gossip = Packet("node-1", "10.0.0.1:7946", tuple(
        mc.Alive(f"node-{i}", f"10.0.{i // 250}.{i % 250}:7946", i) for i in range(30)))
    assert len(encode(gossip)) == gossip.size < 1400
    pp = Packet("node-1", "10.0.0.1:7946", (PushPull(True, False, tuple(
        MemberRow(f"node-{i}", f"10.{i // 250}.{i % 250}.1:7946", 3, State.ALIVE)
        for i in range(1000)), b"s" * 20000),))
    assert len(encode(pp)) == pp.size
    assert 30_000 < pp.size - 20_000 < 40_000  # ~30-35 bytes per member (docs/cluster.md)


def test_decode_refuses_garbage_and_skips_what_it_does_not_know() -> None:
    for bad in (b"\xff\xff\xff", b"\x1a\x05\x0a\x03\x08"):
        try:
            decode(bad)
        except DecodeError:
            continue
        raise AssertionError(f"{bad!r} decoded")
    # an unknown message case (field 99 of Message) and an unknown member state
    pb = peer_pb2.Packet(sender="a", sender_addr="x:1")
    env = pb.msgs.add()
    env.push_pull.rows.add(node="b", addr="y:1", incarnation=1, state=7)
    env.push_pull.rows.add(node="c", addr="z:1", incarnation=1, state=1)
    data = pb.SerializeToString() + b"\x1a\x03\x9a\x06\x00"
    p = decode(data)
    assert p.msgs == (PushPull(False, False, (MemberRow("c", "z:1", 1, State.SUSPECT),)),)


def test_app_state_parts() -> None:
    assert encode_app_state({}) == b""
    parts = {"sla": b"\x00" * 10, "rollout": b"policy"}
    assert decode_app_state(encode_app_state(parts)) == parts
    try:
        decode_app_state(b"\xff")
    except DecodeError:
        pass
    else:
        raise AssertionError("garbage decoded")
