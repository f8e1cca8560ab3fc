"""``mmmeshctl``'s entry point: the quick path, else the typer app.

``main`` first offers the command line to ``_quick.run`` (``policy apply``
on the node's unix socket, the command an operator's policy change takes, is
run there without importing typer: see ``_quick.py``); anything it does not
take goes to the typer app (``_typer_app.py``), built on first use: ``app``
here is that app (``mmmeshctl._app.app``, ``mmmeshctl.app``)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from ._exit import PROG, say

if TYPE_CHECKING:
    import typer

    app: typer.Typer

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from ._typer_app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console entry point (``mmmeshctl``)."""
    try:
        from ._quick import run

        if run(sys.argv[1:]):
            return
        from ._typer_app import app

        app(prog_name=PROG)
    except KeyboardInterrupt:
        say("interrupted")
        raise SystemExit(130) from None
    except BrokenPipeError:  # mmmeshctl ... | head
        with contextlib.suppress(OSError):
            sys.stdout.close()
        raise SystemExit(0) from None
