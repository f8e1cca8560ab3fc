"""The global SLA view across real qosd processes (issue 9, item 3): three
nodes in network namespaces (testkit/netns_mesh.py), each told a different
voice window by a "sidecar" (a report on its admin socket, with a real
DDSketch); every node's ``GET /v1/cluster/sla`` must converge to the same
view: frames summed over the three, attainment frame-weighted, the global
p99 that of the union of all samples (merged sketches, never averaged
percentiles), the per-node breakdown; ``mmmeshctl cluster sla`` shows it.
A node that is killed leaves every view once it is declared dead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.mesh_cases import (
    case_a_dead_node_leaves_every_view,
    case_every_node_converges_to_the_same_global_view,
)
from testkit.netns_mesh import Mesh
from testkit.privileged import require_privileged

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(240)]







@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(3, tmp_path_factory.mktemp("meshsla")) as m:
        m.wait_converged(30)
        yield m


def test_every_node_converges_to_the_same_global_view(mesh: Mesh) -> None:
    case_every_node_converges_to_the_same_global_view(mesh)


def test_a_dead_node_leaves_every_view(mesh: Mesh) -> None:
    case_a_dead_node_leaves_every_view(mesh)
