#!/usr/bin/env python3
"""The closed SLA loop, run after run: how fast it settles on a quiet host and
under CPU contention, and where its delay goes (issue 20).

Each run is one ``mmmesh-demo --closed-loop --json`` (three namespace nodes,
a qosd each, the video flood; the controller off, then on: about 3 minutes),
in a process of its own.  Runs alternate between the two conditions, so that
the host's drift between runs falls on both alike:

  quiet       the demo alone (and whatever else the host runs: its load is
              recorded with every run)
  contended   the demo beside ``--hogs`` CPU hogs (default: one per vCPU, at
              nice 0: a Python busy loop each), which compete with qosd, the
              stages and the mesh for every CPU (the voice path and the flood
              run under SCHED_FIFO in the demo, as audio stacks do, and keep
              their timing; the loop's own parts do not)

Per condition: the distribution of ``settle_windows`` (counts per value) and
of ``settle_s``, ``oscillations``, ``attainment_on`` / ``attainment_off``,
``back_to_policy_windows`` / ``_s`` and ``max_step``; the delay budget's
parts (median, p90 and max over the runs, from the demo's ``delay``) and
each part's median under contention over its median when quiet (which parts
grow with load); and the targets: ``settle_windows`` <= 3 in at least 9 of 10
runs and never above 4, no oscillation, ``attainment_on`` >= 0.999,
``back_to_policy_windows`` <= 3, ``attainment_off`` < 0.9.  Needs root.
Prints a table, writes out/bench/closed_loop.json (every run's figures) and
each run's demo JSON under out/bench/closed_loop/.

    .venv/bin/python bench/closed_loop.py [--runs N] [--conditions quiet,contended]
                                          [--hogs K] [--demo-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.files import write_json

CONDITIONS = ("quiet", "contended")
PARTS = ("window", "hysteresis", "report", "view", "view_local", "view_peers",
         "controller_wait", "controller_step", "kernel_write", "total")
FIGURES = ("settle_windows", "settle_s", "oscillations", "attainment_on", "attainment_off",
           "back_to_policy_windows", "back_to_policy_s", "max_step")
HOG = "import os\nos.nice(0)\nwhile True:\n    pass\n"


def start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` CPU hogs: Python busy loops, stopped by :func:`stop_hogs`."""
    return [subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        h.terminate()
    for h in hogs:
        try:
            h.wait(5)
        except subprocess.TimeoutExpired:
            h.kill()
            h.wait(5)


def one_run(condition: str, hogs: int, demo_args: list[str], timeout_s: float,
            keep: Path | None = None) -> dict[str, Any]:
    """One demo run under ``condition``: its figures, the host's load, how long
    (``keep``: the demo's whole JSON is written there too)."""
    procs = start_hogs(hogs) if condition == "contended" else []
    load0 = os.getloadavg()
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="clb", dir="/tmp") as tmp:
            cmd = [sys.executable, "-m", "demo.cli", "--closed-loop", "--json", "--quiet",
                   "--out", str(Path(tmp) / "out"), *demo_args]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT) as demo:
                try:
                    out, err = demo.communicate(timeout=timeout_s)
                except BaseException as e:  # a timeout, Ctrl-C, SIGTERM
                    demo.send_signal(signal.SIGINT)  # the demo cleans up on SIGINT
                    try:
                        out, err = demo.communicate(timeout=60)
                    except subprocess.TimeoutExpired:
                        demo.kill()
                        out, err = demo.communicate()
                    if not isinstance(e, subprocess.TimeoutExpired):
                        raise
                    err = f"timed out after {timeout_s:.0f} s\n{err}"
            p = subprocess.CompletedProcess(cmd, demo.returncode, out, err)
    finally:
        stop_hogs(procs)
    took = time.monotonic() - t0
    rec: dict[str, Any] = {"condition": condition, "hogs": len(procs),
                           "load_start": [round(x, 2) for x in load0],
                           "load_end": [round(x, 2) for x in os.getloadavg()],
                           "seconds": round(took, 1), "rc": p.returncode}
    if p.returncode != 0:
        rec["error"] = (p.stderr or p.stdout)[-2000:]
        return rec
    res = json.loads(p.stdout)
    if keep is not None:
        write_json(keep, res)
        rec["json"] = str(keep)
    rec.update({k: res.get(k) for k in FIGURES})
    rec["delay"] = res.get("delay")
    rec["flood_mbit_s"] = {m: (r.get("flood") or {}).get("mbit_s")
                           for m, r in (res.get("runs") or {}).items()}
    rec["decisions"] = [f"t={d['t']:+.1f}s {d['class']}: {d['change']}"
                        for d in (res.get("runs") or {}).get("on", {}).get("decisions", [])]
    return rec


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def dist(xs: list[Any]) -> dict[str, Any] | None:
    vals = [float(x) for x in xs if isinstance(x, int | float)]
    if not vals:
        return None
    return {"n": len(vals), "min": round(min(vals), 3), "median": round(statistics.median(vals), 3),
            "p90": round(_q(vals, 0.9), 3), "max": round(max(vals), 3)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition: distributions, delay parts, targets; and the contended /
    quiet ratio of each part's median."""
    out: dict[str, Any] = {}
    for cond in sorted({r["condition"] for r in runs}, key=CONDITIONS.index):
        ok = [r for r in runs if r["condition"] == cond and r.get("rc") == 0]
        settle = [r.get("settle_windows") for r in ok]
        good = [s for s in settle if isinstance(s, int)]
        parts = {p: dist([(r.get("delay") or {}).get(p) for r in ok]) for p in PARTS}
        s: dict[str, Any] = {
            "runs": len([r for r in runs if r["condition"] == cond]), "ok": len(ok),
            "settle_windows_counts": dict(sorted(Counter(good).items())),
            **{f: dist([r.get(f) for r in ok]) for f in FIGURES if f != "settle_windows"},
            "settle_windows": dist(good),
            "load_start_1min": dist([r["load_start"][0] for r in ok]),
            "delay": parts,
        }
        n = len(good)
        s["targets"] = {
            "settle_windows <= 3 in >= 90 % of runs": bool(n) and sum(x <= 3 for x in good)
            >= 0.9 * n,
            "settle_windows never > 4": bool(n) and max(good) <= 4,
            "oscillations == 0": all(r.get("oscillations") == 0 for r in ok) and bool(ok),
            "attainment_on >= 0.999": all((r.get("attainment_on") or 0) >= 0.999 for r in ok)
            and bool(ok),
            "back_to_policy_windows <= 3": all(isinstance(r.get("back_to_policy_windows"), int)
                                               and r["back_to_policy_windows"] <= 3 for r in ok)
            and bool(ok),
            "attainment_off < 0.9": all(r.get("attainment_off") is not None
                                        and r["attainment_off"] < 0.9 for r in ok) and bool(ok),
        }
        out[cond] = s
    if {"quiet", "contended"} <= set(out):
        ratio = {}
        for p in PARTS:
            q, c = out["quiet"]["delay"][p], out["contended"]["delay"][p]
            ratio[p] = (round(c["median"] / q["median"], 2)
                        if q and c and q["median"] > 0.005 else None)
        out["contended_over_quiet"] = ratio
    return out


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    lines = ["closed SLA loop: mmmesh-demo --closed-loop, run after run", ""]
    lines.append(f"{'run':>3} {'condition':<10} {'load':>5} {'settle':>6} {'s':>6} {'osc':>3} "
                 f"{'att on':>7} {'att off':>7} {'back':>4} {'back s':>6} {'step':>5} "
                 f"{'total s':>7}")
    for i, r in enumerate(runs, 1):
        if r.get("rc") != 0:
            lines.append(f"{i:>3} {r['condition']:<10} {r['load_start'][0]:>5.2f} failed "
                         f"(rc {r['rc']})")
            continue
        d = r.get("delay") or {}
        lines.append(
            f"{i:>3} {r['condition']:<10} {r['load_start'][0]:>5.2f} "
            f"{_f(r.get('settle_windows'), 'd'):>6} {_f(r.get('settle_s'), '.1f'):>6} "
            f"{_f(r.get('oscillations'), 'd'):>3} {_f(r.get('attainment_on'), '.4f'):>7} "
            f"{_f(r.get('attainment_off'), '.4f'):>7} "
            f"{_f(r.get('back_to_policy_windows'), 'd'):>4} "
            f"{_f(r.get('back_to_policy_s'), '.1f'):>6} {_f(r.get('max_step'), '.2f'):>5} "
            f"{_f(d.get('total'), '.2f'):>7}")
    for cond, s in summary.items():
        if cond == "contended_over_quiet":
            continue
        lines += ["", (f"{cond}: {s['ok']}/{s['runs']} runs; settle_windows counts "
                      f"{s['settle_windows_counts']}; load (1 min) at start "
                      f"{(s['load_start_1min'] or {}).get('median')} median")]
        for f in ("settle_s", "attainment_on", "attainment_off", "back_to_policy_s"):
            d = s.get(f)
            if d:
                lines.append(f"  {f:<24} median {d['median']}  p90 {d['p90']}  "
                             f"min {d['min']}  max {d['max']}")
        lines.append(f"  {'delay part (s)':<24} {'median':>7} {'p90':>7} {'max':>7}")
        for p in PARTS:
            d = s["delay"][p]
            if d:
                lines.append(f"  {p:<24} {d['median']:>7.3f} {d['p90']:>7.3f} {d['max']:>7.3f}")
        lines.append("  targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}"
                                               for k, v in s["targets"].items()))
    ratio = summary.get("contended_over_quiet")
    if ratio:
        lines += ["", "delay part, median contended / median quiet: "
                  + ", ".join(f"{p} {_f(v)}" for p, v in ratio.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per condition (default 10)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma-separated, of: quiet, contended (default both, alternating)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                    help="CPU hogs beside a contended run (default: one per vCPU)")
    ap.add_argument("--demo-args", default="", help="more mmmesh-demo arguments")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "closed_loop.json"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/closed_loop.py: needs root (the demo's namespaces, qdiscs and BPF)",
              file=sys.stderr)
        return 1
    # SIGTERM as Ctrl-C: the hogs are stopped and the demo (its own SIGINT) cleans up
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    conds = [c for c in a.conditions.split(",") if c]
    if not conds or any(c not in CONDITIONS for c in conds):
        ap.error(f"--conditions: of {', '.join(CONDITIONS)}")
    runs: list[dict[str, Any]] = []
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "argv": sys.argv[1:], "hogs": a.hogs, "cpus": os.cpu_count(),
                           "runs": runs}
    keep = Path(a.out).with_suffix("")  # out/bench/closed_loop/: every run's demo JSON
    for i in range(a.runs):
        for cond in conds:
            rec = one_run(cond, a.hogs, shlex.split(a.demo_args), a.timeout,
                          keep / f"run-{len(runs) + 1:02d}-{cond}.json")
            runs.append(rec)
            print(f"[{len(runs)}/{a.runs * len(conds)}] {cond}: load {rec['load_start'][0]}, "
                  f"settle {rec.get('settle_windows')} ({rec.get('settle_s')} s), "
                  f"osc {rec.get('oscillations')}, att on {rec.get('attainment_on')}, "
                  f"back {rec.get('back_to_policy_windows')}, rc {rec['rc']}", flush=True)
            res["summary"] = summarize(runs)
            write_json(a.out, res)  # after every run: a stopped bench keeps what it measured
    print(table(res["summary"], runs))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
