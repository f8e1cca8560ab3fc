"""The rollout tests' shared cases: policies of known sizes, a fake gossip
section, announcements and reports (tests/qosd/mesh/test_cluster_rollout*.py)."""

from __future__ import annotations

from pathlib import Path

from qosd.mesh.membership.core import (
    AppBroadcast,
    AppMessage,
    MemberInfo,
    State,
)
from qosd.mesh.rollout.core import (
    Announcement,
    LinkOverride,
    MeshVersion,
    Report,
)
from qosd.mesh.rollout.core.codec import encode_announcement, encode_report

ROOT = Path(__file__).resolve().parents[1]


POLICY = (ROOT / "examples" / "policy.yaml").read_text()  # guarantees: 253.2 Mbit/s


SMALL = POLICY.replace("rate: 150mbit", "rate: 50mbit")  # 153.2 Mbit/s


SMALLER = SMALL.replace("rate: 80mbit", "rate: 70mbit")  # 143.2 Mbit/s


SLOW_LINK = LinkOverride(device="eth1", rate=200_000_000)


# --------------------------------------------------------------------------
# A scripted gossip layer: what the core broadcasts, who the members are
# --------------------------------------------------------------------------
class FakeGossip:
    def __init__(self, node_id: str, others: tuple[str, ...] = ()) -> None:
        self.node_id = node_id
        self.sent: list[AppMessage] = []
        self.state = b""
        self.seq = 0
        self.states = {n: State.ALIVE for n in (node_id, *others)}

    def broadcast(self, key: str, payload: bytes) -> int:
        msg = AppBroadcast(self.node_id, key, self.seq + 1, payload)
        assert msg.wire + 40 <= 1400, "a broadcast must fit one packet"
        self.seq += 1
        self.sent.append(AppMessage(self.node_id, key, self.seq, payload))
        return self.seq

    def set_app_state(self, data: bytes) -> None:
        self.state = data

    def members(self) -> list[MemberInfo]:
        return [MemberInfo(n, f"{n}:7946", s, 0, 0.0, None, None)
                for n, s in self.states.items()]


def announce(origin: str, counter: int, text: str = POLICY, seq: int = 1,
             call: tuple[str, ...] = ()) -> AppMessage:
    ann = Announcement(MeshVersion(counter, origin), sha(text), len(text), "op", 1.0)
    return AppMessage(origin, "policy", seq, encode_announcement(ann, call))


def report(node: str, v: MeshVersion, text: str, ok: bool = True, seq: int = 1,
           reason: str = "") -> AppMessage:
    r = Report(node, 0, v, sha(text)[:16], ok, reason, v if ok else None, 2.0)
    return AppMessage(node, f"ack/{node}", seq, encode_report(r))


def sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()
