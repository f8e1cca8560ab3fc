"""Scratch cgroups and a process placed in one, for the report-identity tests
(tests/qosd/test_report_identity.py, tests/system/qosd/test_report_hostile.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def process(uid: int = 0, cgroup: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping process of ``uid`` (in ``cgroup``, a cgroup v2 directory)."""
    code = "import os,sys,time\n" \
           "if sys.argv[2]: open(sys.argv[2] + '/cgroup.procs', 'w').write(str(os.getpid()))\n" \
           "u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u)\n" \
           "print('ready', flush=True); time.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code, str(uid), str(cgroup or "")],
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        yield p
    finally:
        p.kill()
        p.wait(10)


@contextlib.contextmanager
def cgroups(*paths: str) -> Iterator[dict[str, Path]]:
    """Creates cgroup v2 directories (as the kubelet or systemd would: root
    only); kills what is left in them and removes them afterwards."""
    if os.geteuid() != 0:
        pytest.fail("needs root to create cgroups") if os.environ.get("CI") else \
            pytest.skip("needs root to create cgroups")
    root, made = cgroup2_root(), []
    try:
        for p in paths:
            d = root / p.strip("/")
            d.mkdir(parents=True, exist_ok=True)
            made.append(d)
        yield {p: root / p.strip("/") for p in paths}
    finally:
        for d in sorted({a for m in made for a in [m, *m.parents] if root in a.parents},
                        key=lambda x: -len(x.parts)):
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


# --------------------------------------------------------------------------
# Real cgroups
# --------------------------------------------------------------------------
def cgroup2_root() -> Path:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            return Path(fields[4])
    pytest.fail("no cgroup v2 hierarchy is mounted")
