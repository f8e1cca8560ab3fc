"""The aggregated SLA view on a virtual clock, measured: a fleet whose windows
are known sample by sample, the real ``SlaTree`` cores exchanging them
(``qosd.mesh.slaview.core.simulation.TreeSimulation``), and a probe that
compares what the members' views say with the truth (bench/cluster.py and
tests/qosd/mesh/test_slatree.py).

The fleet: ``CLASSES`` (5 classes, each of one modality, with its frames per
window and a lognormal latency), ``STAGES`` (node i hosts stage i mod 4:
every class's frames pass it, so a node reports per class a node-wide row
and one stage row, the same window).  Every node's window of a class is one
of ``POOL`` sample sets drawn once per class (seeded); node i's window k
ends at ``phase_i + k x window``: a sidecar's window, reported when it closes.

The truth of a record: its root's inputs are followed down to the leaves
(``SlaTree.merged``), each leaf's sketch tells which sample set it was, so
the union of every merged window's samples is known exactly: its p99 (lower
nearest rank, as the sketches' rank rule), which members it holds and how
many times each.
"""

from __future__ import annotations

import random
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ddsketch import DDSketch

from mmmesh.sla import Sketch, key_value
from mmmesh.sla.sketch import encode_sketch, parse_sketch
from qosd.mesh.slaview.core import CENSUS, RecordRow, SlaTree, Topology, Window, sketch_keys
from qosd.mesh.slaview.core.simulation import TreeSimulation

# (class, modality, frames per 5 s window, median ms, sigma)
CLASSES = (("control", "control", 100, 8.0, 0.35), ("voice", "audio", 250, 25.0, 0.4),
           ("video", "video", 150, 60.0, 0.45), ("lidar", "point_cloud", 50, 40.0, 0.5),
           ("best-effort", "tensor", 25, 80.0, 0.5))
STAGES = ("ingest", "encode", "fuse", "decode")
POOL = 48


@dataclass
class Entry:
    samples: np.ndarray
    sketch: Sketch
    misses: int


class Pool:
    """``POOL`` sample sets per class, their canonical sketches, and the
    sorted union of them all (for exact quantiles of any multiset of them)."""

    def __init__(self, seed: int, size: int = POOL) -> None:
        rng = np.random.default_rng(seed)
        self.entries: dict[str, list[Entry]] = {}
        self.of_sketch: dict[int, tuple[str, int]] = {}  # id(sketch) -> (class, entry)
        self.sorted: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for cls, _, frames, median, sigma in CLASSES:
            entries = []
            for k in range(size):
                xs = rng.lognormal(np.log(median), sigma, frames)
                sk = DDSketch(0.01)
                for x in xs:
                    sk.add(float(x))
                canon = parse_sketch(encode_sketch(sk) or "")
                entries.append(Entry(np.sort(xs), canon, int((xs > 3 * median).sum())))
                self.of_sketch[id(canon)] = (cls, k)
            self.entries[cls] = entries
            values = np.concatenate([e.samples for e in entries])
            owner = np.concatenate([np.full(len(e.samples), k) for k, e in enumerate(entries)])
            order = np.argsort(values, kind="stable")
            self.sorted[cls] = (values[order], owner[order])

    def exact(self, cls: str, counts: np.ndarray, q: float) -> float | None:
        """The q-quantile of the union of ``counts[k]`` copies of entry k
        (lower nearest rank: the value at rank floor(q x (n - 1)))."""
        values, owner = self.sorted[cls]
        w = counts[owner]
        cum = np.cumsum(w)
        n = int(cum[-1]) if len(cum) else 0
        if n == 0:
            return None
        rank = int(q * (n - 1))
        return float(values[int(np.searchsorted(cum, rank, side="right"))])


class Fleet:
    """Who reports what when: node i's stage, window phase and sample sets."""

    def __init__(self, ids: Sequence[str], pool: Pool, seed: int, window_s: float = 5.0) -> None:
        self.ids, self.pool, self.window_s = list(ids), pool, window_s
        rng = random.Random(seed)
        self.phase = [rng.random() * window_s for _ in ids]
        self.seed = seed

    def stage(self, i: int) -> str:
        return STAGES[i % len(STAGES)]

    def entry(self, i: int, k: int, cls: str) -> int:
        return zlib.crc32(f"{self.seed}/{i}/{k}/{cls}".encode()) % len(self.pool.entries[cls])

    def windows(self, i: int, k: int) -> list[Window]:
        out = []
        for cls, mod, _, _, _ in CLASSES:
            e = self.pool.entries[cls][self.entry(i, k, cls)]
            q = sketch_keys(e.sketch)
            frames = len(e.samples)
            ms = round(self.window_s * 1000)
            out.append(Window(None, cls, mod, frames, e.misses, ms, 0, q, e.sketch))
            out.append(Window(self.stage(i), cls, mod, frames, e.misses, ms, 0, q, e.sketch))
        return out

    def drive(self, ts: TreeSimulation, i: int, start: float) -> None:
        """Node i's windows into its tree from ``start`` on, as they close."""
        w = self.window_s
        k0 = max(0, int((start - self.phase[i]) // w) + 1)

        def close(k: int) -> None:
            if ts.running[i]:
                ts.set_windows(i, self.windows(i, k))
                ts.sim.at(self.phase[i] + (k + 1) * w, lambda: close(k + 1))

        ts.sim.at(self.phase[i] + k0 * w, lambda: close(k0))


@dataclass
class Truth:
    """What one record merged, by following it down to the leaves."""

    leaves: Counter[str] = field(default_factory=Counter)
    counts: dict[tuple[str | None, str], np.ndarray] = field(default_factory=dict)
    frames: dict[tuple[str | None, str], int] = field(default_factory=dict)
    lost: int = 0
    """Inputs no longer held by their sender (the truth is then incomplete)."""


def truth(ts: TreeSimulation, pool: Pool, key: str,
          inputs: Iterable[tuple[str, int, int]]) -> Truth:
    out = Truth()
    stack = list(inputs)
    trees = ts.trees
    index = ts.index
    of_sketch = pool.of_sketch
    while stack:
        sender, seq, _ = stack.pop()
        got = trees[index[sender]].merged(key, seq)
        if got is None:
            out.lost += 1
            continue
        sub, parts = got
        if parts is None:
            stack += sub
            continue
        out.leaves[sender] += 1
        for p in parts:
            if p.sketch is None or not p.nodes:
                continue
            cls, k = of_sketch[id(p.sketch)]
            row = (p.key[0], cls)
            c = out.counts.get(row)
            if c is None:
                c = out.counts[row] = np.zeros(len(pool.entries[cls]), dtype=np.int64)
            c[k] += 1
            out.frames[row] = out.frames.get(row, 0) + p.frames
    return out


def deep_size(obj: Any, skip: tuple[type, ...] = ()) -> int:
    """Bytes of ``obj`` and everything it reaches (``skip``: types not followed)."""
    seen: set[int] = set()
    stack = [obj]
    size = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (*skip, type)):
            continue
        seen.add(id(o))
        size += sys.getsizeof(o)
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack += list(o)
        else:
            slots = getattr(type(o), "__slots__", ())
            for s in (slots,) if isinstance(slots, str) else slots:
                if hasattr(o, s):
                    stack.append(getattr(o, s))
            d = getattr(o, "__dict__", None)
            if d is not None:
                stack.append(d)
    return size


def view_bytes(tree: SlaTree, members: Sequence[str]) -> int:
    """What one member holds for the view: its core (records, inputs,
    forwards, own windows) and its own paths of every tree (what
    ``Topology.local`` keeps; the member ids are the membership's, counted
    once as the pointers of one tuple)."""
    core = deep_size(tree, skip=(Topology,))
    local = Topology.local(members, tree.node_id, bits=tree.config.bits)
    for key in [CENSUS, *tree.classes]:
        local.path(key, tree.node_id)
    paths = deep_size(local.paths())
    return core + paths + sys.getsizeof(local.members)


def row_p99(r: RecordRow) -> float | None:
    return key_value(r.quantiles[1])
