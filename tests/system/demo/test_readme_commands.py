"""The README's two commands: exactly what .ci/run calls, no sudo needed on a
root shell, and re-run through sudo for another user."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Two commands", 1)[1].split("```", 2)[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_two_commands_need_no_sudo_and_ci_runs_the_second() -> None:
    assert readme_commands() == ["./scripts/demo.sh", "./scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./scripts/test\.sh$", ci, re.M)
    for script in ("demo.sh", "test.sh", "bootstrap.sh"):
        assert "as-root.sh" in (ROOT / "scripts" / script).read_text(), script


def test_as_root_helper_without_and_with_sudo() -> None:
    """As root the helper lets the script run on (no sudo on PATH needed); as
    another user without sudo it stops with a clear message; with sudo it
    re-runs the script through it."""
    if os.geteuid() != 0:
        pytest.skip("switches users: needs root")
    work = Path(tempfile.mkdtemp(prefix="mmmesh-asroot-"))  # readable by nobody too
    try:
        work.chmod(0o755)
        shutil.copy(ROOT / "scripts" / "as-root.sh", work / "as-root.sh")
        probe = work / "probe.sh"
        probe.write_text('#!/bin/bash\n. "$(dirname "$0")/as-root.sh" "$0" "$@"\n'
                         'echo "ran as $(id -u) $*"\n')
        for f in (probe, work / "as-root.sh"):
            f.chmod(0o755)
        out = subprocess.run([str(probe), "a", "b"], capture_output=True, text=True,
                             env={"PATH": "/bin"}, check=True)
        assert out.stdout.strip() == "ran as 0 a b"
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        # another user, no sudo: a clear error, the script body never runs
        r = subprocess.run([*nobody, str(probe)], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 1 and "run as root" in r.stderr and "ran as" not in r.stdout, r
        # another user with a sudo on PATH: it is asked to re-run the script
        fake = work / "bin"
        fake.mkdir(mode=0o755)
        (fake / "sudo").write_text('#!/bin/bash\necho "sudo $*"\n')
        (fake / "sudo").chmod(0o755)
        r = subprocess.run([*nobody, str(probe), "x"], capture_output=True, text=True,
                           env={"PATH": f"{fake}:/usr/bin:/bin"})
        assert r.stdout.strip() == f"sudo --preserve-env=CI {probe} x", r
    finally:
        shutil.rmtree(work)
