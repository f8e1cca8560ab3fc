"""Large-frame memory on the sidecar's receive path: pooled page-aligned
buffers are reused only when nothing refers to them, and queues are bounded
in bytes as well as in frames."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from sidecar.bufpool import BufferPool
from sidecar.main import Sidecar
from sidecar.transport import FrameQueue
from testkit import sidecar_stages
from testkit.sidecar_stages import Sink, connect, frame_bytes, make_cfg, out, run, tensor_header

MiB = 1 << 20


def _addr(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_pool_reuses_a_buffer_only_when_nothing_refers_to_it() -> None:
    pool = BufferPool(16 * MiB)
    a = pool.get(4 * MiB)
    assert len(a) == 4 * MiB and not a.readonly
    assert _addr(a) % 4096 == 0  # page-aligned: the kernel's copies are faster
    a_addr = _addr(a)
    arr = np.frombuffer(a, dtype=np.uint32)  # a stage's view of the payload
    arr[:] = 0xA5A5A5A5
    del a
    b = pool.get(4 * MiB)  # `arr` still refers to the first buffer
    assert _addr(b) != a_addr
    np.frombuffer(b, dtype=np.uint8)[:] = 0
    assert (arr == 0xA5A5A5A5).all(), "a buffer still in use was handed out again"
    del arr
    c = pool.get(3 * MiB)  # same size class: the free buffer comes back
    assert _addr(c) == a_addr and len(c) == 3 * MiB
    assert pool.hits == 1 and pool.misses == 2


def test_pool_prefers_the_buffer_freed_last_and_stays_within_budget() -> None:
    pool = BufferPool(8 * MiB)
    a, b = pool.get(4 * MiB), pool.get(4 * MiB)
    a_addr, b_addr = _addr(a), _addr(b)
    c = pool.get(4 * MiB)  # budget full, both busy: an unpooled buffer
    assert pool.owned_bytes == 8 * MiB and pool.snapshot()["buffers"] == 2
    assert _addr(c) not in (a_addr, b_addr)
    del a, b, c
    assert _addr(pool.get(4 * MiB)) == b_addr  # handed out last
    assert pool.in_use() == 0
    small = pool.get(100_000)  # another size: idle big buffers are let go to fit it
    assert len(small) == 100_000 and pool.owned_bytes <= 8 * MiB
    assert pool.snapshot()["buffers"] == 2  # one 4 MiB evicted, one 128 KiB added


def test_frame_queue_is_bounded_in_bytes_and_passes_an_oversized_frame_alone() -> None:
    async def main() -> None:
        q = FrameQueue(100, 1000, len)
        q.put_nowait(b"x" * 600)
        assert not q.full()
        q.put_nowait(b"x" * 600)  # over the byte budget now: full
        assert q.full() and q.bytes == 1200
        waiter = asyncio.create_task(q.put(b"y" * 10))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        q.get_nowait()
        await asyncio.wait_for(waiter, 1)
        assert q.bytes == 610
        q.get_nowait(), q.get_nowait()
        assert q.empty() and q.bytes == 0
        q.put_nowait(b"z" * 5000)  # bigger than the budget: fits when alone
        assert q.full()

    run(main())


def test_a_stage_that_keeps_its_inputs_keeps_them_intact() -> None:
    """Frames bigger than the staging buffer land in pooled buffers; a stage
    that holds on to its inputs must never see them overwritten by later
    frames, and buffers come back into use once it lets go."""
    sidecar_stages.KEPT.clear()
    n, size = 24, 256 * 1024

    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("keeper", "keep", [out(sink.port)], limits={"buffer_pool_mb": 2})
        async with Sidecar(cfg) as sc:
            _, w = await connect(sc.port)
            for i in range(n):
                a = np.full(size // 4, i, dtype=np.uint32)
                w.write(frame_bytes(tensor_header(a, seq=i), a))
            await w.drain()
            got = await sink.get_n(n, timeout=10)
            assert [f.header.sequence for f in got] == list(range(n))
            assert len(sidecar_stages.KEPT) == n
            for i, x in enumerate(sidecar_stages.KEPT):
                assert (x == i).all(), f"kept input {i} was overwritten"
            pool = sc.server.pool
            assert pool.owned_bytes <= 2 * MiB and pool.hits == 0  # all were still held
            sidecar_stages.KEPT.clear()
            del got
            for i in range(n):
                a = np.full(size // 4, 1000 + i, dtype=np.uint32)
                w.write(frame_bytes(tensor_header(a, seq=n + i), a))
            await w.drain()
            later = await sink.get_n(n, timeout=10)
            for i, f in enumerate(later):
                assert (np.frombuffer(f.payload, dtype=np.uint32) == 1000 + i).all()
            assert pool.hits > 0, pool.snapshot()  # let go: reused
            w.close()
        sidecar_stages.KEPT.clear()
        await sink.close()

    run(main())


def test_inbound_queue_holds_at_most_its_byte_budget() -> None:
    """A slow stage and 256 KiB frames: with a 1 MiB inbound budget at most
    four frames wait (plus the one that crossed it), not the 64 the frame
    count would allow; every frame still arrives, in order."""
    n, size = 30, 256 * 1024

    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("slow", "slow", [out(sink.port)],
                       limits={"inbound_queue": 64, "inbound_queue_mb": 1})
        async with Sidecar(cfg) as sc:
            _, w = await connect(sc.port)
            payload = np.zeros(size, dtype=np.uint8)
            for i in range(n):
                w.write(frame_bytes(tensor_header(payload, seq=i), payload))
            await w.drain()
            got = await sink.get_n(n, timeout=20)
            assert [f.header.sequence for f in got] == list(range(n))
            assert all(int(np.frombuffer(f.payload, dtype=np.int64)[0]) == size for f in got)
            hwm = sc.counters.server.queue_hwm
            assert 2 <= hwm <= 5, f"inbound queue held {hwm} frames of 256 KiB"
            assert sc.counters.server.backpressure_waits > 0
            w.close()
        await sink.close()

    run(main())


def test_queued_small_frames_share_a_sendmsg_and_arrive_intact() -> None:
    """A burst of small frames queued behind a busy socket goes out in far
    fewer sendmsg calls than frames; every frame arrives whole, in order."""
    from sidecar.config import Limits, Output
    from sidecar.transport import FrameSender

    n = 2000

    async def main() -> None:
        sink = await Sink().start()
        o = Output(name="s", address=f"127.0.0.1:{sink.port}", modality="tensor",
                   sla_class="video")
        s = FrameSender(o, Limits(outbound_queue=4096))
        await s.start()
        for i in range(n):  # all queued before the writer task runs once
            a = np.full(64, i, dtype=np.int32)
            assert await s.send(tensor_header(a, seq=i), a)
        assert await s.flush(10)
        got = await sink.get_n(n, timeout=10)
        for i, f in enumerate(got):
            assert f.header.sequence == i
            assert (np.frombuffer(f.payload, dtype=np.int32) == i).all()
        c = s.counters
        assert c.frames_out == n and c.bytes_out == sum(
            f.header.hdr_len + f.header.payload_len for f in got)
        assert c.writes <= n // 10, f"{c.writes} sendmsg calls for {n} frames"
        await s.close()
        await sink.close()

    run(main())


def test_a_frame_cut_off_mid_write_is_resent_whole() -> None:
    from sidecar.transport.frames import Framed

    f = Framed(tensor_header(np.zeros(1, np.uint8)), [b"HEAD", memoryview(b"payload-bytes")])
    assert f.total == 17
    assert f.consume(6) == 0 and bytes(f.views[0]) == b"yload-bytes"
    f.rewind()  # the connection broke: the new one gets the whole frame
    assert [bytes(v) for v in f.views] == [b"HEAD", b"payload-bytes"] and not f.started
    assert f.consume(20) == 3 and f.views == []  # 3 bytes belong to the next frame


def test_send_writes_directly_when_idle_and_hands_a_partial_frame_to_the_writer() -> None:
    """An idle sender writes a frame from send() itself (no writer-task hop);
    when the socket buffer fills mid-frame, the rest goes out first, then the
    queued frames, in order and intact."""
    import socket

    from mmmesh.wire import decode_frame
    from sidecar.config import Limits, Output
    from sidecar.transport import FrameSender

    n, size = 40, 256 * 1024

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lsock = socket.create_server(("127.0.0.1", 0))
        lsock.setblocking(False)
        o = Output(name="s", address=f"127.0.0.1:{lsock.getsockname()[1]}", modality="tensor",
                   sla_class="video")
        s = FrameSender(o, Limits(outbound_queue=256, outbound_queue_mb=64))
        await s.start()
        conn, _ = await loop.sock_accept(lsock)  # connected; nothing read yet
        conn.setblocking(False)
        while not s.counters.connected:
            await asyncio.sleep(0.01)
        small = np.arange(16, dtype=np.int32)
        assert await s.send(tensor_header(small, seq=0), small)
        assert s.counters.frames_out == 1 and s.counters.writes == 1  # written by send()
        for i in range(1, n):  # the peer does not read: the socket buffer fills
            a = np.full(size // 4, i, dtype=np.int32)
            assert await s.send(tensor_header(a, seq=i), a)
        assert s.counters.frames_out < n
        data = bytearray()
        done = asyncio.create_task(s.flush(20))
        while not (done.done() and not await _more(loop, conn, data)):
            await _more(loop, conn, data)
        assert done.result() and s.counters.frames_out == n
        view, seqs = memoryview(data), []
        while view:
            h, payload = decode_frame(view)
            arr = np.frombuffer(payload, dtype=np.int32)
            assert (arr == (small if h.sequence == 0 else h.sequence)).all()
            seqs.append(h.sequence)
            view = view[h.hdr_len + h.payload_len:]
        assert seqs == list(range(n))
        await s.close()
        conn.close()
        lsock.close()

    run(main())


async def _more(loop: asyncio.AbstractEventLoop, conn: object, data: bytearray) -> bool:
    try:
        chunk = await asyncio.wait_for(loop.sock_recv(conn, 1 << 20), 0.2)  # type: ignore[arg-type]
    except TimeoutError:
        return False
    data += chunk
    return bool(chunk)


async def _idle_peer(realtime: bool = False, **limits: Any) -> tuple[Any, Any, Any]:
    """A FrameSender connected to a peer that does not read (yet)."""
    import socket

    from sidecar.config import Limits, Output
    from sidecar.transport import FrameSender

    loop = asyncio.get_running_loop()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    o = Output(name="s", address=f"127.0.0.1:{lsock.getsockname()[1]}", modality="tensor",
               sla_class="video", realtime=realtime)
    s = FrameSender(o, Limits(**limits))
    await s.start()
    conn, _ = await loop.sock_accept(lsock)
    conn.setblocking(False)
    while not s.counters.connected:
        await asyncio.sleep(0.01)
    return s, conn, lsock


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(sequence, payload bytes) of every frame in a byte stream; fails on garbage."""
    from mmmesh.wire import decode_frame

    view, out = memoryview(data), []
    while view:
        h, payload = decode_frame(view)
        out.append((h.sequence, len(payload)))
        view = view[h.hdr_len + h.payload_len:]
    return out


def test_a_realtime_drop_never_cuts_a_frame_already_on_the_wire() -> None:
    """send() writes part of a big frame itself; the next real-time frame finds
    the queue full, but the half-sent frame is not the one dropped."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        s, conn, lsock = await _idle_peer(realtime=True, outbound_queue=1)
        big, small = np.zeros(16 << 20, np.uint8), np.ones(1024, np.uint8)
        assert await s.send(tensor_header(big, seq=0), big)
        await s.send(tensor_header(small, seq=1), small)
        flushed = asyncio.create_task(s.flush(10))
        data = bytearray()
        while not flushed.done() or await _more(loop, conn, data):
            await _more(loop, conn, data)
        assert flushed.result()
        got = _frames(bytes(data))
        assert got[0] == (0, 16 << 20) and got in ([(0, 16 << 20)], [(0, 16 << 20), (1, 1024)])
        assert s.counters.frames_out == len(got)
        await s.close()
        conn.close()
        lsock.close()

    run(main())


def test_the_outbound_byte_budget_counts_stage_outputs() -> None:
    """Stage outputs carry no payload_len until framed; the outbound budget
    still bounds them: with 8 MiB, a peer that does not read stops send()
    after a few 4 MiB frames instead of queueing all of them."""
    async def main() -> None:
        s, conn, lsock = await _idle_peer(outbound_queue=64, outbound_queue_mb=8)
        sent = 0
        for i in range(40):
            a = np.full(1 << 20, i, np.int32)  # 4 MiB
            try:
                await asyncio.wait_for(s.send(tensor_header(a, seq=i), a), 0.5)
            except TimeoutError:
                break
            sent += 1
        assert sent < 12, f"{sent} frames of 4 MiB accepted with an 8 MiB budget"
        assert s.lanes[0].queue.bytes <= 12 << 20
        await s.close()
        assert s.counters.dropped_other == sent - s.counters.frames_out
        assert await s.flush(1)  # nothing left unaccounted
        conn.close()
        lsock.close()

    run(main())


def test_after_a_reconnect_cut_frames_start_over_and_expired_ones_go() -> None:
    import time

    from sidecar.config import Limits, Output
    from sidecar.transport import FrameQueue, FrameSender
    from sidecar.transport.frames import Framed
    from sidecar.transport.lane import Lane

    s = FrameSender(Output(name="s", address="127.0.0.1:9", modality="tensor",
                           sla_class="voice", realtime=True), Limits())
    q = FrameQueue(10, 0, lambda it: 0)
    lane = Lane(s.lane_owner, 0, "127.0.0.1:9", q)
    a = np.zeros(4, np.uint8)
    cut = Framed(tensor_header(a, seq=0, deadline_ns=time.time_ns() + 10**10), [b"HDR", a])
    cut.consume(2)
    late = Framed(tensor_header(a, seq=1, deadline_ns=time.time_ns() - 1), [b"HDR", a])
    for _ in range(2):
        q.put_nowait(object())
        q.get_nowait()  # two unfinished tasks, as the writer holds them
    lane.batch[:] = [cut, late]
    lane._after_reconnect()
    batch = lane.batch
    assert batch == [cut] and not cut.started and bytes(cut.views[0]) == b"HDR"
    assert s.counters.dropped_deadline == 1
