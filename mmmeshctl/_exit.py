"""Exit codes and the one way a command fails: a line on stderr, then the code."""

from __future__ import annotations

from typing import NoReturn

import typer

__all__ = ["EXIT", "PROG", "fail", "say"]

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


def say(message: str) -> None:
    """``mmmeshctl: message`` on stderr."""
    typer.echo(f"{PROG}: {message}", err=True)


def fail(code: int, message: str, details: list[str] | None = None) -> NoReturn:
    """One line to stderr (plus indented details), then exit with ``code``."""
    say(message)
    for line in details or []:
        typer.echo(f"  {line}", err=True)
    raise typer.Exit(code)
