"""``mmmesh-demo``: voice keeps its SLA under a video flood with the mesh on.

Builds a testbed of network namespaces, runs voice + video flood + LiDAR over a
shaped uplink with the mesh off (one FIFO) and on (classifier + HTB), and a
voice-only baseline; prints a table and writes results.json and latency.png.
Needs root.  Ctrl-C stops it and removes everything it created.
"""

from __future__ import annotations

import argparse
import os
import sys

from demo.args import rate as _rate
from demo.args import seconds as _seconds


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    parser.add_argument("--rate", type=_rate, default=_rate("300mbit"),
                        help="uplink rate to shape to, tc units (default 300mbit)")
    parser.add_argument("--duration", type=_seconds, default=8.0, metavar="SECONDS",
                        help="seconds of traffic per phase (default 8)")
    parser.add_argument("--policy", default=None,
                        help="policy YAML (default examples/policy.yaml); its link is "
                             "replaced by the testbed uplink at --rate")
    parser.add_argument("--out", default="out/demo",
                        help="directory for results.json and latency.png (default out/demo)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON instead of the table")
    parser.add_argument("--nodes", type=int, choices=(2, 3), default=2,
                        help="2: sender node -> receiver node; 3: pods behind the sender "
                             "node, which forwards to its uplink (default 2)")
    parser.add_argument("--voice-sla-ms", type=float, default=20.0,
                        help="voice SLA for the verdict line: p99 <= this, loss <= 1%% "
                             "(default 20)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--pipeline", action="store_true",
                        help="run the reference multimodal pipeline (sidecars with model "
                             "stages on three nodes) and report SLA attainment per modality")
    parser.add_argument("--flood", type=float, default=0.5,
                        help="--pipeline: video flood as a fraction of the link (default 0.5)")
    parser.add_argument("--mesh", action=argparse.BooleanOptionalAction, default=True,
                        help="--pipeline: one qosd per node, joined as a mesh; ends with the "
                             "global SLA view, mmmeshctl cluster sla (default; --no-mesh: "
                             "without qosd)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="the SLA controller in a closed loop: the pipeline under a video "
                             "flood with a policy that under-provisions voice, controller off "
                             "then on, window by window (table, closed-loop.json, "
                             "closed-loop.png; docs/controller.md); --policy defaults to "
                             "examples/closed-loop-policy.yaml, --flood is the flood's rate")
    from demo.closed_loop.cli import add_arguments as closed_loop_arguments

    closed_loop_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmmesh-demo")
    register(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130


def _run(a: argparse.Namespace) -> int:
    if a.closed_loop:
        from demo.closed_loop.cli import run_from_args as closed_loop

        return closed_loop(a)
    if a.pipeline:
        from demo.pipeline.cli import run_from_args

        return run_from_args(a)
    if os.geteuid() != 0:
        print("mmmesh-demo: needs root (network namespaces, qdiscs and BPF); "
              "try: sudo scripts/demo.sh", file=sys.stderr)
        return 1
    from . import report
    from .scenario import DemoConfig, run_demo

    progress = report.Progress(enabled=not a.quiet)
    cfg = DemoConfig(rate_bps=a.rate, duration=a.duration, policy_path=a.policy, nodes=a.nodes,
                     voice_sla_ms=a.voice_sla_ms)
    results = run_demo(cfg, progress)
    out = os.path.abspath(a.out)
    jpath = report.write_json(os.path.join(out, "results.json"), results)
    try:
        ppath = report.write_plot(os.path.join(out, "latency.png"), results)
    except ImportError as e:  # matplotlib is the 'demo' extra
        progress(f"no plot ({e}); pip install 'mmmesh[demo]'")
        ppath = None
    progress(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    if a.json:
        print(report.to_json(results))
    else:
        print(report.format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
