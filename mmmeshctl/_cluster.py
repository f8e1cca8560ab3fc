"""``mmmeshctl cluster members`` and ``mmmeshctl cluster certs``, on the
``cluster`` group of mmmeshctl/cluster_sla.py.

``members`` asks qosd (``GET /v1/cluster/members``) how it sees the mesh.
``certs`` needs no qosd: it writes a CA and one certificate and key per node
for test and lab set-ups (mmmeshctl/certs.py; docs/operations.md, "Peers",
tells how to issue real ones).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from ._client import conn_of
from ._exit import EXIT, fail
from ._fast import FastCommand
from .certs import issue_certs
from .cluster_sla import cluster_app
from .render import ListOutput, ListOutputOpt, console, print_json

__all__ = ["certs", "issue_certs", "members", "members_table"]

_NODE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


@cluster_app.command(cls=FastCommand, name="members")
def members(ctx: typer.Context, output: ListOutputOpt = ListOutput.table) -> None:
    """The members as this node sees them: state, incarnation, address, last
    ack, RTT; and this node's health score.

    [bold]Examples[/bold]

      mmmeshctl cluster members

      mmmeshctl cluster members -o json
    """
    doc = conn_of(ctx).request("GET", "/v1/cluster/members")
    if output is ListOutput.json:
        print_json(doc)
        return
    console().print(members_table(doc))


def _secs(v: Any, unit: str = "s") -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if unit == "ms" else f"{v:.1f} s ago"


def members_table(doc: dict[str, Any]) -> Any:
    """The members as a rich table, this node's health in the title."""
    from rich.table import Table

    counts: dict[str, int] = {}
    for m in doc["members"]:
        counts[m["state"]] = counts.get(m["state"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    table = Table(title=f"{doc['node']} at {doc['addr']}: {summary}; health score "
                        f"{doc['health_score']}, incarnation {doc['incarnation']}",
                  title_justify="left")
    for col in ("NODE", "STATE", "INC", "ADDRESS", "SINCE", "LAST ACK", "RTT"):
        table.add_column(col, justify="right" if col in ("INC", "RTT") else "left")
    styles = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
    for m in doc["members"]:
        me = " (this node)" if m["node"] == doc["node"] else ""
        table.add_row(m["node"] + me, f"[{styles.get(m['state'], '')}]{m['state']}[/]",
                      str(m["incarnation"]), m["addr"] or "-", _secs(m["since_s"]),
                      _secs(m["last_ack_s"]), _secs(m["rtt_s"], "ms"))
    return table


@cluster_app.command(cls=FastCommand, name="certs")
def certs(
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="directory to write to")],
    nodes: Annotated[str, typer.Option("--nodes", metavar="A,B,C",
                                       help="node ids (qosd's node_name), comma-separated")],
    trust_domain: Annotated[str, typer.Option("--trust-domain",
                                              help="peers.trust_domain")] = "mmmesh",
    days: Annotated[int, typer.Option("--days", min=1, max=3650,
                                      help="validity of every certificate")] = 365,
    force: Annotated[bool, typer.Option("--force", help="replace existing files")] = False,
) -> None:
    """A CA and one certificate and key per node, for test and lab set-ups
    (files 0600).  For production, issue them from your own CA: see
    docs/operations.md, "Peers".

    [bold]Examples[/bold]

      mmmeshctl cluster certs --out /etc/mmmesh/peers --nodes node-a,node-b,node-c
    """
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    bad = [n for n in names if len(n) > 253 or not _NODE.fullmatch(n)]
    if not names or bad:
        fail(EXIT.USAGE, f"--nodes: node ids must be DNS-1123 names (lower-case letters, "
                         f"digits, '-', '.'): {', '.join(bad) or 'none given'}")
    if len(set(names)) != len(names):
        fail(EXIT.USAGE, "--nodes: a node id is repeated")
    try:
        written = issue_certs(out, names, trust_domain=trust_domain, days=days, force=force)
    except FileExistsError as e:
        fail(EXIT.CONFLICT, str(e))
    typer.echo(f"wrote {len(written)} files to {out}: ca.pem (peers.ca_file), "
               f"<node>.pem / <node>.key (peers.cert_file / peers.key_file); "
               f"keep ca.key offline")
