"""The demo scenario: the same traffic with the mesh off, then on, then unloaded.

    1. mesh off   the uplink shaped to the demo rate with one HTB class and one
                  FIFO (``netlab.Lab.apply_fifo``): what a node without mmmesh does
    2. mesh on    ``Dataplane.up`` with the example policy on the uplink (link rate
                  = demo rate): the classifier puts each modality in its class
    3. unloaded   mesh on, voice alone: the baseline for voice latency

Phases 1 and 2 run voice + video flood + LiDAR (see :mod:`.traffic`).  The
dataplane is brought down, and the testbed removed, whatever happens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmmesh.dataplane import Dataplane, DataplaneStatus, HtbClassStats, handle
from mmmesh.policy import Policy, Rate, load_policy, parse_policy

from . import EXAMPLES
from .streams import TrafficSpec
from .testbed import UPLINK, Testbed
from .traffic import run_traffic
from .voice import PARTS

DEFAULT_POLICY = "examples/policy.yaml"
MODALITIES = ("voice", "video", "lidar")
# The classes the demo's streams must land in (names in the example policy).
EXPECTED_CLASS = {"voice": "voice", "video": "video", "lidar": "lidar"}


@dataclass
class DemoConfig:
    rate_bps: int = 300_000_000
    duration: float = 8.0
    policy_path: str | None = None  # None: examples/policy.yaml
    nodes: int = 2
    fifo_limit: int = 1000  # packets: the mesh-off FIFO (a default txqueuelen)
    flood_factor: float = 1.5
    unloaded: bool = True
    voice_sla_ms: float = 20.0  # voice SLA for the verdict: p99 <= this and loss <= 1 %
    voice_sla_loss_pct: float = 1.0
    traffic: dict[str, Any] = field(default_factory=dict)  # TrafficSpec overrides


def find_policy(path: str | None) -> Path:
    """The policy file: ``path``, else examples/policy.yaml here or in the source tree."""
    if path:
        return Path(path)
    here = Path(DEFAULT_POLICY)
    if here.is_file():
        return here
    src = EXAMPLES.parent / DEFAULT_POLICY
    return src if src.is_file() else here


def demo_policy(path: str | None, device: str, rate_bps: int) -> Policy:
    """The policy file with its link replaced by the demo's uplink and rate."""
    base = load_policy(find_policy(path))
    data = base.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": device, "rate": str(Rate(rate_bps))}
    return parse_policy(data)


Progress = Callable[[str], None]


def _class_snapshot(st: DataplaneStatus) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in st.classes:
        h = c.htb
        out[c.name] = {
            "classid": handle(c.classid),
            "egress_packets": c.egress_packets,
            "egress_bytes": c.egress_bytes,
            "htb_packets": h.packets if h else 0,
            "htb_bytes": h.bytes if h else 0,
            "htb_drops": h.drops if h else 0,
            "htb_overlimits": h.overlimits if h else 0,  # throttled: waits for the watchdog
        }
    return out


def _delta(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]
           ) -> dict[str, dict[str, Any]]:
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        out[name] = {k: (v - b.get(k, 0) if isinstance(v, int) else v) for k, v in a.items()}
    return out


def _htb_delta(after: dict[int, HtbClassStats], before: dict[int, HtbClassStats]
               ) -> dict[str, dict[str, int]]:
    out = {}
    for cid, a in after.items():
        b = before.get(cid)
        out[handle(cid)] = {k: getattr(a, k) - (getattr(b, k) if b else 0)
                            for k in ("packets", "bytes", "drops")}
    return out


def _phase_line(res: dict[str, Any]) -> str:
    parts = []
    for m in MODALITIES:
        if m in res:
            r = res[m]
            parts.append(f"{m} p99 {r['p99_ms']:.2f} ms loss {r['loss_pct']:.1f}%")
    return ", ".join(parts)


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and _finite(a) and _finite(b) and b > 0 \
        else None


def summarize(results: dict[str, Any], cfg: DemoConfig) -> dict[str, Any]:
    """The headline numbers: voice p99 off / on / unloaded and their ratios."""
    ph = results["phases"]
    off = ph.get("off", {}).get("voice", {})
    on = ph.get("on", {}).get("voice", {})
    unl = ph.get("unloaded", {}).get("voice", {})
    s: dict[str, Any] = {
        "voice_p99_off_ms": off.get("p99_ms"),
        "voice_loss_off_pct": off.get("loss_pct"),
        "voice_loss_on_pct": on.get("loss_pct"),
    }
    # "kernel": to the kernel's receive timestamp (leaves out the receiver's wake-up)
    s["voice_kernel_p99_off_ms"] = off.get("kernel_p99_ms")
    s["voice_p99_off_over_on"] = _ratio(off.get("p99_ms"), on.get("p99_ms"))
    s["voice_kernel_p99_off_over_on"] = _ratio(off.get("kernel_p99_ms"), on.get("kernel_p99_ms"))
    # mesh on under the flood vs voice alone, p50 and p99, socket and kernel timestamp
    for key in ("p50_ms", "p99_ms", "kernel_p50_ms", "kernel_p99_ms"):
        name = "voice_" + key.removesuffix("_ms")
        s[f"{name}_on_ms"], s[f"{name}_unloaded_ms"] = on.get(key), unl.get(key)
        s[f"{name}_on_over_unloaded"] = _ratio(on.get(key), unl.get(key))
    # where voice spends its time (with TrafficSpec.voice_tx_ts), p50/p99 in ms
    # and what its slowest 1 % spent in each part (means, ms)
    s["voice_breakdown"] = {
        name: {**{part: [r["breakdown"][part]["p50_ms"], r["breakdown"][part]["p99_ms"]]
                  for part in PARTS},
               "tail_kernel": r["breakdown"]["tail_kernel"],
               "tail_socket": r["breakdown"]["tail_socket"]}
        for name, r in (("on", on), ("unloaded", unl)) if r.get("breakdown")
    }

    def sla(r: dict[str, Any]) -> bool | None:
        if not r:
            return None
        return bool(_finite(r.get("p99_ms", math.nan)) and r["p99_ms"] <= cfg.voice_sla_ms
                    and r.get("loss_pct", 100.0) <= cfg.voice_sla_loss_pct)

    s["voice_sla"] = {"p99_ms": cfg.voice_sla_ms, "loss_pct": cfg.voice_sla_loss_pct,
                      "met_off": sla(off), "met_on": sla(on)}
    classes = ph.get("on", {}).get("classes", {})
    s["classified"] = {
        m: classes.get(c, {}).get("egress_packets", 0) for m, c in EXPECTED_CLASS.items()
    }
    return s


def run_demo(cfg: DemoConfig, progress: Progress = lambda _m: None) -> dict[str, Any]:
    """Builds the testbed, runs the phases, returns the results (JSON-able)."""

    if cfg.duration <= 0:
        raise ValueError("duration must be positive")
    t_start = time.monotonic()
    spec = TrafficSpec(link_bps=cfg.rate_bps, duration=cfg.duration,
                       flood_factor=cfg.flood_factor, **cfg.traffic)
    results: dict[str, Any] = {
        "version": 1,
        "config": {**asdict(cfg), "rate": str(Rate(cfg.rate_bps)),
                   "policy_path": str(find_policy(cfg.policy_path)),
                   "traffic": asdict(spec)},
        "phases": {},
    }
    latencies: dict[str, list[int]] = {}

    def keep_voice(name: str, res: dict[str, Any]) -> dict[str, Any]:
        for m, r in res.items():
            if isinstance(r, dict) and "latencies_ns" in r:
                if m == "voice":
                    latencies[name] = r["latencies_ns"]
                del r["latencies_ns"]
        return res

    # the policy first: a rate below its guarantees is refused before any set-up
    policy = demo_policy(cfg.policy_path, UPLINK, cfg.rate_bps)
    with Testbed(rate_bps=cfg.rate_bps, nodes=cfg.nodes) as tb:
        ns, dev = tb.uplink
        dp = Dataplane(dev, ns)
        results["config"]["policy"] = policy.model_dump(mode="json", by_alias=True)
        names = " -> ".join(n.ns for n in (tb.pod, tb.tx, tb.rx) if n is not None)
        progress(f"testbed up: {names}, uplink {dev} shaped to {Rate(cfg.rate_bps)}")
        nphase = 3 if cfg.unloaded else 2
        up_attempted = False
        try:
            # 1. mesh off
            progress(f"phase 1/{nphase}: mesh OFF (one FIFO, {cfg.fifo_limit} packets): voice + "
                     f"video flood ({cfg.flood_factor:g}x link) + lidar for {cfg.duration:g}s")
            tb.shape_fifo(cfg.fifo_limit)
            before = tb.htb_classes()
            res = keep_voice("off", run_traffic(tb, spec))
            res["htb"] = _htb_delta(tb.htb_classes(), before)
            results["phases"]["off"] = res
            progress(f"phase 1/{nphase} done: {_phase_line(res)}")
            tb.unshape()

            # 2. mesh on
            progress(f"phase 2/{nphase}: mesh ON (classifier + HTB, "
                     f"{len(policy.classes)} classes): same traffic")
            up_attempted = True
            t = time.monotonic()
            up = dp.up(policy)
            progress(f"dataplane up on {dev} in {time.monotonic() - t:.1f}s "
                     f"(programs {up.prog_ids})")
            snap0 = _class_snapshot(dp.status(policy))
            res = keep_voice("on", run_traffic(tb, spec))
            st = dp.status(policy)
            res["classes"] = _delta(_class_snapshot(st), snap0)
            res["reasons"] = st.reasons
            res["flows"] = st.flows
            results["phases"]["on"] = res
            progress(f"phase 2/{nphase} done: {_phase_line(res)}")

            # 3. unloaded baseline
            if cfg.unloaded:
                progress(f"phase 3/{nphase}: mesh ON, voice alone (unloaded baseline)")
                uspec = TrafficSpec(**{**asdict(spec), "video": False, "lidar": False})
                res = keep_voice("unloaded", run_traffic(tb, uspec))
                results["phases"]["unloaded"] = res
                progress(f"phase 3/{nphase} done: {_phase_line(res)}")
        finally:
            if up_attempted:
                try:
                    dp.down()
                    progress("dataplane down")
                except Exception as e:  # noqa: BLE001 - never mask the original error
                    progress(f"dataplane down failed: {e}")
    results["summary"] = summarize(results, cfg)
    results["elapsed_s"] = time.monotonic() - t_start
    results["_latencies_ns"] = latencies  # for the plot; report.write_* leave it out
    return results


__all__ = ["DemoConfig", "demo_policy", "find_policy", "run_demo", "summarize"]
