#!/usr/bin/env python3
"""The etcd back end at scale: N watchers on a real 3-member etcd, beside the
gossip simulation at the same N, in one run.

Each watcher is a lightweight node: qosd's own :class:`EtcdNode` (lease,
list + watch of ``P/policy/`` and ``P/members/``, reports, SLA publications;
its own gRPC channel to etcd) with a realiser that waits ``--apply-ms``
(qosd's validate + reconcile + store commit, ~80 ms here) instead of
touching a kernel; many per process (``--procs`` processes), as qosd
processes do not fit this machine by the hundred.  For each size in
``--sizes``, on a fresh etcd (etcd's default timers: heartbeat 100 ms,
election 1 s):

  start     every node up, its member key written, every member known to
            every node (the N^2 member events digested): ``startup_s``; a
            size not in sync within ``--startup-timeout`` is reported as not
            measured (the machine cannot hold it) and the run goes on
  rollout   ``--rollouts`` proposals from an extra node (its CAS
            transaction), each timed from just before the transaction to
            each node's ACK as an observer's watch on ``P/acks/`` sees it;
            p50 / p99 over the ACKs of every warm rollout pooled, the slowest
            rollout's last ACK; the first (cold) rollout apart
  sla       etcd's CPU (its three members, in cores) idle for one period;
            then every node publishes 4 class windows with sketches (~600 B)
            every ``--sla-period`` s and, after one period of warm-up, over
            ``--sla-seconds`` (whole periods: nodes started together publish
            in step): etcd writes per second (its revision counter), write
            failures, etcd's CPU and db size; then the same window again with
            ``--sla-watchers`` raw watchers of ``P/sla/`` (own channel; count
            events and bytes, decode nothing): the share of writes each
            receives and etcd's CPU per delivery (the CPU above the writing
            window's), extrapolated to every node watching (qosd's default:
            N^2 / period deliveries a second); the SLA view's merge of one
            bundle (``SlaView``, the code every qosd's watch feeds) is timed
            apart, so a qosd's CPU for the full view is ``N / period x merge``
            (that every-node view is what the aggregates replaced).  With
            ``--sla-view aggregated`` (the default: qosd's) every node also
            runs the shard and class roles the member list gives it and
            watches the class records ``P/sla/c/``, so the writing window is
            the aggregated view's whole etcd cost: its aggregate writes/s,
            record deliveries/s, etcd's CPU, and that CPU x 5000 / N (the
            view's load is linear in N: N / period node writes, a partial per
            shard and class, a record delivery per node and class)

Gossip (same N, same run): ``RolloutSimulation`` (the real cores on the
virtual clock, apply ``--apply-ms``): applied p50 / p99 / all, the origin's
table (what ``apply --cluster`` waits on) and, up to ``--gossip-every-max``
members, every member's table (300 members: 90 s of wall time);
the SLA view's digest law at N (``SlaViewConfig.digest_interval_s``): how
often a member's 4-window digest may go out, and digests/s mesh-wide.

    .venv/bin/python bench/etcd_rollout.py        # 100, 300, 1000 each: ~5 min

Prints a table; writes out/bench/etcd-rollout.json.  On this 2-vCPU VM the
three etcd members, every watcher process and the coordinator share two
CPUs (with whatever else runs): the etcd figures are an upper bound of what
a deployment (etcd on its own machines, one qosd per node) sees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.files import write_json
from mmmesh.policy import parse_policy
from qosd.mesh.rollout.core import MeshVersion
from qosd.store.cluster import EtcdNode
from qosd.store.etcd.client import EtcdClient, EtcdConfig, EtcdError
from qosd.store.etcd.keys import Layout, decode_ack

PREFIX = "/bench/"
EXAMPLE = ROOT / "examples" / "policy.yaml"
MAX_NODES = 5000
ROLLOUT_TIMEOUT_S = 60.0


def pct(values: list[float], p: float) -> float | None:
    """The p-quantile by nearest rank (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, int(p * len(s) + 0.999999) - 1))], 3)


def policy(i: int) -> str:
    """examples/policy.yaml with voice at 1000+i kbit: a new text each time."""
    import yaml  # type: ignore[import-untyped]

    data = yaml.safe_load(EXAMPLE.read_text())
    for c in data["classes"]:
        if c["name"] == "voice":
            c["rate"] = f"{1000 + i}kbit"
            c.pop("adapt", None)
    return parse_policy(data).to_yaml()


def board(frames: int) -> dict[str, Any]:
    """An SLA board's view with 4 class windows, each with a real sketch."""
    import random

    from mmmesh.sla.sketch import encode_sketch, new_sketch

    rows = []
    rng = random.Random(frames)
    for cls, mod in (("voice", "audio"), ("video", "video"), ("lidar", "point_cloud"),
                     ("best-effort", "text")):
        sk = new_sketch()
        for _ in range(200):
            sk.add(rng.lognormvariate(3.0, 0.4))
        rows.append({"sla_class": cls, "modality": mod, "frames": frames, "deadline_misses": 1,
                     "window_s": 5.0, "received_at": time.time(), "sketch_e2e": encode_sketch(sk)})
    return {"classes": rows, "stages": []}


# -- a worker process: many lightweight nodes ---------------------------------------
async def raw_watcher(endpoints: list[str], counts: dict[str, int]) -> None:
    """Watches P/sla/ on its own channel and counts what etcd delivers."""
    client = EtcdClient(EtcdConfig(tuple(endpoints)))
    lay = Layout(PREFIX)
    rev = 0
    try:
        while True:
            try:
                if not rev:
                    rev = (await client.status())["revision"]
                w = await client.watch([lay.sla], rev + 1)
                counts["watching"] = counts.get("watching", 0) + 1
                try:
                    while True:
                        r, events = await w.next()
                        rev = max(rev, r)
                        counts["sla_events"] = counts.get("sla_events", 0) + len(events)
                        counts["sla_bytes"] = counts.get("sla_bytes", 0) + sum(
                            len(e.kv.value) for e in events)
                finally:
                    w.cancel()
                    counts["watching"] -= 1
            except EtcdError:
                counts["watcher_errors"] = counts.get("watcher_errors", 0) + 1
                await asyncio.sleep(0.2)
    finally:
        await client.close()


async def worker(a: argparse.Namespace) -> None:
    # lost leases, store down: counted (the errors of the JSON), not logged by the thousand
    logging.getLogger("qosd.store.cluster").setLevel(logging.ERROR)
    sla_on = False
    applied: dict[str, MeshVersion | None] = {}
    endpoints = a.endpoints.split(",")

    def make(name: str) -> EtcdNode:
        async def realise(v: MeshVersion, text: str, author: str) -> tuple[bool, str]:
            await asyncio.sleep(a.apply_ms / 1000)
            applied[name] = v
            return True, ""

        client = EtcdClient(EtcdConfig(tuple(endpoints)))
        return EtcdNode(name, client, Layout(PREFIX), realiser=realise,
                        applied=lambda: applied.get(name), lease_ttl_s=10,
                        sla_source=source, sla_period_s=a.sla_period,
                        watch_sla=a.sla_view == "aggregated")

    cached = board(1000)["classes"]

    def source() -> dict[str, Any]:  # a board's view: the windows just received
        now = time.time()
        return {"classes": [dict(r, received_at=now) for r in cached], "stages": []} \
            if sla_on else {}

    nodes = [make(n) for n in a.names.split(",")]
    for n in nodes:
        await n.start()
    counts: dict[str, int] = {}
    watchers: list[asyncio.Task[None]] = []
    # ready: every node up, its member key and its first (empty) SLA publication
    # written, every member of the whole run known to it (the join's N^2 events done)
    while not all(n.up and n.counters.get("member_writes") and n.counters.get("sla_writes")
                  and len(n.mirror.members) >= a.total for n in nodes):
        await asyncio.sleep(0.1)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "sla":
            sla_on = True
        elif line == "watch":
            watchers += [asyncio.create_task(raw_watcher(endpoints, counts))
                         for _ in range(a.sla_watchers)]
        elif line == "stats":
            out = dict(counts)
            for n in nodes:
                for k, v in n.counters.items():
                    out[k] = out.get(k, 0) + v
            print(json.dumps(out), flush=True)
        else:  # "quit" or EOF
            break
    for t in watchers:
        t.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    await asyncio.gather(*(n.stop(leave=False) for n in nodes))


# -- the coordinator -----------------------------------------------------------------
class Workers:
    """``procs`` worker processes holding n nodes and the raw SLA watchers."""

    def __init__(self, n: int, procs: int, endpoints: list[str], a: argparse.Namespace) -> None:
        names = [f"node-{i:04d}" for i in range(n)]
        per = -(-n // procs)
        chunks = [names[k:k + per] for k in range(0, n, per)]
        self.procs: list[subprocess.Popen[str]] = []
        for j, mine in enumerate(chunks):
            w = a.sla_watchers // len(chunks) + (1 if j < a.sla_watchers % len(chunks) else 0)
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--endpoints", ",".join(endpoints),
                 "--names", ",".join(mine), "--total", str(n), "--apply-ms", str(a.apply_ms),
                 "--sla-period", str(a.sla_period), "--sla-watchers", str(w),
                 "--sla-view", a.sla_view],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))

    def wait_ready(self, timeout: float) -> None:
        import selectors

        deadline = time.monotonic() + timeout
        for p in self.procs:
            assert p.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(p.stdout, selectors.EVENT_READ)
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"the watchers were not all up and in sync within "
                                       f"{timeout:g} s (--startup-timeout): this machine "
                                       "cannot hold this many")
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker did not start (see its stderr above)")

    def send(self, line: str) -> list[dict[str, int]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()
        if line != "stats":
            return []
        return [json.loads(p.stdout.readline()) for p in self.procs if p.stdout is not None]

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.send("stats"):
            for k, v in s.items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.close()
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # busy (never ready): it goes anyway
                p.kill()
                p.wait(10)


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the processes (etcd's members)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


async def rollouts(n: int, endpoints: list[str], count: int) -> dict[str, Any]:
    """``count`` + 1 proposals; each node's ACK as seen on P/acks/."""
    lay = Layout(PREFIX)

    async def instant(v: MeshVersion, text: str, author: str) -> tuple[bool, str]:
        return True, ""

    origin = EtcdNode("bench-origin", EtcdClient(EtcdConfig(tuple(endpoints))), lay,
                      realiser=instant, applied=lambda: None, watch_sla=False)
    await origin.start()
    obs = EtcdClient(EtcdConfig(tuple(endpoints)))
    while not origin.up or len(origin.mirror.members) < n + 1:
        await asyncio.sleep(0.1)
    runs: list[dict[str, Any]] = []
    pooled: list[float] = []
    for k in range(count + 1):  # the first one (cold: first use of every code path) apart
        rev, _ = await obs.range_prefix(lay.acks)
        watch = await obs.watch([lay.acks], rev + 1)
        t0 = time.monotonic()
        table = await origin.propose(policy(k), None, "bench")
        committed = time.monotonic() - t0
        v = table.version
        acked: dict[str, float] = {}
        try:
            while len(acked) < n + 1 and time.monotonic() - t0 < ROLLOUT_TIMEOUT_S:
                _, events = await watch.next(ROLLOUT_TIMEOUT_S)
                now = time.monotonic() - t0
                for e in events:
                    node = Layout.node_of(e.kv.key, lay.acks)
                    if e.type == "put" and node and node not in acked:
                        r = decode_ack(node, e.kv.mod_revision, e.kv.value)
                        if r.version == v and r.ok:
                            acked[node] = now
        except EtcdError:
            pass  # counted as missing below
        finally:
            watch.cancel()
        lat = [t for node, t in acked.items() if node != "bench-origin"]
        if k:
            pooled += lat
        runs.append({"commit_s": round(committed, 3), "p50_s": pct(lat, 0.5),
                     "p99_s": pct(lat, 0.99), "all_s": round(max(lat), 3) if lat else None,
                     "missing": n - len(lat)})
        await asyncio.sleep(1.0)
    await origin.stop(leave=False)
    await obs.close()
    warm = runs[1:]
    return {"cold": runs[0], "runs": warm, "acks": len(pooled), "p50_s": pct(pooled, 0.5),
            "p99_s": pct(pooled, 0.99), "all_s": max((r["all_s"] or 0) for r in warm),
            "commit_s": pct([r["commit_s"] for r in warm], 0.5),
            "missing": sum(r["missing"] for r in runs)}


def window(workers: Workers, etcd: Any, pids: list[int], seconds: float) -> dict[str, float]:
    """etcd's writes/s (its revision), its CPU (cores) and the workers' counters
    over ``seconds``, each over its own span (etcdctl and the workers take time)."""
    s0, before = time.monotonic(), workers.stats()
    r0, rev0, cpu0 = time.monotonic(), etcd.revision(), cpu_s(pids)
    time.sleep(seconds)
    s1, after = time.monotonic(), workers.stats()
    r1, rev1, cpu1 = time.monotonic(), etcd.revision(), cpu_s(pids)

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    return {"writes_per_s": (rev1 - rev0) / (r1 - r0), "cores": (cpu1 - cpu0) / (r1 - r0),
            "sla_events_per_s": delta("sla_events") / (s1 - s0),
            "sla_events": delta("sla_events"), "sla_bytes": delta("sla_bytes"),
            "aggregate_writes_per_s": delta("sla_aggregate_writes") / (s1 - s0),
            "watch_events_per_s": delta("watch_events") / (s1 - s0),
            "failures": delta("write_failures")}


def run_size(n: int, a: argparse.Namespace, merge_ms: float) -> dict[str, Any]:
    from testkit.etcd_cluster import EtcdCluster

    with tempfile.TemporaryDirectory(prefix="mmmesh-etcd-bench-") as tmp, \
            EtcdCluster(Path(tmp), heartbeat_ms=100, election_ms=1000) as etcd:
        t0 = time.monotonic()
        workers = Workers(n, min(a.procs, n), etcd.endpoints, a)
        try:
            workers.wait_ready(a.startup_timeout)
            up_s = time.monotonic() - t0
            roll = asyncio.run(rollouts(n, etcd.endpoints, a.rollouts))
            pids = [p.pid for p in etcd.procs if p is not None]
            # windows of whole periods: nodes started together publish in step
            span = a.sla_period * max(1, round(a.sla_seconds / a.sla_period))
            idle = window(workers, etcd, pids, a.sla_period)  # leases, raft heartbeats
            workers.send("sla")
            time.sleep(a.sla_period)  # every node's timer fires once: all publishing
            writing = window(workers, etcd, pids, span)  # no watcher of P/sla/
            watching = writing
            if a.sla_watchers:
                workers.send("watch")
                deadline = time.monotonic() + 30
                while (workers.stats().get("watching", 0) < a.sla_watchers
                       and time.monotonic() < deadline):
                    time.sleep(0.2)
                time.sleep(1.0)
                watching = window(workers, etcd, pids, span)
            after = workers.stats()
            db = max(int(s["Status"]["dbSize"]) for s in etcd.status())
            writes = writing["writes_per_s"]
            per_watcher = watching["sla_events_per_s"] / max(1, a.sla_watchers)
            # etcd's CPU for one delivery to a watcher: the watching window's CPU
            # above the writing one's, per event delivered
            delivered = watching["sla_events_per_s"]
            per_event = max(0.0, watching["cores"] - writing["cores"]) / delivered \
                if delivered else None
            sla = {"writes_per_s": round(writes, 1),
                   "expected_per_s": round(n / a.sla_period, 1),
                   "failures": writing["failures"] + watching["failures"],
                   "bytes_per_write": round(watching["sla_bytes"] / watching["sla_events"])
                   if watching["sla_events"] else None,
                   "etcd_idle_cores": round(idle["cores"], 3),
                   "etcd_cores": round(writing["cores"], 3),
                   "etcd_cores_watched": round(watching["cores"], 3),
                   "etcd_db_bytes": db,
                   "watchers": a.sla_watchers,
                   "events_per_watcher_per_s": round(per_watcher, 1),
                   "delivered_share": round(per_watcher / max(1e-9, writes), 2),
                   "etcd_us_per_delivery": round(per_event * 1e6, 1) if per_event is not None
                   else None,
                   "fanout_if_all_watch_per_s": round(writes * n),
                   "etcd_cores_if_all_watch": round(writing["cores"] + per_event * writes * n, 2)
                   if per_event is not None else None,
                   "view": a.sla_view,
                   "aggregate_writes_per_s": round(writing["aggregate_writes_per_s"], 1),
                   "record_deliveries_per_s": round(writing["watch_events_per_s"], 1),
                   "etcd_cores_at_5000_linear": round(writing["cores"] * 5000 / n, 2),
                   "view_merge_ms": merge_ms,
                   "view_cpu_if_all_watch": round(n / a.sla_period * merge_ms / 1000, 3)}
            errors = {k: after.get(k, 0) for k in ("session_errors", "leases_lost",
                                                   "relists_compacted", "watcher_errors")}
        finally:
            workers.close()
    return {"nodes": n, "procs": min(a.procs, n), "startup_s": round(up_s, 1),
            "rollout": roll, "sla": sla, "errors": errors}


def view_merge_ms(samples: int = 200) -> float:
    """What one peer's SLA bundle costs the SlaView a qosd's watch feeds (ms)."""
    from qosd.mesh.membership.core import Config as CoreConfig
    from qosd.mesh.slaview.core import SlaView, SlaViewConfig

    b = board(1000)
    datas = []
    for i in range(samples):
        v = SlaView(f"node-{i:04d}", SlaViewConfig(cluster=CoreConfig()))
        v.local_windows(b, time.monotonic(), wall=time.time(), members=1)
        datas.append(v.app_state(time.monotonic(), relay=False))
    rx = SlaView("rx", SlaViewConfig(cluster=CoreConfig()))
    for i in range(samples):
        rx.on_member_alive(f"node-{i:04d}")
    t = time.perf_counter()
    for i, d in enumerate(datas):
        rx.on_app_state(f"node-{i:04d}", d, time.monotonic())
    return round((time.perf_counter() - t) / samples * 1000, 3)


def gossip(n: int, apply_s: float, every_max: int) -> dict[str, Any]:
    """The gossip rollout at n (the simulation) and the SLA digest law at n."""
    from qosd.mesh.membership.core import AppBroadcast, Config
    from qosd.mesh.rollout.core.simulation import RolloutSimulation
    from qosd.mesh.slaview.core import SlaViewConfig

    wall = time.monotonic()
    rs = RolloutSimulation(n, seed=1, apply_s=apply_s)
    rs.form(settle=300, join_rate=40)
    rs.sim.run_until(rs.sim.now + 10)
    t0 = rs.sim.now
    v = rs.propose(5, policy(0)).version
    rs.sim.run_while(lambda: not all(x == v for x in rs.applied), t0 + 60, step=0.05)
    applied = [t - t0 for t, _, w, _, _ in rs.realised if w == v]
    origin = rs.sim.run_while(lambda: not rs.answered(5, v), t0 + 120, step=0.05) - t0
    every = None
    if n <= every_max:
        every = round(rs.sim.run_while(lambda: not rs.converged(v), t0 + 600, step=0.25) - t0, 1)
    cfg = SlaViewConfig(cluster=Config())
    wire = AppBroadcast("node-0000", "sla/node-0000", 1, b"\0" * 129).wire  # 4 windows
    interval = cfg.digest_interval_s(n, wire)
    return {"nodes": n, "applied": len(applied), "applied_p50_s": pct(applied, 0.5),
            "applied_p99_s": pct(applied, 0.99), "applied_all_s": round(max(applied), 3),
            "origin_table_s": round(origin, 2), "every_table_s": every,
            "sla_digest_interval_s": round(interval, 1),
            "sla_digests_per_s": round(n / interval, 1), "wall_s": round(time.monotonic() - wall)}


def render(res: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else str(x)

    head = (f"{'nodes':>6} {'start s':>8} {'p50 s':>6} {'p99 s':>6} {'all s':>6} "
            f"{'cold p99':>8} {'CAS s':>6} {'missing':>7}")
    out = [(f"etcd (3 members on this VM, apply {res['apply_ms']:g} ms): from the CAS to each "
            "ACK seen by a watcher, warm rollouts pooled"), head]
    for r in res["etcd"]:
        if "error" in r:
            out.append(f"{r['nodes']:>6} not measured: {r['error']}")
            continue
        ro = r["rollout"]
        out.append(f"{r['nodes']:>6} {r['startup_s']:>8} {f(ro['p50_s']):>6} "
                   f"{f(ro['p99_s']):>6} {f(ro['all_s']):>6} {f(ro['cold']['p99_s']):>8} "
                   f"{f(ro['commit_s']):>6} {ro['missing']:>7}")
    head = (f"{'nodes':>6} {'writes/s':>8} {'N/period':>8} {'fail':>5} {'B/write':>7} "
            f"{'db MB':>6} {'CPU idle':>8} {'writes':>7} {'watched':>7} {'watchers':>8} "
            f"{'delivered':>9} {'us/event':>8} | {'etcd CPU':>8} {'view/qosd':>9}")
    out += ["", (f"etcd SLA: every node's 4 windows every {res['sla_period_s']:g} s; etcd CPU "
                 "(cores) idle, writing, and writing to the watchers | extrapolated: every "
                 "node watching P/sla/"), head]
    for r in (r for r in res["etcd"] if "sla" in r):
        s = r["sla"]
        out.append(f"{r['nodes']:>6} {s['writes_per_s']:>8} {s['expected_per_s']:>8} "
                   f"{s['failures']:>5} {f(s['bytes_per_write']):>7} "
                   f"{s['etcd_db_bytes'] / 1e6:>6.1f} {s['etcd_idle_cores']:>8} "
                   f"{s['etcd_cores']:>7} {s['etcd_cores_watched']:>7} {s['watchers']:>8} "
                   f"{s['delivered_share']:>9} {f(s['etcd_us_per_delivery']):>8} | "
                   f"{f(s['etcd_cores_if_all_watch']):>8} {s['view_cpu_if_all_watch']:>9}")
    out += ["", ("etcd SLA view: aggregate writes/s (partials, records), record deliveries/s "
                 "(every node watching P/sla/c/), etcd CPU while writing; x 5000 / N")]
    for r in (r for r in res["etcd"] if "sla" in r):
        s = r["sla"]
        out.append(f"{r['nodes']:>6} {s['view']:>10} {s['aggregate_writes_per_s']:>8} "
                   f"{s['record_deliveries_per_s']:>9} {s['etcd_cores']:>7} "
                   f"{s['etcd_cores_at_5000_linear']:>7}")
    head = (f"{'nodes':>6} {'p50 s':>6} {'p99 s':>6} {'all s':>6} {'origin s':>8} "
            f"{'every s':>8} | {'digest every s':>14} {'digests/s':>9} {'wall s':>6}")
    out += ["", ("gossip (simulation, same apply): applied; the origin's table; every table | "
            "the SLA digest law (4 windows)"), head]
    for g in res["gossip"]:
        out.append(f"{g['nodes']:>6} {f(g['applied_p50_s']):>6} {f(g['applied_p99_s']):>6} "
                   f"{g['applied_all_s']:>6} {g['origin_table_s']:>8} {f(g['every_table_s']):>8}"
                   f" | {g['sla_digest_interval_s']:>14} {g['sla_digests_per_s']:>9} "
                   f"{g['wall_s']:>6}")
    t = res["target_p99_le_2s_at_1000"]
    out += ["", (f"target rollout p99 <= 2 s at 1000 (etcd): "
            f"{'not measured' if t is None else 'PASS' if t else 'FAIL'}; wall {res['wall_s']} s; "
            f"load average {res['loadavg_start'][0]} -> {res['loadavg_end'][0]} "
            f"on {res['cpus']} CPUs"),
            ("(every node watching: etcd's CPU writing + us/event x writes/s x N; each "
             "qosd's CPU to merge N/period bundles into its view)")]
    return "\n".join(out)


def sizes(text: str, field: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{field}: comma-separated integers, not {text!r}") from None
    if any(not 1 <= x <= MAX_NODES for x in out):
        raise ValueError(f"{field}: each size from 1 to {MAX_NODES}, not {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="100,300,1000", help="etcd watchers, comma-separated")
    ap.add_argument("--gossip-sizes", default="100,300,1000",
                    help="gossip simulation sizes ('' none)")
    ap.add_argument("--gossip-every-max", type=int, default=100,
                    help="largest gossip size whose every-table time is run")
    ap.add_argument("--procs", type=int, default=8, help="worker processes")
    ap.add_argument("--rollouts", type=int, default=5, help="warm rollouts per size")
    ap.add_argument("--apply-ms", type=float, default=100.0)
    ap.add_argument("--sla-period", type=float, default=5.0)
    ap.add_argument("--sla-seconds", type=float, default=15.0,
                    help="each SLA window (idle, writing, watched), in whole periods")
    ap.add_argument("--sla-watchers", type=int, default=50, help="raw watchers of P/sla/")
    ap.add_argument("--sla-view", choices=("aggregated", "off"), default="aggregated",
                    help="every node watches the class records P/sla/c/ (qosd's view), or "
                         "nothing (the shard and class roles run either way)")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds for every watcher of a size to be up and in sync")
    ap.add_argument("--json", action="store_true", help="print the JSON object only")
    ap.add_argument("--out-dir", default=str(ROOT / "out" / "bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        asyncio.run(worker(a))
        return 0
    try:
        etcd_sizes, gossip_sizes = sizes(a.sizes, "--sizes"), sizes(a.gossip_sizes,
                                                                    "--gossip-sizes")
    except ValueError as e:
        ap.error(str(e))
    for name, val, lo, hi in (("--procs", a.procs, 1, 64), ("--rollouts", a.rollouts, 1, 100),
                              ("--apply-ms", a.apply_ms, 0, 10_000),
                              ("--sla-period", a.sla_period, 0.5, 60),
                              ("--sla-seconds", a.sla_seconds, 1, 600),
                              ("--sla-watchers", a.sla_watchers, 0, 1000),
                              ("--startup-timeout", a.startup_timeout, 10, 3600)):
        if not lo <= val <= hi:
            ap.error(f"{name}: from {lo} to {hi}, not {val}")
    wall = time.monotonic()
    res: dict[str, Any] = {"apply_ms": a.apply_ms, "sla_period_s": a.sla_period,
                           "sla_seconds": a.sla_seconds, "procs": a.procs,
                           "rollouts": a.rollouts, "cpus": os.cpu_count(), "etcd": [],
                           "gossip": [], "loadavg_start": [round(x, 1) for x in os.getloadavg()]}
    merge_ms = view_merge_ms()
    for n in etcd_sizes:
        try:
            res["etcd"].append(run_size(n, a, merge_ms))
        except RuntimeError as e:  # this machine could not hold n: said, and the next size
            res["etcd"].append({"nodes": n, "error": str(e)})
        print(f"etcd {n}: {json.dumps(res['etcd'][-1])}", file=sys.stderr, flush=True)
    for n in gossip_sizes:
        res["gossip"].append(gossip(n, a.apply_ms / 1000, a.gossip_every_max))
        print(f"gossip {n}: {json.dumps(res['gossip'][-1])}", file=sys.stderr, flush=True)
    res["target_p99_le_2s_at_1000"] = next(
        (r["rollout"]["p99_s"] is not None and r["rollout"]["p99_s"] <= 2.0
         and r["rollout"]["missing"] == 0 for r in res["etcd"]
         if r["nodes"] == 1000 and "rollout" in r), None)
    res["wall_s"] = round(time.monotonic() - wall)
    res["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    write_json(Path(a.out_dir) / "etcd-rollout.json", res)
    print(json.dumps(res) if a.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
