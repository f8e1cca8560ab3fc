"""The sidecar's contracts: the public faces export what they mean to, the
deadline rule, and the batch protocol a runner declares (never probed)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

import sidecar.sla
import sidecar.transport
from mmmesh.wire import Header
from sidecar.contract import BatchResult, BatchRunner, StageInput, drop_late, past_deadline
from sidecar.main import Sidecar
from testkit.sidecar_stages import Sink, connect, frame_bytes, make_cfg, out, run, tensor_header


def test_the_transport_face_exports_the_role_modules_public_classes() -> None:
    assert sorted(sidecar.transport.__all__) == [
        "FrameQueue", "FrameSender", "FrameServer", "InFrame", "SenderCounters",
        "ServerCounters", "inframe_queue"]
    homes = {name: getattr(sidecar.transport, name).__module__
             for name in sidecar.transport.__all__}
    assert homes == {
        "FrameQueue": "sidecar.transport.frames", "InFrame": "sidecar.transport.frames",
        "inframe_queue": "sidecar.transport.frames",
        "FrameServer": "sidecar.transport.receive", "ServerCounters": "sidecar.transport.receive",
        "FrameSender": "sidecar.transport.send", "SenderCounters": "sidecar.transport.send"}


def test_the_sla_face_exports_the_recorder_and_the_shared_sketch_helpers() -> None:
    for name in sidecar.sla.__all__:
        assert getattr(sidecar.sla, name) is not None, name
    assert sidecar.sla.SlaRecorder.__module__ == "sidecar.sla"
    assert sidecar.sla.merge.__module__ == "mmmesh.sla.sketch"


NOW = 1_000_000_000_000


@pytest.mark.parametrize("deadline,realtime,late,dropped", [
    (None, True, False, False),  # no deadline: never late
    (NOW + 1, True, False, False),  # not yet
    (NOW, True, False, False),  # exactly at the deadline is in time
    (NOW - 1, True, True, True),  # past it: a real-time frame is dropped
    (NOW - 1, False, True, False),  # ... any other one delivered (and counted as missed)
])
def test_the_deadline_rule(deadline: int | None, realtime: bool, late: bool,
                           dropped: bool) -> None:
    h = Header(modality=7, deadline_ns=deadline)
    assert past_deadline(h, NOW) is late
    assert drop_late(h, realtime, NOW) is dropped


def test_past_deadline_defaults_to_now() -> None:
    assert past_deadline(Header(modality=7, deadline_ns=time.time_ns() - 10**9))
    assert not past_deadline(Header(modality=7, deadline_ns=time.time_ns() + 10**10))


class _Double:
    """Doubles its input; remembers how it was called."""

    name = "double"

    def __init__(self) -> None:
        self.single = 0
        self.batches: list[int] = []

    async def start(self) -> None:
        pass

    async def infer(self, inp: StageInput) -> np.ndarray:
        self.single += 1
        return inp.array * 2

    async def close(self) -> None:
        pass

    @property
    def batchable(self) -> bool:
        return True

    async def infer_batch(self, inputs: Sequence[StageInput], done: list[BatchResult]) -> None:
        self.batches.append(len(inputs))
        for inp in inputs:
            done.append(BatchResult(True, inp.array * 2, time.time_ns()))


class _Declared(_Double, BatchRunner):
    """Declares the batch protocol."""


def _relay_ten(runner: _Double) -> list[int]:
    """Ten frames in one burst through a sidecar running ``runner``; the values out."""
    async def main() -> list[int]:
        sink = await Sink().start()
        cfg = make_cfg("b", "double", [out(sink.port)])
        async with Sidecar(cfg, runner=runner) as sc:
            _, w = await connect(sc.port)
            w.write(b"".join(frame_bytes(tensor_header(a, seq=i), a)
                             for i, a in enumerate(np.arange(10, dtype=np.int32)[:, None])))
            await w.drain()
            got = await sink.get_n(10)
            w.close()
        await sink.close()
        return [int(np.frombuffer(g.payload, dtype=np.int32)[0]) for g in got]

    values: list[int] = run(main())
    return values


def test_a_runner_that_declares_the_batch_protocol_gets_batches() -> None:
    r = _Declared()
    assert _relay_ten(r) == [2 * i for i in range(10)]
    assert r.batches and max(r.batches) > 1  # the burst was waiting: one call for several
    assert r.single + sum(r.batches) == 10


def test_a_runner_with_the_methods_but_no_declaration_is_not_batched() -> None:
    r = _Double()  # batchable and infer_batch, but not a BatchRunner
    assert _relay_ten(r) == [2 * i for i in range(10)]
    assert r.batches == [] and r.single == 10
