"""The closed-loop demo's video flood (:mod:`demo.closed_loop.run`): a
process in the sensors node that floods the uplink with MMH video frames from
a given time to another, and reports every window of it to the sensors
node's qosd.

The frames are ``traffic.flood_sender``'s (``video_size`` bytes each,
modality video, one datagram each, paced at ``flood_factor`` x the link
rate from a socket with a large send buffer), but handed to the kernel
``BATCH`` at a time with UDP segmentation offload (``UDP_SEGMENT``): one
``send`` of 8 frames laid end to end, cut by the kernel into 8 datagrams of
``video_size`` bytes, each a whole frame with its own header.  The same
packets on the wire at 1/8 of the system calls.  (Not more: the qdisc sees
the batch as one packet of 8 frames until the device cuts it, and HTB
schedules it as one; 64 KB batches leave gaps in the flood's hold on the
link that voice borrows through.)  The flood stands for
traffic from other machines, so its rate must not depend on this one's CPU:
the process runs under SCHED_FIFO (it sleeps between batches and needs
little), and a batch due while it waited for the CPU is still sent (up to
``MAX_LAG_S`` behind).  On a small machine that also runs the whole pipeline
and three qosd, a Python loop of ~9000 sends a second falls short of its
rate and its windows swing by more than the controller's "load eased"
threshold.  Where the option is missing, one send per frame.

The windows reported (stage ``video-flood``, class video: the frames it sent;
0 outside the flood; no latency, the sender does not know it) let the
controller see the load it raised voice for come and go: its "load eased"
rule (docs/controller.md, "Decay needs a reason").
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Any

from demo.streams import SO_SNDBUFFORCE, FrameTemplate, TrafficSpec, video_header
from demo.testbed import Ctl

FLOOD_STAGE = "video-flood"
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = 103  # linux/udp.h
MAX_GSO_BYTES = 65_000  # a UDP payload is at most 65507 bytes
BATCH = 8  # frames a send (see the module doc)
MAX_LAG_S = 0.25  # behind by more: skip ahead (what is queued already covers it)


class GsoFlood:
    """Paced MMH video frames to ``dst:port`` in batches (see the module doc)."""

    def __init__(self, dst: str, port: int, spec: TrafficSpec, sndbuf: int = 8 << 20,
                 batch: int = BATCH) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # queued packets count against the socket: let the qdisc fill instead
            self.sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, sndbuf)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.connect((dst, port))
        tpl = FrameTemplate(video_header(spec), spec.video_size)
        self.size = len(tpl.buf)
        self.batch = max(1, min(batch, 64, MAX_GSO_BYTES // self.size))
        try:
            self.sock.setsockopt(SOL_UDP, UDP_SEGMENT, self.size)
        except OSError:
            self.batch = 1
        now = time.time_ns()
        self.buf = b"".join(bytes(tpl.stamp(i, now)) for i in range(self.batch))
        self.pps = spec.flood_pps

    def run(self, start_wall: float, stop_wall: float) -> tuple[int, int]:
        """Floods from ``start_wall`` to ``stop_wall``: (frames sent, frames
        the kernel refused)."""
        gap = self.batch / self.pps  # seconds between batches
        send, mono = self.sock.send, time.monotonic
        stop = mono() + (stop_wall - time.time())
        due = mono() + (start_wall - time.time())
        sent = refused = 0
        while True:
            now = mono()
            if now >= stop:
                break
            if now < due:
                time.sleep(min(due - now, stop - now))
                continue
            if now - due > MAX_LAG_S:
                due = now
            try:
                send(self.buf)
                sent += self.batch
            except OSError as e:
                if e.errno not in (errno.ENOBUFS, errno.EAGAIN):
                    raise
                refused += self.batch
            due += gap
        return sent, refused

    def close(self) -> None:
        self.sock.close()


def reporting_flood(ctl: Ctl, dst: str, port: int, spec: TrafficSpec, start_wall: float,
                    stop_wall: float, sla_socket: str, window_s: float, flood_from_s: float,
                    flood_to_s: float) -> dict[str, Any]:
    """The video flood from ``start + flood_from_s`` to ``start + flood_to_s``
    (:class:`GsoFlood`), and every ``window_s`` from ``start_wall`` to
    ``stop_wall`` a window of it reported to the qosd at ``sla_socket`` as
    stage ``video-flood``, class video (the frames it sent)."""
    import httpx

    from demo.pipeline.procs import realtime

    rt = realtime()
    flood = GsoFlood(dst, port, spec)
    sent = refused = posted = failed = 0
    flooded = 0.0
    a = start_wall
    client = httpx.Client(transport=httpx.HTTPTransport(uds=sla_socket),
                          base_url="http://qosd", timeout=2.0)
    try:
        ctl.ready()
        while a < stop_wall - 0.05:
            b = min(a + window_s, stop_wall)
            lo, hi = max(a, start_wall + flood_from_s), min(b, start_wall + flood_to_s)
            n = err = 0
            if hi - lo > 0.01:
                n, err = flood.run(lo, hi)
                flooded += hi - lo
            while time.time() < b:
                time.sleep(min(0.05, max(0.0, b - time.time())))
            sent, refused = sent + n, refused + err
            body = {"stage": FLOOD_STAGE, "instance": f"sensors/{FLOOD_STAGE}", "reports": [{
                "sla_class": "video", "modality": "video", "window_s": round(b - a, 3),
                "frames": n, "deadline_misses": 0, "drops": err, "errors": 0,
                "attainment": 1.0}]}
            try:
                posted += client.post("/v1/sla", json=body).status_code == 200
            except httpx.HTTPError:
                failed += 1
            a = b
    finally:
        client.close()
        flood.close()
    return {"sent": sent + refused, "sent_ok": sent, "send_errors": refused,
            "bytes": sent * flood.size, "seconds": max(flooded, 1e-9),
            "target_pps": spec.flood_pps, "batch": flood.batch, "realtime": rt,
            "reports_posted": posted, "reports_failed": failed}


__all__ = ["FLOOD_STAGE", "GsoFlood", "reporting_flood"]
