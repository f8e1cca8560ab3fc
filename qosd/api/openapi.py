"""The admin API's OpenAPI document, and the command that writes it:

    python -m qosd.api --openapi docs/api/openapi.json   (or '-' for stdout)

docs/api/openapi.json is checked in and a test keeps it equal to
:func:`openapi_text`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mmmesh.files import write_atomic

from .app import create_app


class _NoService:
    """Stands in for the service when only the OpenAPI document is wanted."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(f"_NoService.{name} called: this app only describes the API")


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the admin API."""
    return create_app(_NoService()).openapi()


def openapi_text() -> str:
    """:func:`openapi_document` as the checked-in file holds it: indented JSON, UTF-8."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"


def write_openapi(path: str | os.PathLike[str]) -> None:
    """Writes the OpenAPI document (JSON) to ``path`` atomically (mode 0644)."""
    write_atomic(path, openapi_text().encode(), mode=0o644)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qosd.api",
                                     description="writes qosd's admin API OpenAPI document")
    parser.add_argument("--openapi", metavar="FILE", required=True,
                        help="write the OpenAPI document (JSON) to FILE ('-' = stdout)")
    args = parser.parse_args(argv)
    if args.openapi == "-":
        sys.stdout.write(openapi_text())
    else:
        write_openapi(args.openapi)
    return 0
