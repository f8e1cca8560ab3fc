"""Showing the demo: progress lines, the results table, results.json, latency.png.

Files are written atomically: to a temporary file in the same directory,
then renamed over the target, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from mmmesh.files import write_atomic

MODALITIES = ("voice", "video", "lidar")


class Progress:
    """``[ 12.3s] message`` lines, seconds since creation, on stderr by default."""

    def __init__(self, stream: IO[str] | None = None, enabled: bool = True) -> None:
        self.t0 = time.monotonic()
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {message}", file=self.stream, flush=True)


# --------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------
def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _ms(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def format_table(results: dict[str, Any]) -> str:
    """modality x mesh (off / on / unloaded): frames, loss, latency, throughput;
    then the per-class counters of the mesh-on phase and the headline."""
    ph = results.get("phases", {})
    cfg = results.get("config", {})
    lines = [
        f"mmmesh-demo: uplink {cfg.get('rate', '?')}, {cfg.get('duration', '?')} s per phase, "
        f"flood {cfg.get('flood_factor', '?')}x link",
        "",
        f"{'modality':<9}{'mesh':<10}{'sent':>8}{'recv':>8}{'loss %':>8}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'Mbit/s':>9}",
    ]
    lines.append("-" * len(lines[-1]))
    rows = [(m, p) for m in MODALITIES for p in ("off", "on", "unloaded")]
    for m, p in rows:
        r = ph.get(p, {}).get(m)
        if not r:
            continue
        label = {"off": "off", "on": "on", "unloaded": "on,alone"}[p]
        lines.append(
            f"{m:<9}{label:<10}{r['sent']:>8}{r['received']:>8}{_fmt(r['loss_pct'], '.2f'):>8}"
            f"{_ms(r['p50_ms']):>9}{_ms(r['p99_ms']):>9}{_ms(r['max_ms']):>9}"
            f"{_fmt(r['mbit_s'], '.1f'):>9}"
        )
    classes = ph.get("on", {}).get("classes", {})
    if classes:
        lines += ["", "mesh on, per class on the uplink (classifier counters and HTB):",
                  f"{'class':<13}{'htb':<7}{'bpf pkts':>10}{'bpf MB':>9}{'htb pkts':>10}"
                  f"{'htb drops':>10}"]
        for name, c in classes.items():
            lines.append(
                f"{name:<13}{c['classid']:<7}{c['egress_packets']:>10}"
                f"{c['egress_bytes'] / 1e6:>9.1f}{c['htb_packets']:>10}{c['htb_drops']:>10}"
            )
    s = results.get("summary", {})
    if s:
        lines.append("")
        ratio = s.get("voice_p99_off_over_on")
        lines.append(
            f"voice p99: off {_ms(s.get('voice_p99_off_ms'))} ms, "
            f"on {_ms(s.get('voice_p99_on_ms'))} ms, alone {_ms(s.get('voice_p99_unloaded_ms'))} ms"
            + (f"  ->  {ratio:.0f}x lower with the mesh on" if ratio else "")
        )
        if s.get("voice_kernel_p99_on_ms") is not None:
            kr = s.get("voice_kernel_p99_off_over_on")
            lines.append(
                f"  (to the kernel's receive timestamp: off {_ms(s.get('voice_kernel_p99_off_ms'))}"
                f" ms, on {_ms(s.get('voice_kernel_p99_on_ms'))} ms, alone "
                f"{_ms(s.get('voice_kernel_p99_unloaded_ms'))} ms"
                + (f", {kr:.0f}x)" if kr else ")")
            )
        sla = s.get("voice_sla", {})
        if sla:
            def word(v: bool | None) -> str:
                return "-" if v is None else ("MET" if v else "MISSED")

            lines.append(
                f"voice SLA (p99 <= {sla['p99_ms']:g} ms, loss <= {sla['loss_pct']:g} %): "
                f"mesh off {word(sla.get('met_off'))}, mesh on {word(sla.get('met_on'))}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------
def _jsonable(x: Any) -> Any:
    """NaN/inf -> None (strict JSON); private keys (leading '_') dropped."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def to_json(results: dict[str, Any]) -> str:
    return json.dumps(_jsonable(results), indent=2, sort_keys=True, allow_nan=False)


def write_json(path: str | os.PathLike[str], results: dict[str, Any]) -> Path:
    return write_atomic(path, to_json(results) + "\n")


def write_plot(path: str | os.PathLike[str], results: dict[str, Any]) -> Path:
    """Left: voice latency CDF (off / on / alone).  Right: p99 per modality, off vs on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = results.get("_latencies_ns", {})
    ph = results.get("phases", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"off": ("mesh off (FIFO)", "tab:red"), "on": ("mesh on", "tab:green"),
              "unloaded": ("mesh on, voice alone", "tab:blue")}
    for key, (label, color) in styles.items():
        v = sorted(lat.get(key, []))
        if not v:
            continue
        xs = [max(x, 1) / 1e6 for x in v]
        ys = [(i + 1) / len(v) for i in range(len(v))]
        loss = ph.get(key, {}).get("voice", {}).get("loss_pct")
        extra = f", loss {loss:.1f} %" if loss is not None else ""
        ax1.step(xs, ys, where="post", label=f"{label}{extra}", color=color)
    sla = results.get("summary", {}).get("voice_sla", {}).get("p99_ms")
    if sla:
        ax1.axvline(sla, color="gray", linestyle="--", linewidth=1)
        ax1.text(sla, 0.97, f" voice SLA {sla:g} ms", color="gray", fontsize=8, va="top")
    ax1.set_xscale("log")
    ax1.set_xlabel("voice one-way latency (ms, log)")
    ax1.set_ylabel("fraction of frames received")
    ax1.set_title("voice latency under a video flood")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="center right", fontsize=8)

    mods = [m for m in MODALITIES if m in ph.get("off", {}) or m in ph.get("on", {})]
    width = 0.38
    for i, (key, (label, color)) in enumerate(list(styles.items())[:2]):
        vals: list[float] = []
        for m in mods:
            p99 = ph.get(key, {}).get(m, {}).get("p99_ms")
            vals.append(p99 if isinstance(p99, float) and math.isfinite(p99) else 0.0)
        xs = [j + (i - 0.5) * width for j in range(len(mods))]
        bars = ax2.bar(xs, vals, width, label=label, color=color)
        for b, val in zip(bars, vals, strict=True):
            ax2.annotate(f"{val:.2f}" if val < 10 else f"{val:.0f}",
                         (b.get_x() + b.get_width() / 2, max(val, 1e-3)),
                         ha="center", va="bottom", fontsize=8)
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(mods)), mods)
    ax2.set_ylabel("p99 one-way latency (ms, log)")
    rate = results.get("config", {}).get("rate", "")
    ax2.set_title(f"p99 per modality, uplink {rate}")
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()

    p = Path(path)
    write_atomic(p, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return p


__all__ = ["Progress", "format_table", "to_json", "write_json", "write_plot"]
