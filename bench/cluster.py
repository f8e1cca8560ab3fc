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

The global SLA view (the same run, the same clock): every member runs the
aggregation trees (``qosd.mesh.slaview.core.SlaTree``, as qosd does) from the
end of warm-up on, over direct calls that lose each transmission with
probability ``--loss`` (TCP sends it again after 200 ms, doubling); ``--classes``
SLA classes, ``--window`` s windows, each node reporting per class a node-wide
and a stage row (testkit/slaview_sim.py: every window's samples are known).
After ``--sla-warmup`` s the probe measures, while the crashes above happen:

  view_age_windows_p99     over (member, class, every 0.5 s): how old the
                           oldest window merged in the record the member
                           holds is, in windows (``_newest_``: the newest)
  view_p99_rel_error       the worst class's p99 in any record published,
                           against the exact p99 of the union of the samples
                           of exactly the windows that record merged
  view_counts_exact_share  records whose members are every member alive
                           throughout, each exactly once
  sla_bytes_per_node_per_s every byte of the trees' messages sent, per member
                           and second (``_p99``/``_max``: over members)
  view_bytes_per_member    what a member holds for the view (core + its paths)
  dead_share_removed_windows_p99  over (crash, member): from the member
                           holding the crashed one dead to its view holding
                           no window of it, in windows (0: gone before)

``--membership oracle`` (the default above 2000 members) runs the trees
without the SWIM cores: every member knows every other from the start and
learns a crash ``suspicion_min(n)`` + 2-3.5 s after it (what the SWIM runs
measure: the first timer fires near the minimum, its Dead spreads in ~1 s);
the membership figures are then null.  The trees' cost per member does not
depend on how the membership is simulated, and every member runs its core.

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
from qosd.mesh.slaview.core import CENSUS, RecordRow, TreeConfig
from qosd.mesh.slaview.core.simulation import TreeSimulation
from testkit.slaview_sim import CLASSES, Fleet, Pool, row_p99, truth, view_bytes

MEMBERLIST_CONVERGENCE_S = 2.2
MAX_KBIT_PER_NODE = 350.0
DIGEST_KEY = "sla/digest"
# the global SLA view's targets (docs/cluster.md, "Global SLA view")
MAX_VIEW_AGE_WINDOWS = 2.0
MAX_VIEW_P99_ERROR = 0.02
MAX_SLA_KBIT_PER_NODE = 32.0
MAX_VIEW_BYTES = 1 << 20
MAX_DEAD_SHARE_WINDOWS = 2.0


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
    """Collects, from the cores' events, what the metrics need (and, once the
    SLA trees run, tells each member's tree what its SWIM core learnt)."""

    def __init__(self) -> None:
        self.dead: dict[str, dict[int, float]] = {}  # node -> observer -> first time dead
        self.suspect: dict[str, float] = {}  # node -> first time anyone suspected it
        self.digest: dict[int, float] = {}  # member -> delivery time
        self.suspected_by: dict[str, int] = {}
        self.trees: TreeSimulation | None = None
        self.probe: SlaProbe | None = None

    def __call__(self, t: float, i: int, events: list[Event]) -> None:
        for e in events:
            if type(e) is MemberChanged:
                if self.trees is not None:
                    if e.state in (State.DEAD, State.LEFT):
                        self.trees.learn_dead(i, e.node)
                        if self.probe is not None:
                            self.probe.dead_at.setdefault((i, e.node), t)
                    elif e.state == State.ALIVE:
                        self.trees.learn_alive(i, e.node)
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


class SlaProbe:
    """The aggregated SLA view of a simulated fleet, measured against the
    truth (module doc): ages at members, each record's error and members,
    how fast a crashed member's share leaves every view, bytes, memory."""

    def __init__(self, ts: TreeSimulation, pool: Pool, sampled: list[int],
                 window_s: float, victims: list[int]) -> None:
        self.ts, self.pool, self.window_s = ts, pool, window_s
        n = len(ts.ids)
        self.sampled = sampled
        self.victims = [ts.ids[v] for v in victims]
        self.measuring = False
        self.every = 0.5 if n <= 2000 else 1.0
        self.t_measure = math.inf
        self.oldest: list[float] = []
        self.newest: list[float] = []
        self.errors: dict[str, list[float]] = {c[0]: [] for c in CLASSES}
        self.stage_errors: list[float] = []
        self.records = 0
        self.exact = 0
        self.unknown = 0
        self.missing_max = 0
        self.dup_max = 0
        self.holds: dict[tuple[str, str, int], frozenset[str]] = {}  # record -> victims in it
        self.dead_at: dict[tuple[int, str], float] = {}  # (member, victim) -> held dead since
        self.crash_at: dict[str, float] = {}
        self.removed: dict[tuple[int, str], float] = {}
        self.first_gone: dict[str, float] = {}  # victim -> first record without it
        self.bytes0: list[int] = []
        self.joined: set[str] = set()
        for i, tree in enumerate(ts.trees):
            tree.on_publish = self._publish_hook(i)

    def _publish_hook(self, i: int) -> Any:
        def hook(key: str, epoch: int, inputs: Any, rows: tuple[RecordRow, ...],
                 now: float) -> None:
            if not self.measuring or key == CENSUS:
                return
            self._judge(self.ts.ids[i], key, epoch, inputs, rows, now)
        return hook

    def _judge(self, root: str, key: str, epoch: int, inputs: Any,
               rows: tuple[RecordRow, ...], now: float) -> None:
        t = truth(self.ts, self.pool, key, inputs)
        if t.lost:
            self.unknown += 1
            return
        held = frozenset(v for v in self.victims if v in t.leaves)
        self.holds[(key, root, epoch)] = held
        for v in self.victims:
            if v in self.crash_at and v not in held:
                self.first_gone.setdefault(v, now)
        alive = [m for m in self.ts.ids if m not in self.victims and m not in self.joined]
        missing = sum(1 for m in alive if t.leaves.get(m, 0) == 0)
        dup = sum(1 for c in t.leaves.values() if c > 1)
        self.records += 1
        self.exact += missing == 0 and dup == 0
        self.missing_max = max(self.missing_max, missing)
        self.dup_max = max(self.dup_max, dup)
        for r in rows:
            counts = t.counts.get((r.key[0], key))
            got = row_p99(r)
            if counts is None or got is None:
                continue
            want = self.pool.exact(key, counts, 0.99)
            if not want:
                continue
            err = abs(got - want) / want
            (self.errors[key] if r.key[0] is None else self.stage_errors).append(err)
            if r.frames != t.frames.get((r.key[0], key)):
                self.missing_max = max(self.missing_max, 1)  # counts do not add up: flagged

    def start(self) -> None:
        self.measuring = True
        self.t_measure = self.ts.now
        self.bytes0 = list(self.ts.bytes_sent)
        self._sample()

    def _sample(self) -> None:
        ts = self.ts
        now = ts.now
        w = self.window_s
        for i in self.sampled:
            if not ts.running[i]:
                continue
            tree = ts.trees[i]
            for ages in tree.record_ages(now).values():
                if ages is not None:
                    self.newest.append(ages[0] / w)
                    self.oldest.append(ages[1] / w)
            for v in self.victims:
                since = self.dead_at.get((i, v))
                if since is None or (i, v) in self.removed or now < since:
                    continue
                held = [self.holds.get((k, *r)) for k in tree.classes
                        if (r := tree.record_of(k)) is not None]
                if all(h is not None and v not in h for h in held):
                    self.removed[(i, v)] = now
        ts.sim.at(now + self.every, self._sample)

    def result(self, t_end: float) -> dict[str, Any]:
        ts = self.ts
        dur = max(1e-9, t_end - self.t_measure)
        live = [i for i in self.sampled if ts.running[i]]  # whose messages are sized
        sent = sorted((ts.bytes_sent[i] - self.bytes0[i]) / dur for i in live)
        recv = max((ts.bytes_received[i] for i in live), default=0) / max(1e-9, ts.now)
        members = [m for i, m in enumerate(ts.ids) if ts.running[i]]
        mem = [view_bytes(ts.trees[i], members) for i in self.sampled[:12]
               if ts.running[i]]
        watched = {i for i in self.sampled if ts.running[i]}  # the crashed see nothing more
        delays = [max(0.0, self.removed.get(k, math.inf) - d) / self.window_s
                  for k, d in self.dead_at.items() if k[0] in watched]
        worst = {c: max(v) if v else None for c, v in self.errors.items()}
        errs = [e for v in self.errors.values() for e in v]

        def q(xs: list[float], p: float) -> float | None:
            return nearest_rank(xs, p) if xs else None

        def r(x: float | None, d: int = 4) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, d)

        return {
            "view_age_windows_p99": r(q(self.oldest, 0.99), 3),
            "view_age_windows_p50": r(q(self.oldest, 0.5), 3),
            "view_age_windows_max": r(max(self.oldest, default=None), 3),
            "view_newest_age_windows_p99": r(q(self.newest, 0.99), 3),
            "view_p99_rel_error": r(max(errs, default=None), 5),
            "view_p99_rel_error_p99": r(q(errs, 0.99), 5),
            "view_p99_rel_error_by_class": {c: r(v, 5) for c, v in worst.items()},
            "view_stage_p99_rel_error": r(max(self.stage_errors, default=None), 5),
            "view_records": self.records,
            "view_records_unknown": self.unknown,
            "view_counts_exact_share": r(self.exact / self.records if self.records else None),
            "view_missing_members_max": self.missing_max,
            "view_duplicate_members_max": self.dup_max,
            "sla_bytes_per_node_per_s": r(sum(sent) / len(sent), 1) if sent else None,
            "sla_kbit_per_node_per_s": r(sum(sent) / len(sent) * 8 / 1000, 2) if sent else None,
            "sla_bytes_per_node_per_s_p99": r(q(sent, 0.99), 1),
            "sla_bytes_per_node_per_s_max": r(max(sent, default=None), 1),
            "sla_bytes_received_per_node_per_s_max": r(recv, 1),
            "view_bytes_per_member": max(mem) if mem else None,
            "view_bytes_per_member_p50": sorted(mem)[len(mem) // 2] if mem else None,
            "dead_share_removed_windows_p99": r(q(delays, 0.99), 3),
            "dead_share_removed_windows_max": r(max(delays, default=None), 3),
            "dead_share_gone_after_crash_s_max": r(max(
                (self.first_gone[v] - self.crash_at[v] for v in self.first_gone
                 if v in self.crash_at), default=None), 3),
            "dead_share_pairs": len(delays),
            "sla_sampled_members": len(self.sampled),
            "sla_messages": ts.messages,
            "sla_measured_s": round(dur, 1),
        }


def start_trees(a: argparse.Namespace, sim: Simulation | None, ids: list[str], at: float,
                victims: list[int]) -> tuple[TreeSimulation, SlaProbe, Fleet]:
    """Every member's SlaTree from ``at`` on, on ``sim``'s clock (or its own)."""
    lo, hi = (x / 1000 for x in a.latency_ms)
    cfg = TreeConfig(window_s=a.window, epoch_s=a.window / 2)
    rng = random.Random(a.seed * 31 + 7)
    n = len(ids)
    sampled = sorted(rng.sample(range(n), min(n, a.sla_sample)))
    ts = TreeSimulation(n, cfg, seed=a.seed, loss=a.loss, latency_s=(lo, hi),
                        clock=sim, ids=ids, bytes_of=sampled)
    ts.set_base(ids)
    pool = Pool(a.seed)
    fleet = Fleet(ids, pool, a.seed, a.window)
    for i in range(n):  # every member's qosd runs: the trees start together
        ts.start(i, at=at)
        fleet.drive(ts, i, at)
    probe = SlaProbe(ts, pool, sampled, a.window, victims)
    return ts, probe, fleet


def sla_targets(res: dict[str, Any]) -> dict[str, bool]:
    def le(key: str, bound: float) -> bool:
        v = res.get(key)
        return v is not None and v <= bound

    return {
        "view_age_le_2_windows_p99": le("view_age_windows_p99", MAX_VIEW_AGE_WINDOWS),
        "view_p99_within_2pct": le("view_p99_rel_error", MAX_VIEW_P99_ERROR),
        "view_counts_exact": res.get("view_counts_exact_share") == 1.0,
        "sla_traffic_le_32kbit": le("sla_kbit_per_node_per_s", MAX_SLA_KBIT_PER_NODE),
        "view_memory_le_1MB": le("view_bytes_per_member", MAX_VIEW_BYTES),
        "dead_share_removed_le_2_windows": le("dead_share_removed_windows_p99",
                                              MAX_DEAD_SHARE_WINDOWS),
    }


def converged(sim: Simulation) -> bool:
    n = len(sim.nodes)
    return all(m.live_members() == n - 1 and not m.queued_broadcasts() for m in sim.nodes)


def run(a: argparse.Namespace) -> dict[str, Any]:
    res = run_oracle(a) if a.membership == "oracle" else run_swim(a)
    res["targets"].update(sla_targets(res))
    return res


def run_oracle(a: argparse.Namespace) -> dict[str, Any]:
    """The trees alone: a modelled membership (module doc)."""
    cfg = Config()
    n = a.nodes
    rng = random.Random(a.seed)
    wall0 = time.perf_counter()
    ids = [f"node-{i}" for i in range(n)]
    victims = rng.sample(range(n), min(a.crashes, n - 2))
    ts, probe, _ = start_trees(a, None, ids, 0.0, victims)
    t_c = a.sla_warmup + a.idle
    detect_s = cfg.suspicion_min_s(n)
    drng = random.Random(a.seed * 977)
    last = 0.0
    for k, v in enumerate(victims):
        at = t_c + k * a.crash_gap

        def crash(v: int = v, at: float = at) -> None:
            ts.crash(v)
            probe.crash_at[ids[v]] = at

        ts.sim.at(at, crash)
        for i in range(n):
            if i == v:
                continue
            seen = at + detect_s + 2.0 + 1.5 * drng.random()
            last = max(last, seen)

            def learn(i: int = i, v: int = v, seen: float = seen) -> None:
                if ts.running[i]:
                    ts.learn_dead(i, ids[v])
                    probe.dead_at[(i, ids[v])] = seen

            ts.sim.at(seen, learn)
    ts.sim.at(a.sla_warmup, probe.start)
    t_end = last + a.sla_after
    ts.run_until(t_end)
    wall = time.perf_counter() - wall0
    res: dict[str, Any] = {
        "nodes": n, "loss": a.loss, "seed": a.seed, "latency_ms": list(a.latency_ms),
        "membership": "oracle", "crashes": len(victims), "crash_gap_s": a.crash_gap,
        "window_s": a.window, "classes": len(CLASSES),
        "suspicion_min_s": round(detect_s, 3), "suspicion_max_s": round(cfg.suspicion_max_s(n), 3),
        "virtual_s": round(t_end, 2), "wall_s": round(wall, 2),
    }
    for key in ("convergence_s_p50", "convergence_s_p99", "convergence_s_p9999",
                "detect_s_p50", "detect_s_p99", "false_positives", "bytes_per_node_per_s",
                "kbit_per_node_per_s"):
        res[key] = None
    res.update(probe.result(t_end))
    res["targets"] = {}
    return res


def run_swim(a: argparse.Namespace) -> dict[str, Any]:
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
    origin = rng.randrange(n)
    victims = rng.sample([i for i in range(n) if i != origin], min(a.crashes, n - 2))
    ts, probe, _ = start_trees(a, sim, sim.ids, sim.now, victims)
    obs.trees, obs.probe = ts, probe
    sim.at(sim.now + a.sla_warmup, probe.start)

    # 2. idle
    meter.advance(t_warm + a.idle)
    idle_bytes = bytes_sent(sim) - join_bytes

    # 3. the SLA digest
    t_b = sim.now
    sim.broadcast(origin, DIGEST_KEY, bytes(a.payload_bytes))
    meter.advance(t_b + 30.0, lambda: len(obs.digest) < n - 1)
    meter.advance(t_b + 2.0)

    # 4. crashes
    crash_at: dict[int, float] = {}
    t_c = max(sim.now, t_warm + a.sla_warmup + 1.0)
    for k, v in enumerate(victims):
        def crash(v: int = v) -> None:
            sim.crash(v)
            ts.crash(v)
            crash_at[v] = sim.now
            probe.crash_at[sim.ids[v]] = sim.now
        sim.at(t_c + k * a.crash_gap, crash)
    watchers = [i for i in range(n) if i not in victims]

    def undetected() -> bool:
        return len(crash_at) < len(victims) or any(
            len(obs.dead.get(sim.ids[v], {}).keys() & set(watchers)) < len(watchers)
            for v in victims)

    t_end = meter.advance(t_warm + a.duration, undetected)
    t_sla = t_end + a.sla_after  # the trees go on: every view drops the crashed
    sim.run_until(t_sla)
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
        "membership": "swim",
        "window_s": a.window,
        "classes": len(CLASSES),
    }
    res.update(probe.result(t_sla))
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
    rows = [("members / loss", f"{res['nodes']} / {res['loss']:.2%} ({res['membership']})")]
    if res["membership"] == "swim":
        bound = res["baseline"]["lifeguard_detect_bound_s"]
        bandwidth = (f"{res['kbit_per_node_per_s']} kbit/s ({res['bytes_per_node_per_s']} B/s, "
                     f"idle {res['bytes_per_node_per_s_idle']} B/s, "
                     f"peak {res['peak_kbit_per_node_per_s']} kbit in 1 s)")
        rows += [
            ("digest to 99 % / 99.99 %",
             f"{res['convergence_s_p99']} s / {res['convergence_s_p9999']} s"),
            ("crash -> dead everywhere p50 / p99",
             f"{res['detect_s_p50']} s / {res['detect_s_p99']} s  (bound {bound} s)"),
            ("false positives", str(res["false_positives"])),
            ("bandwidth per member", bandwidth),
            ("warm-up / virtual / wall",
             f"{res['warmup_s']} s / {res['virtual_s']} s / {res['wall_s']} s"),
        ]
    else:
        rows.append(("virtual / wall", f"{res['virtual_s']} s / {res['wall_s']} s"))
    rows += [
        ("SLA view age p50 / p99 (windows)",
         (f"{res['view_age_windows_p50']} / {res['view_age_windows_p99']} "
          f"(newest {res['view_newest_age_windows_p99']})")),
        ("SLA view p99 error, worst class", f"{res['view_p99_rel_error']}"),
        ("SLA records with exact members",
         f"{res['view_counts_exact_share']} of {res['view_records']}"),
        ("SLA traffic per member",
         (f"{res['sla_kbit_per_node_per_s']} kbit/s ({res['sla_bytes_per_node_per_s']} B/s, "
          f"p99 {res['sla_bytes_per_node_per_s_p99']}, "
          f"max {res['sla_bytes_per_node_per_s_max']})")),
        ("SLA view memory per member", f"{res['view_bytes_per_member']} B"),
        ("crashed share gone (windows after dead)", f"p99 {res['dead_share_removed_windows_p99']}"),
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
    p.add_argument("--membership", choices=("swim", "oracle"), default=None,
                   help="simulate the SWIM cores too (default up to 2000 members) or model them")
    p.add_argument("--window", type=float, default=5.0, help="SLA window, s")
    p.add_argument("--sla-warmup", type=float, default=15.0,
                   help="s of the trees running before the SLA view is measured")
    p.add_argument("--sla-after", type=float, default=20.0,
                   help="s the trees run on after the last crash is detected")
    p.add_argument("--sla-sample", type=int, default=None,
                   help="members whose view is read every 0.5 s (1 s above 2000) and whose "
                        "messages are sized (default all up to 1000, then 1000)")
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench"))
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    if a.nodes < 4:
        p.error("--nodes must be at least 4")
    if a.membership is None:
        a.membership = "swim" if a.nodes <= 2000 else "oracle"
    if a.sla_sample is None:
        a.sla_sample = min(a.nodes, 1000)
    if a.duration is None:
        a.duration = (a.idle + 35.0 + a.crashes * a.crash_gap
                      + Config().suspicion_max_s(a.nodes) + 10.0)
    res = run(a)
    write_json(Path(a.out_dir) / f"cluster-{a.nodes}-{a.loss:g}.json", res)
    print(json.dumps(res) if a.json else table(res))
    return 1 if a.strict and not all(res["targets"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
