"""``mmmeshctl policy apply --cluster`` and ``mmmeshctl policy rollout``: a
mesh-wide policy rollout (docs/cluster.md, "Policy rollout") and its table.

``apply --cluster`` sends the policy to this node's qosd, which gives it the
next mesh version and gossips it; then it polls the rollout table until
every live member has answered (ACK or NACK), the version lost to a newer
one, or ``--timeout`` passed, prints the table and exits with:

    0  every live member ACKed the version
    3  some member NACKed it (it stays on its previous version; REASON says why)
    4  it was superseded: another node proposed a newer version meanwhile
    5  the timeout passed with members still pending (see mmmeshctl policy rollout)
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import typer

from ._client import Conn
from ._exit import EXIT, fail
from .render import _when, console, plain_table, print_json

__all__ = ["POLL_S", "apply_cluster", "outcome", "rollout_table", "show_rollout"]

POLL_S = 0.5
"""How often apply --cluster reads the table while it waits."""


def _sleep(seconds: float) -> None:  # tests replace it
    time.sleep(seconds)


def apply_cluster(conn: Conn, text: str, author: str, timeout: float) -> NoReturn:
    """``PUT /v1/cluster/policy``, wait, print the table, exit with its outcome."""
    table = conn.request("PUT", "/v1/cluster/policy", json_body={"yaml": text,
                                                                 "author": author})
    version = str(table["version"])
    typer.echo(f"mesh version {version}: rolling out to {table['live']} members "
               f"(waiting up to {timeout:g}s)", err=True)
    deadline = time.monotonic() + timeout
    while not table.get("complete") and time.monotonic() < deadline:
        _sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        table = conn.request("GET", "/v1/cluster/rollout", params={"version": version})
    console().print(rollout_table(table))
    code, message = outcome(table)
    if code != EXIT.OK:
        fail(code, message)
    typer.echo(message, err=True)
    raise typer.Exit(EXIT.OK)


def outcome(table: dict[str, Any]) -> tuple[int, str]:
    """The exit code and the line that explains it (see the module docstring)."""
    counts = table.get("counts") or {}
    version, live = table.get("version"), table.get("live", 0)
    if table.get("superseded_by"):
        return EXIT.CONFLICT, (f"error: mesh version {version} was superseded by "
                               f"{table['superseded_by']} (proposed elsewhere meanwhile); "
                               "every node moves to that one")
    nacked = counts.get("nacked", 0)
    if nacked:
        return EXIT.REJECTED, (f"error: mesh version {version}: {nacked} of {live} members "
                               "NACKed it and stay on their previous version (see REASON)")
    if not table.get("complete"):
        pending = counts.get("pending", 0)
        return EXIT.UNREACHABLE, (f"error: mesh version {version}: {pending} of {live} "
                                  "members have not answered yet; see mmmeshctl policy rollout")
    return EXIT.OK, f"mesh version {version}: ACKed by all {live} live members"


_STATE = {"acked": "ACK", "nacked": "NACK"}
_STYLE = {"acked": "green", "nacked": "red", "pending": "yellow", "superseded": "dim",
          "gone": "dim"}


def rollout_table(table: dict[str, Any]) -> Any:
    """A rich renderable: a header line and one row per member."""
    from rich.console import Group
    from rich.text import Text

    head = Text()
    head.append(f"mesh version {table.get('version')}", style="bold")
    sha = table.get("sha256")
    if sha:
        head.append(f"  sha256 {sha[:12]}")
    if table.get("author"):
        head.append(f"  by {table['author']}")
    if table.get("proposed_at"):
        head.append(f"  at {_when(table['proposed_at'])}")
    counts = table.get("counts") or {}
    head.append("\n" + ", ".join(f"{n} {state}" for state, n in counts.items() if n)
                + f" of {table.get('live', 0)} live members (as {table.get('node')} sees it)")
    if table.get("superseded_by"):
        head.append(f"\nsuperseded by {table['superseded_by']}", style="bold red")
    t = plain_table()
    for col in ("NODE", "VERSION", "STATE", "APPLIED", "REASON", "TIME"):
        t.add_column(col, overflow="fold" if col == "REASON" else "ellipsis")
    for row in table.get("rows") or []:
        state = str(row.get("state"))
        t.add_row(str(row.get("node")), row.get("version") or "-",
                  Text(_STATE.get(state, state), style=_STYLE.get(state, "")),
                  row.get("applied") or "-", row.get("reason") or "",
                  _when(row.get("time")))
    return Group(head, t)


def show_rollout(conn: Conn, version: str | None, as_json: bool) -> None:
    """``mmmeshctl policy rollout``: the table now (404, exit 6, before any version)."""
    params = {"version": version} if version else None
    table = conn.request("GET", "/v1/cluster/rollout", params=params)
    if as_json:
        print_json(table)
    else:
        console().print(rollout_table(table))
