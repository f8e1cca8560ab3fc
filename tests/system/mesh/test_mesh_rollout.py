"""Mesh-wide policy rollout across real qosd processes (issue 9, item 4): three
nodes in network namespaces on a bridge (testkit/netns_mesh.py), real gRPC with
mutual TLS, each qosd loading the real dataplane on its own ``eth0``.

* ``mmmeshctl policy apply -f p.yaml --cluster`` rolls a version out; every
  member ACKs, every kernel holds it (its policy version in the maps), and
  every node's table says so;
* a node whose own link (qosd.yaml ``mesh_link``) cannot carry the
  guarantees NACKs with the reason and keeps its previous version, while the
  others take the new one; the command says which (exit 3);
* two applies on two nodes at once converge to one version everywhere;
* a node-local apply under a mesh policy is refused (409 mesh_managed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.mesh_cases import (
    case_a_node_whose_link_cannot_carry_it_nacks,
    case_a_rollout_is_acked_by_every_member,
    case_concurrent_applies_converge_to_one_version,
)
from testkit.netns_mesh import Mesh
from testkit.privileged import require_privileged

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(300)]











@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    require_privileged()
    with Mesh(3, tmp_path_factory.mktemp("meshroll")) as m:
        m.wait_converged(30)
        yield m


def test_a_rollout_is_acked_by_every_member(mesh: Mesh, tmp_path: Path) -> None:
    case_a_rollout_is_acked_by_every_member(mesh, tmp_path)


def test_a_node_whose_link_cannot_carry_it_nacks(mesh: Mesh, tmp_path: Path) -> None:
    case_a_node_whose_link_cannot_carry_it_nacks(mesh, tmp_path)


def test_concurrent_applies_converge_to_one_version(mesh: Mesh, tmp_path: Path) -> None:
    case_concurrent_applies_converge_to_one_version(mesh, tmp_path)
