#!/usr/bin/env python3
"""The membership with real processes: N qosd (5-20), one per network namespace
on a bridge (testkit/netns_mesh.py), over gRPC with mutual TLS and the LAN
default timers, compared with the simulation (bench/cluster.py's cores on a
virtual clock) at the same N and timers, in the same run.

Figures, for both:
  join_s         from the start of the last member's join to every member
                 seeing every other alive (real: the last qosd answering its
                 API bounds its start of join from above; the first members
                 start seconds earlier, as processes come up on 2 vCPUs)
  detect_s_p50 / _p99   kill -9 (real) or crash (simulation) of ``--crashes``
                 members ``--crash-gap`` apart: time until every other member
                 holds the victim dead, over victims (real: polled every
                 ~0.1-0.3 s through each member's /v1/cluster/members)
  false_deaths   members that never crashed but were held dead at the end
  refutations_after_idle  (real) suspicions of live members answered, from
                 the end of the ``--idle`` settling to the end
Baseline: the simulation (no other implementation runs here); ratios are
real / simulated.  Needs root.  Prints a table (or ``--json``), writes
out/bench/cluster-netns-<N>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cluster as simbench
from mmmesh.files import write_json
from qosd.mesh.membership.core import Config
from qosd.mesh.membership.core.simulation import Simulation
from testkit.netns_mesh import Mesh


def real(n: int, crashes: int, gap: float, seed: int, idle: float) -> dict[str, Any]:
    """The figures from N qosd processes with the default timers."""
    with tempfile.TemporaryDirectory(prefix="mmmesh-bench-") as tmp, \
            Mesh(n, Path(tmp), protocol={}, start=False) as mesh:
        t0 = time.monotonic()
        for node in mesh.nodes:
            node.start()
        for node in mesh.nodes:
            node.wait_ready(120)
        t_last = time.monotonic()
        mesh.wait(mesh.converged, 120, "full membership", every=0.05)
        join_s = time.monotonic() - t_last
        startup_s = t_last - t0
        time.sleep(idle)  # settle, as the simulation's idle phase (start-up load ends)
        refuted0 = sum(w.get("/v1/cluster/members")["stats"]["refutations"] for w in mesh.nodes)
        victims = random.Random(seed).sample(range(3, n), min(crashes, n - 3))
        watchers = [nd for i, nd in enumerate(mesh.nodes) if i not in victims]
        crash_at: dict[str, float] = {}
        dead_at: dict[str, dict[str, float]] = {}
        t_c = time.monotonic()
        deadline = t_c + crashes * gap + Config().suspicion_max_s(n) + 30
        while time.monotonic() < deadline:
            now = time.monotonic()
            for k, v in enumerate(victims):
                node = mesh.nodes[v]
                if node.name not in crash_at and now >= t_c + k * gap:
                    node.kill()
                    crash_at[node.name] = time.monotonic()
            for w in watchers:
                view = w.members()
                for name in crash_at:
                    if view.get(name) == "dead":
                        dead_at.setdefault(name, {}).setdefault(w.name, time.monotonic())
            if len(crash_at) == len(victims) and all(
                    len(dead_at.get(name, {})) == len(watchers) for name in crash_at):
                break
        detect = sorted(max(dead_at[name].values()) - crash_at[name]
                        for name in crash_at if len(dead_at.get(name, {})) == len(watchers))
        stats = [w.get("/v1/cluster/members")["stats"] for w in watchers]
        declared = sum(st["deaths_declared"] for st in stats)
        refuted = sum(st["refutations"] for st in stats) - refuted0
        # every death is declared by at least one timer; more than one per victim is
        # possible (concurrent timers), so a false death shows as a live member dead
        false_deaths = sum(1 for w in watchers for name, s in w.members().items()
                           if s == "dead" and name not in crash_at)
        return {"join_s": round(join_s, 2), "startup_s": round(startup_s, 2),
                "detect_s": [round(d, 2) for d in detect], "detected": len(detect),
                "crashes": len(victims), "deaths_declared": declared,
                "refutations_after_idle": max(0, refuted),
                "false_deaths": false_deaths}


def simulated_join(n: int, seed: int, join_rate: float = 40.0) -> float:
    """Simulation: from the last member's join to every member seeing all alive."""
    sim = Simulation(n, Config(), seed=seed)
    sim.start(0)
    for i in range(1, n):
        sim.start(i, seeds=[s for s in range(3) if s != i], at=i / join_rate)
    last = (n - 1) / join_rate
    sim.run_until(last)
    t = sim.run_while(lambda: any(m.live_members() < n - 1 for m in sim.nodes), last + 120,
                      step=0.01)
    return round(t - last, 2)


def pct(values: list[float], p: float) -> float | None:
    return simbench.nearest_rank(values, p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--crashes", type=int, default=3)
    ap.add_argument("--crash-gap", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--idle", type=float, default=10.0, help="settle before the crashes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "out" / "bench"))
    a = ap.parse_args(argv)
    if not 5 <= a.nodes <= 20:
        ap.error("--nodes: 5 to 20 (real processes on this machine)")
    wall0 = time.monotonic()
    r = real(a.nodes, a.crashes, a.crash_gap, a.seed, a.idle)
    sim_args = argparse.Namespace(
        nodes=a.nodes, loss=0.0, seed=a.seed, latency_ms=(0.5, 2.0), join_rate=40.0,
        warmup_cap=300.0, idle=a.idle, payload_bytes=160, crashes=r["crashes"],
        crash_gap=a.crash_gap, duration=60.0 + Config().suspicion_max_s(a.nodes))
    s = simbench.run(sim_args)
    cfg = Config()
    res: dict[str, Any] = {
        "nodes": a.nodes, "crashes": r["crashes"], "crash_gap_s": a.crash_gap,
        "suspicion_min_s": round(cfg.suspicion_min_s(a.nodes), 2),
        "suspicion_max_s": round(cfg.suspicion_max_s(a.nodes), 2),
        "real": {**r, "detect_s_p50": pct(r["detect_s"], 0.5),
                 "detect_s_p99": pct(r["detect_s"], 0.99)},
        "simulation": {"join_s": simulated_join(a.nodes, a.seed),
                       "detect_s_p50": round(s["detect_s_p50"], 2),
                       "detect_s_p99": round(s["detect_s_p99"], 2),
                       "false_positives": s["false_positives"]},
        "wall_s": round(time.monotonic() - wall0, 1),
    }
    rr, ss = res["real"], res["simulation"]
    res["ratios"] = {k: None if not rr[k] or not ss[k] else round(rr[k] / ss[k], 2)
                     for k in ("join_s", "detect_s_p50", "detect_s_p99")}
    write_json(Path(a.out_dir) / f"cluster-netns-{a.nodes}.json", res)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{a.nodes} members, {r['crashes']} kill -9 {a.crash_gap:g} s apart; suspicion "
              f"{res['suspicion_min_s']}-{res['suspicion_max_s']} s")
        print(f"{'':12} {'join_s':>8} {'detect p50':>11} {'detect p99':>11} {'false deaths':>13}")
        print(f"{'real':12} {rr['join_s']:>8} {rr['detect_s_p50']!s:>11} "
              f"{rr['detect_s_p99']!s:>11} {rr['false_deaths']:>13}")
        print(f"{'simulation':12} {ss['join_s']:>8} {ss['detect_s_p50']!s:>11} "
              f"{ss['detect_s_p99']!s:>11} {ss['false_positives']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
