"""bench/cluster.py end to end at a small size: the JSON it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"nodes", "loss", "convergence_s_p99", "convergence_s_p9999", "detect_s_p50",
        "detect_s_p99", "false_positives", "bytes_per_node_per_s", "seed", "latency_ms",
        "crashes", "wall_s", "targets", "baseline", "ratios"}


def test_bench_prints_and_writes_one_json_object(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", "24", "--loss", "1%",
           "--seed", "3", "--crashes", "2", "--json", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    res = json.loads(done.stdout)
    assert KEYS <= res.keys()
    assert (res["nodes"], res["loss"], res["crashes"]) == (24, 0.01, 2)
    assert json.loads((tmp_path / "cluster-24-0.01.json").read_text()) == res
    assert res["warmup_converged"] and res["convergence_reached"] == 23
    assert 0 < res["convergence_s_p99"] <= res["convergence_s_p9999"] < 2.2
    assert res["false_positives"] == 0
    assert 0 < res["detect_s_p50"] <= res["detect_s_p99"] <= res["suspicion_max_s"] + 1
    assert 0 < res["bytes_per_node_per_s"] < 350_000 / 8
    assert all(res["targets"].values())


def test_bench_table_and_bad_arguments(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", "8", "--crashes", "1",
           "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert "PASS  no_false_positives" in done.stdout
    bad = subprocess.run(cmd[:2] + ["--nodes", "2"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 2 and "at least 4" in bad.stderr
