"""``mmmeshctl policy ...``: validate, apply, diff, get, history, rollback; and
mesh-wide (``apply --cluster``, ``rollout``: mmmeshctl/_cluster_policy.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ._apply import apply_policy, default_author, read_file
from ._client import conn_of
from ._cluster_policy import apply_cluster, show_rollout
from ._exit import EXIT, fail
from ._fast import FastCommand, FastGroup
from .render import (
    ListOutput,
    ListOutputOpt,
    Output,
    console,
    diff_view,
    history_table,
    policy_view,
    print_json,
)

__all__ = ["policy_app"]

policy_app = typer.Typer(
    help="Validate, apply, diff, inspect and roll back SLA policies.",
    no_args_is_help=True, cls=FastGroup,
)

FileOpt = Annotated[str, typer.Option("--filename", "-f", metavar="FILE",
                                      help="policy YAML file ('-' = stdin)")]
BaseOpt = Annotated[int | None, typer.Option(
    "--base-version", min=0, metavar="N",
    help="refuse (exit 4) unless the current version is still N (0 = none yet)")]
AuthorOpt = Annotated[str | None, typer.Option(
    "--author", help="recorded with the version \\[default: user@host]")]


# (typer-free, shared with the quick path: mmmeshctl/_apply.py)
_read_file = read_file
_default_author = default_author


@policy_app.command(cls=FastCommand, name="apply")
def policy_apply(
    ctx: typer.Context,
    filename: FileOpt,
    base_version: BaseOpt = None,
    author: AuthorOpt = None,
    cluster: Annotated[bool, typer.Option(
        "--cluster", help="roll it out to every member of the mesh and wait for their "
                          "ACK/NACK (exit 0 all ACK, 3 a NACK, 4 superseded, 5 timeout)")] = False,
    wait: Annotated[float, typer.Option(
        "--timeout", min=0.0, metavar="SECONDS",
        help="with --cluster: wait this long for every member's answer")] = 30.0,
) -> None:
    """Apply a policy file as a new version (validated whole, then reconciled).

    [bold]Examples[/bold]

      mmmeshctl policy apply -f examples/policy.yaml

      mmmeshctl policy apply -f edited.yaml --base-version 3   [dim]# exit 4 if someone was faster[/dim]

      mmmeshctl policy apply -f policy.yaml --cluster --timeout 60   [dim]# the whole mesh[/dim]
    """
    text = _read_file(filename)
    if cluster:
        if base_version is not None:
            fail(EXIT.USAGE, "error: --base-version is a node's version; with --cluster "
                             "use the API's base_version (a mesh version, e.g. 12@node-a)")
        apply_cluster(conn_of(ctx), text, author or _default_author(), wait)
    apply_policy(conn_of(ctx), text, base_version, author)


@policy_app.command(cls=FastCommand, name="get")
def policy_get(
    ctx: typer.Context,
    output: Annotated[Output, typer.Option("--output", "-o", help="output format")] =
    Output.table,
    version: Annotated[int | None, typer.Option(
        "--version", min=1, metavar="N", help="a stored version instead of the current")] = None,
) -> None:
    """Show the current policy (or a stored --version).

    [bold]Examples[/bold]

      mmmeshctl policy get

      mmmeshctl policy get -o yaml > policy.yaml   [dim]# edit, then apply -f[/dim]

      mmmeshctl policy get --version 2 -o json
    """
    path = "/v1/policy" if version is None else f"/v1/policy/versions/{version}"
    doc = conn_of(ctx).request("GET", path)
    if output is Output.json:
        print_json(doc)
    elif output is Output.yaml:
        typer.echo(f"# policy version {doc['version']}, sha256 {doc['sha256'][:16]}", nl=True)
        typer.echo(doc["yaml"], nl=False)
    else:
        console().print(policy_view(doc))


@policy_app.command(cls=FastCommand, name="diff")
def policy_diff(ctx: typer.Context, filename: FileOpt) -> None:
    """Show what applying a file would change (unified diff of the canonical YAML).

    [bold]Example[/bold]

      mmmeshctl policy diff -f edited.yaml
    """
    text = _read_file(filename)
    res = conn_of(ctx).request("POST", "/v1/policy/diff", json_body={"yaml": text})
    if not res.get("changed"):
        typer.echo("no changes", err=True)
        return
    console().print(diff_view(str(res["diff"])))


@policy_app.command(cls=FastCommand, name="validate")
def policy_validate(
    ctx: typer.Context,
    filename: FileOpt,
    local: Annotated[bool, typer.Option(
        "--local", help="check the schema here, without qosd (not whether the node can "
                        "realise it)")] = False,
) -> None:
    """Check a policy file without applying it (exit 3 with every problem when invalid).

    [bold]Examples[/bold]

      mmmeshctl policy validate -f policy.yaml

      mmmeshctl policy validate --local -f policy.yaml   [dim]# no daemon needed[/dim]
    """
    text = _read_file(filename)
    if local:  # mmmesh.policy imports pydantic: only here
        from mmmesh.errors import PolicyError
        from mmmesh.policy import parse_policy

        try:
            pol = parse_policy(text, source=filename)
        except PolicyError as e:
            n = len(e.errors)
            fail(EXIT.REJECTED, f"error: policy rejected: {n} problem{'s' if n != 1 else ''}",
                 [f"{loc}: {msg}" if loc else msg for loc, msg in e.errors])
        classes = [c.name for c in pol.classes]
        link, rate = pol.link.device, str(pol.link.rate)
    else:
        res = conn_of(ctx).request("POST", "/v1/policy/validate", json_body={"yaml": text})
        p = res["policy"]
        classes = [str(c["name"]) for c in p["classes"]]
        link, rate = p["link"]["device"], str(p["link"]["rate"])
    typer.echo(f"{filename}: valid: {len(classes)} classes ({', '.join(classes)}) on {link} "
               f"at {rate}")


@policy_app.command(cls=FastCommand, name="history")
def policy_history(ctx: typer.Context, output: ListOutputOpt = ListOutput.table) -> None:
    """List the stored policy versions, newest first (* = current).

    [bold]Example[/bold]

      mmmeshctl policy history
    """
    conn = conn_of(ctx)
    res = conn.request("GET", "/v1/policy/history")
    if output is ListOutput.json:
        print_json(res)
        return
    if not res.get("versions"):
        typer.echo("no policy versions yet", err=True)
        return
    current = conn.request("GET", "/v1/status").get("policy_version")
    console().print(history_table(res["versions"], current))


@policy_app.command(cls=FastCommand, name="rollout")
def policy_rollout(
    ctx: typer.Context,
    version: Annotated[str | None, typer.Option(
        "--version", metavar="VERSION", help="a mesh version (12@node-a) instead of the "
                                            "desired one")] = None,
    output: ListOutputOpt = ListOutput.table,
) -> None:
    """The mesh-wide rollout: each member's ACK/NACK of the desired mesh version.

    [bold]Examples[/bold]

      mmmeshctl policy rollout

      mmmeshctl policy rollout --version 12@node-a -o json
    """
    show_rollout(conn_of(ctx), version, output is ListOutput.json)


@policy_app.command(cls=FastCommand, name="rollback")
def policy_rollback(
    ctx: typer.Context,
    to: Annotated[int, typer.Option("--to", min=1, metavar="VERSION",
                                    help="the version whose policy to apply again")],
    base_version: BaseOpt = None,
    author: Annotated[str | None, typer.Option("--author")] = None,
) -> None:
    """Apply an earlier version's policy again, as a new version.

    [bold]Examples[/bold]

      mmmeshctl policy history

      mmmeshctl policy rollback --to 3

      mmmeshctl policy rollback --to 3 --base-version 5
    """
    body = {"to_version": to, "base_version": base_version,
            "author": author or _default_author()}
    res = conn_of(ctx).request("POST", "/v1/policy/rollback", json_body=body)
    typer.echo(f"rolled back to version {to}: now version {res['version']}")
