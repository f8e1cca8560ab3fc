"""``mmmeshctl cluster sla``: the global SLA view (``GET /v1/cluster/sla``).

``cluster_app`` is the ``mmmeshctl cluster`` group; ``cluster members``
(mmmeshctl/_cluster.py) joins it.  Tables need rich (imported when one is
printed); ``-o json`` loads nothing heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from ._client import conn_of
from ._fast import FastCommand, FastGroup
from .render import ListOutput, ListOutputOpt, console, plain_table, print_json

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

__all__ = ["cluster_app", "cluster_sla"]

cluster_app = typer.Typer(help="The mesh: its members and the global SLA view.",
                          no_args_is_help=True, cls=FastGroup)


@cluster_app.command(cls=FastCommand, name="sla")
def cluster_sla(
    ctx: typer.Context,
    nodes: Annotated[bool, typer.Option("--nodes", help="also each node's part of each class, "
                                                        "every node asked now (with -o json: "
                                                        "the breakdown)")] = False,
    node: Annotated[str | None, typer.Option("--node", help="also this node's part of each "
                                                            "class (asked of it now)")] = None,
    output: ListOutputOpt = ListOutput.table,
) -> None:
    """Per class and modality over every node: global p99 against its target,
    attainment, frames, nodes reporting (exit 1 when peers are not enabled).

    The view is aggregated per class (each node holds the classes' records,
    not every node's windows); the p99 comes from the nodes' sketches merged
    (never averaged); "12/14*" under NODES means 12 of the 14 nodes reporting
    had sent a sketch: the p99 is over those, and P99 RANGE bounds the p99 of
    all of them.  AGE is how old the newest window merged is.  --node X (or
    --nodes, up to 64 nodes) asks the nodes for their own part, now.

    [bold]Examples[/bold]

      mmmeshctl cluster sla

      mmmeshctl cluster sla --node node-17

      mmmeshctl cluster sla --nodes

      mmmeshctl --server http://node1:8470 --token $TOKEN cluster sla -o json
    """
    params = {"nodes": "true" if nodes else "false"}
    if node:
        params["node"] = node
    view = conn_of(ctx).request("GET", "/v1/cluster/sla", params=params)
    if output is ListOutput.json:
        print_json(view)
    else:
        console().print(cluster_sla_view(view, nodes=nodes or bool(node)))


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f} ms"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{float(v) * 100:.2f}%"


def cluster_sla_view(view: dict[str, Any], *, nodes: bool) -> Group:
    """The class table, then (``nodes``) one table per class of its nodes."""
    from rich.console import Group
    from rich.text import Text

    head = Text(f"global SLA view from {view.get('node')}: {view.get('nodes_reporting', 0)} of "
                f"{view.get('members', 0)} members reporting, "
                f"{view.get('nodes_with_sketches', 0)} with sketches")
    asked = view.get("breakdown_nodes") or {}
    if nodes and asked.get("asked"):
        head.append(f"; {asked.get('answered', 0)} of {asked.get('asked')} nodes answered"
                    + (" (the first 64)" if asked.get("truncated") else ""))
    parts: list[Any] = [head, _classes_table(view.get("classes") or [])]
    if nodes:
        one = asked.get("asked") == 1  # --node X: only the classes it has windows of
        for row in view.get("classes") or []:
            if not (one and not row.get("breakdown")):
                parts += [Text(""), _nodes_table(row)]
    return Group(*parts)


def _classes_table(rows: list[dict[str, Any]]) -> Table:
    from rich.text import Text

    t = plain_table()
    aged = any(r.get("age_s") is not None for r in rows)
    for col in ("CLASS", "MODALITY", "GLOBAL P99", "TARGET", "ATTAINMENT", "FRAMES", "NODES",
                "P99 RANGE", *(("AGE",) if aged else ())):
        t.add_column(col, justify="left" if col in ("CLASS", "MODALITY") else "right")
    for r in rows:
        meets = r.get("meets_target")
        p99 = Text(_ms(r.get("p99_ms")), style="red" if meets is False else "")
        rng = r.get("p99_range_ms")
        partial = "*" if r.get("partial") else ""
        cells: list[Text | str] = [str(r.get("sla_class")), str(r.get("modality")), p99,
                 _ms(r.get("target_p99_ms")), _pct(r.get("attainment")),
                 str(r.get("frames", 0)),
                 f"{r.get('sketch_nodes', 0)}/{r.get('nodes', 0)}{partial}",
                 f"{rng[0]:.1f}-{rng[1]:.1f} ms" if rng else "-"]
        if aged:
            age = r.get("age_s")
            cells.append("stale" if r.get("stale") else "-" if age is None else f"{age:.1f}s")
        t.add_row(*cells)
    if not rows:
        t.caption = "no node reports SLA windows"
    return t


def _nodes_table(row: dict[str, Any]) -> Table:
    t = plain_table(f"{row.get('sla_class')}/{row.get('modality')} per node")
    for col in ("NODE", "P99", "FROM", "ATTAINMENT", "FRAMES", "AGE", "STALE"):
        t.add_column(col, justify="left" if col in ("NODE", "FROM", "STALE") else "right")
    for n in row.get("breakdown") or []:
        t.add_row(str(n.get("node")), _ms(n.get("p99_ms")), str(n.get("quantiles") or "-"),
                  _pct(n.get("attainment")), str(n.get("frames", 0)),
                  f"{float(n.get('age_s') or 0):.1f}s", "stale" if n.get("stale") else "")
    return t
