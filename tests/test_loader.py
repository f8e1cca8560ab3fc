"""The loader on a real device: a veth pair between two network namespaces.

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
from tests.conftest import require_privileged, veth_pair

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parent.parent
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
    from mmmesh.dataplane import loader
    from mmmesh.dataplane._netlink import HTB_ROOT, Netlink

    ns_a, _ = veth
    pol = policy_for("a0")
    r1 = loader.up(pol, netns=ns_a, version=1)
    assert not r1.adopted and set(r1.prog_ids) == {"egress", "ingress"}
    pins = loader.pin_dir("a0", ns_a)
    assert {"mm_egress", "mm_ingress", "flow_map", "class_map"} <= set(os.listdir(pins))

    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        filters = n.bpf_filters(idx)
        assert {d: f["prog_id"] for d, f in filters.items()} == r1.prog_ids
        assert n.root_qdisc(idx) == ("htb", HTB_ROOT)
        classes = n.htb_classes(idx)
        for c in pol.classes:
            assert c.classid in classes, c.name
            assert classes[c.classid]["prio"] == c.priority
            assert classes[c.classid]["quantum"] == c.quantum

    # again, same policy: adopted, same programs, nothing duplicated
    r2 = loader.up(pol, netns=ns_a, version=2)
    assert r2.adopted and r2.prog_ids == r1.prog_ids
    st = loader.status("a0", ns_a, pol)
    assert st["policy_version"] == 2 and set(st["programs"]) == {"egress", "ingress"}

    # a changed policy reconciles in place: lidar's class goes, programs stay
    smaller = policy_for("a0", drop="lidar", voice_rate="2mbit")
    r3 = loader.up(smaller, netns=ns_a, version=3)
    assert r3.adopted and r3.prog_ids == r1.prog_ids
    with Netlink(ns_a) as n:
        classes = n.htb_classes(n.ifindex("a0"))
    assert EXAMPLE.class_named("lidar").classid not in classes
    st = loader.status("a0", ns_a, smaller)
    assert "lidar" not in st["classes"] and st["policy_version"] == 3

    loader.down("a0", ns_a)
    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        assert n.bpf_filters(idx) == {}
        assert not n.has_clsact(idx)
        assert n.root_qdisc(idx)[0] != "htb"
    assert not os.path.exists(pins)


def test_foreign_root_qdisc_is_not_replaced(veth: tuple[str, str]) -> None:
    from mmmesh._errors import DataplaneError
    from mmmesh.dataplane import loader
    from mmmesh.dataplane._netlink import Netlink

    ns_a, _ = veth
    with Netlink(ns_a) as n:
        idx = n.ifindex("a0")
        n.ipr.tc("add", "tbf", idx, 0x20000, rate="10mbit", burst=10000, latency="50ms")
    with pytest.raises(DataplaneError, match="did not create"):
        loader.up(policy_for("a0"), netns=ns_a)
    with Netlink(ns_a) as n:
        assert n.root_qdisc(n.ifindex("a0"))[0] == "tbf"


def test_unknown_device_is_a_clear_error(veth: tuple[str, str]) -> None:
    from mmmesh._errors import DataplaneError
    from mmmesh.dataplane import loader

    with pytest.raises(DataplaneError, match="no device 'nope0'"):
        loader.up(policy_for("nope0"), netns=veth[0])


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
    from mmmesh.dataplane import loader

    ns_a, _ = veth
    pol = policy_for("a0")
    loader.up(pol, netns=ns_a)
    subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                    SENDER.format(root=str(ROOT))], check=True, timeout=60)
    st = loader.status("a0", ns_a, pol)
    voice = st["classes"]["voice"]
    assert voice["egress_packets"] >= 40
    assert voice["htb"]["packets"] >= 40  # HTB really put them in 1:b
    assert st["reasons"]["egress"]["parsed"] >= 40
    assert st["reasons"]["egress"]["not_mesh"] >= 10
    assert st["classes"]["best-effort"]["egress_packets"] >= 10


def test_other_build_is_replaced_not_adopted(veth: tuple[str, str]) -> None:
    """A pinned dataplane from another build (older BPF code, other tunables)
    is replaced; the swap happens only after the new one is pinned."""
    from mmmesh.dataplane import loader
    from mmmesh.dataplane._maps import Maps

    ns_a, _ = veth
    pol = policy_for("a0")
    r1 = loader.up(pol, netns=ns_a)
    maps = Maps.open_pinned(loader.pin_dir("a0", ns_a))
    try:
        maps.write_meta(build_id=12345)  # pretend an older build is pinned
    finally:
        maps.close()
    r2 = loader.up(pol, netns=ns_a)
    assert not r2.adopted and r2.prog_ids != r1.prog_ids
    assert os.listdir(os.path.dirname(loader.pin_dir("a0", ns_a))) == ["a0"]  # no staging
    r3 = loader.up(pol, netns=ns_a)
    assert r3.adopted and r3.prog_ids == r2.prog_ids
