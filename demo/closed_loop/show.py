"""The closed-loop demo's table and plot (:mod:`.closed_loop`), from the
result :func:`.closed_loop_report.figures` makes."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from demo.closed_loop.config import WATCH
from demo.closed_loop.report import TARGETS

DELAY_PARTS = ("window", "hysteresis", "report", "view", "view_local", "view_peers",
               "controller_wait", "controller_step", "kernel_write", "total")


def _f(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _run_cells(x: dict[str, Any] | None) -> str:
    x = x or {}
    v, vid, lid = x.get(WATCH) or {}, x.get("video") or {}, x.get("lidar") or {}
    return (f"{_f(v.get('p99_ms'), '.0f'):>6}{_f(v.get('attainment'), '.3f'):>7}"
            f"{_f(vid.get('p99_ms'), '.0f'):>7}{_f(lid.get('p99_ms'), '.0f'):>7}")


def format_table(result: dict[str, Any]) -> str:
    """Window by window, off and on side by side: per class the p99 (ms) and
    voice's attainment, and the voice rate and weight the kernel held at the
    window's end; then qosd's decisions, the figures and the targets."""
    c, obj, pol = result["config"], result["objective"], result["policy"][WATCH]
    lines = [
        (f"mmmesh closed-loop demo: uplink {c['rate']}, window {c['window_s']:g} s; voice "
        f"objective p99 <= {obj.get('p99_ms', '-')} ms, attainment >= "
        f"{obj.get('attainment', '-')}; policy rate {pol['rate'] / 1e6:g} Mbit/s, weight "
        f"{pol['weight']}, adapt {result['adapt']}"),
        ("(p99 in ms per class: voice = audio-frontend, video = vision-encoder, lidar = "
        "lidar-encoder; att = voice's share of frames within its deadline)"), ""]
    sub = f"{'voice':>6}{'att':>7}{'video':>7}{'lidar':>7}"
    head = f"{'phase':<6}{'w':>3} | {sub} | {sub}{'rate':>8}{'weight':>7}"
    lines += [head, f"{'':<9} | {'controller OFF':^27} | {'controller ON':^42}",
              "-" * len(head)]
    for r in result["windows"]:
        on = r.get("on") or {}
        rate = on.get("voice_rate")
        lines.append(f"{r['phase']:<6}{r['i']:>3} | {_run_cells(r.get('off'))} | "
                     f"{_run_cells(on)}{_f(None if rate is None else rate / 1e6, '.2f'):>7}M"
                     f"{_f(on.get('voice_weight'), 'd'):>7}")
    decisions = result["runs"].get("on", {}).get("decisions", [])
    if decisions:
        lines += ["", "qosd's decisions (t from the flood's start):"]
        lines += [f"  t={d['t']:+6.1f}s {d['class']}: {d['change']}: {d['why']}"
                  for d in decisions]
    figs = {k: result.get(k) for k in ("attainment_off", "attainment_on", "settle_windows",
                                       "settle_s", "oscillations", "max_step",
                                       "back_to_policy_windows", "back_to_policy_s")}
    delay = result.get("delay")
    if delay:
        lines += ["", "the loop's delay, first missed frame to the kernel write (s): "
                  + ", ".join(f"{k} {delay[k]}" for k in DELAY_PARTS if delay.get(k) is not None)]
    lines += ["", "  ".join(f"{k} {v}" for k, v in figs.items()),
              "targets: " + ", ".join(f"{k} {op} {t}: {_word(result['targets'][k])}"
                                      for k, (op, t) in TARGETS.items())]
    return "\n".join(lines)


def _word(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "MISSED"


def _steps(run: dict[str, Any], knob: str, policy: float, t_end: float
           ) -> tuple[list[float], list[float]]:
    """The watched class's ``knob`` over time from the kernel's changes."""
    ts, vs = [-1e9], [policy]
    for ch in run.get("changes") or []:
        if ch["class"] == WATCH and ch["knob"] == knob:
            ts.append(ch["t"])
            vs.append(ch["new"])
    ts.append(t_end)
    vs.append(vs[-1])
    return ts, vs


def write_plot(path: str | os.PathLike[str], result: dict[str, Any]) -> Path:
    """Per class p99 and voice's attainment per window, off vs on, and the
    rate and weight qosd gave voice, against time from the flood's start
    (shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmmesh.files import write_atomic

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {"off": "tab:red", "on": "tab:green"}
    styles = {WATCH: "o-", "video": "s--", "lidar": "^:"}
    obj, c = result["objective"], result["config"]
    t_end = max((r[m]["t"] for r in result["windows"] for m in colors if r.get(m)),
                default=0.0)
    for m, color in colors.items():
        for cls, style in styles.items():
            pts = [r[m] for r in result["windows"] if r.get(m) and (r[m].get(cls) or {})
                   .get("p99_ms") is not None]
            axes[0].plot([p["t"] for p in pts], [p[cls]["p99_ms"] for p in pts], style,
                         color=color, alpha=1.0 if cls == WATCH else 0.45, markersize=4,
                         label=f"{cls}, controller {m}")
        pts = [r[m] for r in result["windows"] if r.get(m) and (r[m].get(WATCH) or {})
               .get("attainment") is not None]
        axes[1].plot([p["t"] for p in pts], [p[WATCH]["attainment"] for p in pts], "o-",
                     color=color, label=f"voice, controller {m}")
        run = result["runs"].get(m) or {}
        pol = result["policy"][WATCH]
        ts, vs = _steps(run, "rate", pol["rate"], t_end)
        axes[2].step(ts, [v / 1e6 for v in vs], where="post", color=color,
                     label=f"voice rate, controller {m}")
        if m == "on":
            tw, vw = _steps(run, "weight", pol["weight"], t_end)
            ax2 = axes[2].twinx()
            ax2.step(tw, vw, where="post", color="tab:blue", linestyle="--",
                     label="voice weight, controller on")
            ax2.set_ylabel("voice weight")
            ax2.legend(fontsize=8, loc="lower right")
    if obj.get("p99_ms"):
        axes[0].axhline(obj["p99_ms"], color="gray", linestyle="--", linewidth=1)
    if obj.get("attainment"):
        axes[1].axhline(obj["attainment"], color="gray", linestyle="--", linewidth=1)
    t0 = min((r[m]["t"] for r in result["windows"] for m in colors if r.get(m)), default=0.0)
    axes[2].set_xlim(t0 - c["window_s"], t_end + 1)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("p99 (ms, log)")
    axes[1].set_ylabel("voice attainment")
    axes[2].set_ylabel("voice rate (Mbit/s)")
    axes[2].set_xlabel("seconds from the flood's start (shaded: the flood)")
    span = c["flood"] * c["window_s"]
    for ax in axes:
        ax.axvspan(0, span, color="tab:blue", alpha=0.08)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right", ncol=2)
    axes[1].legend(fontsize=8, loc="lower right")
    axes[2].legend(fontsize=8, loc="upper right")
    axes[0].set_title(f"closed loop: voice under a video flood, uplink {c['rate']}, "
                      f"window {c['window_s']:g} s")
    fig.tight_layout()
    p = Path(path)
    write_atomic(p, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    return p


__all__ = ["format_table", "write_plot"]
