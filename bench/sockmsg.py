#!/usr/bin/env python3
"""Same-node stage-to-stage frames: sk_msg redirect against loopback TCP, with
raw sockets and with the sidecar's own transport, side by side.

Two processes (a stage and the next one), both in a cgroup v2 of the bench's
own with the socket layer (``SocketLayer``) attached; MMH frames over one
connection (and one back for answers).  The paths, all in the same run:

  raw tcp           plain blocking sockets; the port is no mesh endpoint, so
                    the sockets are not registered: loopback TCP, the baseline
  raw pass          the port is a mesh endpoint, redirect switched off: the
                    sk_msg program reads and counts every frame, TCP carries it
                    (what the accounting alone costs)
  raw redirect      mesh endpoint, redirect on: sk_msg moves each frame into the
                    peer socket's receive queue, TCP/IP bypassed
  sidecar tcp       the sidecar's transport (sidecar.transport: FrameSender ->
                    FrameServer -> queue, uvloop) over loopback TCP
  sidecar redirect  the same with both connections registered and redirected

Measured per path, for 1 KiB and 4 MiB frames:
  latency     ping-pong: a frame out, a 64-byte frame back; p50/p99 of the round
              trip (the stage-to-stage latency is about half of it)
  throughput  one way, as fast as the receiver takes them: MB/s and frames/s
              from the first send to the last byte received

The processes are pinned: both on CPU 0 ("same CPU": the receiver runs when the
sender blocks), or sender on 0 and receiver on 1 ("cross CPU": every frame pays
a wake-up of the other vCPU).  Rounds run every path once in a rotating order;
ratios to raw tcp are taken within a round and the medians over rounds are
reported (this 2-vCPU VM drifts between runs).  Each run also reads the socket
layer's counters: a redirect path that redirected nothing, or a tcp/pass path
that redirected anything, fails the bench.  Needs root and bcc; prints a table,
writes out/bench/sockmsg.json.

    .venv/bin/python bench/sockmsg.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.abi import Modality
from mmmesh.dataplane import Endpoint, SocketLayer
from mmmesh.files import write_json
from mmmesh.wire import Header, encode_header
from testkit.socklayer_kit import join_cgroup, scratch_cgroup

MiB = 1 << 20
SIZES = {"1KiB": 1024, "4MiB": 4 * MiB}
PATHS = ("raw tcp", "raw pass", "raw redirect", "sidecar tcp", "sidecar redirect")
PLACEMENTS = {"same CPU": (0, 0), "cross CPU": (0, 1)}  # (sender, receiver)
STAMP = struct.Struct("!Q")
ACK = 64


def hdr(payload_len: int) -> bytes:
    return encode_header(Header(modality=Modality.TENSOR, stream_id=1, sequence=0),
                         payload_len=payload_len)


def enter(spec: dict[str, Any], cpu: int) -> None:
    """A worker joins the bench's cgroup (its sockets are the cgroup's) and its CPU."""
    join_cgroup(spec["cg"])
    os.sched_setaffinity(0, {cpu})


EAGAIN = [0]  # blocking reads that failed with EAGAIN (a socket in a sockhash can)


def recv_exact(s: socket.socket, mv: memoryview, n: int) -> None:
    got = 0
    while got < n:
        try:
            k = s.recv_into(mv[got:n])
        except BlockingIOError:
            # tcp_bpf_recvmsg returns EAGAIN on a blocking socket when its wait
            # for data wakes up empty-handed: try again
            EAGAIN[0] += 1
            continue
        if not k:
            raise ConnectionError("peer closed")
        got += k


# -------------------------------------------------------------- raw sockets
def raw_server(conn: Any, spec: dict[str, Any]) -> None:
    enter(spec, spec["rx_cpu"])
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    conn.send(("ready", ls.getsockname()[1]))
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    flen = len(hdr(spec["size"])) + spec["size"]
    buf = bytearray(flen)
    mv = memoryview(buf)
    ack = hdr(ACK) + bytes(ACK)
    done_ns = 0
    for _ in range(spec["count"]):
        recv_exact(c, mv, flen)
        if spec["mode"] == "latency":
            c.sendall(ack)
        done_ns = time.monotonic_ns()
    conn.send(("result", {"done_ns": done_ns, "eagain": EAGAIN[0]}))
    c.close()


def raw_client(conn: Any, spec: dict[str, Any]) -> None:
    enter(spec, spec["tx_cpu"])
    conn.send(("ready", 0))
    conn.recv()  # go: the endpoints are written
    c = socket.create_connection(("127.0.0.1", spec["port"]))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = hdr(spec["size"]) + bytes(spec["size"])
    ack = bytearray(len(hdr(ACK)) + ACK)
    mv = memoryview(ack)
    rtt: list[int] = []
    start = time.monotonic_ns()
    for _ in range(spec["count"]):
        t0 = time.perf_counter_ns()
        c.sendall(f)
        if spec["mode"] == "latency":
            recv_exact(c, mv, len(ack))
            rtt.append(time.perf_counter_ns() - t0)
    conn.send(("result", {"start_ns": start, "rtt_ns": rtt, "eagain": EAGAIN[0]}))
    conn.recv()
    c.close()


# ------------------------------------------------------- sidecar transport
def _sidecar_io(rx: int) -> tuple[Any, Any, Any]:
    from sidecar.config import Limits, Listen
    from sidecar.transport.receive import FrameServer

    q: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)
    limits = Limits(max_frame_bytes=64 * MiB)
    return FrameServer(Listen(tcp=f"127.0.0.1:{rx}", udp=None), limits, q), q, limits


def _sender(limits: Any, port: int) -> Any:
    from sidecar.config import Output
    from sidecar.transport.send import FrameSender

    return FrameSender(Output(name="next", address=f"127.0.0.1:{port}", modality="tensor",
                              sla_class="bench"), limits)


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def sidecar_server(conn: Any, spec: dict[str, Any]) -> None:
    enter(spec, spec["rx_cpu"])

    async def main() -> None:
        server, q, limits = _sidecar_io(0)
        await server.start()
        conn.send(("ready", server.port))
        port = conn.recv()  # the client's answer port (latency), or 0
        back = _sender(limits, port) if port else None
        if back is not None:
            await back.start()
        done_ns = 0
        for _ in range(spec["count"]):
            await q.get()
            if back is not None:
                await back.send(Header(modality=Modality.TENSOR), bytes(ACK))
            done_ns = time.monotonic_ns()
        conn.send(("result", {"done_ns": done_ns}))
        await server.close()
        if back is not None:
            await back.close()

    _run(main())


def sidecar_client(conn: Any, spec: dict[str, Any]) -> None:
    enter(spec, spec["tx_cpu"])

    async def main() -> None:
        acks, q, limits = _sidecar_io(0)
        if spec["mode"] == "latency":
            await acks.start()
        conn.send(("ready", acks.port or 0))
        conn.recv()  # go
        out = _sender(limits, spec["port"])
        await out.start()
        while not out.counters.connected:
            await asyncio.sleep(0.001)
        payload = bytes(spec["size"])
        h = Header(modality=Modality.TENSOR, stream_id=1)
        rtt: list[int] = []
        start = time.monotonic_ns()
        for _ in range(spec["count"]):
            t0 = time.perf_counter_ns()
            await out.send(h, payload)
            if spec["mode"] == "latency":
                await q.get()
                rtt.append(time.perf_counter_ns() - t0)
        await out.flush(30)
        conn.send(("result", {"start_ns": start, "rtt_ns": rtt}))
        conn.recv()
        await out.close()
        await acks.close()

    _run(main())


# ------------------------------------------------------------------ driver
def _spawn(fn: Callable[..., None], spec: dict[str, Any]) -> tuple[Any, Any]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=fn, args=(child, spec), daemon=True)
    p.start()
    return p, parent


def _get(conn: Any, what: str, timeout: float = 120) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"{what}: no answer within {timeout:.0f}s")
    return conn.recv()[1]


def run_one(sl: SocketLayer, cg: str, path: str, place: tuple[int, int], size: int,
            mode: str, count: int) -> dict[str, Any]:
    kind, how = path.split()
    spec: dict[str, Any] = {"cg": cg, "tx_cpu": place[0], "rx_cpu": place[1], "size": size,
                            "mode": mode, "count": count}
    srv, sconn = _spawn(sidecar_server if kind == "sidecar" else raw_server, spec)
    spec["port"] = _get(sconn, "server")
    cli, cconn = _spawn(sidecar_client if kind == "sidecar" else raw_client, spec)
    ack_port = int(_get(cconn, "client"))
    ports: list[tuple[int, int]] = [(int(str(spec["port"])), 1), (ack_port, 2)]
    eps = [Endpoint("127.0.0.1", p, stage, 0) for p, stage in ports if p and how != "tcp"]
    sl.set_endpoints(eps)
    sl.set_redirect(how == "redirect")
    if kind == "sidecar":
        sconn.send(ack_port)
    before = sl.stats().events
    cconn.send("go")
    res = _get(cconn, "client")
    sres = _get(sconn, "server")
    done = sres["done_ns"]
    cconn.send("bye")
    for p in (cli, srv):
        p.join(10)
        if p.is_alive():
            p.kill()
    after = sl.stats().events
    redirected = after["redirected"] - before["redirected"]
    if (redirected > 0) != (how == "redirect"):
        raise RuntimeError(f"{path}: {redirected} frames redirected")
    out: dict[str, Any] = {"redirected": redirected,
                           "eagain": res.get("eagain", 0) + sres.get("eagain", 0)}
    if mode == "latency":
        rtt = sorted(res["rtt_ns"][max(1, count // 10):])  # the first tenth warms up
        out["p50_us"] = rtt[len(rtt) // 2] / 1e3
        out["p99_us"] = rtt[min(len(rtt) - 1, int(len(rtt) * 0.99))] / 1e3
    else:
        secs = (done - res["start_ns"]) / 1e9
        out["frames_per_s"] = count / secs
        out["mb_per_s"] = count * size / secs / 1e6
    return out


def bench(rounds: int, quick: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    counts = {("latency", "1KiB"): 400 if quick else 3000, ("latency", "4MiB"): 8 if quick else 40,
              ("throughput", "1KiB"): 3000 if quick else 20000,
              ("throughput", "4MiB"): 8 if quick else 24}
    res: dict[str, Any] = {"config": {"rounds": rounds, "cpus": os.cpu_count(), "counts": {
        f"{m} {s}": n for (m, s), n in counts.items()}, "paths": list(PATHS)}, "results": {}}
    with scratch_cgroup("bench") as (cg, rel):
        sl = SocketLayer(rel)
        sl.up([])
        try:
            runs: dict[str, list[dict[str, Any]]] = {}
            for rnd in range(rounds):
                order = PATHS[rnd % len(PATHS):] + PATHS[:rnd % len(PATHS)]
                for pname, place in PLACEMENTS.items():
                    for (mode, sname), n in counts.items():
                        progress(f"round {rnd + 1}/{rounds}: {pname}, {mode} {sname}")
                        got = {p: run_one(sl, cg, p, place, SIZES[sname], mode, n)
                               for p in order}
                        base = got["raw tcp"]
                        for p, r in got.items():
                            key = "p50_us" if mode == "latency" else "mb_per_s"
                            r["vs_raw_tcp"] = r[key] / base[key]
                            runs.setdefault(f"{pname}|{mode}|{sname}|{p}", []).append(r)
        finally:
            sl.down()
    for key, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]
               if k not in ("redirected", "eagain")}
        med["eagain"] = sum(r["eagain"] for r in rs)
        med["vs_raw_tcp_rounds"] = [round(r["vs_raw_tcp"], 3) for r in rs]
        res["results"][key] = med
    return res


def table(res: dict[str, Any]) -> str:
    r = res["results"]
    lines = [(f"same-node frames, 2 processes pinned; medians of {res['config']['rounds']} "
              "rounds; 'x' = ratio to raw tcp in the same round (latency: p50; "
              "throughput: MB/s)"), ""]
    for pname in PLACEMENTS:
        lines += [f"{pname}", (f"{'path':17} {'1KiB p50/p99 us':>17} {'x':>5} "
                               f"{'4MiB p50/p99 ms':>17} {'x':>5} {'1KiB kfr/s':>10} {'x':>5} "
                               f"{'4MiB MB/s':>9} {'x':>5}")]
        for p in PATHS:
            l1, l4 = r[f"{pname}|latency|1KiB|{p}"], r[f"{pname}|latency|4MiB|{p}"]
            t1, t4 = r[f"{pname}|throughput|1KiB|{p}"], r[f"{pname}|throughput|4MiB|{p}"]
            lines.append(
                f"{p:17} {l1['p50_us']:8.1f}/{l1['p99_us']:<8.1f} {l1['vs_raw_tcp']:5.2f} "
                f"{l4['p50_us'] / 1e3:8.2f}/{l4['p99_us'] / 1e3:<8.2f} {l4['vs_raw_tcp']:5.2f} "
                f"{t1['frames_per_s'] / 1e3:10.1f} {t1['vs_raw_tcp']:5.2f} "
                f"{t4['mb_per_s']:9.0f} {t4['vs_raw_tcp']:5.2f}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer frames and 1 round")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "sockmsg.json"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/sockmsg.py needs root (BPF, cgroups)", file=sys.stderr)
        return 2
    rounds = a.rounds or (1 if a.quick else 3)
    res = bench(rounds, a.quick, lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(table(res))
    write_json(a.out, res)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
