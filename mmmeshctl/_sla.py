"""``mmmeshctl sla explain``: what the SLA controller decided and why
(``GET /v1/sla/explain``; docs/controller.md)."""

from __future__ import annotations

import typer

from ._client import conn_of
from ._fast import FastCommand, FastGroup
from .render import ListOutput, ListOutputOpt, print_json

__all__ = ["sla_app", "sla_explain"]

sla_app = typer.Typer(help="The SLA controller of this node.", no_args_is_help=True,
                      cls=FastGroup)


@sla_app.command(cls=FastCommand, name="explain")
def sla_explain(ctx: typer.Context, output: ListOutputOpt = ListOutput.table) -> None:
    """Per class: measured p99 and attainment against the objective, the
    parameters in force against the policy's, the state (steady, increasing,
    decaying, blackout, frozen, stale), and the last decisions with their
    reasons.

    [bold]Examples[/bold]

      mmmeshctl sla explain

      mmmeshctl sla explain -o json
    """
    data = conn_of(ctx).request("GET", "/v1/sla/explain")
    if output is ListOutput.json:
        print_json(data)
        return
    if data.get("note"):
        typer.echo(data["note"])
    typer.echo(str(data.get("text", "")).rstrip())
