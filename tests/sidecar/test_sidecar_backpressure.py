"""A fast producer of 1 MiB frames in front of a slow (50 ms/frame) stage:
the sidecar stops reading, TCP flow control slows the producer to the
stage's pace, queues stay within their limits and RSS stays bounded."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np

from sidecar.config import Limits
from sidecar.main import Sidecar
from testkit.sidecar_stages import Sink, frame_bytes, make_cfg, out, run, tensor_header, vm_kib

FRAME = np.ones(256 * 1024, dtype=np.float32)  # 1 MiB
RUN_S = 3.0
LIMITS = {"inbound_queue": 8, "outbound_queue": 8}


def socket_buffer_frames() -> int:
    """Frames the kernel may buffer on one loopback connection at most: the
    sender's and the receiver's TCP buffers at their maximum (tcp_wmem, tcp_rmem)."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            total += int(f.read().split()[2])
    return -(-total // FRAME.nbytes)


class Producer(threading.Thread):
    """Sends 1 MiB frames as fast as the socket takes them (blocking sends)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.sent = 0
        self.times: list[float] = []  # completion time of each frame
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port))
            s.settimeout(0.2)
            seq = 0
            while not self.stop.is_set():
                data = memoryview(frame_bytes(tensor_header(FRAME, seq=seq), FRAME))
                while data and not self.stop.is_set():
                    try:
                        n = s.send(data)
                    except TimeoutError:
                        continue
                    data = data[n:]
                if not data:
                    self.sent += 1
                    self.times.append(time.monotonic())
                    seq += 1
            s.close()
        except OSError as e:
            self.error = e


def memory_bound(limits: Limits, outputs: int, largest_frame: int, concurrency: int = 1) -> int:
    """docs/sidecar.md: ``inbound_queue_mb + outputs x outbound_queue_mb + (2 +
    concurrency + outputs) x largest frame``, plus the idle buffers of the pool
    (``buffer_pool_mb``), in bytes."""
    return ((limits.inbound_queue_mb + outputs * limits.outbound_queue_mb
             + limits.buffer_pool_mb) << 20) + (2 + concurrency + outputs) * largest_frame


def test_slow_stage_pushes_back_on_a_fast_producer() -> None:
    async def main() -> None:
        sink = await Sink().start()
        cfg = make_cfg("slow", "slow", [out(sink.port)], limits=LIMITS)
        async with Sidecar(cfg) as sc:
            drained = 0

            async def consume() -> None:
                nonlocal drained
                while True:
                    await sink.queue.get()
                    drained += 1

            consumer = asyncio.create_task(consume())
            base = vm_kib("VmRSS")
            peak = base
            prod = Producer(sc.port)
            t0 = time.monotonic()
            prod.start()
            mid_done = None
            while (now := time.monotonic()) - t0 < RUN_S:
                await asyncio.sleep(0.05)
                peak = max(peak, vm_kib("VmRSS"))
                if mid_done is None and now - t0 >= RUN_S / 2:
                    mid_done = sc.counters.stage.frames
            prod.stop.set()
            late_processed = sc.counters.stage.frames - (mid_done or 0)
            late_sent = sum(1 for t in prod.times if t - t0 >= RUN_S / 2)
            server = sc.counters.server
            stage = sc.counters.stage
            sender = sc.counters.senders["next"]
            print(f"\nsent {prod.sent} frames, processed {stage.frames}; last {RUN_S / 2:.1f}s: "
                  f"sent {late_sent}, processed {late_processed}; RSS +{(peak - base) // 1024} MiB; "
                  f"inbound hwm {server.queue_hwm}, backpressure waits "
                  f"{server.backpressure_waits}")
            # the stage ran at its pace (~20 frames/s) and was the bottleneck
            assert 30 <= stage.frames <= 70
            # the producer was held to the stage's pace by TCP flow control: it sent at
            # most what the stage took plus what the queues and the kernel's socket
            # buffers hold (they may still be growing in the second half: autotuning);
            # unheld, it would send thousands of frames a second
            in_flight = LIMITS["inbound_queue"] + socket_buffer_frames()
            assert late_sent <= late_processed + in_flight, (late_sent, late_processed, in_flight)
            assert prod.sent <= stage.frames + in_flight + 10
            assert server.backpressure_waits > 0
            assert server.dropped_overload == 0  # not real-time: nothing dropped
            # queues within their limits; memory bounded
            assert server.queue_hwm <= LIMITS["inbound_queue"]
            assert sender.queue_hwm <= LIMITS["outbound_queue"]
            assert stage.max_in_flight <= cfg.runner.concurrency
            # memory: the bound docs/sidecar.md gives ("Backpressure and deadlines"),
            # plus 64 MiB for the interpreter, the allocator's free lists and the
            # producer thread's frame being built.  The bug: reading ahead of the
            # stage; the producer offers ~1 GiB/s over loopback, so an unbounded
            # reader grows by hundreds of MiB within the first second.
            bound = memory_bound(cfg.limits, len(cfg.outputs), FRAME.nbytes,
                                 cfg.runner.concurrency)
            bound_kib = (bound + (64 << 20)) // 1024
            assert (peak - base) < bound_kib, f"RSS grew by {(peak - base) // 1024} MiB"
            consumer.cancel()
        prod.join(5)
        assert not prod.is_alive()
        assert drained > 0
        await sink.close()

    run(main(), timeout=40)
