"""The per-frame path of issue 18 keeps what the sidecar guarantees.

* a batch of frames goes out together (few ``sendmsg`` calls) and in order,
  error frames in their place, through a plain-function stage and an
  ``async def`` one;
* an ``async def`` stage runs eagerly, and one that waits still gets its
  timeout; a runner returning any awaitable still works;
* ``FrameSender.send_nowait``: the queue's bound holds, it stops at a full
  queue without consuming a pick of the weighted round robin;
* the inbound queue's batch operations keep its accounting;
* the receive protocol: frames cut into 1-byte writes, a burst into a queue of
  one frame (reading paused and resumed), all intact and in order;
* SLA samples recorded in bulk are the same windows, sketches and histograms
  as one by one, visible to every read, and none is lost across threads.

Nothing here depends on how fast the host is."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import numpy as np
from ddsketch import DDSketch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmmesh.abi import Flag
from mmmesh.sla import encode_sketch, new_sketch
from mmmesh.wire import Header
from sidecar.config import Limits, Output
from sidecar.contract import ErrorCode, SlaSample, tensor_from_frame
from sidecar.main import Sidecar
from sidecar.sla import windows
from sidecar.sla.windows import _BUCKETS_MS, FOLD_AT, Counts, Hist, SlaWindows, add_values
from sidecar.stage import Stage
from sidecar.transport import FrameSender, InFrame
from sidecar.transport.frames import FrameQueue
from sidecar.transport.spread import Swrr
from testkit.sidecar_stages import (
    ListSink,
    Sink,
    connect,
    frame_bytes,
    make_cfg,
    out,
    run,
    tensor_header,
    wait_for,
)


def _frames(n: int, poison: dict[int, bytes] | None = None) -> bytes:
    """n frames of one int64 each (value = 1000 + sequence: never ``hang``'s
    7); ``poison`` replaces some by a frame that is not a tensor (BAD_INPUT)."""
    parts = []
    for i in range(n):
        if poison and i in poison:
            parts.append(frame_bytes(Header(modality=7, stream_id=1, sequence=i), poison[i]))
            continue
        a = np.array([1000 + i], dtype=np.int64)
        parts.append(frame_bytes(tensor_header(a, seq=i), a))
    return b"".join(parts)


# --------------------------------------------------------------------------
# a batch goes out together, in order
# --------------------------------------------------------------------------
def _burst(fn: str, n: int, poison: dict[int, bytes]) -> tuple[list[InFrame], Any]:
    async def main() -> tuple[list[InFrame], Any]:
        sink = await Sink().start()
        cfg = make_cfg("b", fn, [out(sink.port)], limits={"inbound_queue": 4 * n})
        async with Sidecar(cfg) as sc:
            await wait_for(lambda: sc.counters.senders["next"].connected, 5, "connected")
            assert sc.stage is not None
            await sc.stage.stop()  # the whole burst is queued before the stage takes any
            _, w = await connect(sc.port)
            w.write(_frames(n, poison))
            await w.drain()
            await wait_for(lambda: sc.counters.server.frames_in == n, 10, "every frame queued")
            await sc.stage.start()
            got = await sink.get_n(n, timeout=20)
            w.close()
            counters = sc.counters.senders["next"]
        await sink.close()
        return got, counters

    result: tuple[list[InFrame], Any] = run(main())
    return result


def test_a_burst_goes_out_in_few_sendmsg_calls_in_order_errors_in_their_place() -> None:
    n = 600
    poison = {5: b"abcd", 64: b"", 300: b"xyz"}
    for fn in ("identity", "hang"):  # a plain function, an async def (echoes)
        got, c = _burst(fn, n, poison)
        assert [g.header.sequence for g in got] == list(range(n)), fn
        for g in got:
            seq = g.header.sequence
            if seq in poison:
                assert g.header.flags & Flag.ERROR and g.header.error is not None
                assert g.header.error[0] == ErrorCode.BAD_INPUT
            else:
                assert int(tensor_from_frame(g.header, g.payload)[0]) == 1000 + seq
        assert c.frames_out == n
        assert c.writes <= n // 10, f"{fn}: {c.writes} sendmsg calls for {n} frames"


def test_an_async_stage_that_waits_times_out_between_frames_that_do_not() -> None:
    async def main() -> list[InFrame]:
        sink = await Sink().start()
        cfg = make_cfg("h", "hang", [out(sink.port)], timeout_s=0.3)
        async with Sidecar(cfg) as sc:
            assert sc.stage is not None
            await wait_for(lambda: sc.counters.senders["next"].connected, 5, "connected")
            await sc.stage.stop()  # one batch: 1, 7 (waits for ever), 3
            _, w = await connect(sc.port)
            for seq, v in enumerate([1, 7, 3]):
                a = np.array([v], dtype=np.int64)
                w.write(frame_bytes(tensor_header(a, seq=seq), a))
            await w.drain()
            await wait_for(lambda: sc.counters.server.frames_in == 3, 10, "queued")
            await sc.stage.start()
            got = await sink.get_n(3, timeout=10)
            assert sc.counters.stage.errors == {"STAGE_TIMEOUT": 1}
            assert sc.counters.stage.in_flight == 0
            w.close()
        await sink.close()
        return got

    got: list[InFrame] = run(main())
    assert [g.header.sequence for g in got] == [0, 1, 2]
    assert got[1].header.error is not None and got[1].header.error[0] == ErrorCode.STAGE_TIMEOUT
    assert [int(tensor_from_frame(g.header, g.payload)[0]) for g in (got[0], got[2])] == [1, 3]


class _FutureRunner:
    """A runner whose infer() is a plain function returning a Future."""

    name = "future"

    async def start(self) -> None: ...

    def infer(self, inp: Any) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, inp.array + 1)
        return fut

    async def close(self) -> None: ...


def test_a_runner_returning_any_awaitable_is_awaited() -> None:
    async def main() -> list[int]:
        sink = await Sink().start()
        cfg = make_cfg("f", "identity", [out(sink.port)])
        async with Sidecar(cfg, runner=_FutureRunner()) as sc:  # type: ignore[arg-type]
            _, w = await connect(sc.port)
            w.write(_frames(5))
            await w.drain()
            got = await sink.get_n(5)
            w.close()
        await sink.close()
        return [int(tensor_from_frame(g.header, g.payload)[0]) for g in got]

    assert run(main()) == [1001, 1002, 1003, 1004, 1005]


def test_every_frame_gets_its_sla_sample_once() -> None:
    async def main() -> ListSink:
        sink = await Sink().start()
        sla = ListSink()
        cfg = make_cfg("s", "identity", [out(sink.port)])
        async with Sidecar(cfg, sink=sla) as sc:
            _, w = await connect(sc.port)
            w.write(_frames(200, {7: b"ab"}))
            await w.drain()
            await sink.get_n(200)
            await wait_for(lambda: len(sla.samples) == 200, 5, "200 samples")
            w.close()
        await sink.close()
        return sla

    sla = run(main())
    assert len(sla.samples) == 200
    assert sum(s.error for s in sla.samples) == 1
    assert all(isinstance(s, SlaSample) and s.stage == "s" for s in sla.samples)


# --------------------------------------------------------------------------
# send_nowait
# --------------------------------------------------------------------------
def test_send_nowait_keeps_the_bound_and_stops_without_taking_a_pick() -> None:
    """Replicas that accept and never read, big frames: the sockets fill,
    then the lanes' queues (1 frame each); send_nowait stops at the first
    frame that would wait, and the weighted round robin is where the frames
    it took left it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
        for ls in listeners:
            ls.setblocking(False)
        o = Output(name="s", replicas=[f"127.0.0.1:{ls.getsockname()[1]}" for ls in listeners],
                   weights=[5, 3, 2], modality="tensor", sla_class="video")
        s = FrameSender(o, Limits(outbound_queue=3, outbound_queue_mb=64))
        await s.start()
        conns = [(await loop.sock_accept(ls))[0] for ls in listeners]
        await wait_for(lambda: all(x.counters.connected for x in s.lanes), 5, "connected")
        big = np.zeros(8 << 20, np.uint8)
        frames = [(tensor_header(big, seq=i), big) for i in range(64)]
        taken = s.send_nowait(frames)
        assert 0 < taken < len(frames)
        ref = Swrr([5, 3, 2])
        picks = [ref.pick([True, True, True]) for _ in range(taken)]
        assert s._swrr.cur == ref.cur  # the frame not taken did not take a pick
        for i, lane in enumerate(s.lanes):
            assert lane.queue.qsize() <= lane.queue.maxsize + 1  # (a partly written one first)
            on_lane = lane.counters.frames_out + lane.queue.qsize()
            assert on_lane == picks.count(i)
        await s.close()
        for c in conns:
            c.close()
        for ls in listeners:
            ls.close()

    run(main())


# --------------------------------------------------------------------------
# the inbound queue in batches
# --------------------------------------------------------------------------
def test_frame_queue_batch_operations_keep_the_accounting() -> None:
    async def main() -> None:
        q = FrameQueue(4, 100, lambda x: x)
        assert q.offer(10) and q.offer(20) and q.offer(30) and q.offer(40)
        assert not q.offer(1)  # four: full
        assert q.bytes == 100 and q.unfinished == 4
        waiter = asyncio.create_task(q.put(5))
        await asyncio.sleep(0)
        assert q.take_nowait(3) == [10, 20, 30] and q.bytes == 40
        await asyncio.wait_for(waiter, 1)  # woken: room again
        assert q.qsize() == 2 and q.bytes == 45 and q.unfinished == 5
        q.force_put_front([1, 2])  # ahead of everything, even when full
        assert q.take_nowait(10) == [1, 2, 40, 5] and q.bytes == 0
        assert q.unfinished == 7  # 4 offered, 1 put, 2 put in front
        joined = asyncio.create_task(q.join())
        q.done(7)
        await asyncio.wait_for(joined, 1)
        try:
            q.done(1)
        except ValueError:
            pass
        else:
            raise AssertionError("done() past zero must raise")

    run(main())


# --------------------------------------------------------------------------
# the receive protocol
# --------------------------------------------------------------------------
def test_frames_in_one_byte_writes_and_a_burst_into_a_one_frame_queue() -> None:
    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("r", "identity", [out(sink.port)],
                       limits={"inbound_queue": 1, "inbound_queue_mb": 1})
        async with Sidecar(cfg) as sc:
            data = _frames(20)
            _, w = await connect(sc.port)
            for i in range(0, 600, 1):  # the first frames byte by byte
                w.write(data[i:i + 1])
                await w.drain()
            w.write(data[600:])  # the rest in one go: the queue holds one frame
            await w.drain()
            got = await sink.get_n(20, timeout=10)
            assert [int(tensor_from_frame(g.header, g.payload)[0]) for g in got] == \
                list(range(1000, 1020))
            assert sc.counters.server.malformed == {}
            w.close()
        await sink.close()

    run(main())


# --------------------------------------------------------------------------
# SLA samples in bulk
# --------------------------------------------------------------------------
values = st.lists(st.one_of(st.just(0.0), st.floats(1e-12, 3_600_000.0),
                            st.sampled_from([1e-9, 0.25, 5.0, 3_600_000.0])), max_size=300)


def _state(sk: DDSketch) -> tuple[Any, ...]:
    st_ = sk._store
    return (st_.bins, st_.offset, st_.min_key, st_.max_key, st_.count, sk._count, sk._sum,
            sk._min, sk._max, sk._zero_count, encode_sketch(sk))


@settings(max_examples=300, deadline=None)
@given(st.lists(values, min_size=1, max_size=4))
def test_values_added_in_bulk_are_ddsketch_add_one_by_one(chunks: list[list[float]]) -> None:
    assert windows._FAST_ADD  # (this ddsketch: the bulk path is the one under test)
    one, bulk = new_sketch(), new_sketch()
    for chunk in chunks:
        for v in chunk:
            one.add(v)
        add_values(bulk, chunk)
    assert _state(bulk) == _state(one)


def _reference(samples: list[SlaSample]) -> tuple[Counts, list[DDSketch], list[Hist]]:
    """What the recorder kept per sample before issue 18 (one by one)."""
    c = Counts()
    sketches = [new_sketch(), new_sketch(), new_sketch()]
    hists = [Hist(), Hist(), Hist()]

    def ms(ns: int) -> float:
        return 0.0 if ns * 1e-6 < 0.0 else min(ns * 1e-6, 3_600_000.0)

    for s in samples:
        c.add(s)
        vals = [ms(s.queue_ns)]
        if not s.dropped:
            vals.append(ms(s.service_ns))
            if s.e2e_ns is not None:
                vals.append(ms(s.e2e_ns))
        for i, v in enumerate(vals):
            sketches[i].add(v)
            hists[i].add(v)
    return c, sketches, hists


samples_st = st.lists(st.builds(
    SlaSample, stage=st.just("s"), sla_class=st.sampled_from(["voice", "video"]),
    modality=st.just("audio"), queue_ns=st.integers(-10**6, 10**10),
    service_ns=st.integers(0, 10**10), e2e_ns=st.none() | st.integers(-10**7, 10**13),
    deadline_missed=st.booleans(), dropped=st.booleans(), error=st.booleans()), max_size=700)


@settings(max_examples=60, deadline=None)
@given(samples_st)
def test_windows_recorded_in_bulk_are_the_one_by_one_windows(samples: list[SlaSample]) -> None:
    w = SlaWindows()
    for s in samples:
        w.record(s)
    series, _ = w.current()
    scraped = {key: (c, hists) for key, c, hists, _ in w.scrape()}
    for key, win in series:
        mine = [s for s in samples if (s.stage, s.sla_class, s.modality) == key]
        c, sketches, hists = _reference(mine)
        assert vars_of(win.counts) == vars_of(c)
        for got, want in zip((win.queue, win.service, win.e2e), sketches, strict=True):
            assert _state(got) == _state(want)
        tc, th = scraped[key]
        assert vars_of(tc) == vars_of(c)
        for got_h, want_h in zip(th, hists, strict=True):
            assert (got_h.buckets, got_h.n, got_h.sum_ms) == \
                (want_h.buckets, want_h.n, want_h.sum_ms)
    assert len(_BUCKETS_MS) + 1 == len(Hist().buckets)


def vars_of(c: Counts) -> tuple[int, ...]:
    return (c.frames, c.met, c.misses, c.drops, c.errors)


def test_every_read_sees_the_samples_recorded_before_it() -> None:
    w = SlaWindows()
    s = SlaSample("s", "voice", "audio", 1000, 2000, 3000, False)
    for _ in range(FOLD_AT // 4):  # fewer than a fold: still buffered
        w.record(s)
    assert w.current()[0][0][1].counts.frames == FOLD_AT // 4
    assert w.scrape()[0][1].frames == FOLD_AT // 4
    w.record(s)
    closed, _ = w.close()
    assert closed[0][1].counts.frames == FOLD_AT // 4 + 1
    assert w.current()[0][0][1].counts.frames == 0  # the next window is empty


def test_no_sample_is_lost_across_threads() -> None:
    w = SlaWindows()
    per, threads = 5000, 4
    stop = threading.Event()
    closed_frames: list[int] = []

    def writer(i: int) -> None:
        s = SlaSample("s", f"c{i % 2}", "audio", 1000 + i, 2000, 3000, i % 3 == 0)
        for _ in range(per):
            w.record(s)

    def reader() -> None:
        while not stop.is_set():
            w.current()
            w.scrape()
            closed_frames.extend(win.counts.frames for _, win in w.close()[0])

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    r = threading.Thread(target=reader)
    r.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    r.join()
    closed_frames.extend(win.counts.frames for _, win in w.close()[0])
    assert sum(closed_frames) == per * threads
    assert sum(c.frames for _, c, _, _ in w.scrape()) == per * threads


def test_the_stage_hands_samples_to_any_sink() -> None:
    """A sink with only record() (the SlaSink protocol) gets SlaSamples."""
    assert Stage.MAX_BATCH >= 32
    sla = ListSink()
    sla.record(SlaSample("s", "v", "m", 1, 2, None, False))
    assert sla.samples[0].dropped is False and sla.samples[0].error is False
    try:
        sla.samples[0].stage = "x"  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("SlaSample must be immutable")
