"""The HTB token buckets the compiler asks for are the ones the kernel runs.

``HTB_BURST_US`` (mmmesh/dataplane/_compile.py) sizes the link class's rate
and ceil buckets and every leaf's ceil bucket; leaves keep the kernel's
default rate bucket.  Read back on a real veth two ways: through the
dataplane face's netlink (pyroute2, scheduler ticks) and through iproute2's
``tc class show`` (bytes, its own arithmetic).  A re-apply with other buckets
rewrites them; the same policy again rewrites nothing."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mmmesh.policy import Policy, load_policy, parse_policy
from testkit.privileged import require_privileged, veth_pair

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = load_policy(ROOT / "examples" / "policy.yaml")
RATE = 300_000_000


def _policy() -> Policy:
    data = EXAMPLE.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": "a0", "rate": str(RATE)}
    return parse_policy(data)


@pytest.fixture()
def veth() -> Iterator[tuple[str, str]]:
    require_privileged()
    with veth_pair(f"mmqb{os.getpid()}", "10.78.0") as pair:
        yield pair


def _ticks_per_us() -> float:
    """The kernel's scheduler clock (/proc/net/psched: t2us, us2t)."""
    t2us, us2t = (int(x, 16) for x in Path("/proc/net/psched").read_text().split()[:2])
    return t2us / us2t


def _bucket_bytes(ticks: int, rate_bps: int) -> float:
    return ticks / _ticks_per_us() * rate_bps / 8 / 1e6


def _near(got: float, want: float, rate_bps: int) -> bool:
    """Within 2 us at ``rate_bps``: pyroute2 sends a bucket as whole
    microseconds at the rate (truncated), iproute2 prints it the same way."""
    return abs(got - want) <= 2e-6 * rate_bps / 8 + 2


def _tc_buckets(ns: str) -> dict[int, tuple[int, int]]:
    """classid -> (burst, cburst) in bytes, as iproute2 prints them."""
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "class", "show", "dev", "a0"],
                         check=True, capture_output=True, text=True).stdout
    units = {"b": 1, "kb": 1024, "mb": 1024 * 1024}  # iproute2's sprint_size
    got = {}
    for m in re.finditer(r"class htb 1:([0-9a-f]+) .*? burst ([\d.]+)([kKmM]?b) "
                         r"cburst ([\d.]+)([kKmM]?b)", out):
        got[0x10000 | int(m[1], 16)] = (round(float(m[2]) * units[m[3].lower()]),
                                        round(float(m[4]) * units[m[5].lower()]))
    assert got, out
    return got


def test_classes_get_the_buckets_the_compiler_asks_for(veth: tuple[str, str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mmmesh.dataplane import Dataplane, _compile
    from mmmesh.dataplane._netlink import HTB_PARENT, Netlink

    ns, _ = veth
    pol = _policy()
    spec = _compile.compile_policy(pol).htb
    assert spec is not None
    assert _compile.HTB_BURST_US > 0
    want_link = _compile.htb_burst(RATE)
    assert want_link == RATE * _compile.HTB_BURST_US // 8_000_000  # 1 ms at 300 Mbit/s: 37.5 kB
    assert spec.link_burst == want_link
    for leaf in spec.leaves:
        assert leaf.cburst == _compile.htb_burst(leaf.ceil_bps), leaf

    dp = Dataplane("a0", ns)
    dp.up(pol, version=1)
    buffers: dict[int, tuple[int, int]] = {}
    with Netlink(ns) as n:
        n.htb_classes(n.ifindex("a0"), buffers)
    tc = _tc_buckets(ns)

    # the link class: both buckets HTB_BURST_US at the link rate
    buf, cbuf = buffers[HTB_PARENT]
    for b in (_bucket_bytes(buf, RATE), _bucket_bytes(cbuf, RATE), *tc[HTB_PARENT]):
        assert _near(b, want_link, RATE), (b, want_link)
    # every leaf: the ceil bucket HTB_BURST_US at its ceil; the rate bucket the
    # kernel's default (rate/HZ + 1600 B: one MTU, HZ = 10^9 here)
    for leaf in spec.leaves:
        assert leaf.cburst is not None and leaf.cburst > 1600  # larger than the default
        buf, cbuf = buffers[leaf.classid]
        for b in (_bucket_bytes(cbuf, leaf.ceil_bps), tc[leaf.classid][1]):
            assert _near(b, leaf.cburst, leaf.ceil_bps), (leaf, b)
        for b in (_bucket_bytes(buf, leaf.rate_bps), tc[leaf.classid][0]):
            assert _near(b, 1600, leaf.rate_bps), (leaf, b)

    # the same policy again: nothing differs, nothing is rewritten
    calls: list[tuple[object, ...]] = []
    real_init = Netlink.__init__

    def spying_init(self: Netlink, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        tc_call = self.ipr.tc

        def spy(*args: object, **kwargs: object) -> object:
            calls.append(args)
            return tc_call(*args, **kwargs)

        self.ipr.tc = spy

    monkeypatch.setattr(Netlink, "__init__", spying_init)
    dp.up(pol, version=1)
    assert [c for c in calls if c and c[0] == "replace-class"] == []

    # the kernel's default buckets (HTB_BURST_US = 0): every class rewritten to ~1 MTU
    monkeypatch.setattr(_compile, "HTB_BURST_US", 0)
    dp.up(pol, version=2)
    assert {c[3] for c in calls if c and c[0] == "replace-class"} == \
        {HTB_PARENT, *(leaf.classid for leaf in spec.leaves)}
    tc = _tc_buckets(ns)
    assert all(_near(b, 1600, RATE) for b in tc[HTB_PARENT]), tc[HTB_PARENT]
    for leaf in spec.leaves:
        assert _near(tc[leaf.classid][1], 1600, leaf.ceil_bps), (leaf, tc[leaf.classid])
    dp.down()
