"""Applying a policy file on one node (``mmmeshctl policy apply`` without
``--cluster``): read the file, PUT it, say what happened, and when the answer
was lost find out whether the apply went through.  Free of typer: the typer
command (``_policy.py``) and the quick path (``_quick.py``) both run it."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from ._client import Conn, RequestLost
from ._exit import EXIT, echo, fail

__all__ = ["OUTCOME_WAIT_S", "apply_outcome", "apply_policy", "default_author", "read_file"]

OUTCOME_WAIT_S = 30.0  # qosd restarts under systemd in a few seconds (RestartSec=2s)


def read_file(path: str) -> str:
    """The file's text ('-' = stdin); exit 2 when unreadable, 3 when not UTF-8."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        fail(EXIT.USAGE, f"error: cannot read {path}: {e.strerror or e}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(EXIT.REJECTED, f"error: policy rejected: {path} is not UTF-8 text "
                            f"({e.reason} at byte {e.start})")


def default_author() -> str:
    """``user@host``, the user who ran sudo when there is one."""
    import getpass
    import socket

    user = os.environ.get("SUDO_USER") or ""
    if not user:
        with contextlib.suppress(Exception):
            user = getpass.getuser()
    return f"{user or 'unknown'}@{socket.gethostname()}"


def apply_policy(conn: Conn, text: str, base_version: int | None, author: str | None) -> None:
    """PUT ``text`` as the node's next version and say so (see the module)."""
    body = {"yaml": text, "base_version": base_version, "author": author or default_author()}
    try:
        res = conn.request("PUT", "/v1/policy", json_body=body, may_be_lost=True)
    except RequestLost as lost:
        apply_outcome(conn, text, lost.reason)
    rec = res.get("reconcile") or {}
    echo(f"policy applied: version {res['version']} "
         f"(reconciled in {float(rec.get('duration_s', 0.0)) * 1000:.0f} ms)")
    if rec and not rec.get("ok", True):
        fail(EXIT.OTHER, f"warning: reconcile reported a problem: {rec.get('error')}")


def apply_outcome(conn: Conn, text: str, reason: str) -> NoReturn:
    """The connection broke after the policy was sent (qosd restarted, or the
    socket went away mid-answer): ask qosd, once it answers again, whether
    the policy in force is the one sent, and say which.  Exit 0 when it is,
    5 when it is not or qosd stays unreachable."""
    import time

    echo(f"warning: lost the connection to qosd during the apply ({reason}); "
         "checking whether it went through", err=True)
    deadline = time.monotonic() + OUTCOME_WAIT_S
    while True:
        diff = conn.try_request("POST", "/v1/policy/diff", json_body={"yaml": text})
        status = conn.try_request("GET", "/v1/status") if diff is not None else None
        if diff is not None and status is not None:
            cur = status.get("policy_version")
            break
        if time.monotonic() > deadline:
            fail(EXIT.UNREACHABLE, f"error: qosd did not answer again within "
                                   f"{OUTCOME_WAIT_S:g}s: whether the policy was applied "
                                   "is unknown (see mmmeshctl policy get)")
        time.sleep(0.5)
    if not diff.get("changed", True):
        echo(f"policy applied: version {cur} is current and is the policy sent "
             "(the answer was lost, the apply was not)")
        raise SystemExit(0)
    fail(EXIT.UNREACHABLE, f"error: the policy was NOT applied: version {cur} is still "
                           "current (qosd stopped before it committed the new one); "
                           "apply it again")
