"""The socket layer hosted by a real qosd (issue 10, item 4; docs/socklayer.md
"qosd"): qosd.yaml ``socket_layer`` on a scratch cgroup v2 with stage asr's
two replicas as endpoints.  qosd loads it at start (status, metrics), real
sockets inside the cgroup are registered and their frames counted per
modality; after kill -9 the restarted qosd adopts it (same program ids,
same pins, the old connection still counted); stopping qosd leaves it,
``qosd --cleanup`` removes it.  With a policy, the replicas' own SLA windows
(admin socket, one instance label per replica) set the kernel's replica
weights: the one that misses gets less, and frames spread over the replicas
by those weights; a hostile uid-65534 reporter is refused and moves nothing;
when the reports stop the weights go back to equal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from qosd.metrics import SOCKLAYER_METRICS, exported_names
from testkit.qosd_node import VENV_BIN, Node, policy_yaml
from testkit.qosd_reports import metric, reporting
from testkit.socklayer_kit import (
    connect,
    frame,
    inside,
    listener,
    read_frames,
    scratch_cgroup,
    swrr_counts,
)
from testkit.socklayer_spread import spread

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(240)]

SENDER = Path(__file__).resolve().parents[3] / "testkit" / "sla_sender.py"
PERIOD_S = 1.0
AUDIO = 4
STAGE = 2


class Layer:
    """The node, its cgroup and the two replicas' listening sockets."""

    def __init__(self, node: Node, path: str, rel: str, lss: list[tuple[socket.socket, int]]
                 ) -> None:
        self.node, self.path, self.rel, self.lss = node, path, rel, lss

    def sl(self) -> Any:
        from mmmesh.dataplane import SocketLayer

        return SocketLayer(self.rel)

    def status(self) -> dict[str, Any]:
        return self.node.get("/v1/status").json()["socket_layer"]  # type: ignore[no-any-return]

    def pairs(self) -> list[tuple[socket.socket, socket.socket]]:
        """One connection to each replica, made inside the cgroup (the lanes
        of one sender)."""
        with inside(self.path):
            return [connect(ls, port) for ls, port in self.lss]


@pytest.fixture()
def layer(node: Node) -> Iterator[Layer]:
    from mmmesh.dataplane import SocketLayer

    run = Path(tempfile.mkdtemp(prefix="mmmesh-slq-"))  # sla.sock reachable by nobody
    run.chmod(0o755)
    with scratch_cgroup("qosd") as (path, rel):
        with inside(path):  # accepted sockets belong to their listener's cgroup
            lss = [listener() for _ in range(2)]
        cfg = yaml.safe_load(node.cfg.read_text())
        cfg.update(sla_socket=str(run / "sla.sock"), sla_controller_period_s=PERIOD_S,
                   sla_limits={"sender_rate": 20.0, "sender_burst": 100},
                   socket_layer={"enabled": True, "cgroup": rel, "stages": [{
                       "name": "asr", "id": STAGE, "endpoints": [
                           {"address": "127.0.0.1", "port": p, "replica": r,
                            "instance": f"asr-{r}"} for r, (_, p) in enumerate(lss)]}]})
        node.cfg.write_text(yaml.safe_dump(cfg))
        try:
            yield Layer(node, path, rel, lss)
        finally:
            node.stop(signal.SIGKILL)
            for ls, _ in lss:
                ls.close()
            SocketLayer(rel).down()
            shutil.rmtree(run, ignore_errors=True)


def test_loaded_adopted_after_kill9_left_on_stop_removed_by_cleanup(layer: Layer) -> None:
    node = layer.node
    node.start()
    st = layer.status()
    assert st["enabled"] and st["loaded"] and st["adopted"] is False, st
    assert st["attached"] == {"sockops": True, "sk_msg": True}, st
    assert st["endpoints"] == 2 and st["redirect"] is True and st["register"] is True
    ids = st["prog_ids"]
    assert set(ids) == {"sockops", "sk_msg"} and all(ids.values())
    pin_dir = st["pin_dir"]
    pins = sorted(os.listdir(pin_dir))

    # real sockets in the cgroup: registered, their frames counted per modality
    (c, s), _ = layer.pairs()
    for i in range(3):
        c.sendall(frame(AUDIO, 200, seq=i))
    assert [h.sequence for h, _ in read_frames(s, 3)] == [0, 1, 2]
    st = layer.status()
    assert st["flows"] >= 2 and st["modalities"]["audio"]["frames"] >= 3, st
    assert metric(node, "mmmesh_socklayer_up") == 1
    assert (metric(node, "mmmesh_socklayer_modality_frames_total", modality="audio") or 0) >= 3
    assert (metric(node, "mmmesh_socklayer_events_total", event="registered") or 0) >= 2

    # kill -9: the layer runs on; the next qosd adopts it
    node.stop(signal.SIGKILL)
    c.sendall(frame(AUDIO, 200, seq=3))
    assert [h.sequence for h, _ in read_frames(s, 1)] == [3]
    node.start()
    st = layer.status()
    assert st["adopted"] is True and st["prog_ids"] == ids, st
    assert st["pin_dir"] == pin_dir and sorted(os.listdir(pin_dir)) == pins
    c.sendall(frame(AUDIO, 200, seq=4))
    assert [h.sequence for h, _ in read_frames(s, 1)] == [4]
    assert layer.status()["modalities"]["audio"]["frames"] >= 5  # the same counters

    # a program detached behind qosd's back: the next resync attaches it again
    from mmmesh.dataplane import _sock

    with _sock.Attachment(pin_dir, layer.path) as att:
        att.detach()
    assert wait_for(lambda: layer.sl().status().attached == {"sockops": True, "sk_msg": True},
                    10), node.log()
    assert layer.status()["prog_ids"] == ids

    # redirect switched off in qosd.yaml: adopted, and the switch follows the file
    node.stop(signal.SIGKILL)
    cfg = yaml.safe_load(node.cfg.read_text())
    cfg["socket_layer"]["redirect"] = False
    node.cfg.write_text(yaml.safe_dump(cfg))
    node.start()
    st = layer.status()
    assert st["adopted"] is True and st["redirect"] is False and st["prog_ids"] == ids, st
    off = st["events"].get("off", 0)
    c.sendall(frame(AUDIO, 200, seq=5))
    assert [h.sequence for h, _ in read_frames(s, 1)] == [5]
    assert layer.status()["events"]["off"] == off + 1  # over TCP, still counted

    # stop: left as it is; --cleanup removes it
    node.stop()
    assert layer.sl().loaded()
    out = subprocess.run([str(VENV_BIN / "qosd"), "--config", str(node.cfg), "--cleanup"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "socket layer" in out, out
    assert not layer.sl().loaded() and not os.path.exists(pin_dir)
    c.sendall(frame(AUDIO, 200, seq=6))  # the connection goes on over TCP
    assert [h.sequence for h, _ in read_frames(s, 1)] == [6]
    c.close()
    s.close()


def windows(replica: int, attainment: float, p99: float) -> dict[str, Any]:
    from mmmesh.sla.sketch import encode_sketch, new_sketch

    sk = new_sketch()
    sk.add(p99, 500)
    return {"stage": "asr", "instance": f"asr-{replica}", "reports": [{
        "sla_class": "voice", "modality": "audio", "window_s": PERIOD_S, "frames": 500,
        "deadline_misses": int(500 * (1 - attainment)), "drops": 0, "errors": 0,
        "attainment": attainment, "sketch_e2e": encode_sketch(sk)}]}


def scraped_names(node: Node) -> set[str]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    addr = yaml.safe_load(node.cfg.read_text())["metrics_addr"]
    text = httpx.get(f"http://{addr}/metrics", timeout=10).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def kernel_weights(layer: Layer) -> tuple[int, ...] | None:
    w = layer.sl().weights().get(STAGE)
    return None if w is None else w[:2]


def wait_for(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(PERIOD_S / 4)
    return bool(pred())


def test_replica_weights_follow_the_replicas_reports(layer: Layer) -> None:
    node = layer.node
    node.start()
    assert node.put_policy(policy_yaml()).status_code == 200
    assert wait_for(lambda: kernel_weights(layer) == (100, 100), 10)  # equal, written once
    pairs = layer.pairs()

    # a hostile local process fakes replica 1's misses: refused, nothing moves
    sla_sock = yaml.safe_load(node.cfg.read_text())["sla_socket"]
    hostile = subprocess.run(
        [sys.executable, str(SENDER), sla_sock, "post", "--uid", "65534", "--count", "8",
         "--body", json.dumps(windows(1, 0.1, 900.0))],
        capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(hostile.stdout)["status"] == {"403": 8}, hostile.stdout
    time.sleep(3 * PERIOD_S)
    assert kernel_weights(layer) == (100, 100)

    # replica 0 misses, replica 1 keeps voice's objective: replica 0 is cut to the floor
    with reporting(node, windows(0, 0.5, 300.0), windows(1, 1.0, 30.0)):
        assert wait_for(lambda: kernel_weights(layer) == (25, 100), 30), (
            kernel_weights(layer), node.ctl("sla", "explain").stdout[-1500:])
    doc = json.loads(node.ctl("sla", "explain", "-o", "json", check=True).stdout)
    reps = doc["kernel"]["replicas"]["asr"]
    assert reps["stage_id"] == STAGE and reps["kernel"] == [25, 100], reps
    r0 = reps["replicas"][0]
    assert r0["weight"] == 25 and r0["verdict"] in ("miss", "no data"), r0
    assert any("missed 2 windows while replica(s) 1 did not" in h["why"]
               for h in r0["history"]), r0
    text = node.ctl("sla", "explain", check=True).stdout
    assert "replica weights of asr (stage 2)" in text and "replica 0: weight 25" in text, text
    assert metric(node, "mmmesh_socklayer_replica_weight", stage="asr", replica="0") == 25
    assert (metric(node, "mmmesh_controller_kernel_writes_total", target="replica_weights",
                   result="ok") or 0) >= 2
    assert layer.status()["weights"][str(STAGE)][:2] == [25, 100]

    # the kernel spreads one sender's frames over the replicas by those weights
    lead = pairs[0][0]
    n = 1000
    got = spread(lead, [s for _, s in pairs], [frame(AUDIO, 64, seq=i) for i in range(n)])
    assert [len(g) for g in got] == swrr_counts([25, 100], n) == [200, 800]
    names = scraped_names(node)  # frames went by: every family has samples
    assert set(SOCKLAYER_METRICS) <= names  # the whole table, as exported
    extra = {n for n in names if n.startswith("mmmesh_")} - exported_names(cluster=False)
    assert not extra, sorted(extra)

    # no more reports: back to equal
    assert wait_for(lambda: kernel_weights(layer) == (100, 100), 20), node.log()
    for c, s in pairs:
        c.close()
        s.close()


def test_bad_socket_layer_config_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "qosd.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path), "socket_layer": {
        "enabled": True, "stages": [{"name": "asr", "id": 2, "endpoints": [
            {"address": "10.1.0.7", "port": 7000, "replica": 9}]}]}}))
    r = subprocess.run([str(VENV_BIN / "qosd"), "--config", str(cfg)], check=False,
                       capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "socket_layer.stages.0.endpoints.0.replica" in r.stderr, r.stderr


def test_more_endpoints_than_the_socket_layer_holds_are_refused() -> None:
    """Each stage may list 64 endpoints and there may be 64 stages, but the
    kernel's endpoint map holds 1024: more is a config error naming the field,
    not an endpoint write failing (half done) at every resync."""
    from pydantic import ValidationError

    from qosd.config import SocketLayerConfig

    def stages(n: int) -> list[dict[str, object]]:
        return [{"name": f"s{i}", "id": i + 1, "endpoints": [
            {"address": f"10.{i}.{j // 250}.{j % 250 + 1}", "port": 7000} for j in range(64)]}
            for i in range(n)]

    assert len(SocketLayerConfig.model_validate({"stages": stages(16)}).stages) == 16  # 1024
    with pytest.raises(ValidationError, match=r"stages\[\]\.endpoints: 1088 in all"):
        SocketLayerConfig.model_validate({"stages": stages(17)})


def test_one_instance_for_two_replicas_is_refused() -> None:
    """An instance names one replica: otherwise its windows would judge only
    the last one listed and the other would never be judged (a silent
    copy-paste slip)."""
    from pydantic import ValidationError

    from qosd.config import SocketLayerConfig

    def stage(inst1: str) -> dict[str, object]:
        return {"stages": [{"name": "asr", "id": 2, "endpoints": [
            {"address": "10.1.0.7", "replica": 0, "instance": "asr-0"},
            {"address": "10.1.0.8", "replica": 1, "instance": inst1}]}]}

    assert SocketLayerConfig.model_validate(stage("asr-1")).stages[0].endpoints[1].replica == 1
    with pytest.raises(ValidationError, match=r"endpoints\[1\]\.instance 'asr-0'"):
        SocketLayerConfig.model_validate(stage("asr-0"))


def test_an_adopted_layer_keeps_no_weights_of_unweighted_stages() -> None:
    """A layer left by a qosd whose qosd.yaml had more stages (or replicas):
    the next qosd adopts it and removes the weights of the stages it does not
    weight (the SLA controller writes only its own, so they would keep
    splitting those stages' frames), leaving a weighted stage's."""
    from mmmesh.dataplane import SocketLayer
    from qosd.config import SocketLayerConfig
    from qosd.socklayer import SocketLayerHost

    with scratch_cgroup("prune") as (_, rel):
        try:
            SocketLayer(rel).up()
            for sid in (2, 3, 9):
                SocketLayer(rel).set_weights(sid, [25, 100])
            host = SocketLayerHost(SocketLayerConfig.model_validate({
                "enabled": True, "cgroup": rel, "stages": [
                    {"name": "asr", "id": 2, "endpoints": [
                        {"address": "10.1.0.7", "replica": 0},
                        {"address": "10.1.0.8", "replica": 1}]},
                    {"name": "tts", "id": 3, "endpoints": [  # down to one replica
                        {"address": "10.1.0.9", "replica": 0}]}]}))
            res = host.start()
            assert res is not None and res.adopted, host.error
            assert SocketLayer(rel).weights() == {2: (25, 100) + (0,) * 6}
        finally:
            SocketLayer(rel).down()


def test_a_missing_cgroup_is_reported_and_retried(node: Node) -> None:
    """qosd serves with the layer down, says why, and brings it up at a resync
    once the cgroup exists."""
    with scratch_cgroup("late") as (path, rel):
        os.rmdir(path)  # not there yet
        cfg = yaml.safe_load(node.cfg.read_text())
        cfg["socket_layer"] = {"enabled": True, "cgroup": rel}
        node.cfg.write_text(yaml.safe_dump(cfg))
        try:
            node.start()
            st = node.get("/v1/status").json()["socket_layer"]
            assert st["enabled"] and not st["loaded"] and "no cgroup" in st["error"], st
            os.mkdir(path)
            assert wait_for(lambda: node.get("/v1/status").json()["socket_layer"].get(
                "loaded") is True, 60), node.log()  # a first load compiles: seconds
            st = node.get("/v1/status").json()["socket_layer"]
            assert st["error"] is None and st["attached"] == {"sockops": True, "sk_msg": True}
        finally:
            node.stop(signal.SIGKILL)
            from mmmesh.dataplane import SocketLayer

            if os.path.isdir(path):
                SocketLayer(rel).down()
