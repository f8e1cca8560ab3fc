"""Shared test plumbing.

Tests that need root, BPF or namespaces call ``require_privileged()``: outside
CI they skip when the machine can't run them; with ``CI`` set they FAIL, so
CI never goes green by skipping the dataplane."""

from __future__ import annotations

import os

import pytest


def privileged_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (python3-bpfcc) is not importable"
    if not os.path.exists("/sys/kernel/btf/vmlinux") and not os.path.exists("/proc/config.gz"):
        pass  # not required; the loader reports what is missing
    return None


def require_privileged() -> None:
    problem = privileged_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"privileged test cannot run in CI: {problem}", pytrace=False)
    pytest.skip(problem)
