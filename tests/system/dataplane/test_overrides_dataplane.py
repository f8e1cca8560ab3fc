"""Overrides on a real device (a veth pair between two namespaces): boost
leaves built, kept across ``up``, dropped with their class, removed again;
and real traffic: a boosted flow gets more of a congested link than its twin
in the same class, and than itself unboosted, in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from mmmesh import abi as _abi
from mmmesh.dataplane import Boost, FlowOverride, Overrides, StageOverride
from mmmesh.policy import parse_policy
from testkit.overrides_cases import example_on
from testkit.privileged import require_privileged, veth_pair

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[3]
FLOOD = ROOT / "testkit" / "udp_flood.py"  # one UDP flow of MMH frames per modality:sport:dport




@pytest.fixture()
def veth() -> Iterator[tuple[str, str]]:
    require_privileged()
    with veth_pair(f"mmo{os.getpid()}", "10.78.0") as pair:
        yield pair


def boost_leaves(htb: Mapping[int, object]) -> set[int]:
    return {c for c in htb if (c & 0xFFFF) > _abi.MAX_CLASSES}


def test_leaves_follow_the_overrides_through_up_and_back(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane
    from mmmesh.errors import DataplaneError

    ns_a, _ = veth
    dp = Dataplane("a0", ns_a)
    pol = example_on("a0")
    voice, lidar = pol.class_named("voice"), pol.class_named("lidar")
    ovr = Overrides(stages=(StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),),
                    flows=(FlowOverride("lidar", "10.78.0.1", 5, "10.78.0.2", 6, "tcp",
                                        Boost(weight=10)),))
    with pytest.raises(DataplaneError, match="run up first"):
        dp.set_overrides(ovr, pol)
    dp.up(pol, version=1)
    with pytest.raises(DataplaneError, match="pass the policy up"):
        dp.set_overrides(ovr, example_on("a0", drop="control"))
    entries = dp.set_overrides(ovr, pol)
    assert sorted((e.kind, e.override.cls, e.classid) for e in entries) == [
        ("flow", "lidar", 0x1004D), ("stage", "voice", 0x1004B)]
    htb = dp.htb_classes()
    assert boost_leaves(htb) == {0x1004B, 0x1004D}
    assert htb[0x1004B].quantum == 8 * 1514 and htb[0x1004B].prio == voice.priority
    # the class's guarantee is split 3 : 8, not added to
    assert (htb[0x1000B].rate_Bps or 0) + (htb[0x1004B].rate_Bps or 0) == int(voice.rate) // 8
    assert htb[0x1004B].ceil_Bps == int(pol.link.rate) // 8
    assert dp.drift(pol, 1) == []

    # up again (adopted): the overrides and their leaves stay
    assert dp.up(pol, version=2).adopted
    assert [e.override for e in dp.overrides(pol)] == [e.override for e in entries]
    assert boost_leaves(dp.htb_classes()) == {0x1004B, 0x1004D}
    assert dp.drift(pol, 2) == []
    # hand-made damage to a boost leaf is drift, and up repairs it
    from mmmesh.dataplane._netlink import Netlink

    with Netlink(ns_a) as n:
        n.ipr.tc("del-class", index=n.ifindex("a0"), handle=0x1004D, parent=0x10040)
    assert dp.drift(pol, 2) == ["HTB class 1:4d (lidar boost 1) missing"]
    dp.up(pol, version=2)
    assert dp.drift(pol, 2) == []

    # a policy without lidar: lidar's override and leaf go, voice's stay
    smaller = example_on("a0", drop="lidar")
    dp.up(smaller, version=3)
    assert [e.override.cls for e in dp.overrides(smaller)] == ["voice"]
    assert boost_leaves(dp.htb_classes()) == {0x1004B} and lidar.classid not in dp.htb_classes()
    assert dp.drift(smaller, 3) == []

    # none: the leaves go, voice's own leaf has its whole rate again
    assert dp.set_overrides(Overrides(), smaller) == []
    htb = dp.htb_classes()
    assert boost_leaves(htb) == set() and htb[0x1000B].rate_Bps == int(voice.rate) // 8
    assert dp.drift(smaller, 3) == []


TRAFFIC_POLICY = {
    "apiVersion": "mmmesh/v1", "link": {"device": "a0", "rate": "20mbit"},
    "classes": [
        {"name": "video", "id": 12, "match": {"modalities": ["video"]}, "rate": "2mbit",
         "weight": 1, "priority": 2, "adapt": {"weight": [1, 20]}},
        {"name": "lidar", "id": 13, "match": {"modalities": ["point_cloud"]}, "rate": "2mbit",
         "weight": 1, "priority": 2},
        {"name": "best-effort", "id": 14, "rate": "1mbit"},
    ],
    "default_class": "best-effort"}

COUNT = r"""
import json, select, socket, time
socks = {{}}
for port in (7001, 7002, 7003):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("10.78.0.2", port))
    socks[s] = port
got = {{p: 0 for p in socks.values()}}
print("ready", flush=True)
end = time.time() + {secs}
while time.time() < end:
    for s in select.select(list(socks), [], [], 0.1)[0]:
        while True:
            try:
                got[socks[s]] += len(s.recv(65536, socket.MSG_DONTWAIT))
            except BlockingIOError:
                break
print(json.dumps(got), flush=True)
"""


def run_phase(ns_a: str, ns_b: str, secs: float = 3.0) -> dict[str, int]:
    """Bytes each flow got through the link while all three flood it."""
    rx = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c",
                           COUNT.format(secs=secs + 1.0)], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, str(FLOOD), str(secs),
                    "10.78.0.1", "10.78.0.2", "3:5001:7001", "3:5002:7002", "5:5003:7003"],
                   check=True, timeout=60)
    out, _ = rx.communicate(timeout=30)
    assert time.monotonic() - t0 < secs + 10
    got = json.loads(out.strip().splitlines()[-1])
    return {"a": got["7001"], "b": got["7002"], "lidar": got["7003"]}


def test_a_boosted_flow_gets_more_of_a_congested_link(veth: tuple[str, str]) -> None:
    """Two video flows and a lidar flood on 20 Mbit/s, all far past it.  Flow a
    unboosted, then with a flow override at weight 10: a goes from about its
    twin b's share to several times it, and gets more than it did unboosted."""
    from mmmesh.dataplane import Dataplane

    ns_a, ns_b = veth
    pol = parse_policy(TRAFFIC_POLICY)
    dp = Dataplane("a0", ns_a)
    dp.up(pol)
    plain = run_phase(ns_a, ns_b)
    entries = dp.set_overrides(Overrides(flows=(
        FlowOverride("video", "10.78.0.1", 5001, "10.78.0.2", 7001, "udp", Boost(weight=10)),)),
        pol)
    boosted = run_phase(ns_a, ns_b)
    hits = dp.overrides(pol)[0].hits
    ratio_plain, ratio_boosted = plain["a"] / plain["b"], boosted["a"] / boosted["b"]
    print(f"\nunboosted {plain}  a/b {ratio_plain:.2f}\nboosted   {boosted}  a/b "
          f"{ratio_boosted:.2f}; a boosted / a unboosted {boosted['a'] / plain['a']:.2f}; "
          f"override hits {hits}")
    assert sum(plain.values()) > 4_000_000, plain  # the link was really used
    assert 0.5 < ratio_plain < 2.0, plain
    assert ratio_boosted > 3.0, boosted
    assert boosted["a"] > 1.5 * plain["a"], (plain, boosted)
    htb = dp.htb_classes()
    assert htb[entries[0].classid].bytes >= boosted["a"]  # a really went through its leaf
    assert hits > 1000
