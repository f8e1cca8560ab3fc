"""The demo's voice sender, and where a voice frame spends its time.

One 200-byte MMH frame (modality audio, AUDIO_BITRATE TLV) every 10 ms on
UDP.  The frame is encoded once with the MMH codec (:class:`FrameTemplate`)
and only its SEQUENCE and TIMESTAMP_NS are patched per frame, so that the
timestamp (``time.time_ns()``) is the last thing before ``send``: whatever the
sender does after it counts as latency.

With ``TrafficSpec.voice_tx_ts`` the socket also asks for TX timestamps
(SO_TIMESTAMPING, software): SCHED when a frame enters the device's
queueing layer (``__dev_queue_xmit``, before the egress classifier and the
qdisc) and SND when the driver takes it (``veth_xmit``).  With the receiver's
kernel timestamp (SO_TIMESTAMPNS, taken when the frame reaches the receiving
stack) and its user-space clock read, each frame's one-way latency splits into

    sender    time_ns() -> SCHED   the rest of the Python send, the syscall, UDP/IP
    qdisc     SCHED -> SND         egress classifier, HTB enqueue, wait, dequeue
    wire      SND -> kernel rx     the veth hand-over
    receiver  kernel rx -> read    receive backlog, socket queue, the reader's wake-up

All four use CLOCK_REALTIME, as the frame's timestamp does.  Every TX
timestamp comes back on the socket's error queue, read without blocking after
each send and once more at the end.
"""

from __future__ import annotations

import array
import math
import socket
import struct
import time
from typing import Any

from .streams import (
    SO_TIMESTAMPING,
    TIMESPEC,
    FrameTemplate,
    TrafficSpec,
    latency_summary,
    mono_at,
    pin_cpu,
    realtime,
    sleep_until,
    voice_header,
)
from .testbed import Ctl

# SOF_TIMESTAMPING_* (linux/net_tstamp.h) and the SCM_TSTAMP_* kinds
TS_TX_SOFTWARE, TS_SOFTWARE, TS_OPT_ID, TS_TX_SCHED, TS_OPT_TSONLY = (
    1 << 1, 1 << 4, 1 << 7, 1 << 8, 1 << 11)
SCM_TSTAMP_SND, SCM_TSTAMP_SCHED = 0, 1
SOCK_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err
SOL_IP = getattr(socket, "SOL_IP", 0)


def enable_tx_timestamps(sock: socket.socket) -> None:
    """SCHED and SND software timestamps for every datagram, numbered from 0
    in send order (OPT_ID), without the payload (OPT_TSONLY)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING,
                    TS_TX_SOFTWARE | TS_SOFTWARE | TS_OPT_ID | TS_TX_SCHED | TS_OPT_TSONLY)


def read_tx_timestamps(sock: socket.socket, sched: array.array[int],
                       snd: array.array[int]) -> int:
    """Drains the error queue into ``sched``/``snd`` (indexed by send number,
    0 = none); returns how many timestamps were read."""
    n = 0
    while True:
        try:
            _d, anc, _f, _a = sock.recvmsg(1, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return n
        ts = kind = key = None
        for level, typ, data in anc:
            if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPING and len(data) >= 16:
                sec, nsec = TIMESPEC.unpack_from(data)
                ts = sec * 1_000_000_000 + nsec
            elif level == SOL_IP and len(data) >= SOCK_EE.size:
                _e, _o, _t, _c, _p, kind, key = SOCK_EE.unpack_from(data)
        if ts is None or key is None:
            continue
        dest = sched if kind == SCM_TSTAMP_SCHED else snd if kind == SCM_TSTAMP_SND else None
        if dest is not None and key < len(dest):
            dest[key] = ts
            n += 1


def voice_sender(ctl: Ctl, dst: str, port: int, spec: TrafficSpec, start_wall: float,
                 stop_wall: float) -> dict[str, Any]:
    """One frame every ``voice_interval``; with ``voice_tx_ts`` also returns
    per frame (by sequence) the send time and the SCHED / SND timestamps."""
    pin_cpu(spec.voice_cpu)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if spec.voice_tx_ts:
        enable_tx_timestamps(sock)
    sock.connect((dst, port))
    tpl = FrameTemplate(voice_header(spec), spec.voice_size)
    frames = int((stop_wall - start_wall) / spec.voice_interval) + 1
    user = array.array("q", bytes(8 * frames))
    sched = array.array("q", bytes(8 * frames))
    snd = array.array("q", bytes(8 * frames))
    rt = realtime(spec.voice_realtime)
    ctl.ready()
    start, stop = mono_at(start_wall), mono_at(stop_wall)
    sent = errors = nbytes = 0
    seq = 0
    send, stamp, now_ns = sock.send, tpl.stamp, time.time_ns
    while seq < frames:
        t = start + seq * spec.voice_interval
        if t >= stop:
            break
        sleep_until(t)
        ts = now_ns()
        try:
            send(stamp(seq, ts))
            user[sent] = ts  # OPT_ID numbers datagrams that were sent
            sent += 1
            nbytes += tpl.size
        except OSError:
            errors += 1
        if spec.voice_tx_ts:
            read_tx_timestamps(sock, sched, snd)
        seq += 1
    out: dict[str, Any] = {"sent": sent, "send_errors": errors, "bytes": nbytes, "realtime": rt,
                           "seconds": stop_wall - start_wall}
    if spec.voice_tx_ts:
        time.sleep(0.05)  # the last frames' SND timestamps
        read_tx_timestamps(sock, sched, snd)
        # by sequence: only without send errors are send numbers and sequences the same
        if not errors:
            out.update(user_ns=user[:sent].tolist(), sched_ns=sched[:sent].tolist(),
                       snd_ns=snd[:sent].tolist())
    sock.close()
    return out


PARTS = ("sender", "qdisc", "wire", "receiver")
KERNEL_PARTS = PARTS[:3]  # up to the kernel's receive timestamp
TAIL_PCT = 99.0


def _tail(rows: list[tuple[int, ...]], parts: tuple[str, ...]) -> dict[str, Any]:
    """Which parts make the slowest frames slow: over the slowest
    (100 - TAIL_PCT) % of ``rows`` by the sum of ``parts`` (at least one
    frame), the mean of each part and of the sum, in ms (the parts' means add
    up to the sum's)."""
    k = max(1, math.ceil(len(rows) * (100 - TAIL_PCT) / 100 - 1e-9))
    tail = sorted(rows, key=lambda r: sum(r[: len(parts)]))[-k:]
    out: dict[str, Any] = {p: sum(r[i] for r in tail) / k / 1e6 for i, p in enumerate(parts)}
    out.update(total=sum(sum(r[: len(parts)]) for r in tail) / k / 1e6, frames=k)
    return out


def breakdown(tx: dict[str, Any], rx: dict[str, Any]) -> dict[str, Any] | None:
    """Per part of the path (``PARTS``) the latency summary over the frames
    that have every timestamp, and what the slowest 1 % of them (to the
    kernel's receive timestamp: ``tail_kernel``; to the reader:
    ``tail_socket``) spent in each part; None without TX or receive
    timestamps or without a frame that has them all."""
    user, sched, snd = tx.get("user_ns"), tx.get("sched_ns"), tx.get("snd_ns")
    seqs, krx, urx = rx.get("rx_seq"), rx.get("rx_kernel_ns"), rx.get("rx_user_ns")
    if user is None or sched is None or snd is None or seqs is None or krx is None \
            or urx is None:
        return None
    rows: list[tuple[int, ...]] = []
    for seq, k, u in zip(seqs, krx, urx, strict=True):
        if not 0 <= seq < len(user) or not (sched[seq] and snd[seq] and k):
            continue
        rows.append((sched[seq] - user[seq], snd[seq] - sched[seq], k - snd[seq], u - k))
    if not rows:
        return None
    out: dict[str, Any] = {p: latency_summary([r[i] for r in rows])
                           for i, p in enumerate(PARTS)}
    out["frames"] = len(rows)
    out["tail_kernel"] = _tail(rows, KERNEL_PARTS)
    out["tail_socket"] = _tail(rows, PARTS)
    return out


__all__ = ["KERNEL_PARTS", "PARTS", "breakdown", "enable_tx_timestamps", "read_tx_timestamps",
           "voice_sender"]
