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
  windows from ``settle_windows`` on (the load steady, the loop settled);
* ``oscillations``: direction changes (up/down) of any knob of any class in
  the controller-on run, but for the one expected of a knob the flood made
  go up and that comes down once the flood is gone;
* ``max_step``: the largest single change of a rate, ceil or weight as a
  fraction of its policy value;
* ``back_to_policy_windows``: windows from the flood's stop until every class
  is back at the policy's values (0: it never left; None: not within the run).
"""

from __future__ import annotations

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
TARGETS = {"attainment_on": (">=", 0.99), "attainment_off": ("<", 0.9),
           "settle_windows": ("<=", 5), "oscillations": ("==", 0),
           "back_to_policy_windows": ("<=", 10)}


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
                               "t": round(w["end"] - run["flood_from"], 2)}
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
    ch = on["observation"].changes if on else []
    settle = settle_windows(ch, on["flood_from"], on["flood_to"], w) if on else None
    out: dict[str, Any] = {
        "version": 1, "measurement": MEASUREMENT, "watch": WATCH,
        "objective": policy.class_named(WATCH).sla.model_dump(exclude_none=True),
        "policy": {c: pol[c] for c in CLASSES if c in pol},
        "adapt": policy.class_named(WATCH).adapt.model_dump(mode="json", exclude_none=True),
        "attainment_off": _attainment(rows["off"], settle or 1) if "off" in rows else None,
        "attainment_on": _attainment(rows["on"], settle or 1) if on else None,
        "settle_windows": settle,
        "oscillations": oscillations(ch, on["flood_to"]) if on else None,
        "max_step": max_step(ch, pol) if on else None,
        "back_to_policy_windows": back_to_policy_windows(
            on["observation"].initial, ch, pol, on["flood_to"], w) if on else None,
        "attainment_on_after": _attainment(rows["on"], 1, "after") if on else None,
    }
    out["targets"] = {k: _meets(out.get(k), *t) for k, t in TARGETS.items()}
    out["windows"] = _side_by_side(rows)
    out["runs"] = {m: {"flood": r["flood"], "pipeline": r["pipeline"],
                       "observer_errors": r["observation"].errors,
                       "changes": [{**c, "t": round(c["t"] - r["flood_from"], 2)}
                                   for c in r["observation"].changes],
                       "decisions": _decisions(r["explain"], r["flood_from"]),
                       "controller": [{**c, "t": round(c["t"] - r["flood_from"], 2)}
                                      for c in r["observation"].controller]}
                   for m, r in runs.items()}
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


__all__ = ["CLASSES", "MEASUREMENT", "TARGETS", "back_to_policy_windows", "figures",
           "max_step", "oscillations", "params_at", "policy_params", "rows_of", "same_params",
           "served", "settle_windows"]
