"""Shared by the tests (moved from tests/mmmeshctl/test_ctl.py: test modules are not libraries)."""

from __future__ import annotations

ENV = {"COLUMNS": "200", "MMMESH_SOCKET": None, "MMMESH_SERVER": None, "MMMESH_TOKEN": None,
       "MMMESH_TIMEOUT": None}


# --------------------------------------------------------------------------
# Start-up cost (see the docstring of mmmeshctl/__init__.py)
# --------------------------------------------------------------------------
HEAVY = ("httpx", "httpcore", "rich", "pydantic", "yaml", "mmmesh.policy", "typer._adapters")


LOADED = (
    "import json, sys\n"
    "import mmmeshctl\n"
    "try:\n"
    "    mmmeshctl.main()\n"
    "finally:\n"
    "    print('\\nLOADED ' + json.dumps(sorted(m for m in sys.modules"
    f" if m.startswith({HEAVY!r}))), file=sys.stderr)\n"
)
