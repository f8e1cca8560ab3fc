"""``mmmeshctl``: the operator's CLI for qosd, mmmesh's node daemon (kubectl-like).

It talks to qosd's admin API (qosd/api): on the node through the unix
socket (``--socket``, default /run/mmmesh/qosd.sock, root only), or from
elsewhere over TCP (``--server http://node:8470 --token T``).

Exit codes (distinct, for scripts):

    0  ok
    1  anything else (dataplane failure on the node, internal error, ...)
    2  usage error (bad options, unreadable file)
    3  the policy was rejected (HTTP 422: invalid, or not realisable on the node)
    4  conflict: the policy changed since --base-version (HTTP 409)
    5  qosd unreachable (no socket, connection refused, timeout)
    6  not found (no policy yet, no such version; HTTP 404)
    7  authentication failed (HTTP 401, or no permission on the socket)

The modules, one role each:

    _app.py      the typer app: global options, command groups, main()
    _policy.py   mmmeshctl policy apply|get|diff|validate|history|rollback
    _node.py     mmmeshctl status, mmmeshctl flows top
    _sla.py      mmmeshctl sla explain
    _cluster.py  mmmeshctl cluster members|certs
    _cluster_policy.py  mmmeshctl policy apply --cluster, policy rollout
    cluster_sla.py      mmmeshctl cluster sla (public: the demo prints the view with it)
    certs.py     the certificates of ``cluster certs`` (public: the demo issues its own)
    _client.py   qosd's API over http.client; HTTP errors -> exit codes
    render.py    JSON and rich tables of qosd's answers (public: the demo prints with it)
    _fast.py     option values without pydantic (typer's click classes)
    _exit.py     the exit codes and fail()

Why the package is frugal with imports
--------------------------------------
The latency an operator feels for a policy change is from typing
``mmmeshctl policy apply -f FILE`` to the kernel state being changed (the
target: p99 < 200 ms), and the CLI's own start-up is part of it.  The daemon's
side of an apply is ~80 ms; a whole ``mmmeshctl`` process used to take ~400 ms
(p50, against an API that answers at once), mostly imports: httpx ~130 ms,
the pydantic typer parses options with ~65 ms, rich ~25 ms.  Now ~120 ms, of
which the interpreter itself is ~50 ms.  So:

* HTTP is the standard library's ``http.client`` (a unix-socket connection
  subclass, plain/TLS connections for ``--server``), not httpx: one small
  JSON request per command needs no more.
* rich is imported only when something is printed as a table or in colour
  (never for ``-o json``/``-o yaml``, apply, validate, rollback).
* mmmesh.policy (pydantic) only for ``policy validate --local``.
* typer coerces option values with pydantic TypeAdapters (importing pydantic:
  the ~65 ms above); ``_fast.py`` gives the plain str/int/float/bool/Enum
  options a pydantic-free path for well-formed values and falls back to
  typer's own coercion (and its error messages) for everything else.

bench/ctl_startup.py measures whole ``mmmeshctl`` processes against qosd's API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._app import main
from ._exit import EXIT

if TYPE_CHECKING:
    import typer

    app: typer.Typer

__all__ = ["EXIT", "app", "main"]


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, built on first use (``_app.py``)
        from ._app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
