"""Fixtures every part's tests share (the harnesses themselves are in testkit/)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from mmmesh.policy import Policy, load_policy
from testkit.policy_cases import EXAMPLE

# No hypothesis test has a per-example time limit: how long an example takes is
# the host's speed (a 200 ms deadline failed at load 20), not the property.
settings.register_profile("mmmesh", deadline=None)
settings.load_profile("mmmesh")


@pytest.fixture(scope="module")
def example() -> Policy:
    """The shipped example policy (examples/policy.yaml)."""
    return load_policy(EXAMPLE)
