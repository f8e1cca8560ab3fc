#!/usr/bin/env python3
"""qosd under a connection flood from an unprivileged local process (issue 12, item 3).

Starts a real qosd from this checkout (testkit/hostile_target.py: temporary
config, no policy, sla.sock 0666, under ``prlimit --nofile=N`` like the
unit's LimitNOFILE) and measures, in one run:

  idle        ``mmmeshctl --socket <admin> status``, ``--calls`` times, nothing else
              going on (the baseline)
  ordinary    ``--requests`` complete POST /v1/sla at once (one thread each)
  flood       testkit/hostile_flood.py as uid/gid 65534 trying to hold ``--connections``
              slow-header connections to sla.sock for ``--seconds``; one second in,
              ``--requests`` ordinary POSTs at once again, and ``mmmeshctl status``
              ``--calls`` times in a row on the admin socket

For each phase: qosd's open descriptors (max, sampled every 50 ms from
/proc), RSS (before, max, after), the status latency p50/p99 (whole
``mmmeshctl`` processes; a call that fails or takes over 10 s counts as
failed) and its ratio to the idle baseline, the answers to the ordinary
requests, qosd's CPU time and the log lines it wrote.  With ``--before-rev
REV`` the flood phase also runs against qosd as it was in git revision REV
(its ``qosd`` and ``mmmesh`` packages from ``git archive``, same venv): the
baseline of what this server changed.  Prints a table and writes
out/bench/api_flood.json.  Needs root (setpriv, prlimit).

    sudo .venv/bin/python bench/api_flood.py [--before-rev REV]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.files import write_json
from qosd.httpd.serve import ADMIN_MAX_CONNECTIONS, SLA_MAX_CONNECTIONS
from testkit.hostile_target import (
    VENV_BIN,
    Sampler,
    Target,
    ordinary_requests,
    start_flood,
)

OUT = ROOT / "out" / "bench" / "api_flood.json"


def status_calls(target: Target, calls: int) -> dict[str, Any]:
    """``mmmeshctl status`` ``calls`` times in a row: latency p50/p99 and failures."""
    took, failed = [], 0
    for _ in range(calls):
        t0 = time.monotonic()
        try:
            r = subprocess.run([str(VENV_BIN / "mmmeshctl"), "--socket",
                                str(target.api_socket), "status"],
                               check=False, capture_output=True, text=True, timeout=10)
            failed += r.returncode != 0
        except subprocess.TimeoutExpired:
            failed += 1
        took.append(time.monotonic() - t0)
    return {"status_p50_ms": ms(took, 50), "status_p99_ms": ms(took, 99),
            "status_failed": failed}


def ms(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.array(xs) * 1000, q)), 1)


def phase(target: Target, run: Any) -> dict[str, Any]:
    """Runs ``run()`` while sampling qosd; its result plus descriptors, RSS, log lines."""
    fds0, rss0, lines0, cpu0 = target.fds(), target.rss_kib(), target.log_lines(), target.cpu_s()
    with Sampler(target).running() as s:
        t0 = time.monotonic()
        result = run()
        wall = time.monotonic() - t0
    return {**result, "seconds": round(wall, 1), "fds_before": fds0,
            "fds_max": max(s.fds, default=fds0), "fds_after": target.fds(),
            "rss_kib_before": rss0, "rss_kib_max": max(s.rss_kib, default=rss0),
            "rss_kib_after": target.rss_kib(), "log_lines": target.log_lines() - lines0,
            "cpu_s": round(target.cpu_s() - cpu0, 2)}


def answers(results: list[tuple[int, float]]) -> dict[str, Any]:
    took = [t for _, t in results]
    return {"answers": dict(Counter(str(s) for s, _ in results)),
            "request_p50_ms": ms(took, 50), "request_p99_ms": ms(took, 99)}


def flooded(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """The flood phase: slow connections, ordinary requests, status calls at once."""
    flood = start_flood(target.sla_socket, args.connections, args.seconds)
    time.sleep(1.0)
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(answers(
        ordinary_requests(target.sla_socket, args.requests))))
    t.start()
    calls = status_calls(target, args.calls)
    out, _ = flood.communicate(timeout=args.seconds + 60)
    t.join()
    return {**calls, **box, "flood": json.loads(out)}


def before(rev: str, args: argparse.Namespace) -> dict[str, Any]:
    """The flood phase against qosd as it was in ``rev``."""
    with tempfile.TemporaryDirectory(prefix="api-flood-before-") as d:
        tar = subprocess.run(["git", "archive", "--format=tar", rev, "qosd", "mmmesh"],
                             cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", d], input=tar, check=True)
        target = Target.start(nofile=args.nofile, source=Path(d))
        try:
            return {"rev": rev, **phase(target, lambda: flooded(target, args))}
        finally:
            target.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = Target.start(nofile=args.nofile)
    try:
        idle = phase(target, lambda: status_calls(target, args.calls))
        ordinary = phase(target, lambda: answers(
            ordinary_requests(target.sla_socket, args.requests)))
        flood = phase(target, lambda: flooded(target, args))
    finally:
        target.stop()
    for q in (50, 99):
        flood[f"status_p{q}_vs_idle"] = round(flood[f"status_p{q}_ms"] / idle[f"status_p{q}_ms"],
                                              2)
    res: dict[str, Any] = {"bench": "api_flood", "host": platform.node(), "python": platform.python_version(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "caps": {"sla.sock": SLA_MAX_CONNECTIONS,
                                         "admin": ADMIN_MAX_CONNECTIONS},
            "idle": idle, "ordinary": ordinary, "flood": flood}
    if args.before_rev:
        res["before"] = before(args.before_rev, args)
    return res


def table(res: dict[str, Any]) -> str:
    rows = [("phase", "seconds", "qosd CPU s", "fds max", "RSS MiB before/max/after",
             "status p50/p99 ms (failed)", "requests p50/p99 ms", "answers", "log lines")]
    for name in ("idle", "ordinary", "flood", "before"):
        if name not in res:
            continue
        p = res[name]
        rss = "/".join(f"{p[k] / 1024:.0f}" for k in ("rss_kib_before", "rss_kib_max",
                                                       "rss_kib_after"))
        st = (f"{p['status_p50_ms']}/{p['status_p99_ms']} ({p['status_failed']})"
              if "status_p50_ms" in p else "-")
        rq = f"{p['request_p50_ms']}/{p['request_p99_ms']}" if "answers" in p else "-"
        label = f"flood at {p['rev']}" if name == "before" else name
        rows.append((label, str(p["seconds"]), str(p["cpu_s"]),
                     f"{p['fds_before']}->{p['fds_max']}", rss, st, rq,
                     json.dumps(p.get("answers", {})), str(p["log_lines"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    f = res["flood"]
    lines.append(f"flood: {json.dumps(f['flood'])}; status under flood vs idle: "
                 f"p50 x{f['status_p50_vs_idle']}, p99 x{f['status_p99_vs_idle']}")
    if "before" in res:
        lines.append(f"flood at {res['before']['rev']}: {json.dumps(res['before']['flood'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--nofile", type=int, default=1024, help="qosd's descriptor limit")
    ap.add_argument("--before-rev", help="also flood qosd as it was in this git revision")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    res = run(args)
    print(table(res))
    write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
