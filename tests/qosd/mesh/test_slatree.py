"""The aggregated global SLA view (qosd.mesh.slaview.core.SlaTree): the trees'
shape, their messages' bytes, the sums against the truth, and the failure
model scripted on the simulator (deaths, joins, partitions, lying members).

The truth: every window's samples are known (testkit/slaview_sim.py), so a
record is checked against the exact union of the windows it merged."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosd.controller.core import from_cluster
from qosd.mesh.slaview.core import (
    CENSUS,
    Down,
    Part,
    SlaTree,
    Topology,
    TreeConfig,
    Up,
    add_parts,
    decode,
    up_digest,
)
from qosd.mesh.slaview.core._aggregate import leaf_part, record_row
from qosd.mesh.slaview.core.simulation import TreeSimulation
from testkit.slaview_sim import CLASSES, Fleet, Pool, truth

CFG = TreeConfig()
W = CFG.window_s


# --------------------------------------------------------------------------
# The trees' shape
# --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 9, 64, 300])
def test_one_members_paths_are_the_full_builds(n: int) -> None:
    ids = [f"m{i}" for i in range(n)]
    full = Topology.full(ids)
    for key in ("voice", CENSUS):
        for m in random.Random(n).sample(ids, min(n, 25)):
            assert full.path(key, m) == Topology.local(ids, m).path(key, m)


def test_fan_in_is_bounded_and_the_depth_logarithmic() -> None:
    ids = [f"node-{i}" for i in range(2000)]
    full = Topology.full(ids)
    for key in ("voice", "video"):
        paths = [full.path(key, m) for m in ids]
        roots = {p.arcs[-1].candidates[0] for p in paths}
        assert len(roots) == 1  # one root per tree, the same for every member
        fan = [len(a.children) for p in paths for a in p.arcs if a.children]
        assert 2 <= min(fan) and max(fan) <= 8
        assert max(len(p.arcs) for p in paths) <= 2 * math.ceil(math.log(2000, 8)) + 2
        # each member aggregates at most a few nodes of a tree
        roles = Counter(p.member for p in paths for a in p.arcs if a.candidates[0] == p.member)
        assert max(roles.values()) <= 4


def test_a_member_joining_or_dying_moves_only_the_nodes_on_its_path() -> None:
    ids = [f"node-{i}" for i in range(500)]
    before = Topology.full(ids)
    for change in (ids[:-1] + ["node-joined"], ids[1:]):  # one joins, one dies
        after = Topology.full(change)
        moved = sum(1 for m in set(ids) & set(change)
                    if before.path("voice", m).arcs[0].candidates[0]
                    != after.path("voice", m).arcs[0].candidates[0])
        assert moved <= 10, moved  # its leaf's siblings at most, never the fleet


# --------------------------------------------------------------------------
# The bytes
# --------------------------------------------------------------------------
POOL = Pool(7)


def _parts(n: int, k: int = 0) -> list[Part]:
    fleet = Fleet([f"n{i}" for i in range(n)], POOL, 7)
    return [leaf_part(w, -1.0 - 0.01 * i, 0.0, 15.0) for i in range(n)
            for w in fleet.windows(i, k)]


def test_messages_round_trip_and_their_size_is_their_bytes() -> None:
    merged = tuple(add_parts(_parts(40)).values())
    for parts in (tuple(_parts(1)), merged):
        up = Up("voice", 1234, 77, 9, 40, parts, None, (), 0.0)
        data = up.encode()
        assert up.wire == len(data)
        back = decode(data, 100.0)
        assert isinstance(back, Up) and up_digest(back) == up_digest(up)
        for a, b in zip(back.parts, parts, strict=True):
            assert (a.key, a.frames, a.misses, a.nodes, a.total) == (b.key, b.frames, b.misses,
                                                                     b.nodes, b.total)
            assert a.sketch == b.sketch
            assert abs((a.newest - 100.0) - b.newest) < 0.002  # ages, on the reader's clock
        rows = tuple(record_row(p) for p in parts)
        down = Down("voice", 3, "n1", 9, 2.4, 40, up_digest(up), rows, None, 0.0)
        assert down.wire == len(down.encode())
        got = decode(down.encode(), 5.0)
        assert isinstance(got, Down) and got.rows[0].quantiles == rows[0].quantiles


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hostile_bytes_are_refused_never_raise_anything_else(data: st.DataObject) -> None:
    up = Up("voice", 1234, 77, 9, 40, tuple(add_parts(_parts(6)).values()), None, (), 0.0)
    good = bytearray(up.encode())
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    tree = SlaTree("n0")
    tree.set_topology(Topology.local(["n0", "n1"], "n0"))
    try:
        decode(bytes(good))
    except ValueError:
        pass
    assert tree.on_message("n1", bytes(good), 1.0) is not None  # counted, not raised
    assert tree.on_message("n1", data.draw(st.binary(max_size=300)), 1.0) == []


# --------------------------------------------------------------------------
# The sums: every grouping of the tree gives the flat sum exactly
# --------------------------------------------------------------------------
def test_any_grouping_sums_to_the_same_quantiles() -> None:
    parts = _parts(60)
    flat = add_parts(parts)
    rng = random.Random(3)
    for _ in range(5):
        shuffled = parts[:]
        rng.shuffle(shuffled)
        cuts = sorted(rng.sample(range(1, len(shuffled)), 12))
        groups = [shuffled[a:b] for a, b in zip([0, *cuts], [*cuts, len(shuffled)],
                                                strict=True)]
        nested = add_parts(p for g in groups for p in add_parts(g).values())
        for k, p in flat.items():
            q = nested[k]
            assert (q.frames, q.misses, q.nodes, q.total) == (p.frames, p.misses, p.nodes,
                                                              p.total)
            assert record_row(q).quantiles == record_row(p).quantiles


# --------------------------------------------------------------------------
# The simulator: a fleet whose every sample is known
# --------------------------------------------------------------------------
class Fleetsim:
    """n members running the trees on the virtual clock, with a probe."""

    def __init__(self, n: int, *, loss: float = 0.0, seed: int = 1) -> None:
        self.ids = [f"node-{i}" for i in range(n)]
        self.ts = TreeSimulation(n, CFG, seed=seed, loss=loss, ids=self.ids + ["node-new"])
        self.ts.set_base(self.ids)
        self.pool = Pool(seed)
        self.fleet = Fleet(self.ids + ["node-new"], self.pool, seed)
        self.records: list[dict[str, Any]] = []
        for i, tree in enumerate(self.ts.trees):
            tree.on_publish = self._hook(i)
        for i in range(n):
            self.ts.start(i, at=0.0)
            self.fleet.drive(self.ts, i, 0.0)

    def _hook(self, i: int) -> Any:
        def hook(key: str, epoch: int, inputs: Any, rows: Any, now: float) -> None:
            if key == CENSUS:
                return
            t = truth(self.ts, self.pool, key, inputs)
            self.records.append({"t": now, "key": key, "root": self.ts.ids[i], "truth": t,
                                 "rows": rows})
        return hook

    def run(self, t: float) -> None:
        self.ts.run_until(t)

    def since(self, t: float) -> list[dict[str, Any]]:
        return [r for r in self.records if r["t"] >= t]

    def views(self, members: list[int]) -> list[dict[str, Any]]:
        now = self.ts.now
        return [self.ts.trees[i].snapshot(now) for i in members]


def exact_p99(pool: Pool, cls: str, counts: np.ndarray) -> float:
    got = pool.exact(cls, counts, 0.99)
    assert got is not None
    return got


def test_steady_state_every_view_is_the_exact_union_and_fresh() -> None:
    f = Fleetsim(60, loss=0.01)
    f.run(40.0)
    recs = f.since(15.0)
    assert len(recs) >= 5 * 8  # every class, every round
    for r in recs:
        t = r["truth"]
        assert t.lost == 0 and set(t.leaves) == set(f.ids) and max(t.leaves.values()) == 1
        for row in r["rows"]:
            if row.key[0] is None:
                want = exact_p99(f.pool, r["key"], t.counts[(None, r["key"])])
                got = row.quantiles[1]
                from mmmesh.sla import key_value
                assert abs((key_value(got) or 0) - want) <= 0.02 * want
                assert row.frames == t.frames[(None, r["key"])] and row.nodes == 60
    for snap in f.views([0, 17, 59]):
        assert snap["nodes_reporting"] == 60 and snap["members"] == 60
        assert {r["sla_class"] for r in snap["classes"]} == {c[0] for c in CLASSES}
        for row in snap["classes"]:
            assert row["nodes"] == 60 and not row["partial"]
            assert row["oldest_age_s"] <= 2 * W and row["age_s"] <= W
    stats = [f.ts.trees[i].stats for i in range(60)]
    assert sum(s.receipt_mismatches + s.receipt_missing + s.malformed + s.misrouted
               + s.oversized + s.unsolicited for s in stats) == 0


def test_a_dead_aggregators_subtree_comes_back_at_once_and_its_share_goes() -> None:
    f = Fleetsim(80)
    f.run(20.0)
    # the root of voice and an inner aggregator of video die
    voice_root = f.ts.trees[0].record_of("voice")
    assert voice_root is not None
    root = f.ids.index(voice_root[0])
    paths = [f.ts.topology(i).path("video", m) for i, m in enumerate(f.ids)]
    inner = next(f.ids.index(a.candidates[0]) for p in paths for a in p.arcs[:-1]
                 if a.candidates[0] != f.ids[root])
    t0 = f.ts.now
    for v in (root, inner):
        f.ts.crash(v)
    alive = [m for i, m in enumerate(f.ids) if i not in (root, inner)]
    f.run(t0 + 2 * W)
    # within two windows, before anyone declares them dead: every record holds
    # every live member once, and nothing of the dead
    late = f.since(t0 + W)
    assert late
    for r in late:
        assert set(r["truth"].leaves) == set(alive) and max(r["truth"].leaves.values()) == 1
    for i, m in enumerate(f.ids):  # then the membership says so: the trees re-form
        for v in (root, inner):
            if i not in (root, inner):
                f.ts.learn_dead(i, f.ids[v])
    f.run(t0 + 5 * W)
    for r in f.since(t0 + 4 * W):
        assert set(r["truth"].leaves) == set(alive)
    for snap in f.views([1, 2]):
        assert all(row["nodes"] == len(alive) for row in snap["classes"])


def test_a_joiner_is_in_every_record_within_two_rounds() -> None:
    f = Fleetsim(40)
    f.run(15.0)
    new = len(f.ids)  # "node-new"
    f.ts.set_base(f.ids)
    t0 = f.ts.now
    f.ts.start(new, at=t0)
    f.fleet.drive(f.ts, new, t0)
    for i in range(len(f.ids)):
        f.ts.sim.at(t0 + 1.0, lambda i=i: f.ts.learn_alive(i, "node-new"))  # gossip: ~1 s
    f.ts.sim.at(t0, lambda: f.ts.learn_alive(new, "node-new"))
    f.run(t0 + 3 * CFG.epoch_s + 2.0)
    recent = f.since(t0 + 2 * CFG.epoch_s + 1.0)
    assert recent and all("node-new" in r["truth"].leaves for r in recent)
    assert all(max(r["truth"].leaves.values()) == 1 for r in recent)
    snap = f.ts.trees[new].snapshot(f.ts.now)
    assert snap["nodes_reporting"] == 41 and all(r["nodes"] == 41 for r in snap["classes"])


def test_a_partition_gives_each_side_its_own_view_and_heals() -> None:
    f = Fleetsim(40)
    f.run(15.0)
    a, b = list(range(20)), list(range(20, 40))
    f.ts.partition([a, b])
    t0 = f.ts.now
    f.run(t0 + 3 * W)  # calls across time out: each side routes around the other
    for side, other in ((a, b), (b, a)):
        for i in side:  # the membership declares the other side dead
            for j in other:
                f.ts.learn_dead(i, f.ids[j])
    f.run(t0 + 6 * W)
    for side in (a, b):
        snap = f.ts.trees[side[0]].snapshot(f.ts.now)
        assert snap["nodes_reporting"] == 20
        assert all(r["nodes"] == 20 for r in snap["classes"]), snap["classes"]
    f.ts.heal()
    for i in range(40):
        for j in range(40):
            if i != j:
                f.ts.learn_alive(i, f.ids[j])
    t1 = f.ts.now
    f.run(t1 + 4 * W)
    for r in f.since(t1 + 2 * W):
        assert set(r["truth"].leaves) == set(f.ids)
    assert all(r["nodes"] == 40 for r in f.ts.trees[5].snapshot(f.ts.now)["classes"])


# --------------------------------------------------------------------------
# Lying within what identity allows
# --------------------------------------------------------------------------
def _tree(me: str, members: list[str]) -> SlaTree:
    t = SlaTree(me)
    t.set_topology(Topology.local(members, me))
    return t


def test_a_member_speaks_for_the_nodes_above_itself_only() -> None:
    members = [f"node-{i}" for i in range(50)]
    topo = Topology.full(members)
    path = topo.path("voice", "node-3")
    agg = path.arcs[0].candidates[0]
    tree = _tree(agg, members)
    parts = tuple(_parts(1))
    leaf = Up("voice", 0, path.arcs[0].id, 1, 1, parts, None, (), 0.0)
    assert tree.on_message("node-3", leaf, 0.0) is not None
    assert tree.stats.accepted == 1
    # the same leaf counting 5 members, or rows of 2: refused
    for bad in (Up("voice", 0, path.arcs[0].id, 2, 5, parts, None, (), 0.0),
                Up("voice", 0, path.arcs[0].id, 3, 1,
                   tuple(add_parts(_parts(2)).values()), None, (), 0.0)):
        tree.on_message("node-3", bad, 0.0)
    assert tree.stats.oversized == 2
    # a member not under that node cannot send it an input
    outsider = next(m for m in members if m not in
                    {x for a in path.arcs[:1] for x in a.candidates} and
                    topo.path("voice", m).arcs[0].id != path.arcs[0].id)
    tree.on_message(outsider, Up("voice", 0, path.arcs[0].id, 4, 1, parts, None, (), 0.0), 0.0)
    assert tree.stats.misrouted == 1
    # nor can anybody push this member a record it did not ask for
    tree.on_message("node-9", Down("voice", 1, "node-9", 12345, 1.0, 1, 0, (), None, 0.0), 0.0)
    assert tree.stats.unsolicited == 1


class Liar:
    """Makes member ``i`` of a simulation drop (or change) one child's input."""

    def __init__(self, f: Fleetsim, i: int, victim: str, *, rewrite: bool) -> None:
        tree = f.ts.trees[i]
        orig = tree.on_message

        def lying(sender: str, msg: Any, now: float) -> Any:
            if sender == victim and isinstance(msg, Up):
                if not rewrite:
                    return []  # dropped: the victim's windows never go up
                msg = Up(msg.key, msg.src, msg.dst, msg.seq, msg.count,
                         tuple(Part(p.key, p.frames * 10, p.misses, p.nodes, p.stale,
                                    p.sketched, p.sketch, p.lo, p.hi, p.window_ms, p.newest,
                                    p.oldest, p.total) for p in msg.parts),
                         msg.census, msg.inputs, msg.t0)
            return orig(sender, msg, now)

        tree.on_message = lying  # type: ignore[method-assign]


@pytest.mark.parametrize("rewrite", [False, True])
def test_an_aggregator_that_drops_or_rewrites_a_share_is_routed_around(rewrite: bool) -> None:
    f = Fleetsim(50)
    paths = [f.ts.topology(i).path("voice", m) for i, m in enumerate(f.ids)]
    victim_i, parent = next((i, p.arcs[0].candidates[0]) for i, p in enumerate(paths)
                            if p.arcs[0].candidates[0] != f.ids[i] and len(p.arcs) > 1)
    victim = f.ids[victim_i]
    Liar(f, f.ids.index(parent), victim, rewrite=rewrite)
    f.run(60.0)
    stats = f.ts.trees[victim_i].stats
    assert (stats.receipt_mismatches if rewrite else stats.receipt_missing) >= 1
    # from then on the victim's windows are in every record, counted right
    for r in f.since(45.0):
        if r["key"] != "voice":
            continue
        assert r["truth"].leaves[victim] == 1, r["t"]
        row = next(x for x in r["rows"] if x.key[0] is None)
        assert row.frames == r["truth"].frames[(None, "voice")]


# --------------------------------------------------------------------------
# The controller reads the same keys, with the same meaning
# --------------------------------------------------------------------------
def test_the_controller_reads_the_aggregated_view() -> None:
    f = Fleetsim(30)
    f.run(30.0)
    now = f.ts.now
    snap = f.ts.trees[4].snapshot(now, {"voice": 120.0}, nodes=True)
    inp = from_cluster(snap, now, suspect_fraction=0.1)
    voice = inp.classes["voice"]
    row = next(r for r in snap["classes"] if r["sla_class"] == "voice")
    assert voice.frames == row["frames"] and voice.nodes == 30
    assert voice.p99_ms == row["p99_ms"] and voice.attainment == pytest.approx(row["attainment"])
    assert 0 <= voice.age_s <= W  # the newest window merged
    assert set(inp.stages) == {(c[0], s) for c in CLASSES
                               for s in ("ingest", "encode", "fuse", "decode")}
    # a record gone stale counts as no data: nothing merged, its age beyond the limit
    later = now + CFG.stale_s + 1.0
    for i in range(30):
        f.ts.crash(i)
    stale = from_cluster(f.ts.trees[4].snapshot(later, nodes=True), later, 0.0)
    assert all(m.frames == 0 and m.nodes == 0 for m in stale.classes.values())
