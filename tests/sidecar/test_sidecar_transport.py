"""Sidecar transport + stage on loopback: round trips, zero-copy send, hostile
peers, error frames, real-time deadlines, reconnect, graceful drain, UDP."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import numpy as np
import pytest

from mmmesh.abi import Flag
from mmmesh.wire import Header, frame
from sidecar.config import Limits, Output
from sidecar.contract import ErrorCode, tensor_from_frame
from sidecar.main import Sidecar
from sidecar.runners import make_runner
from sidecar.transport import FrameSender
from sidecar.transport import lane as lane_module
from testkit.sidecar_stages import (
    ListSink,
    Sink,
    closed_by_peer,
    connect,
    double,
    frame_bytes,
    free_port,
    make_cfg,
    out,
    reset_peak_rss,
    run,
    tensor_header,
    vm_kib,
    wait_for,
)

ARRAYS = [
    np.arange(12, dtype=np.uint8).reshape(3, 4),
    np.array([-3, 0, 7, 300, -32000], dtype=np.int16),
    np.arange(24, dtype=np.int32).reshape(2, 3, 4),
    np.array(42, dtype=np.int64),  # a scalar: shape ()
    np.linspace(-1, 1, 8).astype(np.float16),
    np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32),
    np.random.default_rng(2).standard_normal((2, 2, 2, 2)),
    np.array([True, False, True]),
    np.array([2**40, 5], dtype=np.uint64),
    np.zeros((0, 3), dtype=np.float32),  # empty tensor
    np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32),  # 4 MiB
]


def test_round_trip_dtypes_and_shapes() -> None:
    async def main() -> None:
        sink = await Sink().start()
        sla = ListSink()
        cfg = make_cfg("dbl", "double", [out(sink.port, sla_class_id=5, deadline_ms=250)])
        async with Sidecar(cfg, sink=sla) as sc:
            _, w = await connect(sc.port)
            ts = time.time_ns() - 1_000_000
            # one burst on one connection: several frames per recv, and a 4 MiB one
            w.write(b"".join(frame_bytes(tensor_header(a, stream_id=9, seq=i, timestamp_ns=ts), a)
                             for i, a in enumerate(ARRAYS)))
            await w.drain()
            got = await sink.get_n(len(ARRAYS))
            for i, (a, f) in enumerate(zip(ARRAYS, got, strict=True)):
                h = f.header
                assert (h.stream_id, h.sequence) == (9, i)
                assert h.timestamp_ns == ts and h.deadline_ns == ts + 250_000_000
                assert h.sla_class == 5 and h.modality_name == "tensor"
                y = tensor_from_frame(h, f.payload)
                want = double(a)
                assert y.dtype == want.dtype and y.shape == want.shape
                np.testing.assert_array_equal(y, want)
            w.close()
            assert sc.counters.server.frames_in == len(ARRAYS)
            assert sc.counters.senders["next"].frames_out == len(ARRAYS)
        assert len(sla.samples) == len(ARRAYS)
        assert all(s.stage == "dbl" and s.e2e_ns and s.e2e_ns >= 1_000_000 for s in sla.samples)
        await sink.close()

    run(main())


def test_sender_does_not_copy_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB through a FrameSender: the payload handed to sendmsg is a view of
    the array, and the process's peak RSS does not grow by the tensor's size."""
    seen: list[list[object]] = []
    real_frame = lane_module.frame

    def spy(h: Header, payload: object = b"") -> list[bytes | memoryview]:
        bufs = real_frame(h, payload)  # type: ignore[arg-type]
        seen.append(bufs)  # type: ignore[arg-type]
        return bufs

    monkeypatch.setattr(lane_module, "frame", spy)
    big = np.ones(16 << 20, dtype=np.float32)  # 64 MiB, pages touched
    received = 0

    async def main() -> None:
        nonlocal received
        loop = asyncio.get_running_loop()
        lsock = socket.create_server(("127.0.0.1", 0))
        lsock.setblocking(False)

        async def drain_peer() -> None:
            nonlocal received
            conn, _ = await loop.sock_accept(lsock)
            conn.setblocking(False)
            buf = bytearray(1 << 20)
            while n := await loop.sock_recv_into(conn, buf):
                received += n
            conn.close()

        reader = asyncio.create_task(drain_peer())
        o = Output(name="big", address=f"127.0.0.1:{lsock.getsockname()[1]}",
                   modality="tensor", sla_class="video")
        s = FrameSender(o, Limits(max_frame_bytes=128 << 20))
        await s.start()
        reset_peak_rss()
        base = vm_kib("VmRSS")
        assert await s.send(tensor_header(big), big)
        assert await s.flush(20)
        peak = vm_kib("VmHWM")
        await s.close()
        await asyncio.wait_for(reader, 10)
        lsock.close()
        assert s.counters.frames_out == 1
        # the bug: a copy of the tensor on the way to the socket (bytes(array), a
        # joined header + payload) adds the tensor's whole size to the peak.  A
        # quarter of it (16 MiB) is room for the allocator, the peer's 1 MiB read
        # buffer and the event loop; RSS does not grow with CPU load.
        grew_kib = peak - base
        assert grew_kib < big.nbytes // 4 // 1024, f"peak RSS grew by {grew_kib // 1024} MiB"

    run(main())
    assert received == len(seen[0][0]) + big.nbytes  # type: ignore[arg-type]
    payload = seen[0][1]
    assert isinstance(payload, memoryview) and payload.nbytes == big.nbytes
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), big)


def _stall_bytes() -> bytes:
    a = np.zeros(1000, dtype=np.float32)
    return frame_bytes(tensor_header(a), a)[:2000]  # header + half the payload


BAD_PEERS = {
    "bad_magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad_version": b"MMH\x02" + bytes(20),
    "bad_header": struct.pack("!IBBBBI", 0x4D4D4801, 15, 7, 0, 0, 0) + bytes([1, 1, 0]),
    "oversized": struct.pack("!IBBBBI", 0x4D4D4801, 12, 7, 0, 0, 2 << 20),
    "truncated": _stall_bytes(),  # then EOF
    "read_timeout": _stall_bytes(),  # then silence
}


def test_hostile_peers_are_cut_off_alone() -> None:
    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("id", "identity", [out(sink.port)],
                       limits={"read_timeout_s": 0.5, "max_frame_bytes": 1 << 20})
        async with Sidecar(cfg) as sc:
            good_r, good_w = await connect(sc.port)
            sent = 0

            async def keep_sending() -> None:
                nonlocal sent
                while True:
                    a = np.array([sent], dtype=np.int32)
                    good_w.write(frame_bytes(tensor_header(a, stream_id=1, seq=sent), a))
                    await good_w.drain()
                    sent += 1
                    await asyncio.sleep(0.02)

            feeder = asyncio.create_task(keep_sending())
            bad = {}
            for reason, data in BAD_PEERS.items():
                r, w = await connect(sc.port)
                w.write(data)
                await w.drain()
                if reason == "truncated":
                    w.write_eof()
                bad[reason] = (r, w)
            t0 = time.monotonic()
            for reason, (r, w) in bad.items():
                assert await closed_by_peer(r, timeout=3), reason
                w.close()
            assert time.monotonic() - t0 >= 0.4  # the staller was given its read timeout
            await asyncio.sleep(0.2)
            feeder.cancel()
            n = sent
            got = await sink.get_n(n)
            assert [int(tensor_from_frame(f.header, f.payload)[0]) for f in got] == list(range(n))
            assert n >= 20
            c = sc.counters.server
            for reason in BAD_PEERS:
                assert c.conn_closed[reason] == 1, (reason, c.conn_closed)
            assert c.malformed == {"bad_magic": 1, "bad_version": 1, "bad_header": 1,
                                   "oversized": 1, "truncated": 1}
            assert c.connections_open == 1  # the good one
            assert not good_r.at_eof()
            good_w.close()
        await sink.close()

    run(main())


def test_error_frames_timeouts_and_recovery() -> None:
    async def main() -> None:
        sink = await Sink().start()
        failing = make_cfg("f", "fail", [out(sink.port)])
        hanging = make_cfg("h", "hang", [out(sink.port)], timeout_s=0.3)
        async with Sidecar(failing) as f, Sidecar(hanging) as h:
            for sc, poison, code in ((f, 13, ErrorCode.STAGE_FAILED),
                                     (h, 7, ErrorCode.STAGE_TIMEOUT)):
                _, w = await connect(sc.port)
                for seq, v in enumerate([1, poison, 2]):
                    a = np.array([v], dtype=np.int64)
                    w.write(frame_bytes(tensor_header(a, stream_id=3, seq=seq), a))
                # not a tensor: BAD_INPUT
                w.write(frame_bytes(Header(modality=7, stream_id=3, sequence=3), b"abcd"))
                await w.drain()
                got = await sink.get_n(4)
                by_seq = {g.header.sequence: g for g in got}
                assert int(tensor_from_frame(by_seq[0].header, by_seq[0].payload)[0]) == 1
                assert int(tensor_from_frame(by_seq[2].header, by_seq[2].payload)[0]) == 2
                err = by_seq[1].header
                assert err.flags & Flag.ERROR and err.error is not None
                assert err.error[0] == code and err.stream_id == 3
                assert err.error[1].startswith(sc.cfg.stage + ":")
                if code == ErrorCode.STAGE_FAILED:
                    assert "ZeroDivisionError: unlucky input" in err.error[1]
                assert len(by_seq[1].payload) == 0
                assert by_seq[3].header.error is not None
                assert by_seq[3].header.error[0] == ErrorCode.BAD_INPUT
                assert sc.counters.stage.errors[code.name] == 1
                w.close()
        # an error frame arriving from upstream is forwarded, not run
        async with Sidecar(make_cfg("fw", "double", [out(sink.port)])) as fw:
            _, w = await connect(fw.port)
            w.write(frame_bytes(Header(modality=7, flags=Flag.ERROR, stream_id=4, sequence=8,
                                       error=(int(ErrorCode.STAGE_FAILED), "x: boom"))))
            await w.drain()
            g = await sink.get()
            assert g.header.error == (ErrorCode.STAGE_FAILED, "x: boom")
            assert (g.header.stream_id, g.header.sequence) == (4, 8)
            assert fw.counters.stage.errors["UPSTREAM"] == 1
            w.close()
        await sink.close()

    run(main())


def test_realtime_deadlines_drop_instead_of_late() -> None:
    async def main() -> None:
        sink = await Sink().start()
        sla = ListSink()
        cfg = make_cfg("rt", "slow_echo", [out(sink.port, realtime=True, sla_class="voice")])
        async with Sidecar(cfg, sink=sla) as sc:
            _, w = await connect(sc.port)
            now = time.time_ns()
            a = np.array([1.0], dtype=np.float32)
            for seq, deadline in enumerate([now - 1_000_000,  # already missed: stage drops
                                            now + 100_000_000,  # missed while running: sender
                                            now + 10_000_000_000]):  # in time
                w.write(frame_bytes(tensor_header(a, seq=seq, deadline_ns=deadline), a))
            await w.drain()
            g = await sink.get()
            assert g.header.sequence == 2
            await asyncio.sleep(0.1)
            assert sink.queue.empty()
            assert sc.counters.stage.dropped_deadline == 1
            assert sc.counters.senders["next"].dropped_deadline == 1
            dropped = [s for s in sla.samples if s.dropped]
            assert len(dropped) == 2 and all(s.deadline_missed for s in dropped)
            w.close()
        await sink.close()

    run(main())


def test_reconnects_with_backoff_after_downstream_restart() -> None:
    async def main() -> None:
        port = free_port()
        sink = await Sink(tcp=f"127.0.0.1:{port}").start()
        async with Sidecar(make_cfg("rc", "identity", [out(port)]), backoff_max=0.2) as sc:
            _, w = await connect(sc.port)

            async def send(seq: int) -> None:
                a = np.array([seq], dtype=np.int32)
                w.write(frame_bytes(tensor_header(a, seq=seq), a))
                await w.drain()

            await send(0)
            assert (await sink.get()).header.sequence == 0
            await sink.close()  # downstream goes away
            snd = sc.counters.senders["next"]
            await wait_for(lambda: not snd.connected, what="sender to notice")
            await send(1)
            await wait_for(lambda: snd.connect_failures >= 2, what="connect retries")
            sink = await Sink(tcp=f"127.0.0.1:{port}").start()  # back
            await send(2)
            got = await sink.get_n(2)
            assert [g.header.sequence for g in got] == [1, 2]
            assert snd.reconnects == 1 and snd.connected
            w.close()
        await sink.close()

    run(main())


def test_a_downstream_that_accepts_and_closes_at_once_is_backed_off() -> None:
    """A downstream (or a proxy in front of one) that accepts every
    connection and closes it at once: the lane keeps reconnecting, with
    backoff, not in a busy loop."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = socket.create_server(("127.0.0.1", 0))
        srv.setblocking(False)

        async def accept_and_close() -> None:
            while True:
                conn, _ = await loop.sock_accept(srv)
                conn.close()

        acceptor = loop.create_task(accept_and_close())
        sender = FrameSender(Output(name="next", address=f"127.0.0.1:{srv.getsockname()[1]}",
                                    modality="tensor", sla_class="video"), Limits())
        await sender.start()
        try:
            await asyncio.sleep(1.5)
            n = sender.counters.reconnects
            assert 2 <= n <= 30, n  # (in a busy loop: thousands)
        finally:
            await sender.close()
            acceptor.cancel()
            srv.close()

    run(main())


def test_graceful_stop_delivers_in_flight_frames() -> None:
    async def main() -> None:
        sink = await Sink().start()
        sc = Sidecar(make_cfg("dr", "slow_async", [out(sink.port)]))
        await sc.start()
        _, w = await connect(sc.port)
        for seq in range(6):
            a = np.full(1000, seq, dtype=np.float64)
            w.write(frame_bytes(tensor_header(a, seq=seq), a))
        await w.drain()
        await wait_for(lambda: sc.counters.server.frames_in == 6, what="frames in")
        t0 = time.monotonic()
        assert await sc.stop()
        assert time.monotonic() - t0 >= 0.4  # it waited for the slow stage
        got = [sink.queue.get_nowait() for _ in range(sink.queue.qsize())]
        assert [g.header.sequence for g in got] == list(range(6))
        w.close()
        await sink.close()

    run(main())


def test_udp_in_and_out() -> None:
    async def main() -> None:
        sink = await Sink(tcp=None, udp="127.0.0.1:0").start()
        assert sink.server.udp_port
        cfg = make_cfg("u", "double", [out(sink.server.udp_port, transport="udp",
                                           modality="audio", sla_class="voice")], udp=True)
        async with Sidecar(cfg) as sc:
            assert sc.udp_port
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for seq in range(3):
                a = np.arange(160, dtype=np.int16) + seq
                s.sendmsg(frame(tensor_header(a, seq=seq, modality=4), a),
                          [], 0, ("127.0.0.1", sc.udp_port))
            s.sendto(b"not a frame", ("127.0.0.1", sc.udp_port))
            a = np.arange(4, dtype=np.int16)
            s.sendto(frame_bytes(tensor_header(a), a) + b"junk", ("127.0.0.1", sc.udp_port))
            got = await sink.get_n(3)
            for g in sorted(got, key=lambda g: g.header.sequence):
                x = np.arange(160, dtype=np.int16) + g.header.sequence
                np.testing.assert_array_equal(tensor_from_frame(g.header, g.payload), x * 2)
                assert g.transport == "udp" and g.header.modality_name == "audio"
            await wait_for(lambda: sum(sc.counters.server.malformed.values()) == 2)
            assert sc.counters.server.malformed == {"bad_magic": 1, "datagram_length": 1}
            s.close()
        await sink.close()

    run(main())


def test_otel_child_span_per_stage() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("traced", "double", [out(sink.port)], otel=True)
        async with Sidecar(cfg, tracer=provider.get_tracer("t")) as sc:
            _, w = await connect(sc.port)
            a = np.ones(3, dtype=np.float32)
            w.write(frame_bytes(tensor_header(a).with_traceparent(incoming), a))
            await w.drain()
            g = await sink.get()
            w.close()
        await sink.close()
        tp = g.header.traceparent_text
        assert tp is not None and tp.split("-")[1] == incoming.split("-")[1]
        (span,) = exporter.get_finished_spans()
        assert span.name == "traced"
        assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7
        assert tp.split("-")[2] == f"{span.context.span_id:016x}"

    run(main())


def test_make_runner_kinds() -> None:
    from sidecar.config import RunnerConfig

    r = make_runner(RunnerConfig(kind="python", target="testkit.sidecar_stages:double"))
    assert type(r).__name__ == "PythonRunner"
    with pytest.raises(ValueError):
        run(make_runner(RunnerConfig(kind="python", target="no_colon")).start())


def test_realtime_output_keeps_the_freshest_frames_when_full() -> None:
    async def main() -> None:
        port = free_port()  # downstream not up yet
        cfg = make_cfg("rt2", "identity", [out(port, realtime=True)],
                       limits={"outbound_queue": 2})
        async with Sidecar(cfg, backoff_max=0.1) as sc:
            _, w = await connect(sc.port)
            for seq in range(5):
                a = np.array([seq], dtype=np.int32)
                w.write(frame_bytes(tensor_header(a, seq=seq,
                                                  deadline_ns=time.time_ns() + 10**10), a))
            await w.drain()
            snd = sc.counters.senders["next"]
            await wait_for(lambda: sc.counters.stage.outputs == 5, what="stage outputs")
            assert snd.dropped_overload == 3 and snd.queue_hwm == 2
            sink = await Sink(tcp=f"127.0.0.1:{port}").start()
            got = await sink.get_n(2)
            assert [g.header.sequence for g in got] == [3, 4]
            w.close()
        await sink.close()

    run(main())


def test_onnx_runner(tmp_path: object) -> None:
    import onnx
    from onnx import TensorProto, helper

    from sidecar.config import RunnerConfig
    from sidecar.contract import StageInput

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "dbl", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = f"{tmp_path}/dbl.onnx"
    onnx.save(model, path)

    async def main() -> np.ndarray | None:
        r = make_runner(RunnerConfig(kind="onnx", target=path))  # default input name: the only one
        await r.start()
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        try:
            return await r.infer(StageInput(tensor_header(a), a, time.time_ns(), "t"))
        finally:
            await r.close()

    y_ = run(main())
    np.testing.assert_array_equal(y_, np.arange(8, dtype=np.float32).reshape(2, 4) * 2)


def test_a_hung_sync_stage_does_not_block_later_frames() -> None:
    """A plain function that never returns: its frame times out (counted
    error frame), its thread is abandoned, and the next frames go through."""
    from testkit import sidecar_stages

    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("hs", "hang_sync", [out(sink.port)], timeout_s=0.3)
        try:
            async with Sidecar(cfg) as sc:
                _, w = await connect(sc.port)
                for seq, v in enumerate([7, 1, 2, 3]):
                    a = np.array([v], dtype=np.int64)
                    w.write(frame_bytes(tensor_header(a, stream_id=5, seq=seq), a))
                await w.drain()
                got = {g.header.sequence: g for g in await sink.get_n(4)}
                assert got[0].header.error is not None
                assert got[0].header.error[0] == ErrorCode.STAGE_TIMEOUT
                for seq, v in ((1, 1), (2, 2), (3, 3)):
                    assert got[seq].header.error is None, got[seq].header.error
                    assert int(tensor_from_frame(got[seq].header, got[seq].payload)[0]) == v
                assert sc.counters.stage.errors == {"STAGE_TIMEOUT": 1}
                w.close()
        finally:
            sidecar_stages.RELEASE.set()
            await sink.close()

    run(main())
