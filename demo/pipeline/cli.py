"""``mmmesh-demo --pipeline``: arguments, running the pipeline demo
(:mod:`demo.pipeline.run`) and the table it prints."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from demo.pipeline.run import MODALITIES, PipelineConfig, run_pipeline
from mmmesh.errors import MeshError


def format_table(results: dict[str, Any]) -> str:
    c = results["config"]
    ph = results["phases"]
    names = [p for p in ("off", "on", "none") if p in ph]
    head = {"off": "mesh OFF", "on": "mesh ON", "none": "unshaped"}
    lines = [(f"mmmesh pipeline demo: sensors uplink {c['rate']}, {c['duration']:g} s per phase, "
             f"video flood {c['flood_factor']:g}x link"), ""]
    h1 = f"{'modality':<8}{'deadline':>10}"
    h2 = f"{'':<8}{'':>10}"
    for p in names:
        h1 += f" | {head[p]:^30}"
        h2 += f" | {'SLA met':>9}{'p50 ms':>10}{'p99 ms':>11}"
    lines += [h1, h2, "-" * len(h1)]
    for m in MODALITIES:
        row = f"{m:<8}{c['deadlines_ms'][m]:>8g}ms"
        for p in names:
            r = ph[p]["modalities"][m]
            row += (f" | {r['sla_attainment_pct']:>8.1f}%{_ms(r['p50_ms']):>10}"
                    f"{_ms(r['p99_ms']):>11}")
        lines.append(row)
    lines.append("")
    for p in names:
        r = ph[p]["results"]
        fl = ph[p].get("flood")
        lines.append(f"{head[p]}: decoder outputs {r['outputs']} (errors {r['errors']}), "
                     f"capture->scores p50 {_ms(r['e2e_p50_ms'])} ms p99 "
                     f"{_ms(r['e2e_p99_ms'])} ms" + (f"; flood {fl['mbit_s']:.0f} Mbit/s"
                                                     if fl else ""))
    cls = ph.get("on", {}).get("classes")
    if cls:
        lines.append("mesh ON, packets per class on the uplink: " + ", ".join(
            f"{n} {v['packets']}" for n, v in cls.items() if v["packets"]))
    mesh = results.get("mesh")
    if mesh:
        from demo.pipeline.mesh import render_view

        lines += ["", f"the mesh (qosd on {', '.join(mesh['nodes'])}): the global SLA view of "
                  f"the mesh-on phase, `mmmeshctl cluster sla` on {mesh['view_from']}"
                  + ("" if mesh["view_complete"] else " (incomplete)"), "",
                  render_view(mesh["cluster_sla"])]
    return "\n".join(lines)


def _ms(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from demo.args import rate as _rate
    from demo.args import seconds as _seconds

    p.add_argument("--rate", type=_rate, default=_rate("300mbit"),
                   help="the sensors' uplink rate, tc units (default 300mbit)")
    p.add_argument("--duration", type=_seconds, default=8.0, metavar="SECONDS",
                   help="seconds the sensors produce per phase (default 8)")
    p.add_argument("--flood", type=float, default=0.5, metavar="FACTOR",
                   help="background video flood (paced UDP) in x the uplink rate "
                        "(default 0.5: with the sensors' ~153 Mbit/s it just overloads "
                        "the uplink; 0: none)")
    p.add_argument("--policy", default=None,
                   help="policy YAML (default examples/policy.yaml); its link becomes the "
                        "sensors' uplink at --rate")
    p.add_argument("--mesh", action=argparse.BooleanOptionalAction, default=True,
                   help="one qosd per node, joined as a mesh (gRPC, mTLS): the stages report "
                        "their SLA windows to it, the sensors' qosd applies the policy, and "
                        "the end shows the global SLA view, mmmeshctl cluster sla (default; "
                        "--no-mesh: the dataplane alone, no qosd)")
    p.add_argument("--out", default="out/demo",
                   help="directory for pipeline.json (default out/demo)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_from_args(a: argparse.Namespace) -> int:
    """Runs the demo from parsed arguments (those of :func:`add_arguments`; the
    ``mmmesh-demo`` parser's work too: a missing ``--flood`` means the default)."""
    if os.geteuid() != 0:
        print("mmmesh pipeline demo: needs root (network namespaces, qdiscs and BPF)",
              file=sys.stderr)
        return 1
    from demo import report

    progress = report.Progress(enabled=not getattr(a, "quiet", False))
    cfg = PipelineConfig(rate_bps=a.rate, duration=a.duration,
                         flood_factor=getattr(a, "flood", PipelineConfig.flood_factor),
                         policy_path=getattr(a, "policy", None),
                         mesh=bool(getattr(a, "mesh", PipelineConfig.mesh)))
    try:
        results = run_pipeline(cfg, progress)
    except KeyboardInterrupt:
        print("mmmesh pipeline demo: interrupted; namespaces, qosd and dataplane removed",
              file=sys.stderr)
        return 130
    except MeshError as e:  # a qosd of the mesh did not start or answer
        print(f"mmmesh pipeline demo: {e}", file=sys.stderr)
        return 1
    out = os.path.abspath(getattr(a, "out", "out/demo"))
    path = report.write_json(os.path.join(out, "pipeline.json"), results)
    progress(f"wrote {path}")
    print(report.to_json(results) if getattr(a, "json", False) else format_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.pipeline.cli",
                                description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


__all__ = ["add_arguments", "format_table", "main", "run_from_args"]

if __name__ == "__main__":
    sys.exit(main())
