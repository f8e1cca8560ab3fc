"""The ``mmmeshctl`` typer app: global options, the command groups (built when
``mmmeshctl._app.app`` is first asked for: see ``_app.py``)."""

from __future__ import annotations

from typing import Annotated

import typer

from . import _cluster  # noqa: F401  (adds cluster members / certs to cluster_app)
from ._client import DEFAULT_SOCKET, Conn
from ._exit import PROG
from ._fast import FastCommand, FastGroup
from ._node import flows_app, status
from ._policy import policy_app
from ._sla import sla_app
from .cluster_sla import cluster_app

__all__ = ["app"]

app = typer.Typer(
    name=PROG,
    help=(
        "Operate mmmesh SLA policies and look at a node's dataplane through qosd.\n\n"
        "Talks to qosd on its unix socket (root), or over TCP with --server and --token.\n\n"
        "Exit codes: 0 ok, 1 other error, 2 usage, 3 policy rejected, 4 conflict, "
        "5 qosd unreachable, 6 not found, 7 authentication failed."
    ),
    epilog=(
        "[bold]Examples[/bold]\n\n"
        "  mmmeshctl policy apply -f policy.yaml\n\n"
        "  mmmeshctl policy get -o yaml\n\n"
        "  mmmeshctl policy history; mmmeshctl policy rollback --to 3\n\n"
        "  mmmeshctl flows top -n 10\n\n"
        "  MMMESH_TOKEN=... mmmeshctl --server http://node1:8470 status"
    ),
    no_args_is_help=True,
    cls=FastGroup,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(policy_app, name="policy")
app.command(cls=FastCommand, name="status")(status)
app.add_typer(flows_app, name="flows")
app.add_typer(cluster_app, name="cluster")
app.add_typer(sla_app, name="sla")


@app.callback()
def _global(
    ctx: typer.Context,
    socket_path: Annotated[str, typer.Option(
        "--socket", envvar="MMMESH_SOCKET", metavar="PATH",
        help="qosd's unix socket")] = DEFAULT_SOCKET,
    server: Annotated[str | None, typer.Option(
        "--server", envvar="MMMESH_SERVER", metavar="URL",
        help="qosd over TCP instead, e.g. http://node1:8470")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="MMMESH_TOKEN", metavar="TOKEN",
        help="bearer token for --server", show_default=False)] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, envvar="MMMESH_TIMEOUT", metavar="SECONDS",
        help="give up on qosd after this long")] = 30.0,
) -> None:
    conn = Conn(socket=socket_path, server=server or None, token=token or None, timeout=timeout)
    ctx.obj = conn
    ctx.call_on_close(conn.close)
