#!/usr/bin/env python3
"""Sidecar relay cost against a raw TCP relay and gRPC, side by side, on loopback.

One hop, three relays, each in its own process between a source process and a
sink process (source -> relay -> sink, 127.0.0.1):

  raw      the limit: a plain-socket thread relay that reads a length-prefixed
           frame (staging buffer for small ones, recv_into one reused buffer
           for big ones) and writes it on with one sendall per frame
  sidecar  the mmmesh sidecar as it is deployed: the ``mmmesh-sidecar``
           console (a fresh interpreter: uvloop, the SLA recorder with its
           windows and Prometheus registry; no qosd socket, no /metrics
           listener) with an identity python stage: MMH frames in and out;
           twice: a plain function (the python runner's thread pool, the usual
           case) and an ``async def`` (runs on the event loop)
  grpc     grpc.aio client streaming of raw bytes (generic handlers, no protoc):
           the relay's servicer forwards each message on its own stream to the sink

With ``--before REV`` the sidecar relays are measured a second time from git
revision REV (``git archive`` into a temporary directory, run with that
tree first on the path: its own mmmesh, sidecar and demo), in the same rounds.

Measured, per relay, in the same run:
  4 MiB frames  throughput (MB/s at the sink, first to last frame), and the
                relay process's CPU time per frame (user + system, /proc)
  1 KiB frames  throughput (frames/s) and the relay's CPU per frame, and
                one-way latency at 1000 frames/s: "added per hop" = relay
                path percentile - direct path percentile (source -> sink with
                no relay, same framing, measured right before the relay
                path), p50 and p99
  footprint     each sidecar tree's console with the identity stage: VmRSS
                once it listens, after 20k 1 KiB frames and 2 s idle (the
                steady RSS), after 4 MiB frames (the buffer pool holds some),
                and the time from exec to listening

Everything is measured in rounds: each round runs every relay once (the order
rotates); a relay's ratio to the raw relay, and its added latency over the
direct path, are taken within its round, and the medians over the rounds are
reported (this 2-vCPU VM drifts by 10-30 % between runs, and more when its
neighbours are busy; within a round it mostly cancels).  The host's load
average before and after is in the table and the JSON.

Targets (issue 18; the plain-function stage and the async one each):
1 KiB frames/s >= 30 % of raw and >= 5x gRPC streaming; added latency per hop
at 1000 frames/s: p99 <= 500 us (plain), p50 <= 100 us and p99 <= 300 us
(async), each below gRPC streaming's added p99; 4 MiB >= 0.95x raw; steady
RSS <= 40 MB.  Prints a table with ratios to raw, writes
out/bench/sidecar.json (atomically).  Exit 0 unless --strict and a target is
missed.

    .venv/bin/python bench/sidecar.py [--quick] [--rounds N] [--before REV] [--strict]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import textwrap
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SidecarProc:
    """The ``mmmesh-sidecar`` console of source tree ``tree`` (``python -m
    sidecar.main --config FILE``, that tree first on the path) relaying to
    ``sink_port`` through ``demo.pipeline.stages:identity`` (or
    ``identity_async``): a process of its own, as deployed."""

    def __init__(self, tree: Path, sink_port: int, async_stage: bool, tmp: Path) -> None:
        self.port = _free_port()
        fn = "identity_async" if async_stage else "identity"
        cfg = tmp / f"sidecar-{os.getpid()}-{self.port}.yaml"
        cfg.write_text(textwrap.dedent(f"""\
            stage: identity
            listen: {{tcp: "127.0.0.1:{self.port}"}}
            runner: {{kind: python, target: "demo.pipeline.stages:{fn}"}}
            outputs:
              - {{name: sink, address: "127.0.0.1:{sink_port}", modality: tensor,
                 sla_class: bench}}
            qosd: {{socket: null}}
        """))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMMESH_")}
        env["PYTHONPATH"] = str(tree)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # (as installed: from bytecode)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.main", "--config", str(cfg), "--log-level",
             "warning"], env=env, cwd=str(tree), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self.started_s = self._wait_listening(30.0)

    def _wait_listening(self, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"the sidecar exited: {err[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return time.monotonic() - self.t0
            except OSError:
                time.sleep(0.01)
        raise RuntimeError("the sidecar did not listen within 30 s")

    def rss_mb(self) -> float:
        return _status_kb(self.pid, "VmRSS") / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def source_tree(rev: str, tmp: Path) -> Path:
    """The repository as of git revision ``rev``, extracted under ``tmp``."""
    dest = tmp / f"tree-{rev.replace('/', '_')}"
    tar = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:  # our own repository's files
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # Python before 3.11.4
            tf.extractall(dest)
    return dest


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
            *, async_stage: bool = False, tree: Path = ROOT, tmp: Path | None = None,
            batch: int = 64, timeout: float = 60.0) -> dict[str, Any]:
    """source -> [relay] -> sink once; ``relay`` None is the direct path."""
    procs: list[mp.Process] = []
    sidecar: SidecarProc | None = None
    relay_pid = 0
    keep = rate is not None
    try:
        if family == "grpc":
            p, sink = _spawn(grpc_sink, n, keep, timeout)
        else:
            p, sink = _spawn(stream_sink, family, n, keep, timeout)
        procs.append(p)
        port = _recv(sink, 20, "sink")
        if relay == "sidecar":
            sidecar = SidecarProc(tree, port, async_stage, tmp or Path(tempfile.gettempdir()))
            port, relay_pid = sidecar.port, sidecar.pid
        elif relay is not None:
            relays: dict[str, Callable[..., None]] = {"raw": raw_relay, "grpc": grpc_relay}
            p, rconn = _spawn(relays[relay], port)
            procs.append(p)
            port = _recv(rconn, 30, f"{relay} relay")
            relay_pid = p.pid or 0
        if family == "grpc":
            p, src = _spawn(grpc_source, port, size, n, rate)
        else:
            p, src = _spawn(stream_source, family, port, size, n, rate, batch)
        procs.append(p)
        _recv(src, 20, "source")
        time.sleep(0.2)  # let every process settle before the clock starts
        cpu0 = _cpu_s(relay_pid) if relay is not None else 0.0
        src.send("go")
        _recv(src, timeout + 10, "source")
        res = _recv(sink, timeout + 10, "sink")
        relay_cpu = _cpu_s(relay_pid) - cpu0 if relay is not None else math.nan
    finally:
        if sidecar is not None:
            sidecar.stop()
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
# relay -> (framing of its path, relay kind, async identity stage, source tree or None)
Relay = tuple[str, str, bool, Path | None]


def relays(before: tuple[str, Path] | None) -> tuple[dict[str, Relay], dict[str, str]]:
    table: dict[str, Relay] = {"raw": ("raw", "raw", False, None),
                               "sidecar": ("mmh", "sidecar", False, ROOT),
                               "sidecar-async": ("mmh", "sidecar", True, ROOT),
                               "grpc": ("grpc", "grpc", False, None)}
    labels = {"raw": "raw TCP relay", "sidecar": "mmmesh sidecar",
              "sidecar-async": " (async stage)", "grpc": "gRPC streaming"}
    if before is not None:
        rev, tree = before
        table["sidecar@before"] = ("mmh", "sidecar", False, tree)
        table["sidecar-async@before"] = ("mmh", "sidecar", True, tree)
        labels["sidecar@before"] = f"sidecar @{rev}"[:16]
        labels["sidecar-async@before"] = " (async stage)"
    return table, labels


def footprint(tree: Path, tmp: Path, small: int, big: int) -> dict[str, Any]:
    """One sidecar console of ``tree`` (identity stage, plain function):
    VmRSS once it listens, after ``small`` 1 KiB frames and 2 s idle (the
    steady RSS), after ``big`` 4 MiB frames and 2 s idle (the buffer pool
    keeps some of their buffers); the time from exec to listening."""
    p, sink = _spawn(stream_sink, "mmh", small + big, False, 180.0)
    sc = None
    try:
        port = _recv(sink, 20, "sink")
        sc = SidecarProc(tree, port, False, tmp)
        time.sleep(1.0)
        out: dict[str, Any] = {"listening_s": round(sc.started_s, 3),
                               "rss_listening_mb": round(sc.rss_mb(), 1)}
        for label, size, n in (("1k", 1024, small), ("4m", 4 * MiB, big)):
            ps, src = _spawn(stream_source, "mmh", sc.port, size, n, None, 64)
            _recv(src, 20, "source")
            src.send("go")
            _recv(src, 120, "source")
            ps.join(5)
            if label == "4m":
                _recv(sink, 120, "sink")  # every frame arrived
            time.sleep(2.0)
            out[f"rss_after_{label}_mb"] = round(sc.rss_mb(), 1)
            if label == "1k":
                status = Path(f"/proc/{sc.pid}/status").read_text().splitlines()
                for key in ("RssAnon", "RssFile"):
                    for line in status:
                        if line.startswith(key + ":"):
                            out[f"{key.lower()}_mb"] = round(int(line.split()[1]) / 1024, 1)
        out["rss_hwm_mb"] = round(_status_kb(sc.pid, "VmHWM") / 1024, 1)
        return out
    finally:
        if sc is not None:
            sc.stop()
        if p.is_alive():
            p.terminate()
        p.join(2)


def run(quick: bool, progress: Callable[[str], None], rounds: int | None = None,
        before: tuple[str, Path] | None = None, tmp: Path | None = None) -> dict[str, Any]:
    big_n = 60 if quick else 200
    small_n = 10_000 if quick else 40_000
    lat_n = 800 if quick else 1500
    lat_rate = 1000.0
    rounds = rounds or (2 if quick else 5)
    tmp = tmp or Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
    table_, labels = relays(before)
    res: dict[str, Any] = {"config": {"big_frames": big_n, "big_size": 4 * MiB,
                                      "small_frames": small_n, "small_size": 1024,
                                      "latency_frames": lat_n, "latency_rate_per_s": lat_rate,
                                      "rounds": rounds, "cpus": os.cpu_count(),
                                      "before_rev": before[0] if before else None,
                                      "sidecar": "the mmmesh-sidecar console (uvloop, SLA "
                                                 "recorder), its own process",
                                      "sidecar_stage": "demo.pipeline.stages:identity "
                                                       "(a plain function: the runner's "
                                                       "thread pool)",
                                      "sidecar_async_stage": "demo.pipeline.stages:"
                                                             "identity_async (on the loop)"},
                           "load_before": os.getloadavg(), "labels": labels,
                           "relays": {}, "direct": {}}
    names = list(table_)

    def one(relay: str, size: int, n: int, rate: float | None) -> dict[str, Any]:
        fam, kind, async_stage, tree = table_[relay]
        return measure(kind, fam, size, n, rate, async_stage=async_stage,
                       tree=tree or ROOT, tmp=tmp)

    def latency(label: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """``rounds`` rounds; in each, every relay's path is measured right
        after the direct path of the same framing (source -> sink, no relay),
        and "added" is the difference within that pair: the machine's drift
        between rounds cancels out.  Reported: medians over the rounds."""
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        direct: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(rounds):
            progress(f"{label} round {rnd + 1}/{rounds}")
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for relay in order:
                fam = table_[relay][0]
                d = measure(None, fam, 1024, lat_n, lat_rate)
                r = one(relay, 1024, lat_n, lat_rate)
                r["added_p50_us"] = r["p50_us"] - d["p50_us"]
                r["added_p99_us"] = r["p99_us"] - d["p99_us"]
                per[relay].append(r)
                direct.setdefault(fam, []).append(d)
        keys = ("p50_us", "p99_us", "max_us")
        out = {relay: {**{k: float(np.median([r[k] for r in runs]))
                          for k in (*keys, "added_p50_us", "added_p99_us")},
                       "added_p50_us_rounds": [round(r["added_p50_us"]) for r in runs],
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
        per: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        for rnd in range(rounds):
            progress(f"{label} round {rnd + 1}/{rounds}")
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            got: dict[str, dict[str, Any]] = {}
            for relay in order:
                got[relay] = one(relay, size, n, None)
            for relay in names:
                r = got[relay]
                r["vs_raw"] = r["frames_per_s"] / got["raw"]["frames_per_s"]
                r["vs_grpc"] = r["frames_per_s"] / got["grpc"]["frames_per_s"]
                r["cpu_vs_raw"] = (r["relay_cpu_us_per_frame"]
                                   / got["raw"]["relay_cpu_us_per_frame"])
                per[relay].append(r)
        out: dict[str, dict[str, Any]] = {}
        for relay, runs in per.items():
            med = {k: float(np.median([r[k] for r in runs]))
                   for k in ("frames_per_s", "mb_per_s", "vs_raw", "vs_grpc",
                             "relay_cpu_us_per_frame", "cpu_vs_raw")}
            med["size"] = size
            med["frames"] = n
            med["vs_raw_rounds"] = [round(r["vs_raw"], 3) for r in runs]
            med["vs_grpc_rounds"] = [round(r["vs_grpc"], 2) for r in runs]
            out[relay] = med
        return out

    big = throughput(4 * MiB, big_n, "4 MiB throughput")
    small = throughput(1024, small_n, "1 KiB throughput")
    lat, res["direct"] = latency("1 KiB latency")
    for relay in names:
        res["relays"][relay] = {"big": big[relay], "small": small[relay], "latency": lat[relay]}
    progress("footprint")
    res["footprint"] = {"sidecar": footprint(ROOT, tmp, 20_000, 20)}
    if before is not None:
        res["footprint"]["sidecar@before"] = footprint(before[1], tmp, 20_000, 20)
    res["load_after"] = os.getloadavg()
    gr = res["relays"]["grpc"]
    for name in names:
        if not name.startswith("sidecar"):
            continue
        sc = res["relays"][name]
        lt = sc["latency"]
        t: dict[str, bool] = {
            "1KiB_ge_30pct_of_raw": sc["small"]["vs_raw"] >= 0.30,
            "1KiB_ge_5x_grpc": sc["small"]["vs_grpc"] >= 5.0,
            "4MiB_ge_0.95_of_raw": sc["big"]["vs_raw"] >= 0.95,
            "added_p99_below_grpc": lt["added_p99_us"] < gr["latency"]["added_p99_us"],
        }
        if "async" in name:
            t["added_p50_le_100us"] = lt["added_p50_us"] <= 100.0
            t["added_p99_le_300us"] = lt["added_p99_us"] <= 300.0
        else:
            t["added_p99_le_500us"] = lt["added_p99_us"] <= 500.0
        fp = res["footprint"].get(name)
        if fp is not None:
            t["steady_rss_le_40MB"] = fp["rss_after_1k_mb"] <= 40.0
        res.setdefault("targets", {})[name] = t
    return res


def table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    labels = res["labels"]
    lb, la = res["load_before"], res["load_after"]
    lines = [
        (f"one hop on loopback, {cfg['cpus']} CPUs; source, relay and sink are separate "
         f"processes; medians of {cfg['rounds']} rounds, ratios taken within each round; "
         f"load average before {lb[0]:.1f}/{lb[1]:.1f}/{lb[2]:.1f}, "
         f"after {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}"),
        "",
        (f"{'relay':<16}{'4 MiB MB/s':>11}{'vs raw':>8}{'CPU µs/fr':>10}{'1 KiB fr/s':>12}"
         f"{'vs raw':>8}{'vs gRPC':>8}{'CPU µs/fr':>10}{'p50 µs':>8}{'p99 µs':>8}"
         f"{'+p50 µs':>9}{'+p99 µs':>9}"),
    ]
    lines.append("-" * len(lines[-1]))
    for relay, r in res["relays"].items():
        b, s, lt = r["big"], r["small"], r["latency"]
        lines.append(f"{labels[relay]:<16}{b['mb_per_s']:>11.0f}{b['vs_raw']:>8.2f}"
                     f"{b['relay_cpu_us_per_frame']:>10.0f}"
                     f"{s['frames_per_s']:>12.0f}{s['vs_raw']:>8.2f}{s['vs_grpc']:>8.2f}"
                     f"{s['relay_cpu_us_per_frame']:>10.1f}{lt['p50_us']:>8.0f}"
                     f"{lt['p99_us']:>8.0f}{lt['added_p50_us']:>9.0f}{lt['added_p99_us']:>9.0f}")
    d = res["direct"]
    lines.append(f"(direct, no relay: p50/p99 µs raw {d['raw']['p50_us']:.0f}/"
                 f"{d['raw']['p99_us']:.0f}, mmh {d['mmh']['p50_us']:.0f}/"
                 f"{d['mmh']['p99_us']:.0f}, grpc {d['grpc']['p50_us']:.0f}/"
                 f"{d['grpc']['p99_us']:.0f}; +p50/+p99 = added per hop; CPU µs/fr = the "
                 "relay process's CPU per frame)")
    for what, key in (("1 KiB 'vs raw'", ("small", "vs_raw_rounds")),
                      ("4 MiB 'vs raw'", ("big", "vs_raw_rounds")),
                      ("added p50 µs", ("latency", "added_p50_us_rounds")),
                      ("added p99 µs", ("latency", "added_p99_us_rounds"))):
        lines.append(f"{what} per round: " + ", ".join(
            f"{labels[k].strip(' ()')} {r[key[0]][key[1]]}" for k, r in res["relays"].items()
            if k != "raw" or key[0] == "latency"))
    lines.append("")
    lines.append(f"{'footprint':<16}{'listen s':>9}{'RSS MB':>8}{'steady':>8}{'4 MiB':>8}"
                 f"{'anon':>7}{'file':>7}")
    for name, fp in res["footprint"].items():
        lines.append(f"{labels.get(name, name):<16}{fp['listening_s']:>9.2f}"
                     f"{fp['rss_listening_mb']:>8.1f}{fp['rss_after_1k_mb']:>8.1f}"
                     f"{fp.get('rss_after_4m_mb', math.nan):>8.1f}"
                     f"{fp.get('rssanon_mb', math.nan):>7.1f}{fp.get('rssfile_mb', math.nan):>7.1f}")
    lines.append("")
    for name, t in res["targets"].items():
        lines.append(f"  {labels[name].strip(' ()') if 'async' not in name else name}: " + ", ".join(
            f"{'PASS' if ok else 'MISS'} {k}" for k, ok in t.items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------
# --profile: where a 1 KiB frame's time goes, part by part
# --------------------------------------------------------------------------
def _drain(conn: Any) -> None:
    """A sink that reads and forgets (for --profile's sender)."""
    ls = _listen()
    conn.send(("ready", ls.getsockname()[1]))
    c, _ = ls.accept()
    buf = bytearray(1 << 20)
    while c.recv_into(buf):
        pass


def profile(batch: int = 32, batches: int = 300, repeats: int = 7) -> dict[str, Any]:
    """Each part of the sidecar's path timed on its own, batch by batch as in
    the relay: ``repeats`` x ``batches`` batches of ``batch`` 1 KiB frames (as
    they arrive together at full rate) through receive, the queue, the stage,
    the sender and the SLA recorder; per part the median batch's time per
    frame (a busy host's pauses hit some batches only).  In-process, the real
    classes of this tree, under uvloop; the sender writes to a real socket
    read by another process (its ``sendmsg`` is in "send")."""
    from sidecar.config import SidecarConfig
    from sidecar.runners import make_runner
    from sidecar.sla import SlaRecorder
    from sidecar.stage import Stage, _Out
    from sidecar.transport import FrameSender, FrameServer, inframe_queue
    from sidecar.transport.receive import _Conn

    class _Transport:
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...
        def abort(self) -> None: ...

    hdr = FRAMINGS["mmh"].encode(1024)
    one = bytes(hdr) + bytes(1024)
    results: dict[str, dict[str, float]] = {}

    async def main(fn: str) -> dict[str, float]:
        p, conn = _spawn(_drain)
        port = _recv(conn, 20, "drain")
        cfg = SidecarConfig.model_validate({
            "stage": "identity", "listen": {"tcp": "127.0.0.1:0"},
            "runner": {"kind": "python", "target": f"demo.pipeline.stages:{fn}"},
            "outputs": [{"name": "sink", "address": f"127.0.0.1:{port}", "modality": "tensor",
                         "sla_class": "bench"}],
            "limits": {"inbound_queue": batch * batches + 1, "inbound_queue_mb": 1024},
            "qosd": {"socket": None}})
        runner = make_runner(cfg.runner)
        await runner.start()
        recorder = SlaRecorder(cfg)
        queue = inframe_queue(cfg.limits)
        sender = FrameSender(cfg.outputs[0], cfg.limits)
        await sender.start()
        while not sender.counters.connected:
            await asyncio.sleep(0.01)
        stage = Stage(cfg, runner, queue, [sender], recorder)
        await stage.start()
        await stage.stop()  # (its workers: the parts are called here, one at a time)
        server = FrameServer(cfg.listen, cfg.limits, queue)
        best: dict[str, float] = {}

        def keep(part: str, dt_ns: int) -> None:
            per = dt_ns / (batch * batches) / 1000
            best[part] = min(best.get(part, math.inf), per)

        from prometheus_client import generate_latest

        parts = ("receive and split (+ queue put)", "queue take",
                 "stage hand-off, runner, output headers", "framing and send (sendmsg)",
                 "SLA bookkeeping (record + fold)")
        br = stage._batch_runner() if fn == "identity" else None
        wire = one * batch
        samples: dict[str, list[float]] = {part: [] for part in parts}
        for _ in range(repeats):
            c = _Conn(server, "127.0.0.1:1")
            c.transport = _Transport()  # type: ignore[assignment]
            clock = time.perf_counter_ns
            for _ in range(batches):  # batch by batch through every part, as in the relay
                c.buf[:len(wire)] = wire
                c.start, c.end = 0, len(wire)
                t0 = clock()
                c._hand_over()  # staged bytes -> InFrames queued
                t1 = clock()
                items = queue.take_nowait(batch)
                queue.done(len(items))
                t2 = clock()
                out = _Out()
                if br is not None:  # plain function: the batch in one thread hop
                    await stage._batch(br, items, out)
                else:
                    for f in items:
                        stage._start(f, out)
                t3 = clock()
                sends, out.sends = out.sends, []
                sender.send_nowait([(h, pl) for _, h, pl in sends])
                t4 = clock()
                stage._record(out.rows)
                with recorder.windows._lock:  # (what record() does every 512 samples)
                    recorder.windows._fold()
                t5 = clock()
                for part, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                                    strict=True):
                    samples[part].append(dt / len(items) / 1000)
                if sender.queued:  # (the socket buffer filled: let the writer drain it)
                    await sender.flush(30)
            t0 = clock()  # a scrape of /metrics (per frame of the repeat: it reads at scrape)
            generate_latest(recorder.registry)
            keep("metrics (one scrape, per frame of the run)", clock() - t0)
        scrape = best.pop("metrics (one scrape, per frame of the run)")
        for part in parts:  # the median batch: a busy host's pauses only hit some batches
            best[part] = float(np.median(samples[part]))
        best["metrics (one scrape, per frame of the run)"] = scrape
        await sender.close()
        await runner.close()
        p.terminate()
        p.join(2)
        best["sum of the parts"] = sum(v for k, v in best.items() if not k.startswith("metrics"))
        return best

    for fn in ("identity", "identity_async"):
        results[fn] = _run(main(fn))
    return results


def profile_table(prof: dict[str, dict[str, float]]) -> str:
    parts = list(next(iter(prof.values())))
    lines = [f"{'µs per 1 KiB frame (median batch)':<44}{'plain fn':>10}{'async':>10}"]
    for part in parts:
        lines.append(f"{part:<44}{prof['identity'][part]:>10.2f}"
                     f"{prof['identity_async'][part]:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer frames (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "sidecar.json"))
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default 5, --quick 2)")
    p.add_argument("--before", metavar="REV", default=None,
                   help="also measure the sidecar of this git revision (e.g. HEAD)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--profile", action="store_true",
                   help="only: where a 1 KiB frame's time goes, part by part (this tree)")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    if a.profile:
        prof = profile()
        print(profile_table(prof))
        out = Path(a.out).with_name("sidecar-profile.json")
        write_json(out, {"profile_us_per_frame": prof, "load": os.getloadavg()})
        print(f"\nwrote {out}")
        return 0

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as d:
        tmp = Path(d)
        before = (a.before, source_tree(a.before, tmp)) if a.before else None
        res = run(a.quick, progress, a.rounds, before, tmp)
    res["elapsed_s"] = time.monotonic() - t0
    write_json(Path(a.out), res)
    print(table(res))
    print(f"\nwrote {a.out}")
    ok = all(all(t.values()) for t in res["targets"].values())
    return 1 if a.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
