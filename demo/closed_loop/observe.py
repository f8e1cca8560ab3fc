"""What the closed-loop demo (:mod:`demo.closed_loop.run`) watches.

* :class:`Observer`, a thread in the demo's process while the pipeline runs:
  every SLA window the stages on the edge node reported (their node's qosd
  board, ``GET /v1/sla``: each sidecar's own window, once), and the HTB
  parameters of every class on the sensors' uplink as the kernel holds them
  (the sensors node's qosd, ``GET /v1/status``: qosd runs under ``ip netns
  exec`` with a bpffs of its own, so its API is the way to the kernel), each
  change with its time;
* every controller window as the sensors node's qosd explains it (``GET
  /v1/sla/explain``: verdict, measurement, streaks, the values it holds, the
  step's timing: when it read its input, decided, wrote the kernel) and the
  load its last increase was tied to (its state file's ``need``);
* around the times that matter (:meth:`Observer.focus`: the flood's start and
  stop), every 0.2 s, the watched class's rows in the global SLA view of the
  edge node (its own windows: the local view) and of the sensors node (its
  peers': what the controller reads), ``GET /v1/cluster/sla``: when each
  node's window first shows there (its data time is the view's ``now - age``,
  the time the origin's board took it).  That is the loop's delay budget
  (:func:`.report.delay_budget`).

The flood is :mod:`.closed_loop_flood`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmmesh.errors import MeshError
from mmmesh.policy import QUANTUM_UNIT

Params = dict[str, dict[str, int]]  # class -> {rate, ceil, weight, priority}
Change = dict[str, Any]  # {"t", "class", "knob", "old", "new"}, as the observer records them


def kernel_params(uplink: dict[str, Any]) -> Params:
    """Per class, rate and ceil (bit/s), weight and priority as the kernel's
    HTB classes hold them (an uplink of qosd's ``/v1/status``)."""
    out: Params = {}
    for name, c in (uplink.get("classes") or {}).items():
        h = c.get("htb") or {}
        if h.get("rate_Bps") is None:
            continue
        out[name] = {"rate": int(h["rate_Bps"]) * 8, "ceil": int(h.get("ceil_Bps") or 0) * 8,
                     "weight": int(h.get("quantum") or 0) // QUANTUM_UNIT,
                     "priority": int(h.get("prio") or 0)}
    return out


@dataclass
class Observation:
    """What one run saw: the windows (board rows) and the kernel's changes."""

    windows: list[dict[str, Any]] = field(default_factory=list)
    initial: Params = field(default_factory=dict)
    changes: list[dict[str, Any]] = field(default_factory=list)
    """{"t", "class", "knob", "old", "new"} in time order."""
    counters: list[tuple[float, int, int, int]] = field(default_factory=list)
    """The watched class's HTB counters: (t, bytes, drops, backlog bytes)."""
    controller: list[dict[str, Any]] = field(default_factory=list)
    """One row per controller window (``GET /v1/sla/explain``), in order."""
    loop: list[dict[str, Any]] = field(default_factory=list)
    """The controller's steps as qosd timed them (explain's ``loop``), in order."""
    views: list[dict[str, Any]] = field(default_factory=list)
    """{"view", "stage", "origin", "data_t", "seen"}: a node's window of the
    watched class first seen in a node's global view (``stage`` None: the
    class row)."""
    errors: int = 0

    def params_at(self, t: float) -> Params:
        """The kernel's parameters at unix time ``t``."""
        return params_at(self.initial, self.changes, t)


def params_at(initial: Params, changes: list[Change], t: float) -> Params:
    """The parameters at time ``t``: ``initial`` with every change up to it."""
    p = {c: dict(v) for c, v in initial.items()}
    for ch in sorted(changes, key=lambda c: c["t"]):
        if ch["t"] > t:
            break
        p.setdefault(ch["class"], {})[ch["knob"]] = ch["new"]
    return p


class Observer:
    """Polls the mesh (``request(node, method, path)``, as
    :meth:`~.pipeline_mesh.PipelineMesh.request`) until :meth:`stop`."""

    def __init__(self, request: Callable[..., Any], uplink: str, *, board_node: str = "edge",
                 kernel_node: str = "sensors", stages: tuple[str, ...] = (),
                 kernel_every_s: float = 0.25, board_every_s: float = 0.5,
                 view_every_s: float = 0.2, view_nodes: tuple[str, ...] = ("edge", "sensors"),
                 watch: str = "voice", state_file: Path | None = None) -> None:
        self.request = request
        self.uplink = uplink
        self.board_node, self.kernel_node = board_node, kernel_node
        self.stages = set(stages)
        self.watch, self.state_file = watch, state_file
        self.kernel_every_s, self.board_every_s = kernel_every_s, board_every_s
        self.view_every_s, self.view_nodes = view_every_s, view_nodes
        self._focus: list[tuple[float, float]] = []
        self._loop_seen: set[tuple[int, float]] = set()
        self.seen = Observation()
        self._keys: set[tuple[Any, ...]] = set()
        self._last: Params = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="closed-loop-observer",
                                        daemon=True)

    def start(self) -> Observer:
        self._poll_kernel()  # the parameters before anything runs
        self._thread.start()
        return self

    def stop(self) -> Observation:
        self._stop.set()
        self._thread.join(10.0)
        with contextlib.suppress(MeshError, OSError):
            self._poll_board()
        return self.seen

    def focus(self, spans: list[tuple[float, float]]) -> None:
        """Unix-time spans in which the global views are watched too (each
        poll costs every qosd a snapshot: only where the delay is measured)."""
        self._focus = sorted(spans)

    def _run(self) -> None:
        # a thread with a larger share of the CPU (nice -10, this thread only): on a busy
        # host its polls still come on time (they measure the loop, they must not lag it)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        next_board = next_kernel = 0.0
        while not self._stop.wait(min(self.kernel_every_s, self.view_every_s)):
            try:
                mono, wall = time.monotonic(), time.time()
                if any(a <= wall <= b for a, b in self._focus):
                    self._poll_views()
                if mono >= next_kernel:
                    next_kernel = mono + self.kernel_every_s
                    self._poll_kernel()
                if mono >= next_board:
                    next_board = mono + self.board_every_s
                    self._poll_board()
                    self._poll_controller()
            except (MeshError, OSError, KeyError, ValueError, TypeError):
                self.seen.errors += 1

    def _poll_views(self) -> None:
        """Each node's windows of the watched class in each view node's
        global view: the first poll that holds a new one (by its data time)."""
        for node in self.view_nodes:
            view = self.request(node, "GET", "/v1/cluster/sla", timeout=2.0)
            now = time.time()
            for row in (view.get("classes") or []) + (view.get("stages") or []):
                if row.get("sla_class") != self.watch:
                    continue
                stage = row.get("stage")
                if stage is not None and self.stages and stage not in self.stages:
                    continue
                for b in row.get("breakdown") or []:
                    if b.get("age_s") is None or b.get("stale"):
                        continue
                    data_t = now - float(b["age_s"])
                    key = (node, stage, b.get("node"))
                    if any(v["data_t"] > data_t - 0.5 for v in self.seen.views[-40:]
                           if (v["view"], v["stage"], v["origin"]) == key):
                        continue
                    self.seen.views.append({"view": node, "stage": stage,
                                            "origin": b.get("node"),
                                            "data_t": round(data_t, 3), "seen": round(now, 3)})

    def _poll_kernel(self) -> None:
        status = self.request(self.kernel_node, "GET", "/v1/status", timeout=5.0)
        now = time.time()
        uplink = (status.get("uplinks") or {}).get(self.uplink) or {}
        params = kernel_params(uplink)
        if not params:
            return
        h = ((uplink.get("classes") or {}).get(self.watch) or {}).get("htb") or {}
        self.seen.counters.append((now, int(h.get("bytes") or 0), int(h.get("drops") or 0),
                                   int(h.get("backlog") or 0)))
        if not self._last:
            self.seen.initial = {c: dict(v) for c, v in params.items()}
        else:
            for cls, knobs in params.items():
                for knob, new in knobs.items():
                    old = self._last.get(cls, {}).get(knob)
                    if old is not None and old != new:
                        self.seen.changes.append({"t": now, "class": cls, "knob": knob,
                                                  "old": old, "new": new})
        self._last = params

    def _poll_board(self) -> None:
        view = self.request(self.board_node, "GET", "/v1/sla", timeout=5.0)
        for row in view.get("instances") or []:
            if self.stages and row.get("stage") not in self.stages:
                continue
            key = (row.get("stage"), row.get("sla_class"), row.get("modality"),
                   row.get("received_at"))
            if key in self._keys:
                continue
            self._keys.add(key)
            e2e = row.get("e2e_ms") or {}
            self.seen.windows.append({
                "stage": row.get("stage"), "class": row.get("sla_class"),
                "modality": row.get("modality"), "end": float(row["received_at"]),
                "window_s": float(row.get("window_s") or 0.0),
                "frames": int(row.get("frames") or 0),
                "misses": int(row.get("deadline_misses") or 0),
                "attainment": row.get("attainment"), "p99_ms": e2e.get("p99"),
                "p50_ms": e2e.get("p50")})


    def _poll_controller(self) -> None:
        """The controller's latest window as explain shows it (the watched
        class: verdict, measurement, streaks, state, the values it holds),
        and the load its last increase was tied to (the state file's
        ``need``: what "load eased" is measured against)."""
        ex = self.request(self.kernel_node, "GET", "/v1/sla/explain", timeout=5.0)
        if not isinstance(ex, dict) or ex.get("enabled") is False:
            return
        for step in ex.get("loop") or []:  # the controller's own timing of its steps
            key = (int(step.get("window", -1)), float(step.get("woke", 0.0)))
            if key not in self._loop_seen:
                self._loop_seen.add(key)
                self.seen.loop.append(dict(step))
        window, now = int(ex.get("window") or 0), ex.get("now")
        if window <= 0 or now is None or (self.seen.controller and
                                          self.seen.controller[-1]["t"] >= float(now)):
            return  # no window yet, or the one already seen (a new policy restarts the count)
        row: dict[str, Any] = {"window": window, "t": float(now),
                               "frozen": bool(ex.get("frozen"))}
        for c in ex.get("classes") or []:
            if c.get("class") != self.watch:
                continue
            m = c.get("measured") or {}
            row.update(state=c.get("state"), verdict=m.get("verdict"), why=m.get("why"),
                       p99_ms=m.get("p99_ms"), attainment=m.get("attainment"),
                       frames=m.get("frames"), streaks=c.get("streaks"),
                       values={k: v.get("current") for k, v in (c.get("params") or {}).items()})
        if self.state_file is not None:
            with contextlib.suppress(OSError, ValueError):
                snap = json.loads(self.state_file.read_text())
                row["need"] = ((snap.get("classes") or {}).get(self.watch) or {}).get("need")
        self.seen.controller.append(row)


__all__ = ["Observation", "Observer", "kernel_params"]
