"""``mmmesh`` console entry point.

Sub-command groups register themselves from their own modules so that the
heavy ones (bcc, pyroute2) are only imported when used:

    mmmesh wire encode|decode           mmmesh/_wirecli.py
    mmmesh dataplane up|down|status|classify   mmmesh/dataplane/_cli.py
    mmmesh demo                         mmmesh/demo/_cli.py
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import MeshError

# (command, module with register(subparsers) -> None, help)
_GROUPS = [
    ("wire", "mmmesh._wirecli", "encode and decode MMH headers"),
    ("dataplane", "mmmesh.dataplane._cli", "load, inspect and test the BPF dataplane"),
    ("demo", "mmmesh.demo._cli", "run the multi-node QoS demo in network namespaces"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    sub.required = True
    for name, module, help_ in _GROUPS:
        grp = sub.add_parser(name, help=help_)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:  # a group not built yet
            if not (e.name == module or module.startswith(f"{e.name}.")):
                raise
            grp.set_defaults(func=lambda _a, n=name: _missing(n))
            continue
        mod.register(grp)
    return parser


def _missing(name: str) -> int:
    print(f"mmmesh: '{name}' is not available in this build", file=sys.stderr)
    return 2


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
