"""The demo's streams: ports, the traffic spec, MMH frame templates, the
latency statistics and the process set-up (CPU, scheduling class, timing)
that senders and receivers (``traffic.py``, ``voice.py``) share."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from mmmesh.abi import MMH_MAGIC_V1_U32, MMH_PREAMBLE_LEN, Modality, Tlv
from mmmesh.wire import Header, encode_header

VOICE_PORT = 5004
VIDEO_PORT = 5006
LIDAR_PORT = 7000
VOICE_STREAM, VIDEO_STREAM, LIDAR_STREAM = 11, 12, 13
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
UDP_IP_OVERHEAD = 28  # IPv4 + UDP header bytes per datagram

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # also SCM_TIMESTAMPNS
SO_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37)  # also SCM_TIMESTAMPING
TIMESPEC = struct.Struct("@qq")
U64 = struct.Struct("!Q")
MAGIC = struct.Struct("!I")


@dataclass(frozen=True)
class TrafficSpec:
    """What one phase sends.  Times in seconds, rates in bit/s."""

    link_bps: int = 300_000_000
    duration: float = 8.0  # voice and lidar send for this long
    warmup: float = 0.5  # the flood starts this much earlier (fills the queue)
    drain: float = 0.7  # receivers keep listening this long after the senders stop
    voice: bool = True
    video: bool = True
    lidar: bool = True
    voice_size: int = 200  # bytes per frame, header included
    voice_interval: float = 0.010
    voice_bitrate: int = 160_000  # AUDIO_BITRATE TLV: 200 B every 10 ms
    video_size: int = 1400
    video_fps: int = 60
    flood_factor: float = 1.5  # flood rate / link rate
    lidar_bytes: int = 500_000  # bytes per sweep (one frame)
    lidar_period: float = 0.100
    lidar_density: int = 120_000  # POINT_DENSITY TLV: points per sweep
    # Voice endpoints run SCHED_FIFO, as audio stacks do (rtkit/PipeWire): on a
    # 2-CPU machine that also runs the flood, this keeps CPU scheduling out of
    # what is measured, the network path.  Same in every phase.
    voice_realtime: bool = True
    # Niceness of the bulk endpoints (flood sender, video and LiDAR endpoints).
    # On a real node the flood comes from other machines; here everything
    # shares 2 CPUs with the kernel threads that carry every packet (ksoftirqd),
    # voice's included.  Same in every phase.
    bulk_nice: int = 0
    # Also measure voice latency to the kernel's receive timestamp (SO_TIMESTAMPNS).
    voice_kernel_ts: bool = True
    # Also take the voice sender's TX timestamps (SO_TIMESTAMPING: when a frame
    # enters the device's queueing layer, and when the driver takes it), which
    # split the latency to the kernel's receive timestamp into sender, qdisc
    # and wire (``voice.breakdown``).  Same in every phase.
    voice_tx_ts: bool = False
    # CPUs of the voice endpoints and of the bulk endpoints (flood sender,
    # video and LiDAR endpoints); None: wherever the scheduler puts them.
    voice_cpu: int | None = None
    bulk_cpu: int | None = None

    @property
    def flood_pps(self) -> float:
        return self.flood_factor * self.link_bps / ((self.video_size + UDP_IP_OVERHEAD) * 8)


# --------------------------------------------------------------------------
# Process set-up (each stream runs in its own process)
# --------------------------------------------------------------------------
def realtime(enabled: bool, prio: int = 10) -> bool:
    """Switches the calling process to SCHED_FIFO ``prio``; False if not possible."""
    if not enabled:
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(prio))
    except (AttributeError, OSError):
        return False
    return True


def nice(inc: int) -> None:
    if inc:
        try:
            os.nice(inc)
        except OSError:
            pass


def pin_cpu(cpu: int | None) -> None:
    """Keeps the calling process on ``cpu`` (None, or a CPU it may not use: no-op)."""
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except (AttributeError, OSError):
            pass


def sleep_until(t: float) -> None:
    while True:
        d = t - time.monotonic()
        if d <= 0:
            return
        time.sleep(d)


def mono_at(wall: float) -> float:
    """A wall-clock instant (time.time()) on the monotonic clock."""
    return time.monotonic() + (wall - time.time())


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------
def percentile(sorted_values: list[float] | list[int], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of an ascending list."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def latency_summary(latencies_ns: Any) -> dict[str, float | int]:
    """p50/p99/max/mean in milliseconds of a sequence of nanosecond latencies."""
    v = sorted(latencies_ns)
    if not v:
        return {"n": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan,
                "mean_ms": math.nan}
    return {
        "n": len(v),
        "p50_ms": percentile(v, 50) / 1e6,
        "p99_ms": percentile(v, 99) / 1e6,
        "max_ms": v[-1] / 1e6,
        "mean_ms": sum(v) / len(v) / 1e6,
    }


# --------------------------------------------------------------------------
# A pre-encoded frame whose sequence and timestamp are patched in place
# --------------------------------------------------------------------------
class FrameTemplate:
    """``header + payload`` encoded once; :meth:`stamp` patches SEQUENCE and
    TIMESTAMP_NS in place and :meth:`read` reads them back (the hot path of the
    flood sender and its receiver), checked against a full decode."""

    def __init__(self, header: Header, frame_size: int) -> None:
        proto = dataclasses.replace(header, sequence=0, timestamp_ns=0)
        hdr_len = len(encode_header(proto))
        payload = max(0, frame_size - hdr_len)
        hdr = encode_header(dataclasses.replace(proto, payload_len=payload))
        self.hdr_len = len(hdr)
        self.modality = header.modality
        self.seq_off = self.ts_off = -1
        i = MMH_PREAMBLE_LEN
        while i + 2 <= len(hdr):
            typ, ln = hdr[i], hdr[i + 1]
            if typ == Tlv.SEQUENCE:
                self.seq_off = i + 2
            elif typ == Tlv.TIMESTAMP_NS:
                self.ts_off = i + 2
            i += 2 + ln
        if self.seq_off < 0 or self.ts_off < 0:
            raise ValueError("the template header needs SEQUENCE and TIMESTAMP_NS")
        self.buf = bytearray(hdr) + bytearray(payload)
        self.size = len(self.buf)

    def stamp(self, seq: int, ts_ns: int) -> bytearray:
        U64.pack_into(self.buf, self.seq_off, seq)
        U64.pack_into(self.buf, self.ts_off, ts_ns)
        return self.buf

    def read(self, buf: bytes | bytearray | memoryview, n: int) -> tuple[int, int] | None:
        """(sequence, timestamp) of a frame laid out like the template, else None."""
        if (n < self.hdr_len or MAGIC.unpack_from(buf, 0)[0] != MMH_MAGIC_V1_U32
                or buf[4] != self.hdr_len or buf[5] != self.modality
                or buf[self.seq_off - 2] != Tlv.SEQUENCE
                or buf[self.ts_off - 2] != Tlv.TIMESTAMP_NS):
            return None
        return U64.unpack_from(buf, self.seq_off)[0], U64.unpack_from(buf, self.ts_off)[0]


def voice_header(spec: TrafficSpec) -> Header:
    return Header(modality=Modality.AUDIO, stream_id=VOICE_STREAM, sequence=0, timestamp_ns=0,
                  bitrate=spec.voice_bitrate)


def video_header(spec: TrafficSpec) -> Header:
    return Header(modality=Modality.VIDEO, stream_id=VIDEO_STREAM, sequence=0, timestamp_ns=0,
                  fps=spec.video_fps)


def lidar_header(spec: TrafficSpec) -> Header:
    return Header(modality=Modality.POINT_CLOUD, stream_id=LIDAR_STREAM, sequence=0,
                  timestamp_ns=0, density=spec.lidar_density)
