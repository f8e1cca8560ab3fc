"""The ``node`` fixture of the qosd system tests: testkit/qosd_node.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.qosd_node import Node, node_on


@pytest.fixture()
def node(tmp_path: Path) -> Iterator[Node]:
    with node_on(tmp_path) as n:
        yield n
