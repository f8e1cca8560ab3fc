"""Shared test plumbing.

Tests that need root, BPF or namespaces call ``require_privileged()``.  They
FAIL instead of skipping when ``CI`` is set or when the suite runs as root
(the README's test command runs as root: a root run that cannot load BPF is
broken, not excused); only a non-root run outside CI skips them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
    if os.environ.get("CI") or os.geteuid() == 0:
        pytest.fail(f"privileged test cannot run here: {problem}", pytrace=False)
    pytest.skip(problem)


@contextmanager
def veth_pair(prefix: str, net: str) -> Iterator[tuple[str, str]]:
    """Namespaces ``<prefix>-a`` and ``<prefix>-b`` joined by a0 <-> b0 with
    ``<net>.1/24`` and ``<net>.2/24``; the dataplane on a0 and both namespaces
    are removed afterwards, also on failure."""
    from demo import netlab
    from mmmesh.dataplane import Dataplane

    a, b = f"{prefix}-a", f"{prefix}-b"
    netlab.create_netns(a)
    netlab.create_netns(b)
    try:
        with netlab.Lab(a) as n:
            n.add_veth("a0", "b0", b)
            n.loopback_up()
            n.configure("a0", f"{net}.1/24")
        with netlab.Lab(b) as n:
            n.loopback_up()
            n.configure("b0", f"{net}.2/24")
        yield a, b
    finally:
        try:
            Dataplane("a0", a).down()
        except Exception:
            pass
        netlab.remove_netns(a)
        netlab.remove_netns(b)
