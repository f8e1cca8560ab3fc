"""The closed-loop demo's figures (:mod:`.closed_loop`; the table and the plot
are :mod:`.closed_loop_show`'s).

Windows are the stages' own SLA windows (one a ``window_s``), each placed in
its run's timeline by its middle (warm-up, quiet, flood, after) and numbered
from 1 within its phase by position; the off and on runs share the timeline,
so window ``i`` of a phase is compared with window ``i`` of the same phase.  The parameters of a
window are the kernel's at its end.  The figures, as the simulator's
(``qosd.controller.core.sim``) with the kernel's changes in place of its rows:

* ``settle_windows``: from the flood's start, counted from 1, the first
  window that runs on the parameters that then hold until the flood stops
  (the last change during the flood + 1; 1 when nothing changed);
* ``attainment_off`` / ``attainment_on``: voice, frame-weighted over the flood
  windows from ``settle_windows`` on that began once the kernel held the
  settled values (``attainment_from_window``; the load steady, the loop
  settled), the same windows in both runs;
* ``oscillations``: direction changes (up/down) of any knob of any class in
  the controller-on run, but for the one expected of a knob the flood made
  go up and that comes down once the flood is gone;
* ``max_step``: the largest single change of a rate, ceil or weight as a
  fraction of its policy value;
* ``back_to_policy_windows``: windows from the flood's stop until every class
  is back at the policy's values (0: it never left; None: not within the run);
* ``settle_s`` / ``back_to_policy_s``: the same in seconds (from the flood's
  start to the last kernel change during it; from its stop to the policy);
* ``delay``: the loop's delay budget of the first increase, part by part
  (:func:`delay_budget`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

from demo.closed_loop.config import STAGES, WATCH, ClosedLoopConfig
from demo.closed_loop.observe import Change, Params, params_at

CLASSES = tuple(STAGES)
KNOBS = ("rate", "ceil", "weight", "priority")
PHASES = ("warm", "quiet", "flood", "after")
MEASUREMENT = ("per class, the stages' SLA windows as the edge node's qosd holds them (GET "
               "/v1/sla: audio-frontend for voice, vision-encoder for video, lidar-encoder "
               "for lidar; latency from capture to the stage's output, attainment = share "
               "of frames within their deadline); parameters: the kernel's HTB classes on "
               "the uplink, through the sensors node's qosd (GET /v1/status)")
TARGETS = {"attainment_on": (">=", 0.999), "attainment_off": ("<", 0.9),
           "settle_windows": ("<=", 3), "oscillations": ("==", 0),
           "back_to_policy_windows": ("<=", 3)}
"""A run's targets (issue 20; over runs: settle_windows <= 3 in 9 of 10 and never
above 4, bench/closed_loop.py)."""


def policy_params(policy: Any) -> Params:
    from mmmesh.policy import policy_values

    return {c.name: policy_values(policy, c) for c in policy.classes}


def same_params(kernel: dict[str, int] | None, policy: dict[str, int]) -> bool:
    """The kernel holds the policy's values: rates and ceilings in whole bytes
    a second (HTB's unit), weight and priority as they are."""
    if kernel is None:
        return False
    for knob, v in policy.items():
        k = kernel.get(knob)
        if k is None:
            return False
        if knob in ("rate", "ceil"):
            if int(k) // 8 != int(v) // 8:
                return False
        elif int(k) != int(v):
            return False
    return True


def _phase_of(run: dict[str, Any], t: float, w: float) -> tuple[str, int] | None:
    """The phase holding time ``t`` and the window's number in it (from 1, by
    position: a window missing from the board leaves its number out)."""
    if t < run["t0"] or t > run["end"]:
        return None
    starts = (("warm", run["t0"]), ("quiet", run["start"]), ("flood", run["flood_from"]),
              ("after", run["flood_to"]))
    phase, begin = next((p, b) for p, b in reversed(starts) if t >= b)
    return phase, int((t - begin) // w) + 1


def _nearest(windows: list[dict[str, Any]], end: float, within: float) -> dict[str, Any] | None:
    best = min(windows, key=lambda w: abs(w["end"] - end), default=None)
    return best if best is not None and abs(best["end"] - end) <= within else None


def _measure(w: dict[str, Any] | None) -> dict[str, Any] | None:
    if w is None:
        return None
    att = w["attainment"]
    return {"p99_ms": None if w["p99_ms"] is None else round(float(w["p99_ms"]), 1),
            "attainment": None if att is None else round(float(att), 4),
            "frames": w["frames"]}


def rows_of(cfg: ClosedLoopConfig, run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's windows: one per voice window, with video's and LiDAR's
    nearest windows and the kernel's parameters at its end."""
    obs = run["observation"]
    by_class = {c: sorted((w for w in obs.windows if w["stage"] == s and w["class"] == c),
                          key=lambda w: w["end"]) for c, s in STAGES.items()}
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for w in by_class[WATCH]:
        at = _phase_of(run, w["end"] - w["window_s"] / 2, cfg.window_s)
        if at is None or w["window_s"] < 0.5 * cfg.window_s or at in seen:
            continue
        seen.add(at)
        row: dict[str, Any] = {"phase": at[0], "i": at[1],
                               "t": round(w["end"] - run["flood_from"], 2),
                               "start": round(w["end"] - w["window_s"] - run["flood_from"], 2)}
        for c in CLASSES:
            near = w if c == WATCH else _nearest(by_class[c], w["end"], cfg.window_s / 2)
            row[c] = _measure(near)
        row["params"] = obs.params_at(w["end"])
        row["link"] = served(obs.counters, w["end"] - w["window_s"], w["end"])
        rows.append(row)
    return rows


def served(counters: list[tuple[float, int, int, int]], a: float,
           b: float) -> dict[str, Any] | None:
    """What the watched class's HTB leaf did between ``a`` and ``b`` (the
    nearest samples): Mbit/s sent, packets dropped, the largest backlog."""
    inside = [c for c in counters if a <= c[0] <= b]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
        return None
    first, last = inside[0], inside[-1]
    return {"mbit_s": round((last[1] - first[1]) * 8 / (last[0] - first[0]) / 1e6, 3),
            "drops": last[2] - first[2], "backlog_max": max(c[3] for c in inside)}


def settled_from(rows: list[dict[str, Any]], settle: int, since: float) -> int:
    """The first flood window, counted from 1, that is ``settle`` or later and
    began once the kernel held the settled values (``since``: seconds from the
    flood's start to the last change during it): the window the last change
    fell in ran partly on the values before it, and is not "after settling"."""
    later = [r["i"] for r in rows if r["phase"] == "flood" and r["i"] >= settle
             and r.get("start", r["t"]) >= since]
    return min(later, default=settle)


def _attainment(rows: list[dict[str, Any]], first: int, phase: str = "flood") -> float | None:
    """Voice's attainment, frame-weighted, over ``phase``'s windows from ``first``."""
    ms = [r[WATCH] for r in rows if r["phase"] == phase and r["i"] >= first and r[WATCH]]
    frames = sum(m["frames"] for m in ms)
    met = sum(m["frames"] * (m["attainment"] or 0.0) for m in ms)
    return round(met / frames, 4) if frames else None




def settle_windows(changes: list[Change], flood_from: float, flood_to: float,
                   window_s: float) -> int:
    """From the flood's start, counted from 1, the first window that runs on
    the parameters that then hold until the flood stops: the window after the
    one holding the last change made during the flood (1 when none was)."""
    during = [float(c["t"]) for c in changes if flood_from <= c["t"] < flood_to]
    if not during:
        return 1
    return max(1, math.ceil((max(during) - flood_from) / window_s) + 1)


def oscillations(changes: list[Change], flood_to: float) -> int:
    """Direction changes (up to down or down to up) of any knob of any class,
    but for one per knob that is expected: a knob that went up, coming down
    once the flood has stopped (the load went away)."""
    series: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for c in sorted(changes, key=lambda c: c["t"]):
        if c["new"] != c["old"]:
            series.setdefault((c["class"], c["knob"]), []).append((c["t"], c["new"] - c["old"]))
    osc = 0
    for moves in series.values():
        flips = [b for a, b in itertools.pairwise(moves) if (a[1] > 0) != (b[1] > 0)]
        expected = bool(flips) and moves[0][1] > 0 and flips[0][1] < 0 and \
            flips[0][0] >= flood_to
        osc += len(flips) - expected
    return osc


def max_step(changes: list[Change], policy: Params) -> float:
    """The largest single change of a rate, ceil or weight as a fraction of
    its policy value (0.0 when nothing changed)."""
    steps = [abs(c["new"] - c["old"]) / policy[c["class"]][c["knob"]]
             for c in changes
             if c["knob"] != "priority" and policy.get(c["class"], {}).get(c["knob"])]
    return round(max(steps, default=0.0), 4)


def back_to_policy_windows(initial: Params, changes: list[Change], policy: Params,
                           flood_to: float, window_s: float) -> int | None:
    """Windows from the flood's stop until every class the kernel holds is
    at the policy's values (:func:`same_params`): 0 when they already are,
    None when not within the changes seen."""

    def at_policy(t: float) -> bool:
        p = params_at(initial, changes, t)
        return all(same_params(p.get(c), v) for c, v in policy.items() if c in p)

    if at_policy(flood_to):
        return 0
    for c in sorted(changes, key=lambda c: c["t"]):
        t = float(c["t"])
        if t > flood_to and at_policy(t):
            return math.ceil((t - flood_to) / window_s)
    return None


def last_change_s(changes: list[Change], flood_from: float, flood_to: float) -> float:
    """Seconds from the flood's start to the last kernel change during it (0: none)."""
    during = [float(c["t"]) for c in changes if flood_from <= c["t"] < flood_to]
    return round(max(during) - flood_from, 2) if during else 0.0


def back_to_policy_s(initial: Params, changes: list[Change], policy: Params,
                     flood_to: float) -> float | None:
    """Seconds from the flood's stop until every class is at the policy's values."""

    def at_policy(t: float) -> bool:
        p = params_at(initial, changes, t)
        return all(same_params(p.get(c), v) for c, v in policy.items() if c in p)

    if at_policy(flood_to):
        return 0.0
    for c in sorted(changes, key=lambda c: c["t"]):
        if c["t"] > flood_to and at_policy(float(c["t"])):
            return round(float(c["t"]) - flood_to, 2)
    return None


def closes(windows: list[dict[str, Any]]) -> dict[float, float]:
    """When each of one sender's windows closed, by its board time (``end``):
    consecutive windows chain (each starts where the one before closed, its
    ``window_s`` on the sender's own clock), so ``end - close`` is known up to
    the sender's fastest report of the run, taken as 0 (a lower bound of the
    report's delay: a few ms when nothing waits).  A gap (a window the observer
    missed) starts a chain of its own."""
    ws = sorted(windows, key=lambda w: w["end"])
    out: dict[float, float] = {}
    chain: list[tuple[float, float]] = []

    def settle() -> None:
        if chain:
            offset = min(end - c for end, c in chain)
            out.update((end, c + offset) for end, c in chain)
            chain.clear()

    at, last = 0.0, None
    for w in ws:
        # a window the observer did not see (a busy host) breaks the chain: start another
        if last is not None and w["end"] - last > 1.5 * max(w["window_s"], 1e-3):
            settle()
        at += w["window_s"]
        chain.append((w["end"], at))
        last = w["end"]
    settle()
    return out


def _late(w: dict[str, Any]) -> bool:
    att = w.get("attainment")
    return bool(w.get("misses")) or (att is not None and float(att) < 1.0)


def first_miss_t(counters: list[tuple[float, int, int, int]], after: float, rate_bps: float,
                 deadline_s: float) -> float | None:
    """The first time after ``after`` the watched leaf's queue held more than
    the deadline's worth at its rate (the first frame that misses leaves it then)."""
    for t, _b, _d, backlog in counters:
        if t >= after and backlog * 8 / rate_bps >= deadline_s:
            return t
    return None


def delay_budget(cfg: ClosedLoopConfig, run: dict[str, Any], policy: Any) -> dict[str, Any] | None:
    """From the first missed frame to the kernel write of the first increase,
    part by part (seconds), for the watched class (voice, whose windows the
    audio front end on the edge node reports and the sensors node's
    controller reads from its global view):

    * ``window``: the first missed frame (the leaf's queue past the deadline)
      to the close of the stage's window that holds it;
    * ``hysteresis``: that close to the close of the window the increase was
      decided on (the law waiting for more windows; 0 when the first was enough);
    * ``report``: that window's close to the edge node's board (a lower bound,
      :func:`closes`);
    * ``view``: the board to the sensors node's global view, which the
      controller reads: ``view_local``, the board to the edge node's own view
      (its publication tick), then ``view_peers``, the edge's view to the
      sensors node's (gossip, push-pull); the split only when the observer's
      polls saw the window in the edge's view first;
    * ``controller_wait``: the window in the sensors node's view to the
      controller's step on it (its period, or its poll);
    * ``controller_step``: reading its input and deciding;
    * ``kernel_write``: the decision to the kernel holding it (the reconciler's write);
    * ``total``: the first missed frame to the kernel write.

    The decided-on window is the one whose data time the controller's step
    recorded; a view's time is the first of the observer's polls that held it,
    and no later than the controller's step that read it (the observer, a
    thread of the demo's process, lags on a busy host: an upper bound).  None
    when there was no increase."""
    obs = run["observation"]
    flood_from, flood_to = run["flood_from"], run["flood_to"]
    stage = STAGES[WATCH]
    ups = sorted((c for c in kernel_changes(obs) if c["class"] == WATCH and c["new"] > c["old"]
                  and flood_from <= c["t"] < flood_to), key=lambda c: c["t"])
    if not ups:
        return None
    t_kernel = float(ups[0]["t"])
    steps = [s for s in obs.loop if WATCH in (s.get("changed") or [])
             and float(s["decided"]) <= t_kernel + 0.05]
    wins = sorted((w for w in obs.windows if w["stage"] == stage and w["class"] == WATCH),
                  key=lambda w: w["end"])
    if not steps or not wins:
        return None
    step = max(steps, key=lambda s: float(s["decided"]))
    woke, decided, written = (float(step[k]) for k in ("woke", "decided", "written"))
    data_t = (step.get("data") or {}).get(WATCH)
    # the board's window the step read: the view's data time is at or after the board's
    # (a peer's view may take a window up to a push-pull state's age late)
    before = [w for w in wins if data_t is not None and w["end"] <= float(data_t) + 0.05]
    decisive = before[-1] if before else max((w for w in wins if w["end"] <= woke),
                                             key=lambda w: w["end"], default=None)
    if decisive is None or (data_t is not None and float(data_t) - decisive["end"] > 1.5):
        return None  # the observer missed the window the step read (a very busy host)
    close = closes(wins)
    missed = [w for w in wins if w["end"] > flood_from and _late(w)]
    first = missed[0] if missed and missed[0]["end"] <= decisive["end"] else decisive
    rate = float(policy_params(policy)[WATCH]["rate"])
    deadline_s = float(policy.class_named(WATCH).sla.p99_ms) / 1000.0
    close_first, close_dec = close[first["end"]], close[decisive["end"]]
    t_miss = first_miss_t(obs.counters, flood_from, rate, deadline_s)
    if t_miss is None or not close_first - first["window_s"] <= t_miss <= close_first:
        late = 1.0 - float(first.get("attainment") or 0.0)  # the window's last frames
        t_miss = close_first - first["window_s"] * min(1.0, late)

    def seen_in(view: str) -> float | None:
        vs = [v["seen"] for v in obs.views if v["view"] == view and v["stage"] == stage
              and v["origin"] == "edge" and -0.05 <= v["data_t"] - decisive["end"] < 1.5]
        return min(vs, default=None)

    peers = min(x for x in (seen_in("sensors"), woke) if x is not None)
    local = seen_in("edge")
    if local is not None and local >= peers:  # the observer lagged: no split
        local = None
    parts: dict[str, float | None] = {
        "window": close_first - t_miss,
        "hysteresis": close_dec - close_first,
        "report": decisive["end"] - close_dec,
        "view": peers - decisive["end"],
        "view_local": None if local is None else local - decisive["end"],
        "view_peers": None if local is None else peers - local,
        "controller_wait": woke - peers,
        "controller_step": decided - woke,
        "kernel_write": written - decided,
        "total": written - t_miss,
    }
    out: dict[str, Any] = {k: None if v is None else round(v, 3) for k, v in parts.items()}
    out["first_miss_s"] = round(t_miss - flood_from, 3)  # from the flood's start
    out["kernel_s"] = round(t_kernel - flood_from, 3)
    out["decided_on"] = {"window_close_s": round(close_dec - flood_from, 3),
                         "window_s": decisive["window_s"],
                         "attainment": decisive.get("attainment"),
                         "p99_ms": decisive.get("p99_ms")}
    later = [c for c in ups if c["t"] > t_kernel + cfg.window_s / 2]
    out["second_increase_s"] = round(float(later[0]["t"]) - t_kernel, 3) if later else None
    return out


def kernel_changes(obs: Any) -> list[Change]:
    """The kernel's changes, each at the time the controller's write of it
    returned when one falls between the observer's poll that saw it and the
    poll before (the observer polls every 0.25 s, and lags on a busy host);
    else at the poll's time."""
    polls = sorted({float(c[0]) for c in obs.counters})
    writes = sorted(float(s["written"]) for s in obs.loop if s.get("changed"))
    out = []
    for c in obs.changes:
        t = float(c["t"])
        k = bisect.bisect_left(polls, t)
        prev = polls[k - 1] if k > 0 else -math.inf
        inside = [x for x in writes if prev < x <= t]
        out.append({**c, "t": inside[-1] if inside else t})
    return out


def _decisions(explain: dict[str, Any] | None, t0: float) -> list[dict[str, Any]]:
    out = []
    for c in (explain or {}).get("classes") or []:
        for d in c.get("decisions") or []:
            out.append({"class": c["class"], "t": round(float(d["at"]) - t0, 1),
                        "window": d["window"], "change": d["change"], "why": d["why"]})
    return sorted(out, key=lambda d: d["t"])


def figures(cfg: ClosedLoopConfig, policy: Any, runs: dict[str, Any]) -> dict[str, Any]:
    """The demo's result: windows side by side, the figures, the targets."""
    pol = policy_params(policy)
    w = cfg.window_s
    rows = {m: rows_of(cfg, r) for m, r in runs.items()}
    on = runs.get("on")
    ch = kernel_changes(on["observation"]) if on else []
    settle = settle_windows(ch, on["flood_from"], on["flood_to"], w) if on else None
    first = settle or 1
    if on and "on" in rows:  # voice, frame-weighted, over the windows run on the settled values
        first = settled_from(rows["on"], first, last_change_s(ch, on["flood_from"],
                                                              on["flood_to"]))
    out: dict[str, Any] = {
        "version": 1, "measurement": MEASUREMENT, "watch": WATCH,
        "objective": policy.class_named(WATCH).sla.model_dump(exclude_none=True),
        "policy": {c: pol[c] for c in CLASSES if c in pol},
        "adapt": policy.class_named(WATCH).adapt.model_dump(mode="json", exclude_none=True),
        "attainment_off": _attainment(rows["off"], first) if "off" in rows else None,
        "attainment_on": _attainment(rows["on"], first) if on else None,
        "attainment_from_window": first,
        "settle_windows": settle,
        "oscillations": oscillations(ch, on["flood_to"]) if on else None,
        "max_step": max_step(ch, pol) if on else None,
        "back_to_policy_windows": back_to_policy_windows(
            on["observation"].initial, ch, pol, on["flood_to"], w) if on else None,
        "attainment_on_after": _attainment(rows["on"], 1, "after") if on else None,
        "settle_s": last_change_s(ch, on["flood_from"], on["flood_to"]) if on else None,
        "back_to_policy_s": back_to_policy_s(on["observation"].initial, ch, pol,
                                             on["flood_to"]) if on else None,
        "delay": delay_budget(cfg, on, policy) if on else None,
    }
    out["targets"] = {k: _meets(out.get(k), *t) for k, t in TARGETS.items()}
    out["windows"] = _side_by_side(rows)
    out["runs"] = {m: {"flood": r["flood"], "pipeline": r["pipeline"],
                       "observer_errors": r["observation"].errors,
                       "changes": [{**c, "t": round(c["t"] - r["flood_from"], 2),
                                    "seen": round(o["t"] - r["flood_from"], 2)}
                                   for c, o in zip(kernel_changes(r["observation"]),
                                                   r["observation"].changes, strict=True)],
                       "decisions": _decisions(r["explain"], r["flood_from"]),
                       "controller": [{**c, "t": round(c["t"] - r["flood_from"], 2)}
                                      for c in r["observation"].controller],
                       "loop": [_relative(s, r["flood_from"]) for s in r["observation"].loop],
                       "views": [{**v, "data_t": round(v["data_t"] - r["flood_from"], 3),
                                  "seen": round(v["seen"] - r["flood_from"], 3)}
                                 for v in r["observation"].views]}
                   for m, r in runs.items()}
    return out


def _relative(step: dict[str, Any], t0: float) -> dict[str, Any]:
    """A controller step's times from ``t0`` (the flood's start)."""
    out = dict(step)
    for k in ("due", "woke", "read", "decided", "written", "done"):
        if isinstance(out.get(k), int | float):
            out[k] = round(float(out[k]) - t0, 3)
    out["data"] = {c: round(float(v) - t0, 3) for c, v in (step.get("data") or {}).items()}
    return out


def _meets(v: Any, op: str, target: float) -> bool | None:
    if v is None:
        return None
    return bool({"<=": v <= target, ">=": v >= target, "<": v < target,
                 "==": v == target}[op])


def _side_by_side(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for phase in PHASES:
        by = {m: {r["i"]: r for r in rs if r["phase"] == phase} for m, rs in rows.items()}
        for i in range(1, max((max(b, default=0) for b in by.values()), default=0) + 1):
            row: dict[str, Any] = {"phase": phase, "i": i}
            for m, b in by.items():
                r = b.get(i)
                row[m] = None if r is None else {
                    "t": r["t"], **{c: r[c] for c in CLASSES},
                    "voice_rate": r["params"].get(WATCH, {}).get("rate"),
                    "voice_weight": r["params"].get(WATCH, {}).get("weight"),
                    "voice_link": r["link"],
                    "params": r["params"]}
            out.append(row)
    return out


__all__ = ["CLASSES", "MEASUREMENT", "TARGETS", "back_to_policy_s", "back_to_policy_windows",
           "closes", "delay_budget", "figures", "first_miss_t", "kernel_changes",
           "last_change_s", "max_step", "oscillations", "params_at", "policy_params", "rows_of",
           "same_params", "served", "settle_windows", "settled_from"]
