#!/usr/bin/env python3
"""Membership and gossip at scale: N members of the real ``qosd.mesh.membership.core`` core
on a virtual clock (``qosd.mesh.membership.core.simulation``) over an in-memory network
that drops each packet with probability ``--loss`` and delays it uniformly by
``--latency-ms`` (default 0.5-2 ms).  Nothing sleeps; the cost is the core's.

Scenario (all times virtual):
  1. join: member 0 starts, the others join through seeds 0-2 at ``--join-rate``
     per second (a DaemonSet rollout); warm-up until every member knows every
     other alive and no gossip is queued (capped);
  2. idle: ``--idle`` seconds of steady state (probes, push-pull only);
  3. broadcast: a random member originates a new SLA digest (an application
     broadcast of ``--payload-bytes``); ``convergence_s_pX`` is the time until
     X % of the other members have delivered it;
  4. crashes: ``--crashes`` members crash one after another, ``--crash-gap``
     apart; ``detect_s_pX`` is over crashes of the time from the crash until
     every member that never crashed holds it dead (``detect_member_s_pX``: over
     every (crash, member) pair); the run stops when all are detected or after
     ``--duration`` seconds past warm-up.
``false_positives``: members that never crashed but were declared dead by
someone, at any time.  ``bytes_per_node_per_s``: every byte sent (the cores'
protobuf size estimates) from the end of warm-up to the end, per member and
second; ``_idle`` for phase 2 alone, ``_join`` for phase 1; ``peak_kbit_*``:
the most one member sent in one whole second (after warm-up; during the join,
when the seeds answer every joiner with the full state).

Baseline, from outside this run (no other implementation runs here):
memberlist's published 99.99 % convergence of 2.2 s for 1000 members at these
parameters, and the Lifeguard maximum suspicion timeout of the same formula.
Targets (stated for 1000 members at 1 % loss, checked at every size):
convergence_s_p9999 <= 2.2 s, no false positives, detect_s_p99 <= Lifeguard
maximum + one probe interval, <= 350 kbit/s per member.

Prints one JSON object (``--json``) or a table, writes
out/bench/cluster-<N>-<loss>.json; exits 0 unless ``--strict`` and a target
is missed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.files import write_json
from qosd.mesh.membership.core import AppMessage, Config, Event, MemberChanged, State
from qosd.mesh.membership.core.simulation import Simulation

MEMBERLIST_CONVERGENCE_S = 2.2
MAX_KBIT_PER_NODE = 350.0
DIGEST_KEY = "sla/digest"


def nearest_rank(values: list[float], p: float, total: int | None = None) -> float | None:
    """The p-quantile (0 < p <= 1) by nearest rank over ``total`` samples, of
    which the ones missing from ``values`` count as never (None if the rank
    falls on one of them)."""
    n = len(values) if total is None else total
    if n == 0:
        return None
    rank = max(1, math.ceil(p * n))
    ordered = sorted(values)
    return ordered[rank - 1] if rank <= len(ordered) else None


class Observer:
    """Collects, from the cores' events, what the metrics need."""

    def __init__(self) -> None:
        self.dead: dict[str, dict[int, float]] = {}  # node -> observer -> first time dead
        self.suspect: dict[str, float] = {}  # node -> first time anyone suspected it
        self.digest: dict[int, float] = {}  # member -> delivery time
        self.suspected_by: dict[str, int] = {}

    def __call__(self, t: float, i: int, events: list[Event]) -> None:
        for e in events:
            if type(e) is MemberChanged:
                if e.state == State.DEAD:
                    self.dead.setdefault(e.node, {}).setdefault(i, t)
                elif e.state == State.SUSPECT:
                    self.suspect.setdefault(e.node, t)
                    self.suspected_by[e.node] = self.suspected_by.get(e.node, 0) + 1
            elif type(e) is AppMessage and e.key == DIGEST_KEY:
                self.digest.setdefault(i, t)


def bytes_sent(sim: Simulation) -> int:
    return sum(m.stats.bytes_sent for m in sim.nodes)


class PeakMeter:
    """The most one member sent in one second (sampled on whole seconds)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.last = [0] * len(sim.nodes)
        self.peak = 0

    def sample(self) -> None:
        now = [m.stats.bytes_sent for m in self.sim.nodes]
        self.peak = max(self.peak, max(b - a for a, b in zip(self.last, now, strict=True)))
        self.last = now

    def advance(self, t_end: float, cond: Callable[[], bool] | None = None) -> float:
        """Run to ``t_end`` (or while ``cond()``) in one-second steps, sampling."""
        sim = self.sim
        while sim.now < t_end and (cond is None or cond()):
            sim.run_until(min(t_end, math.floor(sim.now) + 1.0))
            self.sample()
        return sim.now

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def converged(sim: Simulation) -> bool:
    n = len(sim.nodes)
    return all(m.live_members() == n - 1 and not m.queued_broadcasts() for m in sim.nodes)


def run(a: argparse.Namespace) -> dict[str, Any]:
    cfg = Config()
    n = a.nodes
    obs = Observer()
    lo, hi = (x / 1000 for x in a.latency_ms)
    sim = Simulation(n, cfg, seed=a.seed, loss=a.loss, latency_s=(lo, hi), on_event=obs)
    rng = random.Random(a.seed)
    wall0 = time.perf_counter()

    # 1. join and warm up
    seeds = list(range(min(3, n)))
    sim.start(0)
    for i in range(1, n):
        sim.start(i, seeds=[s for s in seeds if s != i], at=i / a.join_rate)
    join_end = (n - 1) / a.join_rate
    meter = PeakMeter(sim)
    meter.advance(join_end)
    t_warm = meter.advance(join_end + a.warmup_cap, lambda: not converged(sim))
    warm_ok = converged(sim)
    join_bytes = bytes_sent(sim)
    peak_join = meter.take()
    wall_warm = time.perf_counter() - wall0

    # 2. idle
    meter.advance(t_warm + a.idle)
    idle_bytes = bytes_sent(sim) - join_bytes

    # 3. the SLA digest
    origin = rng.randrange(n)
    t_b = sim.now
    sim.broadcast(origin, DIGEST_KEY, bytes(a.payload_bytes))
    meter.advance(t_b + 30.0, lambda: len(obs.digest) < n - 1)
    meter.advance(t_b + 2.0)

    # 4. crashes
    victims = rng.sample([i for i in range(n) if i != origin], min(a.crashes, n - 2))
    crash_at: dict[int, float] = {}
    t_c = sim.now
    for k, v in enumerate(victims):
        def crash(v: int = v) -> None:
            sim.crash(v)
            crash_at[v] = sim.now
        sim.at(t_c + k * a.crash_gap, crash)
    watchers = [i for i in range(n) if i not in victims]

    def undetected() -> bool:
        return len(crash_at) < len(victims) or any(
            len(obs.dead.get(sim.ids[v], {}).keys() & set(watchers)) < len(watchers)
            for v in victims)

    t_end = meter.advance(t_warm + a.duration, undetected)
    wall = time.perf_counter() - wall0

    # metrics
    delays = [t - t_b for i, t in obs.digest.items() if i != origin]
    detect: list[float] = []
    per_member: list[float] = []
    first_suspect: list[float] = []
    for v in victims:
        marks = obs.dead.get(sim.ids[v], {})
        seen = [marks[w] - crash_at[v] for w in watchers if w in marks and v in crash_at]
        per_member += seen
        if len(seen) == len(watchers):
            detect.append(max(seen))
        if sim.ids[v] in obs.suspect and v in crash_at:
            first_suspect.append(obs.suspect[sim.ids[v]] - crash_at[v])
    victim_ids = {sim.ids[v] for v in victims}
    false_pos = sorted(node for node in obs.dead if node not in victim_ids)
    total_after = bytes_sent(sim) - join_bytes
    bps = total_after / n / max(1e-9, t_end - t_warm)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    res: dict[str, Any] = {
        "nodes": n,
        "loss": a.loss,
        "seed": a.seed,
        "latency_ms": list(a.latency_ms),
        "join_rate": a.join_rate,
        "crashes": len(victims),
        "crash_gap_s": a.crash_gap,
        "payload_bytes": a.payload_bytes,
        "convergence_s_p50": r(nearest_rank(delays, 0.5, n - 1)),
        "convergence_s_p99": r(nearest_rank(delays, 0.99, n - 1)),
        "convergence_s_p9999": r(nearest_rank(delays, 0.9999, n - 1)),
        "convergence_reached": len(delays),
        "detect_s_p50": r(nearest_rank(detect, 0.5, len(victims))),
        "detect_s_p99": r(nearest_rank(detect, 0.99, len(victims))),
        "detect_member_s_p50": r(nearest_rank(per_member, 0.5, len(victims) * len(watchers))),
        "detect_member_s_p99": r(nearest_rank(per_member, 0.99, len(victims) * len(watchers))),
        "first_suspect_s_p50": r(nearest_rank(first_suspect, 0.5, len(victims))),
        "false_positives": len(false_pos),
        "false_positive_nodes": false_pos[:20],
        "suspicions_of_live_members": sum(c for node, c in obs.suspected_by.items()
                                          if node not in victim_ids),
        "refutations": sum(m.stats.refutations for m in sim.nodes),
        "bytes_per_node_per_s": round(bps, 1),
        "kbit_per_node_per_s": round(bps * 8 / 1000, 2),
        "bytes_per_node_per_s_idle": round(idle_bytes / n / max(1e-9, a.idle), 1),
        "bytes_per_node_per_s_join": round(join_bytes / n / max(1e-9, t_warm), 1),
        "peak_kbit_per_node_per_s": round(meter.take() * 8 / 1000, 1),
        "peak_kbit_per_node_per_s_join": round(peak_join * 8 / 1000, 1),
        "suspicion_min_s": round(cfg.suspicion_min_s(n), 3),
        "suspicion_max_s": round(cfg.suspicion_max_s(n), 3),
        "retransmit_limit": cfg.retransmit_limit(n),
        "push_pull_s": cfg.push_pull_s(n),
        "warmup_s": round(t_warm, 2),
        "warmup_converged": warm_ok,
        "virtual_s": round(t_end, 2),
        "packets_delivered": sim.delivered,
        "packets_dropped": sim.dropped,
        "wall_s": round(wall, 2),
        "wall_s_join": round(wall_warm, 2),
    }
    p9999, d99 = res["convergence_s_p9999"], res["detect_s_p99"]
    detect_bound = cfg.suspicion_max_s(n) + cfg.probe_interval_s
    res["baseline"] = {"memberlist_convergence_s_p9999": MEMBERLIST_CONVERGENCE_S,
                       "lifeguard_detect_bound_s": round(detect_bound, 3)}
    res["ratios"] = {
        "convergence_vs_memberlist": None if p9999 is None
        else round(p9999 / MEMBERLIST_CONVERGENCE_S, 3),
        "detect_vs_lifeguard_bound": None if d99 is None else round(d99 / detect_bound, 3),
    }
    res["targets"] = {
        "convergence_p9999_le_2.2s": p9999 is not None and p9999 <= MEMBERLIST_CONVERGENCE_S,
        "no_false_positives": not false_pos,
        "detect_p99_within_lifeguard_max": d99 is not None and d99 <= detect_bound,
        "bandwidth_le_350kbit": res["kbit_per_node_per_s"] <= MAX_KBIT_PER_NODE,
    }
    return res


def table(res: dict[str, Any]) -> str:
    bound = res["baseline"]["lifeguard_detect_bound_s"]
    bandwidth = (f"{res['kbit_per_node_per_s']} kbit/s ({res['bytes_per_node_per_s']} B/s, "
                 f"idle {res['bytes_per_node_per_s_idle']} B/s, "
                 f"peak {res['peak_kbit_per_node_per_s']} kbit in 1 s)")
    rows = [
        ("members / loss", f"{res['nodes']} / {res['loss']:.2%}"),
        ("digest to 99 % / 99.99 %",
         f"{res['convergence_s_p99']} s / {res['convergence_s_p9999']} s"),
        ("crash -> dead everywhere p50 / p99",
         f"{res['detect_s_p50']} s / {res['detect_s_p99']} s  (bound {bound} s)"),
        ("false positives", str(res["false_positives"])),
        ("bandwidth per member", bandwidth),
        ("warm-up / virtual / wall",
         f"{res['warmup_s']} s / {res['virtual_s']} s / {res['wall_s']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in res["targets"].items()]
    return "\n".join(out)


def parse_loss(text: str) -> float:
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("loss is a fraction in [0, 1) or a percentage")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--loss", type=parse_loss, default=0.0, help="0.01 or 1%%")
    p.add_argument("--duration", type=float, default=None,
                   help="virtual seconds after warm-up at most (default: enough to detect)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the JSON object only")
    p.add_argument("--latency-ms", type=float, nargs=2, default=(0.5, 2.0))
    p.add_argument("--join-rate", type=float, default=40.0, help="joins per second")
    p.add_argument("--warmup-cap", type=float, default=300.0)
    p.add_argument("--idle", type=float, default=10.0)
    p.add_argument("--payload-bytes", type=int, default=160)
    p.add_argument("--crashes", type=int, default=5)
    p.add_argument("--crash-gap", type=float, default=3.0)
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench"))
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    if a.nodes < 4:
        p.error("--nodes must be at least 4")
    if a.duration is None:
        a.duration = (a.idle + 35.0 + a.crashes * a.crash_gap
                      + Config().suspicion_max_s(a.nodes) + 10.0)
    res = run(a)
    write_json(Path(a.out_dir) / f"cluster-{a.nodes}-{a.loss:g}.json", res)
    print(json.dumps(res) if a.json else table(res))
    return 1 if a.strict and not all(res["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
