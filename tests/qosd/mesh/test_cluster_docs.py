"""docs/cluster.md's table of the membership timers at N members is what the
core computes (an operator sizes detection bounds from it)."""

from __future__ import annotations

import re

from qosd.mesh.membership.core import Config
from testkit import ROOT


def test_the_timer_table_is_the_cores() -> None:
    text = (ROOT / "docs" / "cluster.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) s \| ([\d.]+) s \| (\d+) \| (\d+) \| ([\d.]+) s \|$",
                      text, re.M)
    assert [int(r[0]) for r in rows] == [5, 20, 100, 1000]
    cfg = Config()
    for n, lo, hi, k, retransmits, push_pull in rows:
        n_ = int(n)
        assert abs(cfg.suspicion_min_s(n_) - float(lo)) < 0.05, (n, lo)
        assert abs(cfg.suspicion_max_s(n_) - float(hi)) < 0.3, (n, hi)
        assert cfg.suspicion_k(n_) == int(k), (n, k)
        assert cfg.retransmit_limit(n_) == int(retransmits), (n, retransmits)
        assert cfg.push_pull_s(n_) == float(push_pull), (n, push_pull)
