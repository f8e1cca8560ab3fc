"""What ``mmmeshctl`` prints: JSON, and rich tables built from qosd's answers.

rich is imported inside the functions that build tables (~25 ms of start-up),
so ``-o json`` and the commands that print one line never load it.
"""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # imported where used: see the module docstring
    from rich.console import Console, Group
    from rich.table import Table

__all__ = [
    "ListOutput",
    "ListOutputOpt",
    "Output",
    "console",
    "plain_table",
    "diff_view",
    "flows_table",
    "history_table",
    "human_bytes",
    "human_rate",
    "policy_view",
    "print_json",
    "status_view",
]


class Output(str, Enum):
    table = "table"
    yaml = "yaml"
    json = "json"


class ListOutput(str, Enum):
    table = "table"
    json = "json"


ListOutputOpt = Annotated[ListOutput, typer.Option("--output", "-o")]


def console() -> Console:
    """stdout for tables; not a terminal (pipes, CI logs): wide enough that
    tables are not cut."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else 160
    return Console(highlight=False, soft_wrap=False, width=width)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, ensure_ascii=False))


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def human_rate(bps: float) -> str:
    """bit/s as "150.0 Mbit/s" (SI, as tc and the policy count)."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def human_bytes(n: Any) -> str:
    """Bytes as "1.5 MiB" (binary units, whole bytes below 1 KiB); "-" for no number."""
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v:.0f} B"


def plain_table(title: str | None = None, **kw: Any) -> Table:
    """A borderless table with bold headers, as every table here is."""
    from rich.table import Table

    return Table(title=title, title_justify="left", box=None, header_style="bold",
                 pad_edge=False, **kw)


# -- policy -------------------------------------------------------------------
def policy_view(doc: dict[str, Any]) -> Group:
    """A stored policy version (``GET /v1/policy``): header, classes, source rules."""
    from rich.console import Group
    from rich.text import Text

    pol = doc["policy"]
    link = pol.get("link", {})
    head = Text()
    head.append(f"policy version {doc['version']}", style="bold")
    head.append(f"   created {_when(doc.get('created_at'))}")
    if doc.get("author"):
        head.append(f" by {doc['author']}")
    if doc.get("note"):
        head.append(f" ({doc['note']})")
    head.append(f"\nsha256 {doc.get('sha256', '')[:16]}   link {link.get('device')} at "
                f"{link.get('rate')}   default class {pol.get('default_class')}")
    if pol.get("description"):
        head.append(f"\n{pol['description']}", style="dim")
    classes = plain_table()
    for col in ("NAME", "ID", "MATCH", "RATE", "CEIL", "WEIGHT", "PRIO", "DSCP"):
        classes.add_column(col, justify="right" if col in ("ID", "WEIGHT", "PRIO", "DSCP")
                           else "left", overflow="fold")
    for c in pol.get("classes", []):
        classes.add_row(
            str(c.get("name")), str(c.get("id")), _match(c.get("match")), str(c.get("rate")),
            str(c["ceil"]) if c.get("ceil") is not None else "link",
            str(c.get("weight")), str(c.get("priority")),
            str(c["dscp"]) if c.get("dscp") is not None else "-",
        )
    parts: list[Any] = [head, Text(""), classes]
    rules = pol.get("source_rules") or []
    if rules:
        rt = plain_table()
        rt.add_column("SOURCE PREFIX")
        rt.add_column("MAX CLASS")
        for r in rules:
            rt.add_row(str(r.get("prefix")), str(r.get("max_class")))
        parts += [Text(""), rt]
    return Group(*parts)


def _match(match: dict[str, Any] | None) -> str:
    """A class's match: modalities and metadata ranges, or "(by id only)"."""
    if not match:
        return "(by id only)"
    what = ",".join(match.get("modalities", []))
    for meta in ("fps", "bitrate", "density"):
        rng = match.get(meta)
        if rng:
            what += f" {meta}={rng.get('min')}..{rng.get('max')}"
    return what


def history_table(versions: list[dict[str, Any]], current: int | None) -> Table:
    """The stored versions, newest first; ``*`` marks the current one."""
    t = plain_table()
    for col in ("VERSION", "CREATED", "AUTHOR", "NOTE", "SHA256"):
        t.add_column(col, justify="right" if col == "VERSION" else "left")
    for v in versions:
        mark = "*" if v["version"] == current else " "
        t.add_row(f"{mark}{v['version']}", _when(v.get("created_at")), v.get("author") or "-",
                  v.get("note") or "-", str(v.get("sha256", ""))[:12])
    return t


def diff_view(diff: str) -> Group:
    """A unified diff, coloured line by line."""
    from rich.console import Group
    from rich.text import Text

    def style(line: str) -> str:
        return ("bold" if line.startswith(("---", "+++")) else
                "green" if line.startswith("+") else
                "red" if line.startswith("-") else
                "cyan" if line.startswith("@@") else "")
    return Group(*(Text(line, style=style(line)) for line in diff.splitlines()))


# -- status -------------------------------------------------------------------
def status_view(st: dict[str, Any]) -> Group:
    """``GET /v1/status``: the node, then a table per loaded uplink, then the SLA
    tables (when sidecars report)."""
    from rich.console import Group

    parts: list[Any] = [_node_table(st)]
    for dev, info in (st.get("uplinks") or {}).items():
        if isinstance(info, dict) and info.get("loaded"):
            parts.append(_uplink_table(dev, info))
    sla = st.get("sla") or {}
    if isinstance(sla, dict) and sla.get("stages"):
        parts.append(_sla_table(sla["stages"], "SLA attainment per stage (last window of each "
                                               "sidecar, replicas merged)", per_stage=True))
        parts.append(_sla_table(sla.get("classes") or [], "SLA per class, node-wide (every "
                                                          "stage merged)", per_stage=False))
    return Group(*parts)


def _node_table(st: dict[str, Any]) -> Table:
    from rich.table import Table
    from rich.text import Text

    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("node", str(st.get("node")))
    t.add_row("policy version", str(st.get("policy_version") or "none"))
    t.add_row("up since", f"{_when(st.get('started_at'))} ({_ago(st.get('started_at'))})")
    t.add_row("adopted dataplane", "yes" if st.get("adopted") else "no")
    rec = st.get("last_reconcile")
    if rec:
        state = "ok" if rec.get("ok") else f"FAILED: {rec.get('error')}"
        line = (f"{state}, {rec.get('trigger')} of version {rec.get('version')}, "
                f"{_ago(rec.get('started_at'))} ago, {float(rec.get('duration_s', 0)) * 1000:.0f}"
                " ms")
        if rec.get("repaired"):
            line += f", repaired: {', '.join(rec['repaired'])}"
        t.add_row("last reconcile", Text(line, style="" if rec.get("ok") else "red"))
    else:
        t.add_row("last reconcile", "-")
    for dev, info in (st.get("uplinks") or {}).items():
        t.add_row(f"uplink {dev}", _uplink_line(info))
    problems = st.get("store_problems") or []
    t.add_row("store problems", Text("\n".join(problems), style="yellow") if problems else "none")
    return t


def _uplink_line(info: Any) -> Any:
    """One uplink in the node table: loaded or not, versions, flows; or its error."""
    from rich.text import Text

    if not isinstance(info, dict):
        return str(info)
    if "error" in info:
        return Text(f"error: {info['error']}", style="red")
    bits = [f"{'loaded' if info.get('loaded') else 'NOT loaded'}"]
    for key in ("policy_version", "abi_version", "flows"):
        if key in info:
            bits.append(f"{key.replace('_', ' ')} {info[key]}")
    return ", ".join(bits)


def _uplink_table(dev: str, info: dict[str, Any]) -> Table:
    """Programs, then one row per class: BPF counters and HTB statistics."""
    progs = ", ".join(f"{d} prog {p.get('prog_id')}" for d, p in
                      sorted((info.get("programs") or {}).items())) or "NO programs attached"
    t = plain_table(f"{dev}: {progs}")
    for col in ("CLASS", "HTB", "RANK", "EGRESS PKTS", "EGRESS BYTES", "INGRESS PKTS",
                "HTB PKTS", "DROPS", "OVERLIMITS", "BACKLOG"):
        t.add_column(col, justify="left" if col in ("CLASS", "HTB") else "right")
    for name, c in (info.get("classes") or {}).items():
        h = c.get("htb") or {}
        t.add_row(name, str(c.get("classid")), str(c.get("rank")),
                  str(c.get("egress_packets", 0)), human_bytes(c.get("egress_bytes", 0)),
                  str(c.get("ingress_packets", 0)), str(h.get("packets", "-")),
                  str(h.get("drops", "-")), str(h.get("overlimits", "-")),
                  human_bytes(h.get("backlog", 0)))
    reasons = info.get("reasons") or {}
    eg = reasons.get("egress") or {}
    if eg:
        t.caption = "egress reasons: " + "  ".join(f"{k}={v}" for k, v in eg.items())
        t.caption_justify = "left"
    return t


# The SLA tables' columns: (header, field of mmmesh.sla.report.SlaMerged; "a.b" is
# field b of the object in field a).  tests/mmmeshctl/test_ctl.py checks the names
# against mmmesh/sla/report.py, so the schema stays the one source of them
# without importing pydantic here.
SLA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("STAGE", "stage"), ("CLASS", "sla_class"), ("MODALITY", "modality"),
    ("SIDECARS", "sources"), ("FRAMES", "frames"), ("IN DEADLINE", "attainment"),
    ("MISSES", "deadline_misses"), ("DROPS", "drops"), ("ERRORS", "errors"),
    ("E2E P50", "e2e_ms.p50"), ("E2E P99", "e2e_ms.p99"), ("AGE", "received_at"))


def _sla_table(rows: list[dict[str, Any]], title: str, *, per_stage: bool) -> Table:
    """Merged SLA rows (``SlaView.stages`` or ``.classes``, each a SlaMerged): one
    per stage and class (``sources`` = sidecars), or per class node-wide (no
    stage; ``sources`` = windows)."""
    t = plain_table(title)
    fields = [f for _, f in SLA_COLUMNS if per_stage or f != "stage"]
    for head, field in SLA_COLUMNS:
        if field in fields:
            t.add_column("WINDOWS" if field == "sources" and not per_stage else head,
                         justify="left" if field in ("stage", "sla_class", "modality")
                         else "right")
    for r in rows:
        t.add_row(*(_sla_cell(r, field) for field in fields))
    return t


def _sla_cell(row: dict[str, Any], field: str) -> Any:
    from rich.text import Text

    name, _, quantile = field.partition(".")
    value = row.get(name)
    if quantile:  # e2e_ms is None when no frame of the window had a timestamp
        return f"{value[quantile]:.1f} ms" if value else "-"
    if name == "attainment":
        att = float(row.get(name, 1.0))
        return Text(f"{att * 100:.1f}%", style="" if att >= 0.99 else "red")
    if name == "received_at":
        return _ago(value)
    return str(value)


# -- flows --------------------------------------------------------------------
def flows_table(flows: list[dict[str, Any]], where: str) -> Table:
    """``GET /v1/flows/top``: one row per flow, busiest first."""
    t = plain_table(f"top flows on {where}  ({time.strftime('%H:%M:%S')})")
    for col, just in (("SOURCE", "left"), ("DESTINATION", "left"), ("PROTO", "left"),
                      ("CLASS", "left"), ("MODALITY", "left"), ("RATE", "right"),
                      ("BYTES", "right"), ("PACKETS", "right"), ("IDLE", "right")):
        t.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for f in flows:
        cls = f.get("class_name") or (f"#{f.get('class_id')}" if f.get("class_id") else "-")
        t.add_row(
            f"{f.get('src')}:{f.get('sport')}", f"{f.get('dst')}:{f.get('dport')}",
            str(f.get("proto")), cls, str(f.get("modality") or "-"),
            human_rate(float(f.get("rate_bps") or 0.0)), human_bytes(f.get("bytes") or 0),
            str(f.get("packets")), f"{float(f.get('idle_s') or 0.0):.1f}s",
        )
    if not flows:
        t.caption = "no flows"
    return t
