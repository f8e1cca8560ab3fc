"""The quick path: ``mmmeshctl [--socket PATH] [--timeout S] policy apply -f FILE
[--author A] [--base-version N]`` on the node's unix socket, without typer.

Why: the latency an operator feels for a policy change is a whole
``mmmeshctl policy apply`` process, and its own work is small next to what
importing the CLI's libraries costs.  Counted with callgrind (instructions,
the same on a busy host as on an idle one): ``python -c pass`` 116 M, typer
+109 M, ``http.client`` +68 M (the unix socket no longer needs it:
``_client.py``); this path, with its imports, adds about a sixth of
``python -c pass`` (bench/ctl_startup.py, docs/benchmarks.md).

What it takes is exactly what the typer command takes for these words, and
it does exactly what that command does (``_apply.apply_policy``: the same
request, output, messages and exit codes).  Anything else -- ``--help``, an
option it does not know, a value that is not plainly well-formed, ``--server``
or a token, ``--cluster``, shell completion -- it leaves alone: ``run``
returns False and the typer app parses the command line as always, with its
own messages for what is wrong.  tests/mmmeshctl/test_ctl_quick.py holds the
two paths to the same results."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["parse", "run"]

_TIMEOUT_MIN = 0.1  # --timeout's min (_typer_app.py)


def _float(value: str) -> float | None:
    """A plain decimal (what mmmeshctl/_fast.py passes without typer), else None."""
    digits = value[1:] if value[:1] in ("+", "-") else value
    digits = digits.replace(".", "", 1)
    if not (digits.isascii() and digits.isdigit()):
        return None
    return float(value)


def _int(value: str) -> int | None:
    digits = value[1:] if value[:1] in ("+", "-") else value
    if not (digits.isascii() and digits.isdigit()):
        return None
    return int(value)


def _options(args: Sequence[str], names: Mapping[str, str]) -> tuple[dict[str, str], int] | None:
    """Leading ``--name value`` / ``--name=value`` / ``-f value`` options of
    ``args`` (``names``: spelling -> key); (values, where they end), or None
    for anything this path does not take (a repeat, a value that looks like
    an option, an option without its value)."""
    got: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        key = names.get(name)
        if key is None or key in got:
            return None
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
            i += 1
        if value.startswith("-") and value != "-":
            return None
        got[key] = value
        i += 1
    return got, i


def parse(argv: Sequence[str], env: Mapping[str, str]
          ) -> tuple[str, float, str, int | None, str | None] | None:
    """(socket, timeout, file, base version, author) when the quick path takes
    ``argv``, else None."""
    if env.get("MMMESH_SERVER") or env.get("MMMESH_TOKEN") or env.get("_MMMESHCTL_COMPLETE"):
        return None
    head = _options(argv, {"--socket": "socket", "--timeout": "timeout"})
    if head is None:
        return None
    glob, i = head
    if list(argv[i:i + 2]) != ["policy", "apply"]:
        return None
    tail = _options(argv[i + 2:], {"-f": "file", "--filename": "file", "--author": "author",
                                   "--base-version": "base"})
    if tail is None:
        return None
    opts, j = tail
    if i + 2 + j != len(argv) or "file" not in opts:
        return None
    from ._client import DEFAULT_SOCKET

    # (an option given wins, even empty; an empty variable counts as unset, as with click)
    socket = glob["socket"] if "socket" in glob else env.get("MMMESH_SOCKET") or DEFAULT_SOCKET
    timeout_text = glob["timeout"] if "timeout" in glob else env.get("MMMESH_TIMEOUT") or None
    timeout = 30.0
    if timeout_text is not None:
        t = _float(timeout_text)
        if t is None or t < _TIMEOUT_MIN:
            return None
        timeout = t
    base = None
    if "base" in opts:
        base = _int(opts["base"])
        if base is None or base < 0:
            return None
    return socket, timeout, opts["file"], base, opts.get("author")


def run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> bool:
    """Runs the command when this path takes it (it returns, or exits with the
    command's code); False when it does not (the typer app runs it)."""
    got = parse(argv, os.environ if env is None else env)
    if got is None:
        return False
    socket, timeout, path, base, author = got
    from ._apply import apply_policy, read_file
    from ._client import Conn

    text = read_file(path)
    apply_policy(Conn(socket=socket, timeout=timeout), text, base, author)
    return True
