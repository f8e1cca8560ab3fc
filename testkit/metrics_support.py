"""Shared by tests/system/qosd/test_metrics.py and test_prometheus_scrape.py:
qosd's metrics without a kernel (a fake dataplane, ``DataplaneReader``, and SLA
boards with known contents) and the Prometheus tools (``promtool``,
``prometheus``, Debian's package, installed by scripts/bootstrap.sh).

A :class:`FakeDataplane` answers ``stats()`` and ``htb_classes()`` from a few
numbers; its counters grow on every read, so a Prometheus scraping it sees
rates.  Its classifier counters keep the kernel's invariant: the partition
reasons and the class counters count the same packets."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from ddsketch import DDSketch

from mmmesh import abi
from mmmesh.dataplane import DataplaneStats, DirectionCounters, FlowCensus, HtbClassStats
from mmmesh.errors import DataplaneError
from mmmesh.sla.report import SlaReport
from mmmesh.sla.sketch import encode_sketch
from qosd.metrics import DataplaneFactory, Target
from qosd.sla.board import SlaBoard

# the example policy's classes
CLASS_NAMES = {10: "control", 11: "voice", 12: "video", 13: "lidar", 14: "best-effort"}
HTB_LINK = (abi.HTB_MAJOR << 16) | abi.MAX_CLASSES


@dataclass
class FakeDataplane:
    """One device's dataplane: policy ``version``, ``flows`` of ``capacity``
    in the flow table, ``step`` packets per class and read; ``up=False``:
    nothing pinned."""

    iface: str
    version: int = 1
    flows: int = 0
    capacity: int = 65536
    step: int = 100
    up: bool = True
    reads: int = 0
    pin_dir: str = field(init=False)

    def __post_init__(self) -> None:
        self.pin_dir = f"/fake/bpf/{self.iface}"

    def stats(self) -> DataplaneStats:
        if not self.up:
            raise DataplaneError(f"no dataplane pinned at {self.pin_dir}")
        self.reads += 1
        n = self.reads * self.step
        # per class n packets: 2 parsed + 1 flow hit + 1 not mesh in every 4
        classes = {cid: (n, n * 500) for cid in CLASS_NAMES}
        total = n * len(CLASS_NAMES)
        reasons = {"parsed": total // 2, "flow_hit": total // 4, "malformed": 0,
                   "not_mesh": total - total // 2 - total // 4,
                   "clamped": n // 10, "flow_new": n // 20, "flow_update": 0,
                   "dscp_rewrite": total}
        counters = {"egress": DirectionCounters(reasons, classes),
                    "ingress": DirectionCounters({r: 0 for r in reasons}, {})}
        by_class = {12: self.flows // 2, 13: self.flows - self.flows // 2}
        return DataplaneStats(self.version, counters, FlowCensus(self.flows, self.capacity,
                                                                 by_class))

    def htb_classes(self) -> dict[int, HtbClassStats]:
        if not self.up:
            raise DataplaneError(f"no HTB on {self.iface}")
        n = max(1, self.reads) * self.step
        out = {(abi.HTB_MAJOR << 16) | cid: HtbClassStats(
            classid=(abi.HTB_MAJOR << 16) | cid, parent=HTB_LINK, bytes=n * 500, packets=n,
            drops=n // 50 if cid == 12 else 0) for cid in CLASS_NAMES}
        out[HTB_LINK] = HtbClassStats(classid=HTB_LINK, parent=0)
        return out


def fake_dataplanes(*dps: FakeDataplane) -> tuple[list[Target], DataplaneFactory]:
    """Targets for ``dps`` and the factory that opens them (by iface)."""
    by_iface = {d.iface: d for d in dps}
    return ([Target(d.iface, None, dict(CLASS_NAMES)) for d in dps],
            lambda iface, netns: by_iface[iface])


def sketch_b64(*values_ms: float) -> str:
    sk = DDSketch(0.01)
    for v in values_ms:
        sk.add(v)
    enc = encode_sketch(sk)
    assert enc is not None
    return enc


def sla_body(stage: str, instance: str, cls: str, modality: str, frames: int,
             attainment: float, e2e_ms: tuple[float, ...] = ()) -> SlaReport:
    """A report of one window (``e2e_ms``: the frames' latencies, for a sketch)."""
    return SlaReport.model_validate({"node": None, "stage": stage, "instance": instance,
                                     "reports": [{
                                         "sla_class": cls, "modality": modality,
                                         "window_s": 5.0, "frames": frames,
                                         "deadline_misses": round(frames * (1 - attainment)),
                                         "drops": 0, "errors": 0, "attainment": attainment,
                                         "e2e_ms": None,
                                         "sketch_e2e": sketch_b64(*e2e_ms) if e2e_ms else None,
                                     }]})


def board_with(attainment: float, frames: int = 100, now: float | None = None) -> SlaBoard:
    """A board with voice/audio windows from two stages (merged into one
    class row at ``attainment``) and one video/video window."""
    b = SlaBoard()
    lat = tuple(float(v) for v in range(1, 101))
    for stage in ("asr", "fusion"):
        b.report(sla_body(stage, f"{stage}-0", "voice", "audio", frames, attainment, lat),
                 now=now)
    b.report(sla_body("vision", "vision-0", "video", "video", frames, 1.0), now=now)
    return b


def prometheus_tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``.  Missing, the test fails
    under CI or as root (scripts/bootstrap.sh installs them) and is skipped
    otherwise, like testkit/privileged.py's privileged tests."""
    path = shutil.which(name)
    if path is not None:
        return path
    if os.environ.get("CI") or os.geteuid() == 0:
        pytest.fail(f"{name} is not installed (scripts/bootstrap.sh installs Debian's "
                    "prometheus package)", pytrace=False)
    pytest.skip(f"{name} is not installed")


def promtool_check_metrics(text: str) -> None:
    """``promtool check metrics`` (the exposition linter) finds nothing."""
    r = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=text,
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
        (r.returncode, r.stdout, r.stderr)
