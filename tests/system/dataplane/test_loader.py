"""The dataplane face on a real device: a veth pair between two network namespaces.

up -> programs attached and pinned, HTB tree built from the policy; up again
-> adopted, nothing re-attached; a changed policy -> reconciled in place;
down -> the device is as it was.  Real UDP traffic moves the counters."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmmesh.policy import load_policy, parse_policy
from testkit.privileged import require_privileged, veth_pair

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = load_policy(ROOT / "examples" / "policy.yaml")


def policy_for(dev: str, rate: str = "500mbit", drop: str | None = None,
               voice_rate: str | None = None):  # type: ignore[no-untyped-def]
    data = EXAMPLE.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": dev, "rate": rate}
    data["classes"] = [c for c in data["classes"] if c["name"] != drop]
    if voice_rate:
        for c in data["classes"]:
            if c["name"] == "voice":
                c["rate"] = voice_rate
    return parse_policy(data)


@pytest.fixture()
def veth() -> Iterator[tuple[str, str]]:
    """Namespaces A and B joined by a0 <-> b0 (10.77.0.1/24, 10.77.0.2/24)."""
    require_privileged()
    with veth_pair(f"mmt{os.getpid()}", "10.77.0") as pair:
        yield pair


def test_up_adopt_reconcile_down(veth: tuple[str, str]) -> None:
    from mmmesh import abi as _abi
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._netlink import HTB_ROOT, Netlink

    ns_a, _ = veth
    dp = Dataplane("a0", ns_a)
    pol = policy_for("a0")
    r1 = dp.up(pol, version=1)
    assert not r1.adopted and set(r1.prog_ids) == {"egress", "ingress"}
    # exactly the maps and programs of the one list are pinned
    assert set(os.listdir(dp.pin_dir)) == {*_abi.MAP_NAMES, *_abi.PROGRAMS.values()}
    assert dp.drift(pol, 1) == []

    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        filters = n.bpf_filters(idx)
        assert {d: f["prog_id"] for d, f in filters.items()} == r1.prog_ids
        assert n.root_qdisc(idx) == ("htb", HTB_ROOT)
    classes = dp.htb_classes()
    for c in pol.classes:
        assert c.classid in classes, c.name
        assert classes[c.classid].prio == c.priority
        assert classes[c.classid].quantum == c.quantum
        assert classes[c.classid].rate_Bps == int(c.rate) // 8
        assert classes[c.classid].ceil_Bps == int(pol.ceil_of(c)) // 8

    # again, same policy: adopted, same programs, nothing duplicated
    r2 = dp.up(pol, version=2)
    assert r2.adopted and r2.prog_ids == r1.prog_ids
    st = dp.status(pol)
    assert st.policy_version == 2 and set(st.programs) == {"egress", "ingress"}
    assert dp.drift(pol, 1) == ["policy maps hold version 2, want 1"]

    # a changed policy reconciles in place: lidar's class goes, voice's rate
    # changes (read back from the kernel), programs stay
    smaller = policy_for("a0", drop="lidar", voice_rate="2mbit")
    r3 = dp.up(smaller, version=3)
    assert r3.adopted and r3.prog_ids == r1.prog_ids
    classes = dp.htb_classes()
    assert EXAMPLE.class_named("lidar").classid not in classes
    assert classes[EXAMPLE.class_named("voice").classid].rate_Bps == 2_000_000 // 8
    st = dp.status(smaller)
    assert "lidar" not in {c.name for c in st.classes} and st.policy_version == 3
    assert dp.drift(smaller, 3) == []
    assert any("voice" in d and "changed" in d for d in dp.drift(pol, 3))

    dp.down()
    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        assert n.bpf_filters(idx) == {}
        assert not n.has_clsact(idx)
        assert n.root_qdisc(idx)[0] != "htb"
    assert not os.path.exists(dp.pin_dir)
    assert dp.drift(pol, 3) == ["pinned programs and maps missing"]


def test_drift_names_what_was_changed_by_hand(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._netlink import DIRECTIONS, FILTER_PRIO, Netlink

    ns_a, _ = veth
    dp = Dataplane("a0", ns_a)
    pol = policy_for("a0")
    dp.up(pol, version=5)
    voice = pol.class_named("voice")
    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        n.ipr.tc("del-class", index=idx, handle=voice.classid, parent=0x10040)
        n.ipr.tc("del-filter", "bpf", idx, 0x4D4D, parent=DIRECTIONS["ingress"],
                 prio=FILTER_PRIO, protocol=0x0003)
    found = dp.drift(pol, 5)
    assert "ingress program detached" in found
    assert f"HTB class 1:{voice.id:x} (voice) missing" in found
    dp.up(pol, version=5)
    assert dp.drift(pol, 5) == []


def test_foreign_root_qdisc_is_not_replaced(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._netlink import Netlink
    from mmmesh.errors import DataplaneError

    ns_a, _ = veth
    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        n.ipr.tc("add", "tbf", idx, 0x20000, rate="10mbit", burst=10000, latency="50ms")
    with pytest.raises(DataplaneError, match="did not create"):
        Dataplane("a0", ns_a).up(policy_for("a0"))
    with Netlink(ns_a) as n:
        assert n.root_qdisc(n.ifindex("a0"))[0] == "tbf"


def test_unknown_device_and_netns_are_clear_errors(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane, link_exists
    from mmmesh.errors import DataplaneError

    with pytest.raises(DataplaneError, match="no device 'nope0'"):
        Dataplane("nope0", veth[0]).up(policy_for("nope0"))
    ghost = f"{veth[0]}-ghost"
    with pytest.raises(DataplaneError, match="no netns"):
        link_exists("a0", ghost)
    assert not os.path.exists(f"/var/run/netns/{ghost}")  # a read never creates a netns


SENDER = r"""
import socket, sys, time
sys.path.insert(0, {root!r})
from mmmesh.wire import Header, encode_header
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(40):
    s.sendto(encode_header(Header(modality=4, stream_id=1, sequence=i)), ("10.77.0.2", 7000))
for i in range(10):
    s.sendto(b"not a mesh frame", ("10.77.0.2", 7000))
"""


def test_real_traffic_moves_class_counters(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane

    ns_a, _ = veth
    dp = Dataplane("a0", ns_a)
    pol = policy_for("a0")
    dp.up(pol)
    subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                    SENDER.format(root=str(ROOT))], check=True, timeout=60)
    st = dp.status(pol)
    classes = {c.name: c for c in st.classes}
    voice = classes["voice"]
    assert voice.egress_packets >= 40
    assert voice.htb is not None and voice.htb.packets >= 40  # HTB really put them in 1:b
    assert st.reasons["egress"]["parsed"] >= 40
    assert st.reasons["egress"]["not_mesh"] >= 10
    assert classes["best-effort"].egress_packets >= 10
    stats = dp.stats()
    assert stats.counters["egress"].classes[voice.id][0] == voice.egress_packets
    as_json = st.as_dict()
    assert as_json["classes"]["voice"]["classid"] == "1:b"
    assert as_json["classes"]["voice"]["htb"]["packets"] >= 40


def test_other_build_is_replaced_not_adopted(veth: tuple[str, str]) -> None:
    """A pinned dataplane from another build (older BPF code, other tunables)
    is replaced; the swap happens only after the new one is pinned."""
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._maps import Maps

    ns_a, _ = veth
    dp = Dataplane("a0", ns_a)
    pol = policy_for("a0")
    r1 = dp.up(pol)
    with Maps.open_pinned(dp.pin_dir) as maps:
        maps.write_meta(build_id=12345)  # pretend an older build is pinned
    r2 = dp.up(pol)
    assert not r2.adopted and r2.prog_ids != r1.prog_ids
    assert os.listdir(os.path.dirname(dp.pin_dir)) == ["a0"]  # no staging
    r3 = dp.up(pol)
    assert r3.adopted and r3.prog_ids == r2.prog_ids


PRIO_FLOOD = r"""
import socket, sys, threading, time
sys.path.insert(0, {root!r})
from mmmesh.wire import Header, encode_header
def flood(modality, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)  # SO_SNDBUFFORCE: fill the qdisc
    frame = encode_header(Header(modality=modality, payload_len=1300)) + b"x" * 1300
    end = time.time() + {secs}
    while time.time() < end:
        try:
            s.sendto(frame, ("10.77.0.2", port))
        except OSError:
            time.sleep(0.0005)
ts = [threading.Thread(target=flood, args=(m, p)) for m, p in ((3, 7001), (5, 7002))]
for t in ts: t.start()
for t in ts: t.join()
"""


@pytest.mark.parametrize("hi_prio,lo_prio", [(1, 6), (6, 1)])
def test_priority_decides_who_borrows_the_spare_link(veth: tuple[str, str], hi_prio: int,
                                                     lo_prio: int) -> None:
    """Two classes with the same small guarantee and weight, both flooding far
    past the link: HTB lends the spare link to the class with the lower
    priority number first, so it sends several times more than the other.
    Swapping the priorities swaps the winner: the kernel really runs the
    policy's priorities (flattening them would split the link evenly)."""
    from mmmesh.dataplane import Dataplane

    ns_a, _ = veth
    pol = parse_policy({
        "apiVersion": "mmmesh/v1", "link": {"device": "a0", "rate": "20mbit"},
        "classes": [
            {"name": "video", "id": 12, "match": {"modalities": ["video"]}, "rate": "1mbit",
             "weight": 1, "priority": hi_prio},
            {"name": "lidar", "id": 13, "match": {"modalities": ["point_cloud"]},
             "rate": "1mbit", "weight": 1, "priority": lo_prio},
            {"name": "best-effort", "id": 14, "rate": "1mbit"},
        ],
        "default_class": "best-effort"})
    dp = Dataplane("a0", ns_a)
    dp.up(pol)
    before = dp.htb_classes()
    subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                    PRIO_FLOOD.format(root=str(ROOT), secs=3)], check=True, timeout=60)
    after = dp.htb_classes()
    sent = {name: after[pol.class_named(name).classid].bytes
            - before[pol.class_named(name).classid].bytes for name in ("video", "lidar")}
    winner, loser = ("video", "lidar") if hi_prio < lo_prio else ("lidar", "video")
    # 3 s at 20 Mbit/s is 7.5 MB: the winner takes nearly all of it
    assert sent[winner] + sent[loser] > 4_000_000, sent
    assert sent[winner] > 4 * sent[loser], sent
