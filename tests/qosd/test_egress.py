"""qosd.yaml's ``egress:`` section and its plumbing into the reconciler,
with the real dataplane face on ``lo`` (no privileges: nothing is written;
the reconciler driving egress mode fq in a kernel with sch_fq:
testkit/fq_vm_checks.py, ``the_sla_controllers_writes_drive_fq``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mmmesh.dataplane import Boost, Dataplane, Overrides, StageOverride
from mmmesh.policy import Policy, load_policy, parse_policy
from qosd.config import QosdConfig, load_config
from qosd.errors import UnrealizableError
from qosd.reconciler import Reconciler
from testkit.policy_cases import EXAMPLE

POLICY = load_policy(EXAMPLE)


def cfg(tmp_path: Path, **kw: Any) -> QosdConfig:
    return QosdConfig(node_name="n", state_dir=tmp_path, api_socket=tmp_path / "s",
                      sla_socket=None, metrics_addr=None, **kw)


def test_the_default_is_auto_and_each_mode_can_be_chosen(tmp_path: Path) -> None:
    assert cfg(tmp_path).egress.mode == "auto"
    for mode in ("auto", "htb", "fq"):
        assert cfg(tmp_path, egress={"mode": mode}).egress.mode == mode
    with pytest.raises(ValidationError, match="egress.mode"):
        cfg(tmp_path, egress={"mode": "cake"})
    with pytest.raises(ValidationError, match="egress.bands"):
        cfg(tmp_path, egress={"mode": "fq", "bands": 3})


def test_the_file_and_the_environment_set_it(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "qosd.yaml"
    f.write_text(f"state_dir: {tmp_path}\negress:\n  mode: htb\n")
    assert load_config(str(f)).egress.mode == "htb"
    monkeypatch.setenv("MMMESH_QOSD_EGRESS", '{"mode": "fq"}')
    assert load_config(str(f)).egress.mode == "fq"


def test_the_reconciler_hands_the_mode_to_every_dataplane(tmp_path: Path) -> None:
    for mode in ("auto", "htb", "fq"):
        dp = Reconciler(cfg(tmp_path, egress={"mode": mode})).dataplane("eth0")
        assert dp.egress == mode and dp.iface == "eth0"


def on_loopback(**ceils: str) -> Policy:
    """The example on ``lo`` (a device every host has, no line rate), with
    ``ceils`` ({class: ceil}; its rate lowered below it)."""
    doc = POLICY.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["link"]["device"] = "lo"
    for c in doc["classes"]:
        if c["name"] in ceils:
            c.update(ceil=ceils[c["name"]], rate="1kbit")
            c.pop("adapt", None)
    return parse_policy(doc)


def test_a_policy_the_mode_cannot_realise_is_unrealisable_naming_the_field(
        tmp_path: Path) -> None:
    slow = on_loopback(video="10kbit")  # below one full frame per pacing horizon
    i = [c.name for c in slow.classes].index("video")
    with pytest.raises(UnrealizableError) as info:
        Reconciler(cfg(tmp_path, egress={"mode": "fq"})).check_realizable(slow)
    assert [f for f, _ in info.value.errors] == [f"classes[{i}].ceil"]
    assert "egress mode fq paces a ceil" in info.value.errors[0][1]
    Reconciler(cfg(tmp_path, egress={"mode": "htb"})).check_realizable(slow)  # htb shapes it
    Reconciler(cfg(tmp_path, egress={"mode": "fq"})).check_realizable(on_loopback())


def test_overrides_the_mode_cannot_realise_are_left_out_naming_them() -> None:
    """What the reconciler passes the SLA controller's boosts through before
    writing them (Reconciler.set_overrides): in fq, a boost in its class's
    band of an unpaced class changes nothing and is left out, with why."""
    pol = on_loopback(video="50mbit")
    ovr = Overrides(stages=(StageOverride("voice", "10.1.0.7/32", Boost(weight=8)),
                            StageOverride("video", "10.1.0.8/32", Boost(weight=9))))
    kept, why = Dataplane("lo", egress="fq").realisable(ovr, pol)
    assert [s.cls for s in kept.stages] == ["video"]  # paced: the boost splits its ceil
    assert len(why) == 1 and why[0].startswith("stages[0]: egress mode fq: a boost of 'voice'")
    assert Dataplane("lo", egress="htb").realisable(ovr, pol) == (ovr, [])
