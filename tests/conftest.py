"""Fixtures every part's tests share (the harnesses themselves are in testkit/)."""

from __future__ import annotations

import pytest

from mmmesh.policy import Policy, load_policy
from testkit.policy_cases import EXAMPLE


@pytest.fixture(scope="module")
def example() -> Policy:
    """The shipped example policy (examples/policy.yaml)."""
    return load_policy(EXAMPLE)
