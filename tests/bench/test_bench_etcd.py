"""bench/etcd_rollout.py end to end at a small size, on a real 3-member etcd:
the JSON it promises, every watcher's ACK of every rollout, SLA writes that
reach etcd and its watchers, and bad arguments refused by name.  Timings are
the bench's business, not asserted here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "etcd_rollout.py"

pytestmark = pytest.mark.timeout(240)


def test_twenty_watchers_all_ack_and_publish(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (scripts/bootstrap.sh)")
    cmd = [sys.executable, str(BENCH), "--sizes", "20", "--gossip-sizes", "20", "--procs", "2",
           "--rollouts", "2", "--sla-period", "1", "--sla-seconds", "3", "--sla-watchers", "3",
           "--json", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout)
    assert json.loads((tmp_path / "etcd-rollout.json").read_text()) == res
    assert {"apply_ms", "sla_period_s", "etcd", "gossip", "target_p99_le_2s_at_1000",
            "wall_s", "loadavg_start", "loadavg_end"} <= res.keys()
    assert res["target_p99_le_2s_at_1000"] is None  # no 1000-node run
    (e,) = res["etcd"]
    ro, sla = e["rollout"], e["sla"]
    assert e["nodes"] == 20 and e["procs"] == 2
    # every watcher ACKed the cold rollout and both warm ones
    assert ro["missing"] == 0 and ro["cold"]["missing"] == 0 and ro["acks"] == 2 * 20
    assert len(ro["runs"]) == 2
    assert 0 < ro["p50_s"] <= ro["p99_s"] <= ro["all_s"]
    assert ro["p50_s"] >= res["apply_ms"] / 1000  # no ACK before the realisation
    # 20 nodes every second: writes reach etcd, and its watchers
    assert sla["expected_per_s"] == 20.0 and sla["writes_per_s"] > 5
    assert sla["watchers"] == 3 and sla["events_per_watcher_per_s"] > 5
    assert sla["bytes_per_write"] > 400  # 4 windows with sketches, not empty publications
    assert sla["etcd_db_bytes"] > 0 and sla["view_merge_ms"] > 0
    assert sla["etcd_cores"] > 0 and sla["etcd_us_per_delivery"] is not None
    assert e["errors"]["relists_compacted"] == 0
    (g,) = res["gossip"]
    assert g["nodes"] == 20 and g["applied"] == 20
    assert 0 < g["applied_p50_s"] <= g["applied_p99_s"] <= g["applied_all_s"]
    assert g["every_table_s"] is not None and g["sla_digest_interval_s"] >= 5.0


@pytest.mark.parametrize(("args", "field"), [
    (["--sizes", "0"], "--sizes"), (["--sizes", "ten"], "--sizes"),
    (["--gossip-sizes", "99999"], "--gossip-sizes"), (["--procs", "0"], "--procs"),
    (["--sla-period", "0"], "--sla-period"),
])
def test_bad_arguments_name_the_field(args: list[str], field: str) -> None:
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and field in r.stderr, r.stderr
