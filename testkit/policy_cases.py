"""The policy tests' shared cases: the shipped example as a mapping to
mutate, mutations, and the refusal check (tests/mmmesh/policy/test_policy.py,
tests/qosd/controller/test_controller_policy.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mmmesh.errors import PolicyError
from mmmesh.policy import load_policy, parse_policy
from testkit import ROOT

__all__ = ["DELETE", "EXAMPLE", "ROOT", "Mut", "example_doc", "refused",
           "rejected_with_field_named", "set_field"]

EXAMPLE = ROOT / "examples" / "policy.yaml"
Mut = Callable[[dict[str, Any]], None]
DELETE = object()
"""``set_field(path, DELETE)`` removes the field."""


def example_doc() -> dict[str, Any]:
    """The example as a plain mapping, to mutate."""
    return load_policy(EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)


def set_field(path: str, value: Any) -> Mut:
    """A mutation: the field at ``path`` ("classes.2.rate") set to ``value``."""
    def mut(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value

    return mut


def refused(data: Any) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(data)
    assert info.value.errors, "a PolicyError always lists what is wrong"
    return info.value.errors


def rejected_with_field_named(mutate: Mut, loc: str, fragment: str) -> None:
    """The example mutated by ``mutate`` is refused, naming ``loc`` with ``fragment``."""
    doc = example_doc()
    mutate(doc)
    errors = refused(doc)
    assert any(e_loc == loc and fragment in msg for e_loc, msg in errors), errors
    # the field is named in the exception's text as well
    with pytest.raises(PolicyError, match=r"^invalid policy: "):
        parse_policy(doc)
    assert loc in str(PolicyError(errors))
