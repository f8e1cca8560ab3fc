"""``mmmesh-demo --closed-loop``: arguments, running the closed-loop demo
(:mod:`demo.closed_loop.run`), its table, closed-loop.json and closed-loop.png."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from demo.closed_loop.config import ClosedLoopConfig
from demo.closed_loop.run import run_closed_loop
from mmmesh.errors import MeshError


def _windows(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of windows: {text!r}") from None
    if not 1 <= v <= 200:
        raise argparse.ArgumentTypeError("between 1 and 200 windows")
    return v


def _window_s(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 1.0 <= v <= 30.0:
        raise argparse.ArgumentTypeError("a window is between 1 and 30 seconds")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The closed-loop options (``mmmesh-demo`` shares --policy, --flood, --out,
    --json and --quiet with its other modes)."""
    d = ClosedLoopConfig()
    p.add_argument("--window", type=_window_s, default=d.window_s, metavar="SECONDS",
                   help=f"--closed-loop: the SLA window, the controller's period and the "
                        f"stages' report interval (default {d.window_s:g})")
    p.add_argument("--warm-windows", type=_windows, default=d.warm, metavar="N",
                   help=f"--closed-loop: windows of warm-up under the policy without "
                        f"objectives, before the timeline (default {d.warm})")
    p.add_argument("--quiet-windows", type=_windows, default=d.quiet, metavar="N",
                   help=f"--closed-loop: windows before the flood (default {d.quiet})")
    p.add_argument("--flood-windows", type=_windows, default=d.flood, metavar="N",
                   help=f"--closed-loop: windows of video flood (default {d.flood})")
    p.add_argument("--after-windows", type=_windows, default=d.after, metavar="N",
                   help=f"--closed-loop: windows observed after the flood, controller on "
                        f"(default {d.after})")


def config_from_args(a: argparse.Namespace) -> ClosedLoopConfig:
    d = ClosedLoopConfig()
    flood = getattr(a, "flood", None)
    return replace(d, window_s=getattr(a, "window", d.window_s),
                   warm=getattr(a, "warm_windows", d.warm),
                   quiet=getattr(a, "quiet_windows", d.quiet),
                   flood=getattr(a, "flood_windows", d.flood),
                   after=getattr(a, "after_windows", d.after),
                   flood_factor=d.flood_factor if flood is None else flood,
                   policy_path=getattr(a, "policy", None))


def run_from_args(a: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("mmmesh closed-loop demo: needs root (network namespaces, qdiscs and BPF)",
              file=sys.stderr)
        return 1
    from demo import report
    from demo.closed_loop.show import format_table, write_plot

    progress = report.Progress(enabled=not getattr(a, "quiet", False))
    try:
        result = run_closed_loop(config_from_args(a), progress)
    except KeyboardInterrupt:
        print("mmmesh closed-loop demo: interrupted; namespaces, qosd and dataplane removed",
              file=sys.stderr)
        return 130
    except MeshError as e:
        print(f"mmmesh closed-loop demo: {e}", file=sys.stderr)
        return 1
    out = os.path.abspath(getattr(a, "out", "out/demo"))
    jpath = report.write_json(os.path.join(out, "closed-loop.json"), result)
    try:
        ppath = write_plot(os.path.join(out, "closed-loop.png"), result)
    except ImportError as e:  # matplotlib is the 'demo' extra
        progress(f"no plot ({e}); pip install 'mmmesh[demo]'")
        ppath = None
    progress(f"wrote {jpath}" + (f" and {ppath}" if ppath else ""))
    print(report.to_json(result) if getattr(a, "json", False) else format_table(result))
    return 0


__all__ = ["add_arguments", "config_from_args", "run_from_args"]
