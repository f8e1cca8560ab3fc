#!/usr/bin/env python3
"""What ``mmmeshctl`` itself adds to an operator's command, as whole processes.

The issue's target is "policy apply latency (CLI call to kernel state changed)
p99 < 200 ms"; the daemon's side of an apply is ~80 ms, so the CLI's own
start-up (interpreter, imports, connecting) must stay small.  This starts the
real admin API of qosd (``qosd.api.create_app`` over the in-test
``StoreService`` of tests/qosd/test_api.py: a real PolicyStore, a pretend kernel),
served by ``qosd.api.bind_uds`` on a temporary unix socket in a background
thread of this process, and times ``--runs`` complete runs (process start to
exit, output checked) of:

  * ``python -c pass``                          the interpreter alone (same venv)
  * ``python -c "import httpx, typer, rich"``   the floor of the old CLI: what it
                                                imported before doing anything
  * ``mmmeshctl --socket S status -o json``
  * ``mmmeshctl --socket S policy validate -f examples/policy.yaml``
  * ``mmmeshctl --socket S policy apply -f examples/policy.yaml``
    (each run commits a new version in the temporary store)

``mmmeshctl`` is the console script next to this interpreter (``python -m
mmmeshctl`` when there is none).  With ``--before-rev REV`` the three CLI
commands are also timed with the ``mmmesh`` package as it is in git revision
REV (``git archive`` into a temporary directory, so nothing in the work tree
changes; ``mmmeshctl.py`` before the split, ``mmmeshctl/`` after it).  The
variants are interleaved run by run so that load on the machine hits all of
them alike; one untimed warm-up run each comes first.

Bytecode: an installed CLI runs from .pyc files (pip compiles them), while a
work tree under ``PYTHONDONTWRITEBYTECODE=1`` compiles mmmeshctl (~10 ms) on
every run.  By default (``--bytecode cache``) the children get a private
``PYTHONPYCACHEPREFIX`` in the temporary directory (filled by the warm-up
run), so every variant runs from bytecode as when installed and nothing is
written to the work tree; ``--bytecode env`` leaves the environment as it is.

Prints a table of p50/p99 ms and each p99 over ``python -c pass``'s (issue
18's target: ``mmmeshctl policy apply`` p99 <= 2x ``python -c pass``'s on the
same host), writes out/bench/ctl_startup.json (atomically).  With
``--callgrind``, each command is also run once under ``valgrind
--tool=callgrind`` (after its warm-up): the instructions it executes, a count
that a busy host does not move, and their ratio to ``python -c pass``'s.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.files import write_json
from qosd import api
from testkit.qosd_fake import StoreService

POLICY = ROOT / "examples" / "policy.yaml"
PY = sys.executable


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(ms: list[float]) -> dict[str, Any]:
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2), "min_ms": round(min(ms), 2),
            "max_ms": round(max(ms), 2)}


def ctl_argv() -> list[str]:
    script = Path(PY).parent / "mmmeshctl"
    if script.is_file() and os.access(script, os.X_OK):
        return [PY, str(script)]
    return [PY, "-m", "mmmeshctl"]


def before_argv(rev: str, tmp: Path) -> list[str]:
    """``mmmeshctl.main`` of git revision ``rev``: its ``mmmesh`` and
    ``mmmeshctl`` packages are extracted into ``tmp`` and imported from there,
    as the console script does."""
    dest = tmp / "before"
    # the CLI's own package (mmmeshctl/, once it left mmmesh/) and the library
    names = subprocess.run(["git", "ls-tree", "--name-only", rev], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    paths = [p for p in ("mmmesh", "mmmeshctl") if p in names]
    tar = subprocess.run(["git", "archive", "--format=tar", rev, *paths], cwd=ROOT,
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:  # our own repository's files
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # Python before 3.11.4
            tf.extractall(dest)
    # sys.argv[1:] are the CLI's arguments, as with the console script
    code = f"import sys; sys.path.insert(0, {str(dest)!r}); from mmmeshctl import main; main()"
    return [PY, "-c", code]


Check = Callable[[subprocess.CompletedProcess[str]], None]


def expect_ok(what: str) -> Check:
    def check(r: subprocess.CompletedProcess[str]) -> None:
        if r.returncode != 0 or (what and what not in r.stdout):
            raise SystemExit(f"unexpected result of {r.args}: exit {r.returncode}\n"
                             f"stdout: {r.stdout[:500]}\nstderr: {r.stderr[:500]}")
    return check


def expect_json(r: subprocess.CompletedProcess[str]) -> None:
    expect_ok("")(r)
    if json.loads(r.stdout).get("node") != "node-a":
        raise SystemExit(f"unexpected status: {r.stdout[:500]}")


def instructions(argv: list[str], env: dict[str, str], out: Path) -> int:
    """Instructions one run of ``argv`` executes (callgrind)."""
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv],
                   capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=300)
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no callgrind totals for {argv}")


def run(runs: int, before_rev: str | None, bytecode: str,
        callgrind: bool = False) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMMESH_")}
    with tempfile.TemporaryDirectory(prefix="ctl-startup-") as d:
        tmp = Path(d)
        if bytecode == "cache":
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        service = StoreService(tmp / "state")
        sock = tmp / "qosd.sock"
        server = api.bind_uds(api.create_app(service), sock)
        server.start_thread()
        try:
            variants: dict[str, tuple[list[str], Check]] = {
                "python -c pass": ([PY, "-c", "pass"], expect_ok("")),
                "import httpx, typer, rich (old floor)":
                    ([PY, "-c", "import httpx, typer, rich"], expect_ok("")),
            }
            clis = [("mmmeshctl", ctl_argv())]
            if before_rev:
                clis.insert(0, (f"mmmeshctl@{before_rev}", before_argv(before_rev, tmp)))
            for label, argv in clis:
                base = [*argv, "--socket", str(sock)]
                variants[f"{label} status -o json"] = ([*base, "status", "-o", "json"],
                                                       expect_json)
                variants[f"{label} policy validate"] = (
                    [*base, "policy", "validate", "-f", str(POLICY)], expect_ok(": valid: "))
                variants[f"{label} policy apply"] = (
                    [*base, "policy", "apply", "-f", str(POLICY), "--author", "bench"],
                    expect_ok("policy applied: version "))
            times: dict[str, list[float]] = {k: [] for k in variants}
            for i in range(runs + 1):  # run 0: warm-up, not counted
                for label, (argv, check) in variants.items():
                    t0 = time.perf_counter()
                    r = subprocess.run(argv, capture_output=True, text=True, env=env,
                                       cwd=ROOT, check=False, timeout=60)
                    dt = (time.perf_counter() - t0) * 1000.0
                    check(r)
                    if i:
                        times[label].append(dt)
            counted: dict[str, int] = {}
            if callgrind:
                for label, (argv, _) in variants.items():
                    counted[label] = instructions(argv, env, tmp / "callgrind.out")
        finally:
            server.stop()
    results = {k: {**stats(v), "samples_ms": [round(x, 2) for x in v]} for k, v in times.items()}
    floor = results["python -c pass"]
    for k, r in results.items():
        r["p99_vs_python"] = round(r["p99_ms"] / floor["p99_ms"], 2)
        r["p50_vs_python"] = round(r["p50_ms"] / floor["p50_ms"], 2)
        if counted:
            r["instructions"] = counted[k]
            r["instructions_vs_python"] = round(counted[k] / counted["python -c pass"], 2)
    return {"runs": runs, "ctl": " ".join(ctl_argv()[1:]), "before_rev": before_rev,
            "bytecode": bytecode, "load": os.getloadavg(), "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="timed runs per command")
    ap.add_argument("--before-rev", metavar="REV", default=None,
                    help="also time mmmeshctl as of this git revision (e.g. HEAD~1)")
    ap.add_argument("--bytecode", choices=("cache", "env"), default="cache",
                    help="cache: run from .pyc files in a private PYTHONPYCACHEPREFIX, as an "
                         "installed CLI does (default); env: the environment as it is")
    ap.add_argument("--callgrind", action="store_true",
                    help="also count each command's instructions once (valgrind callgrind)")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "ctl_startup.json"))
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    if a.before_rev and shutil.which("git") is None:
        ap.error("--before-rev needs git")

    r = run(a.runs, a.before_rev, a.bytecode, a.callgrind)
    load = r["load"]
    print(f"whole-process wall time, {a.runs} runs each (qosd API on a unix socket, "
          f"in-test StoreService; bytecode: {a.bytecode}); load average "
          f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    width = max(len(k) for k in r["results"]) + 2
    print(f"  {'command':<{width}}{'p50 ms':>9}{'p99 ms':>9}{'p99/pass':>10}"
          + (f"{'M instr':>10}{'/pass':>7}" if a.callgrind else ""))
    for label, s in r["results"].items():
        print(f"  {label:<{width}}{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}"
              f"{s['p99_vs_python']:>10.2f}"
              + (f"{s['instructions'] / 1e6:>10.0f}{s['instructions_vs_python']:>7.2f}"
                 if a.callgrind else ""))
    apply_r = r["results"]["mmmeshctl policy apply"]
    print(f"  target: mmmeshctl policy apply p99 <= 2x python -c pass: "
          f"{'PASS' if apply_r['p99_vs_python'] <= 2.0 else 'MISS'} "
          f"({apply_r['p99_vs_python']:.2f}x)")
    write_json(Path(a.out), {
        "bench": "ctl_startup",
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **r,
    })
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
