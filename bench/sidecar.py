#!/usr/bin/env python3
"""Sidecar relay cost against a raw TCP relay and gRPC, side by side, on loopback.

One hop, three relays, each in its own process between a source process and a
sink process (source -> relay -> sink, 127.0.0.1):

  raw      the limit: a plain-socket thread relay that reads a length-prefixed
           frame (staging buffer for small ones, recv_into one reused buffer
           for big ones) and writes it on with one sendall per frame
  sidecar  the mmmesh sidecar (sidecar.main.Sidecar, uvloop as the console
           entry uses it) with an identity python stage: MMH frames in and out;
           twice: a plain function (the python runner's thread pool, the usual
           case) and an ``async def`` (runs on the event loop)
  grpc     grpc.aio client streaming of raw bytes (generic handlers, no protoc):
           the relay's servicer forwards each message on its own stream to the sink

Measured, per relay, in the same run:
  4 MiB frames  throughput (MB/s at the sink, first to last frame), and the
                relay process's CPU time per frame (user + system, /proc)
  1 KiB frames  throughput (frames/s), and one-way latency at 1000 frames/s:
                "added per hop" = relay path percentile - direct path percentile
                (source -> sink with no relay, same framing, measured right
                before the relay path), p50 and p99

Everything is measured in rounds: each round runs every relay once (the order
rotates); a relay's ratio to the raw relay, and its added latency over the
direct path, are taken within its round, and the medians over the rounds are
reported (this 2-vCPU VM drifts by 10-30 % between runs, and more when its
neighbours are busy; within a round it mostly cancels).  "Faster than gRPC"
compares the two ratios to raw.

Targets (judged on the plain-function stage; the async one is shown beside):
sidecar >= 80 % of raw on 4 MiB; sidecar faster than gRPC on both sizes;
added p99 per hop < 1 ms on 1 KiB.  Prints a table with ratios to raw,
writes out/bench/sidecar.json (atomically).  Exit 0 unless --strict and a
target is missed.

    .venv/bin/python bench/sidecar.py [--quick] [--rounds N] [--strict]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np

from mmmesh.abi import DType, Modality
from mmmesh.files import write_json
from mmmesh.wire import Header, TensorSpec, encode_header

MiB = 1 << 20
LEN = struct.Struct("!I")
STAMP = struct.Struct("!Q")  # first 8 payload bytes: the source's monotonic send time
GRPC_METHOD = "/mmbench.Relay/Stream"
GRPC_OPTS = [("grpc.max_receive_message_length", 64 * MiB),
             ("grpc.max_send_message_length", 64 * MiB)]
now_ns = time.monotonic_ns  # CLOCK_MONOTONIC: one clock for every process


# --------------------------------------------------------------------------
# Framing: raw (4-byte length) and MMH (the sidecar's)
# --------------------------------------------------------------------------
class Framing:
    name = ""

    def encode(self, payload_len: int) -> bytes:  # the header for a payload
        raise NotImplementedError

    def need(self, buf: memoryview) -> tuple[int, int] | None:
        """(header length, payload length) of the frame at buf[0], or None if
        more bytes are needed to know."""
        raise NotImplementedError


class RawFraming(Framing):
    name = "raw"

    def encode(self, payload_len: int) -> bytes:
        return LEN.pack(payload_len)

    def need(self, buf: memoryview) -> tuple[int, int] | None:
        if len(buf) < 4:
            return None
        return 4, LEN.unpack_from(buf)[0]


class MmhFraming(Framing):
    name = "mmh"

    def encode(self, payload_len: int) -> bytes:
        return encode_header(Header(modality=Modality.TENSOR, stream_id=1, sequence=0,
                                    payload_len=payload_len,
                                    tensor=TensorSpec(DType.UINT8, (payload_len,))))

    def need(self, buf: memoryview) -> tuple[int, int] | None:
        if len(buf) < 12:
            return None
        return buf[4], struct.unpack_from("!I", buf, 8)[0]


FRAMINGS: dict[str, Framing] = {"raw": RawFraming(), "mmh": MmhFraming()}


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------
def _spawn(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(fn, args, child), daemon=True)
    p.start()
    child.close()
    return p, parent


def _child(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    try:
        fn(conn, *args)
    except BaseException as e:  # noqa: BLE001 - report anything, then exit
        import traceback

        try:
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
        except OSError:
            pass


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"{what}: no answer within {timeout:.0f}s")
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{what} failed: {value}")
    return value


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _listen() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# -- sinks ---------------------------------------------------------------------
class _Tally:
    def __init__(self, expect: int, keep_latency: bool) -> None:
        self.expect = expect
        self.frames = 0
        self.bytes = 0
        self.first = self.last = 0
        self.keep = keep_latency
        self.lat: list[int] = []

    def frame(self, stamp: int, nbytes: int) -> None:
        t = now_ns()
        if not self.frames:
            self.first = t
        self.last = t
        self.frames += 1
        self.bytes += nbytes
        if self.keep:
            self.lat.append(t - stamp)

    @property
    def done(self) -> bool:
        return self.frames >= self.expect

    def result(self) -> dict[str, Any]:
        return {"frames": self.frames, "bytes": self.bytes, "first_ns": self.first,
                "last_ns": self.last, "lat_ns": np.array(self.lat, dtype=np.int64)}


def stream_sink(conn: Any, framing_name: str, expect: int, keep_latency: bool,
                timeout: float) -> None:
    """Counts frames on one TCP connection (the relay's or the source's)."""
    framing = FRAMINGS[framing_name]
    ls = _listen()
    conn.send(("ready", ls.getsockname()[1]))
    ls.settimeout(timeout)
    c, _ = ls.accept()
    c.settimeout(timeout)
    tally = _Tally(expect, keep_latency)
    buf = bytearray(4 * MiB)
    mv = memoryview(buf)
    start = end = 0
    skip = 0  # payload bytes of the current (big) frame still to discard
    pending = (0, 0)  # (stamp, size) of that frame: counted when it is complete
    deadline = time.monotonic() + timeout
    while not tally.done and time.monotonic() < deadline:
        if skip:
            n = c.recv_into(mv, min(skip, len(buf)))
            if not n:
                break
            skip -= n
            if not skip:
                tally.frame(*pending)
            continue
        if start == end:
            start = end = 0
        elif len(buf) - end < 65536:
            buf[: end - start] = buf[start:end]
            end -= start
            start = 0
        n = c.recv_into(mv[end:])
        if not n:
            break
        end += n
        while True:
            info = framing.need(mv[start:end])
            if info is None:
                break
            hl, pl = info
            have = end - start
            if have < hl + 8:
                break
            stamp = STAMP.unpack_from(buf, start + hl)[0]
            if have >= hl + pl:
                tally.frame(stamp, pl)
                start += hl + pl
                if tally.done:
                    break
            else:  # a big frame: discard the rest as it comes, then count it
                pending = (stamp, pl)
                skip = hl + pl - have
                start = end = 0
                break
    c.close()
    ls.close()
    conn.send(("result", tally.result()))


def grpc_sink(conn: Any, expect: int, keep_latency: bool, timeout: float) -> None:
    import grpc  # type: ignore[import-untyped]

    tally = _Tally(expect, keep_latency)

    async def main() -> None:
        done = asyncio.Event()

        async def stream(request_iterator: Any, context: Any) -> bytes:
            async for msg in request_iterator:
                tally.frame(STAMP.unpack_from(msg)[0], len(msg))
                if tally.done:
                    done.set()
            return b""

        server = grpc.aio.server(options=GRPC_OPTS)
        handler = grpc.method_handlers_generic_handler("mmbench.Relay", {
            "Stream": grpc.stream_unary_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(("ready", port))
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except TimeoutError:
            pass
        await server.stop(0.5)

    _run(main())
    conn.send(("result", tally.result()))


# -- relays ----------------------------------------------------------------------
def raw_relay(conn: Any, sink_port: int) -> None:
    """Thread-per-connection relay of length-prefixed frames."""
    ls = _listen()
    conn.send(("ready", ls.getsockname()[1]))

    def serve(cin: socket.socket) -> None:
        cin.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = _connect(sink_port)
        buf = bytearray(256 << 10)
        mv = memoryview(buf)
        big = bytearray(0)
        start = end = 0
        while True:
            if start == end:
                start = end = 0
            elif len(buf) - end < 4096:
                buf[: end - start] = buf[start:end]
                end -= start
                start = 0
            n = cin.recv_into(mv[end:])
            if not n:
                break
            end += n
            while end - start >= 4:
                plen = LEN.unpack_from(buf, start)[0]
                total = 4 + plen
                if end - start >= total:  # whole frame here: write it on
                    out.sendall(mv[start:start + total])
                    start += total
                    continue
                if total <= len(buf) - start:
                    break  # fits: read more
                # a big frame: read the rest straight into one reused buffer
                # (grown, never zero-filled again: what a tuned relay does)
                if len(big) < total:
                    big = bytearray(total)
                fmv = memoryview(big)[:total]
                have = end - start
                fmv[:have] = mv[start:end]
                while have < total:
                    n = cin.recv_into(fmv[have:])
                    if not n:
                        return
                    have += n
                out.sendall(fmv)
                start = end = 0
                break
        out.close()

    def guarded(cin: socket.socket) -> None:
        try:
            serve(cin)
        except OSError:  # the sink hung up at the end of a run
            pass

    while True:
        c, _ = ls.accept()
        threading.Thread(target=guarded, args=(c,), daemon=True).start()


def sidecar_relay(conn: Any, sink_port: int, async_stage: bool) -> None:
    from sidecar.config import SidecarConfig
    from sidecar.main import Sidecar

    fn = "identity_async" if async_stage else "identity"
    cfg = SidecarConfig.model_validate({
        "stage": "identity",
        "listen": {"tcp": "127.0.0.1:0"},
        "runner": {"kind": "python", "target": f"demo.pipeline.stages:{fn}"},
        "outputs": [{"name": "sink", "address": f"127.0.0.1:{sink_port}",
                     "modality": "tensor", "sla_class": "bench"}],
        "qosd": {"socket": None},
    })

    async def main() -> None:
        async with Sidecar(cfg) as sc:
            conn.send(("ready", sc.port))
            await asyncio.Event().wait()

    _run(main())


def grpc_relay(conn: Any, sink_port: int) -> None:
    import grpc

    async def main() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sink_port}", options=GRPC_OPTS)
        onward = channel.stream_unary(GRPC_METHOD)

        async def stream(request_iterator: Any, context: Any) -> bytes:
            async def forward() -> Any:
                async for msg in request_iterator:
                    yield msg

            await onward(forward())
            return b""

        server = grpc.aio.server(options=GRPC_OPTS)
        handler = grpc.method_handlers_generic_handler("mmbench.Relay", {
            "Stream": grpc.stream_unary_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(("ready", port))
        await server.wait_for_termination()

    _run(main())


# -- sources ---------------------------------------------------------------------
def _schedule(n: int, rate: float | None) -> Iterator[int]:
    """Yields frame numbers, paced at ``rate`` per second (None: as fast as possible)."""
    t0 = time.monotonic()
    for i in range(n):
        if rate:
            due = t0 + i / rate
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
        yield i


def stream_source(conn: Any, framing_name: str, port: int, size: int, n: int,
                  rate: float | None, batch: int) -> None:
    framing = FRAMINGS[framing_name]
    hdr = framing.encode(size)
    one = bytearray(hdr) + bytearray(size)
    off = len(hdr)
    # small frames as fast as possible go out ``batch`` per sendall (the relays
    # still read and forward them one by one)
    k = max(1, min(batch, n)) if rate is None and size <= 64 << 10 else 1
    block = bytearray(one * k)
    mv = memoryview(block)
    s = _connect(port)
    conn.send(("ready", None))
    conn.recv()  # go
    sent = 0
    for _ in _schedule(-(-n // k), rate):
        m = min(k, n - sent)
        t = now_ns()
        for j in range(m):
            STAMP.pack_into(block, j * len(one) + off, t)
        s.sendall(mv[: m * len(one)])
        sent += m
    s.shutdown(socket.SHUT_WR)
    time.sleep(0.2)
    s.close()
    conn.send(("result", {"sent": sent}))


def grpc_source(conn: Any, port: int, size: int, n: int, rate: float | None) -> None:
    import grpc

    payload = bytearray(size)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTS)
    grpc.channel_ready_future(channel).result(timeout=10)
    call = channel.stream_unary(GRPC_METHOD)
    conn.send(("ready", None))
    conn.recv()  # go

    def messages() -> Iterator[bytes]:
        for _ in _schedule(n, rate):
            STAMP.pack_into(payload, 0, now_ns())
            yield bytes(payload)

    call(messages(), timeout=120)
    channel.close()
    conn.send(("result", {"sent": n}))


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# --------------------------------------------------------------------------
# One measurement
# --------------------------------------------------------------------------
def measure(relay: str | None, family: str, size: int, n: int, rate: float | None,
            *, async_stage: bool = False, batch: int = 64, timeout: float = 60.0
            ) -> dict[str, Any]:
    """source -> [relay] -> sink once; ``relay`` None is the direct path."""
    procs: list[mp.Process] = []
    keep = rate is not None
    try:
        if family == "grpc":
            p, sink = _spawn(grpc_sink, n, keep, timeout)
        else:
            p, sink = _spawn(stream_sink, family, n, keep, timeout)
        procs.append(p)
        port = _recv(sink, 20, "sink")
        if relay is not None:
            relays: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
                "raw": (raw_relay, ()), "sidecar": (sidecar_relay, (async_stage,)),
                "grpc": (grpc_relay, ())}
            fn, args = relays[relay]
            p, rconn = _spawn(fn, port, *args)
            procs.append(p)
            port = _recv(rconn, 30, f"{relay} relay")
        if family == "grpc":
            p, src = _spawn(grpc_source, port, size, n, rate)
        else:
            p, src = _spawn(stream_source, family, port, size, n, rate, batch)
        procs.append(p)
        _recv(src, 20, "source")
        time.sleep(0.2)  # let every process settle before the clock starts
        cpu0 = _cpu_s(procs[1].pid) if relay is not None else 0.0
        src.send("go")
        _recv(src, timeout + 10, "source")
        res = _recv(sink, timeout + 10, "sink")
        relay_cpu = _cpu_s(procs[1].pid) - cpu0 if relay is not None else math.nan
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(2)
    if res["frames"] < n:
        raise RuntimeError(f"{relay or 'direct'}/{family}: sink saw {res['frames']} of {n} frames")
    span = (res["last_ns"] - res["first_ns"]) / 1e9
    out = {"frames": res["frames"], "size": size,
           "seconds": span, "relay_cpu_s": relay_cpu,
           "relay_cpu_us_per_frame": relay_cpu / n * 1e6,
           "frames_per_s": (res["frames"] - 1) / span if span > 0 else math.nan,
           "mb_per_s": (res["frames"] - 1) * size / span / 1e6 if span > 0 else math.nan}
    if keep:
        lat = np.sort(res["lat_ns"][min(50, n // 10):]) / 1e3  # drop the warm-up frames
        out.update(p50_us=float(np.percentile(lat, 50)), p99_us=float(np.percentile(lat, 99)),
                   max_us=float(lat[-1]))
    return out


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------
# relay -> (framing of its path, async identity stage)
RELAYS = {"raw": ("raw", False), "sidecar": ("mmh", False), "sidecar-async": ("mmh", True),
          "grpc": ("grpc", False)}
LABELS = {"raw": "raw TCP relay", "sidecar": "mmmesh sidecar", "sidecar-async": " (async stage)",
          "grpc": "gRPC streaming"}


def run(quick: bool, progress: Callable[[str], None], rounds: int | None = None
        ) -> dict[str, Any]:
    big_n = 60 if quick else 200
    small_n = 10_000 if quick else 40_000
    lat_n = 800 if quick else 1500
    lat_rate = 1000.0
    rounds = rounds or (2 if quick else 5)
    res: dict[str, Any] = {"config": {"big_frames": big_n, "big_size": 4 * MiB,
                                      "small_frames": small_n, "small_size": 1024,
                                      "latency_frames": lat_n, "latency_rate_per_s": lat_rate,
                                      "rounds": rounds, "cpus": os.cpu_count(),
                                      "sidecar_stage": "demo.pipeline.stages:identity "
                                                       "(a plain function: the runner's "
                                                       "thread pool)",
                                      "sidecar_async_stage": "demo.pipeline.stages:"
                                                             "identity_async (on the loop)"},
                           "relays": {}, "direct": {}}

    def latency(label: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """``rounds`` rounds; in each, every relay's path is measured right
        after the direct path of the same framing (source -> sink, no relay),
        and "added" is the difference within that pair: the machine's drift
        between rounds cancels out.  Reported: medians over the rounds."""
        names = list(RELAYS)
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        direct: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(rounds):
            progress(f"{label} round {rnd + 1}/{rounds}")
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for relay in order:
                fam, async_stage = RELAYS[relay]
                kind = "sidecar" if relay.startswith("sidecar") else relay
                d = measure(None, fam, 1024, lat_n, lat_rate)
                r = measure(kind, fam, 1024, lat_n, lat_rate, async_stage=async_stage)
                r["added_p50_us"] = r["p50_us"] - d["p50_us"]
                r["added_p99_us"] = r["p99_us"] - d["p99_us"]
                per[relay].append(r)
                direct.setdefault(fam, []).append(d)
        keys = ("p50_us", "p99_us", "max_us")
        out = {relay: {**{k: float(np.median([r[k] for r in runs]))
                          for k in (*keys, "added_p50_us", "added_p99_us")},
                       "added_p99_us_rounds": [round(r["added_p99_us"]) for r in runs]}
               for relay, runs in per.items()}
        dout = {fam: {k: float(np.median([r[k] for r in runs])) for k in keys}
                for fam, runs in direct.items()}
        return out, dout

    def throughput(size: int, n: int, label: str) -> dict[str, dict[str, Any]]:
        """``rounds`` rounds; each measures every relay once (the order rotates
        from round to round), and each relay's ratio to the raw relay is taken
        within its round: the machine's drift between rounds cancels out.
        Reported: medians over the rounds."""
        names = list(RELAYS)
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        for rnd in range(rounds):
            progress(f"{label} round {rnd + 1}/{rounds}")
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            got: dict[str, dict[str, Any]] = {}
            for relay in order:
                fam, async_stage = RELAYS[relay]
                kind = "sidecar" if relay.startswith("sidecar") else relay
                got[relay] = measure(kind, fam, size, n, None, async_stage=async_stage)
            for relay in names:
                r = got[relay]
                r["vs_raw"] = r["frames_per_s"] / got["raw"]["frames_per_s"]
                r["cpu_vs_raw"] = (r["relay_cpu_us_per_frame"]
                                   / got["raw"]["relay_cpu_us_per_frame"])
                per[relay].append(r)
        out: dict[str, dict[str, Any]] = {}
        for relay, runs in per.items():
            med = {k: float(np.median([r[k] for r in runs]))
                   for k in ("frames_per_s", "mb_per_s", "vs_raw", "relay_cpu_us_per_frame",
                             "cpu_vs_raw")}
            med["size"] = size
            med["frames"] = n
            med["vs_raw_rounds"] = [round(r["vs_raw"], 3) for r in runs]
            out[relay] = med
        return out

    big = throughput(4 * MiB, big_n, "4 MiB throughput")
    small = throughput(1024, small_n, "1 KiB throughput")
    lat, res["direct"] = latency("1 KiB latency")
    for relay in RELAYS:
        res["relays"][relay] = {"big": big[relay], "small": small[relay], "latency": lat[relay]}
    gr = res["relays"]["grpc"]
    for name in ("sidecar", "sidecar-async"):
        sc = res["relays"][name]
        res["targets" if name == "sidecar" else "targets_async_stage"] = {
            "sidecar_4MiB_ge_80pct_of_raw": sc["big"]["vs_raw"] >= 0.8,
            "sidecar_faster_than_grpc_4MiB": sc["big"]["vs_raw"] > gr["big"]["vs_raw"],
            "sidecar_faster_than_grpc_1KiB": sc["small"]["vs_raw"] > gr["small"]["vs_raw"],
            "sidecar_added_p99_per_hop_lt_1ms": sc["latency"]["added_p99_us"] < 1000.0,
        }
    return res


def table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        (f"one hop on loopback, {cfg['cpus']} CPUs; source, relay and sink are separate "
         f"processes; throughput: medians of {cfg['rounds']} rounds, 'vs raw' taken "
         "within each round"),
        "",
        (f"{'relay':<16}{'4 MiB MB/s':>11}{'vs raw':>8}{'CPU µs/fr':>10}{'1 KiB fr/s':>12}"
         f"{'vs raw':>8}{'p50 µs':>9}{'p99 µs':>9}{'+p50 µs':>9}{'+p99 µs':>9}"),
    ]
    lines.append("-" * len(lines[-1]))
    for relay, r in res["relays"].items():
        b, s, lt = r["big"], r["small"], r["latency"]
        lines.append(f"{LABELS[relay]:<16}{b['mb_per_s']:>11.0f}{b['vs_raw']:>8.2f}"
                     f"{b['relay_cpu_us_per_frame']:>10.0f}"
                     f"{s['frames_per_s']:>12.0f}{s['vs_raw']:>8.2f}{lt['p50_us']:>9.0f}"
                     f"{lt['p99_us']:>9.0f}{lt['added_p50_us']:>9.0f}{lt['added_p99_us']:>9.0f}")
    d = res["direct"]
    lines.append(f"(direct, no relay: p50/p99 µs raw {d['raw']['p50_us']:.0f}/"
                 f"{d['raw']['p99_us']:.0f}, mmh {d['mmh']['p50_us']:.0f}/"
                 f"{d['mmh']['p99_us']:.0f}, grpc {d['grpc']['p50_us']:.0f}/"
                 f"{d['grpc']['p99_us']:.0f}; +p50/+p99 = added per hop; CPU µs/fr = the "
                 "relay process's CPU per 4 MiB frame)")
    lines.append("added p99 µs per round: " + ", ".join(
        f"{LABELS[k].strip(' ()')} {r['latency']['added_p99_us_rounds']}"
        for k, r in res["relays"].items()))
    lines.append("4 MiB 'vs raw' per round: " + ", ".join(
        f"{LABELS[k].strip(' ()')} {r['big']['vs_raw_rounds']}"
        for k, r in res["relays"].items() if k != "raw"))
    lines.append("")
    async_t = res["targets_async_stage"]
    for k, ok in res["targets"].items():
        lines.append(f"  {'PASS' if ok else 'MISS'}  {k}"
                     f"   (async stage: {'PASS' if async_t[k] else 'MISS'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer frames (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "sidecar.json"))
    p.add_argument("--rounds", type=int, default=None,
                   help="throughput rounds (default 5, --quick 2)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    res = run(a.quick, progress, a.rounds)
    res["elapsed_s"] = time.monotonic() - t0
    write_json(Path(a.out), res)
    print(table(res))
    print(f"\nwrote {a.out}")
    return 1 if a.strict and not all(res["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
