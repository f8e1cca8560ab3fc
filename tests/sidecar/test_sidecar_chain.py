"""Three sidecars on loopback: source -> a (double) -> b (plus_one) -> sink.
The sink sees 2x+1 with the source's stream ids, sequences and timestamps."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from mmmesh.abi import Flag
from mmmesh.wire import Header
from sidecar.config import Limits, Output
from sidecar.contract import ErrorCode, tensor_from_frame
from sidecar.main import Sidecar
from sidecar.transport import FrameSender
from testkit.sidecar_stages import ListSink, Sink, make_cfg, out, run, tensor_header

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_three_stage_chain_values_ids_and_timestamps() -> None:
    async def main() -> None:
        sink = await Sink().start()
        sla_b = ListSink()
        b = Sidecar(make_cfg("b", "plus_one", [out(sink.port, name="sink", modality="text",
                                                   sla_class="voice", sla_class_id=3,
                                                   deadline_ms=500)]), sink=sla_b)
        await b.start()
        assert b.port is not None
        a = Sidecar(make_cfg("a", "double", [out(b.port, name="b", sla_class_id=2)],
                             concurrency=2))
        await a.start()
        assert a.port is not None
        src = FrameSender(Output(name="a", address=f"127.0.0.1:{a.port}", modality="video",
                                 sla_class="video"), Limits())
        await src.start()

        sent: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        rng = np.random.default_rng(7)
        for seq in range(10):
            for stream, dtype, shape in ((1, np.float32, (4, 8)), (2, np.int32, (3,)),
                                         (3, np.float64, (2, 2, 2))):
                x = (rng.standard_normal(shape) * 100).astype(dtype)
                ts = time.time_ns() - 5_000_000 * (stream + 1)
                h = tensor_header(x, stream_id=stream, seq=seq, timestamp_ns=ts,
                                  modality=3).with_traceparent(TRACE)
                assert await src.send(h, x)
                sent[(stream, seq)] = (x, ts)
        # a frame that is not a tensor fails at a; b forwards the error to the sink
        await src.send(Header(modality=3, stream_id=9, sequence=0, timestamp_ns=time.time_ns()),
                       b"\x00\x01")
        assert await src.flush(5)

        got = await sink.get_n(len(sent) + 1)
        errors = [g for g in got if g.header.flags & Flag.ERROR]
        frames = [g for g in got if not g.header.flags & Flag.ERROR]
        assert len(errors) == 1
        e = errors[0].header
        assert (e.stream_id, e.sequence) == (9, 0)
        assert e.error is not None and e.error[0] == ErrorCode.BAD_INPUT
        assert e.error[1].startswith("a: BAD_INPUT")

        seen = set()
        for g in frames:
            h = g.header
            key = (h.stream_id, h.sequence)
            x, ts = sent[key]
            y = tensor_from_frame(h, g.payload)
            np.testing.assert_array_equal(y, x * 2 + 1)
            assert y.dtype == (x * 2 + 1).dtype and y.shape == x.shape
            assert h.timestamp_ns == ts  # end-to-end: the ORIGINAL timestamp
            assert h.deadline_ns == ts + 500_000_000  # b's output deadline_ms
            assert h.modality_name == "text" and h.sla_class == 3  # from b's Output
            assert h.traceparent_text == TRACE  # propagated (otel off)
            seen.add(key)
        assert seen == set(sent)
        # per-stream order is kept through a (concurrency 2 may interleave streams)
        for stream in (1, 2, 3):
            seqs = [g.header.sequence for g in frames if g.header.stream_id == stream]
            assert sorted(seqs) == list(range(10))

        # b measured e2e latency from the source's timestamps
        ok = [s for s in sla_b.samples if not s.error]
        assert len(ok) == len(sent)
        assert all(s.e2e_ns is not None and s.e2e_ns >= 5_000_000 for s in ok)
        assert [s.error for s in sla_b.samples].count(True) == 1
        assert a.counters.stage.outputs == len(sent) and b.counters.stage.outputs == len(sent)
        assert b.counters.stage.errors["UPSTREAM"] == 1

        await src.close()
        await a.stop()
        await b.stop()
        await sink.close()
        ours = ("sender-", "stage-", "a-", "b-", "sink-")
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(ours)]

    run(main())


def test_python_runner_passes_the_header_to_functions_that_take_it() -> None:
    """Stateful stages (fusion) need the stream id and sequence."""
    import numpy as np

    from mmmesh.wire import Header
    from sidecar.config import RunnerConfig
    from sidecar.contract import StageInput
    from sidecar.runners import make_runner

    async def go() -> tuple[object, object]:
        r = make_runner(RunnerConfig(kind="python", target="demo.pipeline.stages:fusion"))
        await r.start()
        emb = np.ones(64, dtype=np.float32)
        outs = []
        for mod in (3, 4, 5):  # video, audio, point cloud of one (stream, sequence)
            h = Header(modality=mod, stream_id=9, sequence=1)
            outs.append(await r.infer(StageInput(h, emb, 0, "test")))
        await r.close()
        return outs[1], outs[2]

    import asyncio

    waiting, fused = asyncio.run(go())
    assert waiting is None
    assert fused is not None and fused.shape == (192,)
