"""Outputs with several replicas: one connection (lane) per replica, frames
spread by weight over them.

* the config: ``replicas``, ``weights``, ``spread``, errors naming the field;
* the user-space pick is the socket layer's law (``tests/socklayer_kit.
  swrr_counts`` is the kernel's reference model);
* ``spread: user`` on loopback: 10 000 frames of mixed sizes arrive
  byte-exact, in order on every lane, split by the weights;
* a replica (a real sidecar process) killed with SIGKILL: its share goes to
  the others, nothing sent after the loss is lost, and it gets its share back
  once it is restarted;
* ``spread: kernel`` with the real socket layer in a cgroup of the test's
  own (redirect on, ``set_weights``): a real sidecar process writes every
  frame on its lead lane and the kernel splits 10 000 frames by the weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from mmmesh.wire import Header
from sidecar.config import Limits, Output, SidecarConfig
from sidecar.transport import FrameSender
from sidecar.transport.spread import Swrr
from testkit.sidecar_stages import Sink, free_port, run, tensor_header, wait_for
from testkit.socklayer_kit import swrr_counts

ROOT = Path(__file__).resolve().parents[2]


def output(**kw: Any) -> Output:
    return Output.model_validate({"name": "next", "modality": "tensor", "sla_class": "video",
                                  **kw})


# -- config ---------------------------------------------------------------------
def test_config_replicas_weights_and_spread() -> None:
    o = output(replicas=["127.0.0.1:9001", "[::1]:9002", "fusion.ns.svc:9003"],
               weights=[5, 3, 0])
    assert o.addresses == ("127.0.0.1:9001", "[::1]:9002", "fusion.ns.svc:9003")
    assert o.lane_weights == (5, 3, 0) and o.spread == "user"
    assert output(address="127.0.0.1:9").lane_weights == (1,)
    assert output(replicas=["127.0.0.1:1", "127.0.0.1:2"], spread="kernel").spread == "kernel"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"replicas": ["127.0.0.1:1", "nope"]}, r"replicas\[1\] 'nope': expected host:port"),
        ({"replicas": ["127.0.0.1:1", "127.0.0.1:70000"]}, r"replicas\[1\]"),
        ({"replicas": [f"127.0.0.1:{p}" for p in range(1, 10)]}, r"replicas: 1 to 8"),
        ({"replicas": []}, r"replicas: 1 to 8"),
        ({"replicas": ["127.0.0.1:1", "127.0.0.1:1"]}, r"replicas\[1\] .*listed twice"),
        ({"replicas": ["127.0.0.1:1", "127.0.0.1:01"]}, r"replicas\[1\] .*listed twice"),
        ({"replicas": ["[::1]:1", "[0::1]:1"]}, r"replicas\[1\] .*listed twice"),
        ({"replicas": ["Next.ns:1", "next.ns:1"]}, r"replicas\[1\] .*listed twice"),
        ({"replicas": ["127.0.0.1:1"], "weights": [1, 2]}, r"weights: 2 for 1 replicas"),
        ({"replicas": ["127.0.0.1:1"], "weights": [70000]}, r"weights\[0\]: 70000"),
        ({"replicas": ["127.0.0.1:1"], "weights": [0]}, r"weights: at least one"),
        ({"replicas": ["127.0.0.1:1"], "weights": [1], "spread": "kernel"},
         r"weights: spread kernel takes the socket layer's"),
        ({"address": "127.0.0.1:1", "replicas": ["127.0.0.1:2"]}, r"either address or replicas"),
        ({}, r"either address or replicas"),
        ({"address": "127.0.0.1:1", "weights": [1]}, r"weights: only with replicas"),
        ({"address": "127.0.0.1:1", "spread": "kernel"}, r"spread: kernel needs replicas"),
        ({"replicas": ["127.0.0.1:1"], "transport": "udp"}, r"replicas: only with transport tcp"),
        ({"replicas": ["127.0.0.1:1"], "spread": "both"}, r"spread"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValidationError, match=msg):
            output(**kw)
    # in a whole config, the error names the output's field
    with pytest.raises(ValidationError, match=r"outputs\.0\.replicas"):
        SidecarConfig.model_validate({"stage": "a", "runner": {"kind": "python", "target": "m:f"},
                                      "outputs": [{"name": "n", "replicas": "127.0.0.1:1",
                                                   "modality": "tensor", "sla_class": "v"}]})


def test_the_documented_replicas_output_is_valid() -> None:
    import re

    doc = (ROOT / "docs" / "sidecar.md").read_text()
    section = doc[doc.index("## Replicas and lanes"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block, "docs/sidecar.md: no yaml example under 'Replicas and lanes'"
    (o,) = [Output.model_validate(x) for x in yaml.safe_load(block.group(1))["outputs"]]
    assert len(o.addresses) == 3 and o.lane_weights == (5, 3, 2) and o.spread == "user"


# -- the pick ----------------------------------------------------------------------
def test_user_space_pick_is_the_kernels_law() -> None:
    rng = np.random.default_rng(7)
    cases = [[5, 3, 2], [1, 1], [1, 0, 1], [65535, 1], [7], [3, 1, 4, 1, 5, 9, 2, 6]]
    cases += [list(rng.integers(0, 20, size=int(rng.integers(1, 9)))) for _ in range(20)]
    for weights in cases:
        if not any(weights):
            continue
        s = Swrr(weights)
        for n in (1, 7, 100, 1013):
            got = [0] * len(weights)
            s = Swrr(weights)
            for _ in range(n):
                i = s.pick()
                assert i is not None
                got[i] += 1
            assert got == swrr_counts([int(w) for w in weights], n), (weights, n)
    # a lane that is down is out of the pick: the others share its frames by weight
    s = Swrr([5, 3, 2])
    got = [0, 0, 0]
    for _ in range(700):
        i = s.pick([True, False, True])
        assert i is not None
        got[i] += 1
    assert got == [500, 0, 200]
    assert Swrr([0, 1]).pick([True, False]) is None


# -- spread: user on loopback ----------------------------------------------------------
def _payload(seq: int, n: int) -> np.ndarray:
    seed = hashlib.sha256(seq.to_bytes(8, "little")).digest()
    return np.frombuffer((seed * (n // 32 + 1))[:n], np.uint8).copy()


def _within(counts: list[int], weights: list[int], n: int, tol: float = 0.05) -> bool:
    total = sum(weights)
    return all(abs(c - n * w / total) <= tol * n * w / total for c, w in zip(counts, weights))


def test_user_spread_is_byte_exact_in_order_and_weighted() -> None:
    n, weights = 10_000, [5, 3, 2]
    rng = np.random.default_rng(11)
    sizes = [int(rng.choice((rng.integers(0, 64), rng.integers(64, 4096),
                             rng.integers(4096, 65536)))) for _ in range(n)]
    sizes[100], sizes[5000] = 4 << 20, 1 << 20

    async def main() -> None:
        sinks = [await Sink(maxsize=n + 1).start() for _ in weights]
        o = output(replicas=[f"127.0.0.1:{s.port}" for s in sinks], weights=weights)
        sender = FrameSender(o, Limits())
        await sender.start()
        try:
            for i, size in enumerate(sizes):
                h = Header(modality=7, stream_id=3, sequence=i)
                await sender.send(h, _payload(i, size))
            assert await sender.flush(60)
            await wait_for(lambda: sum(s.queue.qsize() for s in sinks) == n, 30,
                           "every frame at a replica")
            c = sender.counters
            assert c.frames_out == n and c.lanes_up == 3 and c.connected
            assert [lc.frames_out for lc in c.lanes] == [s.queue.qsize() for s in sinks]
            counts = []
            for s in sinks:
                seqs = []
                while not s.queue.empty():
                    f = s.queue.get_nowait()
                    seq = f.header.sequence
                    assert seq is not None
                    assert bytes(f.payload) == _payload(seq, sizes[seq]).tobytes(), seq
                    seqs.append(seq)
                assert seqs == sorted(seqs)  # in order on every lane
                counts.append(len(seqs))
            assert _within(counts, weights, n), counts
            assert counts == swrr_counts(weights, n)  # the kernel's pick, exactly
            snap = c.snapshot()
            assert [lane["address"] for lane in snap["lanes"]] == list(o.addresses)
            # scraped: frames per lane, and each lane up
            from prometheus_client import CollectorRegistry, generate_latest

            from sidecar.sla.prometheus import CountersCollector

            class Counters:
                def snapshot(self) -> dict[str, Any]:
                    return {"senders": {"next": c.snapshot()}}

            reg = CollectorRegistry()
            reg.register(CountersCollector("st", Counters()))
            text = generate_latest(reg).decode()
            for i, (a, k) in enumerate(zip(o.addresses, counts)):
                lv = f'address="{a}",output="next",replica="{i}",stage="st"'
                assert f"mmmesh_sidecar_lane_frames_sent_total{{{lv}}} {float(k)}" in text, text
                assert f"mmmesh_sidecar_lane_up{{{lv}}} 1.0" in text
        finally:
            await sender.close()
            for s in sinks:
                await s.close()

    run(main(), timeout=180)


def test_frames_of_a_lane_that_breaks_move_whole() -> None:
    """Replica 1 takes a connection and never reads: its lane fills up, one
    frame cut off mid-write.  The replica resets the connection: the cut frame
    and the ones queued behind it move whole to the other lanes; nothing
    arrives torn, nothing twice, and only what the dead socket had taken
    whole is missing."""
    import struct

    n, size = 60, 1 << 20

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sinks = [await Sink(maxsize=n + 1).start() for _ in range(2)]
        mute = socket.create_server(("127.0.0.1", 0))
        mute.setblocking(False)
        addrs = [f"127.0.0.1:{p}" for p in (sinks[0].port, mute.getsockname()[1], sinks[1].port)]
        sender = FrameSender(output(replicas=addrs), Limits())
        await sender.start()
        conn, _ = await loop.sock_accept(mute)
        lane = sender.lanes[1]
        try:
            feed = loop.create_task(_send_sized(sender, n, size))
            await wait_for(lambda: bool(lane.batch) and lane.batch[0].started, 10,
                           "a frame cut off on lane 1")
            assert not feed.done()  # the whole output waits for the lane (strict weights)
            mute.close()  # the replica is gone: no reconnect
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST
            await asyncio.wait_for(feed, 30)
            assert await sender.flush(30)
            lost = lane.counters.frames_out  # taken whole by the dead socket, never read
            assert lane.counters.moved >= 1 and not lane.up
            got = []
            await wait_for(lambda: sum(s.queue.qsize() for s in sinks) == n - lost, 10,
                           "every other frame")
            for s in sinks:
                while not s.queue.empty():
                    f = s.queue.get_nowait()
                    assert f.header.sequence is not None
                    assert bytes(f.payload) == _payload(f.header.sequence, size).tobytes()
                    got.append(f.header.sequence)
                assert s.server.counters.malformed == {}  # nothing torn
            assert len(got) == len(set(got)) == n - lost  # nothing twice
        finally:
            await sender.close()
            for s in sinks:
                await s.close()
            mute.close()

    run(main(), timeout=60)


def test_a_frame_send_cut_off_moves_whole_when_the_lane_closes() -> None:
    """``send()`` writes part of a big frame itself (the rest queued on lane
    0), and the loop learns that replica 0 closed before the lane's writer
    ran: the frame moves to lane 1 whole, not from where the dead connection
    stopped (that tail would tear lane 1's stream)."""
    import select

    size = 16 << 20

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sink = await Sink(maxsize=4).start()
        closer = socket.create_server(("127.0.0.1", 0))
        closer.setblocking(False)
        addrs = [f"127.0.0.1:{closer.getsockname()[1]}", f"127.0.0.1:{sink.port}"]
        sender = FrameSender(output(replicas=addrs), Limits())
        await sender.start()
        conn, _ = await loop.sock_accept(closer)
        lane = sender.lanes[0]
        try:
            await wait_for(lambda: all(x.counters.connected for x in sender.lanes)
                           and sender.ready.is_set(), 10, "both lanes connected")
            conn.shutdown(socket.SHUT_WR)  # replica 0 closes (FIN), never reads
            sock = lane._sock
            assert sock is not None
            assert select.select([sock], [], [], 5)[0]  # the FIN is there for the loop
            await asyncio.sleep(0)  # its readable event is now queued ahead of what we do
            assert await sender.send(Header(modality=7, stream_id=4, sequence=0),
                                     _payload(0, size))
            assert lane.counters.frames_out == 0  # only part of it went (the fast path)
            f = await sink.get(20)
            assert f.header.sequence == 0
            assert bytes(f.payload) == _payload(0, size).tobytes()  # whole, from its start
            assert sink.server.counters.malformed == {}
            assert lane.counters.moved == 1 and sender.lanes[1].counters.frames_out == 1
        finally:
            await sender.close()
            await sink.close()
            conn.close()
            closer.close()

    run(main(), timeout=60)


def test_a_lane_of_weight_0_takes_no_frames_of_a_lane_that_is_down() -> None:
    """Weights 1:0 and replica 0 refuses: the lane of weight 0 is up but gets
    no frames, so replica 0's frames stay on its lane (nothing "moved")."""

    async def main() -> None:
        sink = await Sink(maxsize=4).start()
        dead = free_port()
        sender = FrameSender(output(replicas=[f"127.0.0.1:{dead}", f"127.0.0.1:{sink.port}"],
                                    weights=[1, 0]), Limits())
        await sender.start()
        try:
            for i in range(3):  # before the first connect fails: queued on lane 0
                await sender.send(Header(modality=7, stream_id=5, sequence=i), b"x" * 10)
            lane0, lane1 = sender.lanes
            await wait_for(lambda: not lane0.up and lane1.counters.connected, 10,
                           "lane 0 down, lane 1 connected")
            await asyncio.sleep(0.2)
            assert lane1.counters.frames_out == 0 and sink.queue.empty()
            assert lane0.counters.moved == 0 and lane0.queue.qsize() == 3
            assert not await sender.flush(0.1)  # they wait for replica 0
        finally:
            await sender.close()
            await sink.close()
        assert sender.counters.dropped_other == 3  # counted when closed

    run(main(), timeout=30)


async def _send_sized(sender: FrameSender, n: int, size: int) -> None:
    for i in range(n):
        await sender.send(Header(modality=7, stream_id=2, sequence=i), _payload(i, size))


# -- real sidecar processes ------------------------------------------------------------------
@contextlib.contextmanager
def sidecar_process(tmp: Path, name: str, port: int, outputs: list[dict[str, Any]],
                    cgroup: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``mmmesh-sidecar`` (identity stage) on 127.0.0.1:``port``,
    started inside ``cgroup`` when given; killed at the end."""
    cfg = {"stage": name, "listen": {"tcp": f"127.0.0.1:{port}"},
           "runner": {"kind": "python", "target": "testkit.sidecar_stages:identity"},
           "outputs": outputs, "qosd": {"socket": None},
           "limits": {"outbound_queue": 1024, "inbound_queue": 1024}}
    path = tmp / f"{name}-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp / f"{name}-{port}.log", "ab")  # noqa: SIM115  (closed below)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "sidecar.main", "--config", str(path), "--log-level", "info"]
    if cgroup is not None:
        from testkit.socklayer_kit import inside

        with inside(cgroup):  # the child is born in the cgroup, and its sockets with it
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    else:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        end = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp / f"{name}-{port}.log").read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < end, f"sidecar {name} did not listen on {port}"
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


async def _collect(sink: Sink, n: int, timeout: float = 30) -> dict[int, list[int]]:
    """``n`` frames from the collector: sequences by replica (the class byte
    each replica's sidecar puts on its output is 10 + its index)."""
    got: dict[int, list[int]] = {}
    for _ in range(n):
        f = await sink.get(timeout)
        seq = f.header.sequence
        assert seq is not None
        assert bytes(f.payload) == _payload(seq, 256).tobytes(), seq
        got.setdefault(f.header.sla_class - 10, []).append(seq)
    return got


async def _send(sender: FrameSender, seqs: range) -> None:
    for i in seqs:
        a = _payload(i, 256)
        await sender.send(tensor_header(a, stream_id=5, seq=i), a)
    assert await sender.flush(30)


def test_killed_replica_share_goes_to_the_others_and_comes_back(tmp_path: Path) -> None:
    weights = [5, 3, 2]
    ports = [free_port() for _ in weights]

    async def main() -> None:
        collector = await Sink(maxsize=100_000).start()
        outs = [[{"name": "collect", "address": f"127.0.0.1:{collector.port}",
                  "modality": "tensor", "sla_class": "video", "sla_class_id": 10 + i}]
                for i in range(len(weights))]
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(sidecar_process(tmp_path, f"rep{i}", p, outs[i]))
                     for i, p in enumerate(ports)]
            o = output(replicas=[f"127.0.0.1:{p}" for p in ports], weights=weights)
            sender = FrameSender(o, Limits(), backoff_initial=0.05, backoff_max=0.2)
            await sender.start()
            lanes = sender.counters.lanes
            try:
                await _send(sender, range(1000))
                got = await _collect(collector, 1000)
                assert {r: len(s) for r, s in got.items()} == {0: 500, 1: 300, 2: 200}
                assert all(s == sorted(s) for s in got.values())

                procs[1].kill()  # SIGKILL: the replica's connection is gone
                procs[1].wait(10)
                await wait_for(lambda: not lanes[1].up, 10, "lane 1 down")
                await _send(sender, range(1000, 2000))
                got = await _collect(collector, 1000)  # nothing lost
                assert 1 not in got, "a frame went to the killed replica"
                assert _within([len(got[0]), len(got[2])], [5, 2], 1000), got.keys()
                assert all(s == sorted(s) for s in got.values())
                assert sender.counters.lanes_up == 2
                # (its writer retries in the background: on a busy host the
                # first refused connect can come after the frames went through)
                await wait_for(lambda: lanes[1].connect_failures >= 1, 15, "lane 1 retrying")

                with sidecar_process(tmp_path, "rep1", ports[1], outs[1]):
                    await wait_for(lambda: lanes[1].up and lanes[1].connected, 15,
                                   "lane 1 back")
                    assert lanes[1].reconnects == 1
                    await _send(sender, range(2000, 3000))
                    got = await _collect(collector, 1000)
                    counts = [len(got.get(r, [])) for r in range(3)]
                    assert _within(counts, weights, 1000), counts  # its share is back
                    assert all(s == sorted(s) for s in got.values())
                assert sender.counters.frames_out == 3000
                assert sender.counters.dropped_other == 0
            finally:
                await sender.close()
                await collector.close()

    run(main(), timeout=240)


# -- spread: kernel with the real socket layer ------------------------------------------------
@pytest.fixture(scope="module")
def layer() -> Iterator[tuple[str, Any]]:
    """The real socket layer on a cgroup of the test's own: (path, SocketLayer);
    one for the module, each test on a stage of its own."""
    from mmmesh.dataplane import SocketLayer
    from testkit.privileged import require_privileged
    from testkit.socklayer_kit import scratch_cgroup

    require_privileged()
    with scratch_cgroup("lanes") as (path, rel):
        sl = SocketLayer(rel)
        sl.up([])
        try:
            yield path, sl
        finally:
            sl.down()


async def _replica(path: str, port: int = 0) -> Sink:
    """A replica's receiving end, its listening socket made inside the cgroup
    (an accepted socket belongs to its listener's cgroup)."""
    from testkit.socklayer_kit import inside

    with inside(path):
        return await Sink(tcp=f"127.0.0.1:{port}", maxsize=100_000).start()


def _take(sinks: list[Sink]) -> list[list[int]]:
    """Every frame the replicas hold now: sequences per replica, each checked
    byte for byte and in order."""
    out = []
    for s in sinks:
        seqs = []
        while not s.queue.empty():
            f = s.queue.get_nowait()
            seq = f.header.sequence
            assert seq is not None
            assert bytes(f.payload) == _payload(seq, 64).tobytes(), seq
            seqs.append(seq)
        assert seqs == sorted(seqs)  # in order at every replica
        out.append(seqs)
    return out


async def _feed(w: asyncio.StreamWriter, sinks: list[Sink], seqs: range) -> None:
    """Frames ``seqs`` into the sender sidecar, until all are at the replicas."""
    held = sum(s.queue.qsize() for s in sinks)
    for k in range(seqs.start, seqs.stop, 500):
        w.write(b"".join(_frame_bytes(i) for i in range(k, min(k + 500, seqs.stop))))
        await w.drain()
    await wait_for(lambda: sum(s.queue.qsize() for s in sinks) == held + len(seqs), 60,
                   "every frame at a replica")


def _kernel_output(sinks: list[Sink]) -> list[dict[str, Any]]:
    return [{"name": "next", "replicas": [f"127.0.0.1:{s.port}" for s in sinks],
             "spread": "kernel", "modality": "tensor", "sla_class": "video"}]


def _lanes(sl: Any, stage: int) -> list[Any]:
    return [f for f in sl.flows() if f.stage == stage and f.role == "client"]


@pytest.mark.privileged
def test_kernel_spread_from_a_real_sidecar(tmp_path: Path, layer: tuple[str, Any]) -> None:
    """A real sidecar process in a cgroup with the socket layer attached
    writes all its frames on its lead lane; the kernel redirects them to the
    replicas by the weights qosd would write (set_weights)."""
    from mmmesh.dataplane import Endpoint

    path, sl = layer
    n, weights, stage = 10_000, [5, 3, 2], 41

    async def main() -> None:
        sinks = [await _replica(path) for _ in weights]
        sl.set_endpoints([Endpoint("127.0.0.1", s.port, stage, r) for r, s in enumerate(sinks)])
        sl.set_weights(stage, weights)
        before = sl.stats().events
        port = free_port()
        try:
            with sidecar_process(tmp_path, "lead", port, _kernel_output(sinks), cgroup=path):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                await _feed(w, sinks, range(n))
                w.close()
                flows = _lanes(sl, stage)
                assert sorted(f.replica for f in flows) == [0, 1, 2]  # one lane each
                assert not any("sent_tcp" in f.flags for f in flows)  # no lane wrote TCP
            counts = [len(x) for x in _take(sinks)]
            assert _within(counts, weights, n), counts
            print(f"kernel split of {n} frames: {counts} (model {swrr_counts(weights, n)})")
            d = {k: v - before.get(k, 0) for k, v in sl.stats().events.items()}
            # the kernel moved every frame (none over TCP), each to a lane it knew
            assert d["redirected"] == d["frames"] == n and d["passed"] == 0, d
            assert d["lane_miss"] == d["not_lead"] == d["split_header"] == 0, d
        finally:
            for s in sinks:
                await s.close()

    run(main(), timeout=180)


@pytest.mark.privileged
def test_kernel_spread_survives_the_lead_replica(tmp_path: Path, layer: tuple[str, Any]) -> None:
    """The lead lane's replica goes away: the next lane becomes the lead (the
    old one's claim is released at once), the kernel sends the lost replica's
    share to the lead's own replica (lane_miss), nothing is lost; back, the
    replica gets its share again on its new lane."""
    from mmmesh.dataplane import Endpoint

    path, sl = layer
    n, weights, stage = 2000, [5, 3, 2], 42

    async def main() -> None:
        sinks = [await _replica(path) for _ in weights]
        sl.set_endpoints([Endpoint("127.0.0.1", s.port, stage, r) for r, s in enumerate(sinks)])
        sl.set_weights(stage, weights)
        port = free_port()
        try:
            with sidecar_process(tmp_path, "lead", port, _kernel_output(sinks), cgroup=path):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                await _feed(w, sinks, range(n))
                assert [len(x) for x in _take(sinks)] == [1000, 600, 400]

                gone = sinks[0].port
                await sinks[0].close()  # replica 0, the lead's, goes away
                await wait_for(lambda: 0 not in [f.replica for f in _lanes(sl, stage)], 10,
                               "lane 0 closed")
                before = sl.stats().events
                await _feed(w, sinks, range(n, 2 * n))
                got = _take(sinks)
                d = {k: v - before.get(k, 0) for k, v in sl.stats().events.items()}
                assert got[0] == [] and len(got[1]) + len(got[2]) == n  # nothing lost
                assert _within([len(got[1]), len(got[2])], [8, 2], n), got  # 0's share -> lead's
                assert d["redirected"] == n and d["not_lead"] == 0, d
                assert abs(d["lane_miss"] - n // 2) <= 0.05 * n // 2, d

                sinks[0] = await _replica(path, gone)  # back on its address
                await wait_for(lambda: 0 in [f.replica for f in _lanes(sl, stage)], 15,
                               "lane 0 reconnected")
                await _feed(w, sinks, range(2 * n, 3 * n))
                counts = [len(x) for x in _take(sinks)]
                assert _within(counts, weights, n), counts  # its share is back
                w.close()
        finally:
            for s in sinks:
                await s.close()

    run(main(), timeout=180)


def _frame_bytes(i: int) -> bytes:
    from testkit.sidecar_stages import frame_bytes

    a = _payload(i, 64)
    return frame_bytes(tensor_header(a, stream_id=9, seq=i), a)
