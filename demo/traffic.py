"""The demo's traffic: each stream in its own process, inside a testbed node.

    voice   UDP, one 200-byte MMH frame (modality audio, AUDIO_BITRATE TLV)
            every 10 ms (the sender and its TX timestamps: ``voice.py``)
    video   UDP flood of ~1400-byte MMH frames (modality video, VIDEO_FPS TLV),
            paced at ``flood_factor`` x the link rate from a socket with a
            multi-megabyte send buffer, so that the uplink queue really fills
    lidar   TCP: one MMH frame (modality point_cloud, POINT_DENSITY TLV) per
            sweep, e.g. 0.5 MB every 100 ms, on one persistent connection

Every frame carries STREAM_ID, SEQUENCE and TIMESTAMP_NS (``time.time_ns()``
just before the send).  Receivers take ``time.time_ns()`` when a frame is
complete: sender and receiver share the machine's clock, so the difference is
the one-way latency, socket to socket.  Loss comes from sequence numbers, and
every process stops by itself at a deadline.

For a sensor stream a sweep that cannot be sent on time is skipped (as a
LiDAR driver drops sweeps when the link is behind); skipped sweeps count as
lost.
"""

from __future__ import annotations

import array
import errno
import math
import socket
import time
from typing import Any

from mmmesh.abi import MMH_PREAMBLE_LEN
from mmmesh.errors import WireError
from mmmesh.wire import decode_header

from .streams import (
    LIDAR_PORT,
    SO_RCVBUFFORCE,
    SO_SNDBUFFORCE,
    SO_TIMESTAMPNS,
    TIMESPEC,
    VIDEO_PORT,
    VOICE_PORT,
    FrameTemplate,
    TrafficSpec,
    latency_summary,
    lidar_header,
    mono_at,
    pin_cpu,
    sleep_until,
    video_header,
)
from .streams import nice as set_nice
from .streams import realtime as set_realtime
from .testbed import Child, Ctl, Testbed
from .voice import breakdown, voice_sender


# --------------------------------------------------------------------------
# Child processes (each runs inside a node's namespace; first argument: Ctl)
# --------------------------------------------------------------------------
def flood_sender(ctl: Ctl, dst: str, port: int, spec: TrafficSpec, start_wall: float,
                 stop_wall: float, sndbuf: int = 8 << 20) -> dict[str, Any]:
    """Video frames at ``flood_pps``, in small batches, never bursting to catch up."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # queued packets count against the socket: let the qdisc fill instead
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, sndbuf)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.connect((dst, port))
    tpl = FrameTemplate(video_header(spec), spec.video_size)
    gap = 1.0 / spec.flood_pps
    max_lag = 0.02
    pin_cpu(spec.bulk_cpu)
    set_nice(spec.bulk_nice)
    ctl.ready()
    start, stop = mono_at(start_wall), mono_at(stop_wall)
    sleep_until(start)
    send = sock.send
    stamp = tpl.stamp
    now_ns = time.time_ns
    mono = time.monotonic
    sent = errors = 0
    seq = 0
    due = start  # when the next frame is due
    while True:
        now = mono()
        if now >= stop:
            break
        if now < due:
            time.sleep(due - now)
            continue
        if now - due > max_lag:  # fell behind: do not burst to catch up
            due = now
        # every frame that is due now, at most 64 per round
        n = min(64, int((now - due) / gap) + 1)
        for _ in range(n):
            try:
                send(stamp(seq, now_ns()))
                sent += 1
            except OSError as e:
                if e.errno not in (errno.ENOBUFS, errno.EAGAIN):
                    raise
                errors += 1
            seq += 1
        due += n * gap
    sock.close()
    return {"sent": seq, "sent_ok": sent, "send_errors": errors, "bytes": seq * tpl.size,
            "seconds": stop_wall - start_wall, "target_pps": spec.flood_pps}


def udp_receiver(ctl: Ctl, port: int, stop_wall: float, modality: str,
                 template: FrameTemplate | None = None, keep: bool = False,
                 rcvbuf: int = 16 << 20, realtime: bool = False,
                 nice: int = 0, kernel_ts: bool = False, cpu: int | None = None,
                 keep_ts: bool = False) -> dict[str, Any]:
    """Counts frames, bytes and one-way latency on a UDP port until ``stop_wall``.

    With a ``template`` the sequence and timestamp are read at the template's
    offsets (checked); otherwise each frame is decoded with the MMH codec.
    ``kernel_ts`` also records the latency to the kernel's receive timestamp
    (SO_TIMESTAMPNS: when the packet reached the receiving node's stack), which
    leaves out the receiver's wake-up.  ``keep_ts`` also returns, per frame in
    arrival order, its sequence and both receive times (for ``voice.breakdown``).
    """
    pin_cpu(cpu)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
    except OSError:
        pass
    sock.bind(("0.0.0.0", port))
    sock.settimeout(0.05)
    if kernel_ts:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    klat = array.array("q")
    rx_seq, rx_k, rx_u = array.array("q"), array.array("q"), array.array("q")
    rt = set_realtime(realtime)
    set_nice(nice)
    ctl.ready()
    buf = bytearray(65536)
    mv = memoryview(buf)
    lat = array.array("q")
    seen = bytearray(1 << 16)  # bitmap of sequence numbers, grows
    frames = nbytes = dups = malformed = 0
    max_seq = -1
    first = last = 0
    recv_into = sock.recv_into
    now_ns = time.time_ns
    stop_ns = int(stop_wall * 1e9)
    kts = 0
    while True:
        try:
            if kernel_ts:
                n, anc, _flags, _addr = sock.recvmsg_into([buf], 64)
                kts = 0
                for level, typ, data in anc:
                    if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS and len(data) >= 16:
                        sec, nsec = TIMESPEC.unpack_from(data)
                        kts = sec * 1_000_000_000 + nsec
            else:
                n = recv_into(buf)
        except TimeoutError:
            if now_ns() >= stop_ns:
                break
            continue
        t = now_ns()
        got = template.read(buf, n) if template is not None else None
        if got is None:
            try:
                h = decode_header(mv[:n])
            except WireError:
                malformed += 1
                continue
            if h.sequence is None or h.timestamp_ns is None:
                malformed += 1
                continue
            got = (h.sequence, h.timestamp_ns)
        seq, ts = got
        if seq >= len(seen) * 8:
            seen.extend(bytearray(max(len(seen), seq // 8 + 1 - len(seen))))
        byte, bit = seq >> 3, 1 << (seq & 7)
        if seen[byte] & bit:
            dups += 1
            continue
        seen[byte] |= bit
        frames += 1
        nbytes += n
        lat.append(t - ts)
        if kts:
            klat.append(kts - ts)
        if keep_ts:
            rx_seq.append(seq)
            rx_k.append(kts)
            rx_u.append(t)
        max_seq = max(max_seq, seq)
        if not first:
            first = t
        last = t
        if t >= stop_ns:
            break
    sock.close()
    out: dict[str, Any] = {
        "modality": modality, "received": frames, "bytes": nbytes, "duplicates": dups,
        "malformed": malformed, "max_seq": max_seq, "first_ns": first, "last_ns": last,
        "latency": latency_summary(lat), "realtime": rt,
    }
    if kernel_ts:
        out["latency_kernel"] = latency_summary(klat)
    if keep:
        out["latencies_ns"] = lat.tolist()
    if keep_ts:
        out.update(rx_seq=rx_seq.tolist(), rx_kernel_ns=rx_k.tolist(), rx_user_ns=rx_u.tolist())
    return out


def lidar_sender(ctl: Ctl, dst: str, port: int, spec: TrafficSpec, start_wall: float,
                 stop_wall: float) -> dict[str, Any]:
    """One MMH frame per sweep on one TCP connection; late sweeps are skipped."""
    tpl = FrameTemplate(lidar_header(spec), spec.lidar_bytes)
    pin_cpu(spec.bulk_cpu)
    set_nice(spec.bulk_nice)
    deadline = time.monotonic() + 5.0
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.connect((dst, port))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    ctl.ready()
    start, stop = mono_at(start_wall), mono_at(stop_wall)
    sent = skipped = incomplete = 0
    tick = 0
    nticks = math.ceil((stop_wall - start_wall) / spec.lidar_period - 1e-9)
    while tick < nticks:
        t = start + tick * spec.lidar_period
        sleep_until(t)
        now = time.monotonic()
        if now >= stop:
            skipped += nticks - tick
            break
        late = int((now - t) / spec.lidar_period)
        if late:  # the previous sweep took too long: drop the ones we missed
            skipped += late
            tick += late
            continue
        data = tpl.stamp(tick, time.time_ns())
        sock.settimeout(max(0.05, stop - now + spec.lidar_period))
        try:
            sock.sendall(data)
            sent += 1
        except (TimeoutError, OSError):
            incomplete += 1
            break
        tick += 1
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
    return {"sent": sent, "scheduled": nticks, "skipped": skipped, "incomplete": incomplete,
            "bytes": sent * tpl.size, "seconds": stop_wall - start_wall}


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def tcp_receiver(ctl: Ctl, port: int, stop_wall: float, modality: str,
                 keep: bool = False, nice: int = 0, cpu: int | None = None) -> dict[str, Any]:
    """Reads MMH frames from one TCP connection; latency when a frame is complete."""
    pin_cpu(cpu)
    set_nice(nice)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(max(0.1, stop_wall - time.time()))
    ctl.ready()
    lat = array.array("q")
    frames = nbytes = 0
    max_seq = -1
    seqs: set[int] = set()
    first = last = 0
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        srv.close()
        return {"modality": modality, "received": 0, "bytes": 0, "max_seq": -1,
                "first_ns": 0, "last_ns": 0, "latency": latency_summary([]), "error": "no peer"}
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    pre = bytearray(MMH_PREAMBLE_LEN)
    hdr = bytearray(255)
    sink = bytearray(1 << 20)
    try:
        while True:
            remaining = stop_wall - time.time()
            if remaining <= 0:
                break
            conn.settimeout(remaining)
            if not _recv_exact(conn, memoryview(pre)):
                break
            hl = pre[4]
            if hl < MMH_PREAMBLE_LEN:
                raise WireError(f"hdr_len {hl}", 4)
            hdr[:MMH_PREAMBLE_LEN] = pre
            if not _recv_exact(conn, memoryview(hdr)[MMH_PREAMBLE_LEN:hl]):
                break
            h = decode_header(memoryview(hdr)[:hl])
            left = h.payload_len
            while left:
                n = conn.recv_into(sink, min(left, len(sink)))
                if n == 0:
                    raise EOFError
                left -= n
            t = time.time_ns()
            frames += 1
            nbytes += hl + h.payload_len
            if h.timestamp_ns is not None:
                lat.append(t - h.timestamp_ns)
            if h.sequence is not None:
                seqs.add(h.sequence)
                max_seq = max(max_seq, h.sequence)
            if not first:
                first = t
            last = t
    except (TimeoutError, EOFError, ConnectionError):
        pass
    finally:
        conn.close()
        srv.close()
    out: dict[str, Any] = {"modality": modality, "received": frames, "bytes": nbytes,
                           "max_seq": max_seq, "first_ns": first, "last_ns": last,
                           "latency": latency_summary(lat)}
    if keep:
        out["latencies_ns"] = lat.tolist()
    return out


# --------------------------------------------------------------------------
# Running one phase
# --------------------------------------------------------------------------
def _merge(tx: dict[str, Any], rx: dict[str, Any], seconds: float,
           scheduled: int | None = None) -> dict[str, Any]:
    sent = int(tx["sent"])
    expected = scheduled if scheduled is not None else sent
    received = int(rx["received"])
    loss = max(0.0, 1.0 - received / expected) if expected else math.nan
    out = {
        "sent": sent,
        "received": received,
        "loss_pct": 100.0 * loss,
        "mbit_s": rx["bytes"] * 8 / seconds / 1e6 if seconds > 0 else math.nan,
        "offered_mbit_s": tx["bytes"] * 8 / seconds / 1e6 if seconds > 0 else math.nan,
        **{k: v for k, v in rx["latency"].items()},
        **({"kernel_" + k: v for k, v in rx["latency_kernel"].items() if k != "n"}
           if "latency_kernel" in rx else {}),
        "sender": {k: v for k, v in tx.items() if k != "seconds" and not isinstance(v, list)},
    }
    if scheduled is not None:
        out["scheduled"] = scheduled
    if "latencies_ns" in rx:
        out["latencies_ns"] = rx["latencies_ns"]
    return out


def run_traffic(tb: Testbed, spec: TrafficSpec, *, keep_voice: bool = True) -> dict[str, Any]:
    """Runs one phase of traffic from ``tb.sender`` to ``tb.receiver``.

    Timeline: the flood starts first (``warmup`` s to fill the queue), then
    voice and lidar send for ``duration`` s together with it; receivers listen
    ``drain`` s longer.  Returns per-modality results (see :func:`_merge`).
    """
    snd, rcv = tb.sender, tb.receiver
    dst = rcv.addr
    video_tpl = FrameTemplate(video_header(spec), spec.video_size)
    lead = spec.warmup if spec.video else 0.0
    children: list[Child] = []
    # The whole timeline is fixed up front; forking and connecting take a few
    # tens of milliseconds, ``setup`` leaves ample room for them.
    setup = 0.6
    t0 = time.time() + setup
    start = t0 + lead
    stop = start + spec.duration
    rx_stop = stop + spec.drain
    try:
        rx_children = {}
        if spec.voice:
            rx_children["voice"] = tb.spawn(rcv.ns, "voice-rx", udp_receiver, VOICE_PORT,
                                            rx_stop, "voice", None, keep_voice,
                                            realtime=spec.voice_realtime,
                                            kernel_ts=spec.voice_kernel_ts, cpu=spec.voice_cpu,
                                            keep_ts=spec.voice_tx_ts and spec.voice_kernel_ts)
        if spec.video:
            rx_children["video"] = tb.spawn(rcv.ns, "video-rx", udp_receiver, VIDEO_PORT,
                                            rx_stop, "video", video_tpl, False,
                                            nice=spec.bulk_nice, cpu=spec.bulk_cpu)
        if spec.lidar:
            rx_children["lidar"] = tb.spawn(rcv.ns, "lidar-rx", tcp_receiver, LIDAR_PORT,
                                            rx_stop, "lidar", False, nice=spec.bulk_nice,
                                            cpu=spec.bulk_cpu)
        children += rx_children.values()
        for c in rx_children.values():
            c.wait_ready(10.0)
        tx_children = {}
        if spec.video:
            tx_children["video"] = tb.spawn(snd.ns, "video-tx", flood_sender, dst, VIDEO_PORT,
                                            spec, t0, stop)
        if spec.voice:
            tx_children["voice"] = tb.spawn(snd.ns, "voice-tx", voice_sender, dst, VOICE_PORT,
                                            spec, start, stop)
        if spec.lidar:
            tx_children["lidar"] = tb.spawn(snd.ns, "lidar-tx", lidar_sender, dst, LIDAR_PORT,
                                            spec, start, stop)
        children += tx_children.values()
        for c in tx_children.values():
            c.wait_ready(10.0)
        slack = t0 - time.time()
        wait = rx_stop - time.time() + 10.0
        tx_res = {k: c.result(wait) for k, c in tx_children.items()}
        rx_res = {k: c.result(wait) for k, c in rx_children.items()}
    finally:
        for c in children:
            tb.reap(c)
    out: dict[str, Any] = {}
    for name, tx in tx_res.items():
        rx = rx_res[name]
        if name == "lidar":
            out[name] = _merge(tx, rx, tx["seconds"], scheduled=tx["scheduled"])
        else:
            out[name] = _merge(tx, rx, tx["seconds"])
    if "voice" in out and (parts := breakdown(tx_res["voice"], rx_res["voice"])) is not None:
        out["voice"]["breakdown"] = parts
    out["_timing"] = {"setup_slack_s": slack, "warmup_s": lead, "duration_s": spec.duration,
                      "drain_s": spec.drain}
    return out
