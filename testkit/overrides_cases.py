"""The example policy on a test device, for the override tests
(tests/system/dataplane/test_overrides_*.py)."""

from __future__ import annotations

from mmmesh.policy import Policy, load_policy, parse_policy
from testkit import ROOT
from testkit.overrides import with_adapt


def example_on(dev: str, drop: str | None = None) -> Policy:
    data = load_policy(ROOT / "examples" / "policy.yaml").model_dump(mode="json", by_alias=True)
    data["link"] = {"device": dev, "rate": "500mbit"}
    data["classes"] = [c for c in data["classes"] if c["name"] != drop]
    return with_adapt(parse_policy(data), {"lidar": {"weight": [5, 15]}})
