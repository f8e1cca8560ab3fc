"""Every field of qosd.yaml is in docs/operations.md's configuration table,
with the default the schema has (an operator reads only docs/)."""

from __future__ import annotations

import re

from qosd.config import QosdConfig
from testkit import ROOT


def _table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Configuration", 1)[1].split("\n\n`socket_layer`", 1)[0]
    rows = {}
    for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \| (.+) \|$", section, re.M):
        rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_every_field_is_documented_and_nothing_else() -> None:
    assert set(_table()) == set(QosdConfig.model_fields)


def test_the_documented_scalar_defaults_are_the_schemas() -> None:
    rows = _table()
    for name, field in QosdConfig.model_fields.items():
        default = field.get_default(call_default_factory=False)
        if isinstance(default, bool):
            assert rows[name][0] == f"`{str(default).lower()}`", name
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert rows[name][0] == f"`{default:g}`", name
        elif default is None:
            assert rows[name][0] in ("none", "gossip"), name
