"""kill -9 at every point of an apply: what the kernel holds while qosd is down,
and that a restart always lands the kernel and the store on the same version.

qosd runs with ``MMMESH_FAILPOINTS=<point>`` (mmmesh/failpoints.py): it kills
itself with SIGKILL at that point of the apply of version 2 (version 1 is in
force).  Then, with qosd down, the kernel must be *safe*: every class the
maps point at exists in HTB (so no packet is steered at a class that is not
there), and the maps hold version 1 or 2.  After a restart without
failpoints, the store's current version is 2 exactly when the crash came
after current.json was written, else 1; the kernel holds that version with
no drift; no version is left pending; and ``mmmeshctl policy apply``, whose
connection the crash cut, says which of the two happened.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from mmmesh import abi as _abi
from mmmesh.failpoints import POINTS
from testkit.qosd_node import VENV_BIN, Node, policy_yaml

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(600)]

# after these, current.json names version 2: the apply has happened
COMMITTED = {"store.activate.current", "store.activate.renamed"}


def v2_text() -> str:
    """Version 2 differs in every way an apply can touch: a class goes
    (lidar), a new one comes (text), a rate goes down (video) and one goes up
    (voice)."""
    import yaml

    data = yaml.safe_load(policy_yaml(drop="lidar", voice_rate="3mbit"))
    for c in data["classes"]:
        if c["name"] == "video":
            c["rate"] = "100mbit"
    data["classes"].append({"name": "text", "id": 15, "match": {"modalities": ["text"]},
                            "rate": "5mbit", "weight": 1, "priority": 3})
    return yaml.safe_dump(data)


def kernel_problems(node: Node) -> list[str]:
    """What is unsafe in the kernel now: a class the maps point at (valid in
    class_map, or named by a modality rule, a fallback, a source rule or the
    default) with no HTB class, or a version other than 1 or 2."""
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._maps import Maps

    dp = Dataplane("a0", node.ns)
    htb = dp.htb_classes()
    out: list[str] = []
    with Maps.open_pinned(dp.pin_dir) as maps:
        valid = {}
        for cid in range(1, _abi.MAX_CLASSES):
            info = maps.classes.lookup(cid)
            if info is not None and info.valid:
                valid[cid] = int(info.classid)
        refs: set[int] = set()
        cfg = maps.config.lookup(0)
        assert cfg is not None
        refs.add(int(cfg.default_class))
        for m in range(_abi.MAX_MODALITIES):
            mi = maps.modalities.lookup(m)
            if mi is not None and mi.valid:
                if mi.default_class:
                    refs.add(int(mi.default_class))
                refs |= {int(mi.rules[i].class_id) for i in range(mi.nrules)}
        for _, src in maps.sources.items():
            refs.add(int(src.max_class))
        version = int(cfg.policy_version)
    for cid in sorted(refs):
        if cid not in valid:
            out.append(f"maps point at class {cid}, which class_map does not have")
    for cid, classid in sorted(valid.items()):
        if classid not in htb:
            out.append(f"class {cid} ({classid:#x}) is in the maps but not in HTB")
    if version not in (1, 2):
        out.append(f"maps hold version {version}")
    return out


def state_files(node: Node) -> list[str]:
    return sorted(p.name for p in (node.dir / "state" / "policies").iterdir())


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_at_every_point_of_an_apply(node: Node, tmp_path: Path, point: str) -> None:
    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200  # version 1
    node.stop()
    # the start-up reconcile of version 1 passes the dataplane's points once
    nth = 2 if point.startswith(("dataplane.", "maps.")) else 1
    node.start(env={"MMMESH_FAILPOINTS": f"{point}@{nth}"})
    f = tmp_path / "v2.yaml"
    f.write_text(v2_text())
    # the apply whose connection the crash cuts; it waits for qosd to come back
    ctl = subprocess.Popen([str(VENV_BIN / "mmmeshctl"), "--socket", str(node.sock),
                            "policy", "apply", "-f", str(f)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert node.proc is not None
    try:
        node.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"qosd did not reach {point}: {node.log()}") from None
    assert node.proc.returncode == -signal.SIGKILL, node.log()

    # qosd is down: the kernel may mix versions 1 and 2, but safely
    assert kernel_problems(node) == [], point

    node.start()
    out, err = ctl.communicate(timeout=90)
    want = 2 if point in COMMITTED else 1
    from mmmesh.dataplane import Dataplane
    from mmmesh.policy import parse_policy

    st = node.get("/v1/status").json()
    assert st["policy_version"] == want, (point, st["policy_version"])
    cur = node.get("/v1/policy").json()
    dp = Dataplane("a0", node.ns)
    assert dp.drift(parse_policy(cur["yaml"]), want) == [], point
    assert dp.policy_version() == want
    assert not [n for n in state_files(node) if n.endswith(".pending")], state_files(node)
    # the operator is told which happened
    if want == 2:
        assert ctl.returncode == 0 and "policy applied: version 2" in out, (out, err)
    else:
        assert ctl.returncode == 5 and "NOT applied: version 1 is still current" in err, \
            (out, err)
    # and the mesh carries on: the next apply gets a fresh number
    assert node.put_policy(policy_yaml(voice_rate="2mbit")).json()["version"] == 3


def test_every_failpoint_is_listed_and_reached() -> None:
    """POINTS is the whole list: each name appears once in the code."""
    root = Path(__file__).resolve().parents[3]
    seen: dict[str, int] = {}
    for path in [*root.glob("mmmesh/**/*.py"), *root.glob("qosd/**/*.py")]:
        if path.name == "failpoints.py":
            continue
        for name in re.findall(r'failpoint\("([a-z_.]+)"\)', path.read_text()):
            seen[name] = seen.get(name, 0) + 1
    assert seen == {p: 1 for p in POINTS}
