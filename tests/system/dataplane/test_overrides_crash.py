"""kill -9 at every point of ``Dataplane.set_overrides``: whatever the kernel
then holds is safe, and the next call converges.

A child process runs ``set_overrides`` with ``MMMESH_FAILPOINTS=<point>``
(mmmesh/failpoints.py) and dies by SIGKILL there, while changing the
overrides in every way at once: a new boost leaf, a boost changed in place,
one removed, entries added, moved and removed.  Safe means: every valid
boost's leaf exists in HTB; every override entry points at a valid boost of
its class (so no packet is steered at a missing leaf); every class leaf
exists; and a class's leaves never guarantee more than its rate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmmesh import abi as _abi
from mmmesh.dataplane import Boost, FlowOverride, Overrides, StageOverride
from mmmesh.dataplane._compile import MIN_RATE_BPS, boost_class
from mmmesh.policy import Policy
from testkit.overrides import with_adapt
from testkit.overrides_cases import example_on
from testkit.privileged import require_privileged, veth_pair

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[3]
# the points set_overrides passes, in order (tests/system/qosd/test_crash_apply.py runs the
# same points inside up())
POINTS = ["dataplane.up.htb_added", "maps.boosts_written", "maps.overrides_written",
          "maps.overrides_pruned", "dataplane.up.htb_pruned"]

BEFORE = Overrides(
    stages=(StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),
            StageOverride("voice", "10.0.2.0/24", Boost(weight=5))),
    flows=(FlowOverride("lidar", "10.79.0.1", 5, "10.79.0.2", 6, "tcp", Boost(weight=10)),))
AFTER = Overrides(  # voice w5 -> w6 in place, w8 goes, w9 comes; lidar's goes; video's comes
    stages=(StageOverride("voice", "10.0.2.0/24", Boost(weight=6)),
            StageOverride("voice", "10.0.3.0/24", Boost(weight=9)),
            StageOverride("video", "10.0.1.0/24", Boost(weight=12))))

SET = r"""
import json, sys
sys.path.insert(0, {root!r})
from mmmesh.dataplane import Dataplane, Overrides
from mmmesh.policy import load_policy
Dataplane("a0", {ns!r}).set_overrides(Overrides.from_dict(json.loads({ovr!r})),
                                      load_policy({policy!r}))
"""


@pytest.fixture()
def veth() -> Iterator[tuple[str, str]]:
    require_privileged()
    with veth_pair(f"mmk{os.getpid()}", "10.79.0") as pair:
        yield pair


def problems(ns: str, pol: Policy) -> list[str]:
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._maps import Maps

    dp = Dataplane("a0", ns)
    htb = dp.htb_classes()
    out: list[str] = []
    with Maps.open_pinned(dp.pin_dir) as maps:
        boosts = maps.read_boosts()
        for (cid, lvl) in boosts:
            if _abi.boost_classid(cid, lvl) not in htb:
                out.append(f"boost {lvl} of class {cid} is valid but its leaf is missing")
        for k, v in maps.read_overrides():
            if (int(v.class_id), int(v.level)) not in boosts:
                out.append(f"override {bytes(k).hex()} points at boost {v.level} of class "
                           f"{v.class_id}, which is not valid")
    for c in pol.classes:
        if c.classid not in htb:
            out.append(f"class leaf {c.name} missing")
        leaves = [s for x, s in htb.items() if (boost_class(x) or x & 0xFFFF) == c.id]
        extra = len(leaves) * MIN_RATE_BPS  # a leaf being emptied keeps the smallest rate
        if sum((s.rate_Bps or 0) * 8 for s in leaves) > int(c.rate) + extra:
            out.append(f"{c.name}'s leaves guarantee more than its rate")
    return out


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_every_point_of_set_overrides(veth: tuple[str, str], tmp_path: Path,
                                              point: str) -> None:
    from mmmesh.dataplane import Dataplane

    ns_a, _ = veth
    pol = with_adapt(example_on("a0"), {"video": {"weight": [7, 20]}})
    (tmp_path / "p.yaml").write_text(pol.to_yaml())
    dp = Dataplane("a0", ns_a)
    dp.up(pol)
    dp.set_overrides(BEFORE, pol)
    assert problems(ns_a, pol) == []
    child = subprocess.run(
        [sys.executable, "-c", SET.format(root=str(ROOT), ns=ns_a, policy=str(tmp_path / "p.yaml"),
                                          ovr=json.dumps(AFTER.as_dict()))],
        env={**os.environ, "MMMESH_FAILPOINTS": point}, capture_output=True, text=True,
        timeout=60)
    assert child.returncode == -signal.SIGKILL, (point, child.stderr)
    assert problems(ns_a, pol) == [], point
    # the next call (no failpoint) converges: exactly AFTER, no drift
    entries = dp.set_overrides(AFTER, pol)
    def plain(o: StageOverride | FlowOverride) -> tuple[str, str, int | None]:
        assert isinstance(o, StageOverride)
        return o.cls, o.prefix, o.boost.weight

    assert {plain(e.override) for e in entries} == set(map(plain, AFTER.stages)), point
    assert problems(ns_a, pol) == [] and dp.drift(pol, 0) == [], point
    boost_ids = {c for c in dp.htb_classes() if boost_class(c) is not None}
    assert boost_ids == {e.classid for e in entries}, point
