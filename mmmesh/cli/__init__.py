"""``mmmesh`` console entry point.

Each sub-command group adds its commands from its own module; the heavy
imports (bcc, pyroute2) happen inside the commands that need them, so
building the parser stays cheap:

    mmmesh wire encode|decode                   mmmesh/cli/wire.py
    mmmesh dataplane up|down|status|classify    mmmesh/cli/dataplane.py

The demo is an application of its own (``mmmesh-demo``, demo/cli.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from mmmesh.errors import MeshError

from . import dataplane as _dataplane_cli
from . import wire as _wirecli

# (command, register(parser) adding its sub-commands, help)
_GROUPS: list[tuple[str, Callable[[argparse.ArgumentParser], None], str]] = [
    ("wire", _wirecli.register, "encode and decode MMH headers"),
    ("dataplane", _dataplane_cli.register, "load, inspect and test the BPF dataplane"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    sub.required = True
    for name, register, help_ in _GROUPS:
        register(sub.add_parser(name, help=help_))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except MeshError as e:
        print(f"mmmesh: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
