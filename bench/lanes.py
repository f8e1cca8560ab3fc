#!/usr/bin/env python3
"""A sidecar output spread over three replicas: in user space or by the
socket layer, against one connection, side by side.

Two processes in a cgroup v2 of the bench's own with the socket layer
attached: the sender (the sidecar's ``FrameSender``, uvloop) and the
receivers (one or three listeners read by plain non-blocking sockets).  The
paths, all in the same run:

  one lane          an Output with one address: one connection, loopback TCP
                    (the port is no mesh endpoint): the baseline
  user tcp          ``replicas`` x3, ``weights`` 5:3:2, ``spread: user``: the
                    sidecar picks each frame's lane; loopback TCP
  user redirect     the same with the replicas' ports mesh endpoints and
                    redirect on, no weights in the kernel: each lane's frames
                    are moved into its own peer (TCP/IP bypassed)
  kernel            ``spread: kernel``: every frame written on the lead lane,
                    the socket layer splits them 5:3:2 (``set_weights``)

Per path and frame size: MB/s and frames/s from the first send to the last
byte received, and the split (frames per replica).  Rounds run every path
once in a rotating order; ratios to ``one lane`` are taken within a round and
the medians over rounds are reported.  A spread path whose split is off the
weights by more than 5 %, or a tcp path that redirected anything, fails the
bench.  Needs root and bcc; prints a table, writes out/bench/lanes.json.

    .venv/bin/python bench/lanes.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import selectors
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.abi import Modality
from mmmesh.dataplane import Endpoint, SocketLayer
from mmmesh.files import write_json
from mmmesh.wire import Header, encode_header
from testkit.socklayer_kit import join_cgroup, scratch_cgroup

WEIGHTS = [5, 3, 2]
PATHS = ["one lane", "user tcp", "user redirect", "kernel"]
STAGE = 61


def frame_len(size: int) -> int:
    return len(encode_header(Header(modality=int(Modality.TENSOR), stream_id=1, sequence=0),
                             payload_len=size)) + size


def receiver(conn: Any, cgroup: str, nrecv: int, total: int) -> None:
    """Listens on ``nrecv`` ports, reads until ``total`` bytes arrived; sends
    back (monotonic time of the last byte, bytes per listener)."""
    join_cgroup(cgroup)
    lss = []
    for _ in range(nrecv):
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(8)
        lss.append(ls)
    conn.send([ls.getsockname()[1] for ls in lss])
    sel = selectors.DefaultSelector()
    for i, ls in enumerate(lss):
        s, _ = ls.accept()
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    got = [0] * nrecv
    buf = bytearray(1 << 20)
    while sum(got) < total:
        for key, _ in sel.select(30):
            try:
                n = key.fileobj.recv_into(buf)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):  # (tcp_bpf_recvmsg: EAGAIN)
                continue
            if n == 0:
                raise SystemExit("a sender closed early")
            got[key.data] += n
    conn.send((time.monotonic(), got))


def sender(conn: Any, cgroup: str, output: dict[str, Any], n: int, size: int) -> None:
    """The sidecar's FrameSender on ``output``: every lane connected, then
    ``n`` frames as fast as it takes them; sends back the start time."""
    join_cgroup(cgroup)
    import uvloop

    from sidecar.config import Limits, Output
    from sidecar.transport import FrameSender

    async def main() -> None:
        s = FrameSender(Output.model_validate(output), Limits())
        await s.start()
        while not (s.ready.is_set() and all(c.connected for c in s.counters.lanes)):
            await asyncio.sleep(0.01)
        payload = bytes(size)
        t0 = time.monotonic()
        for i in range(n):
            await s.send(Header(modality=int(Modality.TENSOR), stream_id=1, sequence=i), payload)
        assert await s.flush(120)
        conn.send(t0)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # receivers done
        await s.close()

    uvloop.run(main())


def run_path(path: str, cg: str, sl: SocketLayer, n: int, size: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    nrecv = 1 if path == "one lane" else 3
    total = n * frame_len(size)
    rc, rc_child = ctx.Pipe()
    recv = ctx.Process(target=receiver, args=(rc_child, cg, nrecv, total))
    recv.start()
    ports = rc.recv()
    eps = [Endpoint("127.0.0.1", p, STAGE, r) for r, p in enumerate(ports)]
    sl.set_endpoints(eps if path in ("user redirect", "kernel") else [])
    sl.set_weights(STAGE, WEIGHTS if path == "kernel" else [])
    out: dict[str, Any] = {"name": "next", "modality": "tensor", "sla_class": "video"}
    if path == "one lane":
        out["address"] = f"127.0.0.1:{ports[0]}"
    else:
        out["replicas"] = [f"127.0.0.1:{p}" for p in ports]
        if path == "kernel":
            out["spread"] = "kernel"
        else:
            out["weights"] = WEIGHTS
    before = sl.stats().events
    sc, sc_child = ctx.Pipe()
    send = ctx.Process(target=sender, args=(sc_child, cg, out, n, size))
    send.start()
    try:
        t0 = sc.recv()
        if not rc.poll(180):
            raise SystemExit(f"{path}: the receivers did not get every byte")
        t1, got = rc.recv()
        sc.send(None)
    finally:
        for p in (send, recv):
            p.join(10)
            if p.is_alive():
                p.kill()
    redirected = sl.stats().events.get("redirected", 0) - before.get("redirected", 0)
    frames = [b // frame_len(size) for b in got]
    if nrecv == 3:
        for f, w in zip(frames, WEIGHTS):
            want = n * w / sum(WEIGHTS)
            if abs(f - want) > 0.05 * want:
                raise SystemExit(f"{path}: split {frames} is off the weights {WEIGHTS}")
    if path in ("one lane", "user tcp") and redirected:
        raise SystemExit(f"{path}: {redirected} frames redirected on a tcp path")
    if path in ("user redirect", "kernel") and redirected < n:
        raise SystemExit(f"{path}: only {redirected} of {n} frames redirected")
    secs = t1 - t0
    return {"secs": secs, "mb_s": total / secs / 1e6, "kfr_s": n / secs / 1e3,
            "split": frames, "redirected": redirected}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer frames and 1 round")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "lanes.json"))
    a = ap.parse_args(argv)
    rounds = a.rounds or (1 if a.quick else 3)
    sizes = {1024: 5000 if a.quick else 20_000, 65536: 500 if a.quick else 3000}
    res: dict[str, Any] = {"weights": WEIGHTS, "rounds": rounds, "sizes": {}}
    with scratch_cgroup("bench-lanes") as (cg, rel):
        sl = SocketLayer(rel)
        sl.up([])
        try:
            for size, n in sizes.items():
                runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
                for r in range(rounds):
                    order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
                    got = {p: run_path(p, cg, sl, n, size) for p in order}
                    for p in PATHS:
                        got[p]["x"] = got[p]["mb_s"] / got["one lane"]["mb_s"]
                        runs[p].append(got[p])
                res["sizes"][size] = {"frames": n, "runs": runs, "median": {
                    p: {k: statistics.median(x[k] for x in runs[p])
                        for k in ("mb_s", "kfr_s", "x")} for p in PATHS}}
        finally:
            sl.down()
    print(f"sidecar output over 3 replicas (weights {WEIGHTS}), medians of {rounds} round(s)")
    print(f"{'path':<15} {'size':>6} {'frames':>7} {'MB/s':>8} {'kfr/s':>7} {'x':>5}  split")
    for size, r in res["sizes"].items():
        for p in PATHS:
            m = r["median"][p]
            split = r["runs"][p][-1]["split"]
            print(f"{p:<15} {size:>6} {r['frames']:>7} {m['mb_s']:>8.1f} {m['kfr_s']:>7.1f} "
                  f"{m['x']:>5.2f}  {split}")
    write_json(a.out, res)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
