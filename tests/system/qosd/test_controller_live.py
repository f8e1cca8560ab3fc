"""The SLA controller in a real qosd on a netns node (issue 10, items 2 and 5):
voice misses its objective window after window (reports from a trusted
sidecar: the admin socket) -> qosd raises voice's HTB rate in the kernel,
within the policy's bounds; drift repair keeps the adapted rate (it is the
kernel's desired state now, under the same store version); `mmmeshctl sla
explain` says why; when the data goes stale the kernel goes back to the
policy's rate.  Before that, a hostile unprivileged process faking misses
on sla.sock changes nothing: its reports are refused and never reach the
controller."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from testkit.qosd_node import EXAMPLE, Node, policy_yaml

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(180)]

SENDER = Path(__file__).resolve().parents[3] / "testkit" / "sla_sender.py"
PERIOD_S = 1.0
VOICE = EXAMPLE.class_named("voice")


def missing(frames: int = 500) -> dict[str, Any]:
    return {"stage": "asr", "instance": "asr-1", "reports": [{
        "sla_class": "voice", "modality": "audio", "window_s": PERIOD_S, "frames": frames,
        "deadline_misses": frames // 2, "drops": 0, "errors": 0, "attainment": 0.5,
        "e2e_ms": {"p50": 150.0, "p90": 250.0, "p99": 300.0, "max": 320.0}}]}


def voice_rate_bps(node: Node) -> int:
    from mmmesh.dataplane import Dataplane

    return int(Dataplane("a0", node.ns).htb_classes()[VOICE.classid].rate_Bps or 0) * 8


@pytest.fixture()
def live(node: Node) -> Iterator[tuple[Node, Path]]:
    run = Path(tempfile.mkdtemp(prefix="mmmesh-ctrl-"))  # sla.sock reachable by nobody
    run.chmod(0o755)
    cfg = yaml.safe_load(node.cfg.read_text())
    cfg.update(sla_socket=str(run / "sla.sock"), sla_controller_period_s=PERIOD_S)
    node.cfg.write_text(yaml.safe_dump(cfg))
    try:
        node.start()
        yield node, run / "sla.sock"
    finally:
        node.stop()
        shutil.rmtree(run, ignore_errors=True)


def post(node: Node, body: dict[str, Any]) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(node.sock)),
                      base_url="http://qosd", timeout=10) as c:
        assert c.post("/v1/sla", json=body).status_code == 200


def test_misses_raise_the_rate_within_bounds_then_expire(live: tuple[Node, Path]) -> None:
    node, sla_sock = live
    assert VOICE.sla is not None and VOICE.adapt is not None and VOICE.adapt.rate is not None
    low, high = (int(r) for r in VOICE.adapt.rate)
    assert node.put_policy(policy_yaml()).status_code == 200
    policy_rate = voice_rate_bps(node)
    assert abs(policy_rate - int(VOICE.rate)) < 16

    # a hostile local process fakes misses for 5 windows: refused, nothing moves
    hostile = subprocess.run(
        [sys.executable, str(SENDER), str(sla_sock), "post", "--uid", "65534",
         "--count", "20", "--body", json.dumps(missing())],
        capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(hostile.stdout)["status"] == {"403": 20}, hostile.stdout
    time.sleep(5 * PERIOD_S)
    assert voice_rate_bps(node) == policy_rate

    # a trusted sidecar reports misses every window: the rate goes up, never past the bound
    deadline, raised = time.monotonic() + 40, 0
    while time.monotonic() < deadline:
        post(node, missing())
        raised = voice_rate_bps(node)
        if raised > policy_rate:
            break
        time.sleep(PERIOD_S / 2)
    assert policy_rate < raised <= high, (policy_rate, raised, node.log())
    for _ in range(int(6 / (PERIOD_S / 2))):  # drift repair (every 1 s) keeps it
        post(node, missing())
        time.sleep(PERIOD_S / 2)
        assert policy_rate < voice_rate_bps(node) <= high
    st = node.get("/v1/status").json()
    assert st["policy_version"] == 1  # the store did not move: the same version, adapted
    out = node.ctl("sla", "explain", check=True).stdout
    assert "voice" in out and "attainment 0.500 < 0.99" in out, out
    doc = json.loads(node.ctl("sla", "explain", "-o", "json", check=True).stdout)
    assert doc["classes"], doc

    # no more data: stale after 3 windows, back to the policy's rate
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and voice_rate_bps(node) != policy_rate:
        time.sleep(PERIOD_S / 2)
    assert voice_rate_bps(node) == policy_rate, node.log()
    assert low <= policy_rate
