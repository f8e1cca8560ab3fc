"""Exit codes and the one way a command fails: a line on stderr, then the code.

Free of typer: the quick path (``_quick.py``) runs without it.  Inside the
typer app (typer imported) the lines go out with ``typer.echo`` and a failure
is ``typer.Exit``, as before; without it, plain writes and ``SystemExit``
(the same text and exit code)."""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["EXIT", "PROG", "echo", "fail", "say"]

PROG = "mmmeshctl"


class EXIT:
    """The exit codes, distinct for scripts (listed in ``mmmeshctl --help``)."""

    OK = 0
    OTHER = 1
    USAGE = 2
    REJECTED = 3
    CONFLICT = 4
    UNREACHABLE = 5
    NOT_FOUND = 6
    AUTH = 7


def echo(message: str = "", *, err: bool = False, nl: bool = True) -> None:
    """``typer.echo`` when the typer app runs, else a plain write (and flush)."""
    if "typer" in sys.modules:
        import typer

        typer.echo(message, err=err, nl=nl)
        return
    stream = sys.stderr if err else sys.stdout
    stream.write(message + ("\n" if nl else ""))
    stream.flush()


def say(message: str) -> None:
    """``mmmeshctl: message`` on stderr."""
    echo(f"{PROG}: {message}", err=True)


def fail(code: int, message: str, details: list[str] | None = None) -> NoReturn:
    """One line to stderr (plus indented details), then exit with ``code``."""
    say(message)
    for line in details or []:
        echo(f"  {line}", err=True)
    if "typer" in sys.modules:
        import typer

        raise typer.Exit(code)
    raise SystemExit(code)
