"""``mmmeshctl status`` and ``mmmeshctl flows top``: what the node is doing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from ._client import conn_of
from ._fast import FastCommand, FastGroup
from .render import ListOutput, ListOutputOpt, console, flows_table, print_json, status_view

__all__ = ["flows_app", "status"]

flows_app = typer.Typer(help="The flows the dataplane sees.", no_args_is_help=True,
                        cls=FastGroup)


def status(ctx: typer.Context, output: ListOutputOpt = ListOutput.table) -> None:
    """The node: policy version, last reconcile, uplinks, store problems.

    [bold]Examples[/bold]

      mmmeshctl status

      mmmeshctl --server http://node1:8470 --token $TOKEN status -o json
    """
    st = conn_of(ctx).request("GET", "/v1/status")
    if output is ListOutput.json:
        print_json(st)
    else:
        console().print(status_view(st))


@flows_app.command(cls=FastCommand, name="top")
def flows_top(
    ctx: typer.Context,
    n: Annotated[int, typer.Option("-n", "--count", min=1, max=1000,
                                   help="how many flows")] = 20,
    watch: Annotated[bool, typer.Option("--watch/--once",
                                        help="refresh until Ctrl-C, or print once")] = True,
    interval: Annotated[float, typer.Option("--interval", min=0.1, metavar="SECONDS",
                                            help="refresh period")] = 1.0,
    output: Annotated[ListOutput, typer.Option("--output", "-o",
                                               help="json implies --once")] = ListOutput.table,
) -> None:
    """The busiest flows with their class and rate (live; --once for one table).

    [bold]Examples[/bold]

      mmmeshctl flows top

      mmmeshctl flows top -n 5 --once
    """
    conn = conn_of(ctx)

    def fetch() -> list[dict[str, Any]]:
        return list(conn.request("GET", "/v1/flows/top", params={"n": n}).get("flows", []))

    if output is ListOutput.json:
        print_json({"flows": fetch()})
        return
    where = conn.server or "this node"
    if not watch:
        console().print(flows_table(fetch(), where))
        return
    from rich.live import Live

    # qosd estimates rates between two samples: the first table shows 0
    with contextlib.suppress(KeyboardInterrupt), \
            Live(flows_table(fetch(), where), console=console(), auto_refresh=False,
                 screen=False) as live:
        for _ in _ticks(interval):
            live.update(flows_table(fetch(), where), refresh=True)


def _ticks(interval: float) -> Iterator[None]:
    """Forever: wait ``interval`` seconds, then yield (tests replace it)."""
    while True:
        time.sleep(interval)
        yield None
