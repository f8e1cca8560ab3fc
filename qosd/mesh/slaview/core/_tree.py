"""The aggregated global SLA view: :class:`SlaTree`, one member's part in the
per-class aggregation trees (docs/cluster.md, "Global SLA view").

Every tree (one per SLA class, plus the census ``""``) is derived from the
member list (``_topology``): each member sends its own windows of the class
up to the aggregator of its leaf's node, each aggregator sends the sum of its
node's inputs up to the aggregator of the node above, and the root's sum,
made into a *record* (counts and quantile keys), goes back down the way the
partials came, to every member.  A member therefore holds O(classes x rows)
of view whatever the fleet's size, and each message has at most ``2^bits``
inputs.

A *round* (``epoch_s``): every member of a tree samples its own windows at
about the same moment (the record says when the next sample is due, so the
members lock onto the root's phase), an aggregator forwards as soon as every
input of its node is in (or at a deadline that grows toward the root), the
root publishes, and the record comes back down at once.  A round costs each
member one partial up and one record down per tree, and the view is about a
round plus the member's own window old.

Rules that keep it exact:

* each message is merged exactly once: an aggregator merges the newest
  input of each sender since it last forwarded, and forgets them when it
  forwards; a late input goes into the next round, never into two;
* a member sends each message to one member only (the node's aggregator, or
  its backups after a send that surely failed); a send that *may* have
  arrived (a timeout) is never sent again elsewhere;
* a record reaches a member only from a member it sent to in that round,
  with the receipt of what it sent (its counts as merged: ``digest``); a
  member whose receipt does not match stops trusting that parent and sends
  to the node's backup instead.

Identity: the host checks who sent a message (mutual TLS) before
:meth:`SlaTree.on_message`, which then checks that the sender may send it:
a member contributes to the nodes above its own leaf only, a partial names
a node under the one it is for, counts no more members than the node has
(plus slack for joiners), a leaf counts one member.  So a member can
misreport its own windows but cannot speak for another, and an aggregator
that drops or changes an input is found out by the member it came from.

The host drives it (sans-I/O: no sockets, clocks or threads)::

    tree = SlaTree("node-a", TreeConfig(), seq_start=wall_clock_us)
    tree.set_topology(Topology.local(members, "node-a"))    # again on every change
    tree.local_windows(board.view(), now, wall=time.time())
    for out in tree.tick(now):        # and on_message(sender, msg, now), on_failed(out, ...)
        send(out.to, out.msg.encode())
    tree.next_deadline()              # when tick has work
    tree.snapshot(now, targets)       # the view (GET /v1/cluster/sla)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mmmesh.sla import MAX_NAME, NO_KEY, attainment, check_positive, key_value

from ._aggregate import (
    Census,
    Part,
    RecordRow,
    add_parts,
    census_of,
    leaf_part,
    record_row,
    snapshot_row,
)
from ._board import board_windows
from ._codec import Key, Window
from ._merge import collapse
from ._topology import Arc, Path, Topology, contains, position, position_of_arc, valid_arc
from ._tree_wire import MAX_CLASSES, Down, Up, decode, up_digest

__all__ = ["CENSUS", "HeldRecord", "Out", "SlaTree", "TreeConfig", "TreeStats",
           "view_snapshot"]

CENSUS = ""
"""The census tree's key: who contributes, who reports, which classes."""

PublishHook = Callable[[str, int, tuple[tuple[str, int, int], ...], tuple[RecordRow, ...], float],
                       None]


@dataclass(frozen=True)
class TreeConfig:
    """The trees' constants, in one place (docs/cluster.md has them with the
    reasons).  Times are seconds."""

    epoch_s: float = 2.5
    """A round: every member samples its windows this often (two per window)."""
    window_s: float = 5.0
    """The sidecars' SLA window (ages are counted in them)."""
    stale_windows: float = 3.0
    """A window, or a record whose newest window, is older than this many
    windows: stale (listed, nothing merged: the controller's no-data)."""
    forget_windows: float = 6.0
    """A record older than this many windows is dropped."""
    base_s: float = 0.8
    """An aggregator waits for its inputs at most ``base_s`` + ``slot_s`` x
    (depth estimate - its node's depth) after its sample: deeper nodes
    forward first."""
    slot_s: float = 0.2
    bits: int = 3
    """Digits of the trie: a node has at most 2^bits (8) inputs."""
    max_classes: int = MAX_CLASSES
    max_rows: int = 64
    """Rows of one class a member contributes (node-wide and stage rows)."""
    max_sketch_bins: int = 512
    history_rounds: float = 3.0
    """Rounds a member remembers what it sent (receipts come within one)."""
    unreachable_s: float = 30.0
    """A member a send to failed is avoided this long (its backup is used),
    or until it sends something (an alive member does every round)."""
    distrust_s: float = 60.0
    """A parent whose receipt did not match is avoided this long."""
    receipt_rounds: int = 4
    """Rounds in a row without a receipt of its own leaf after which a member
    avoids the member it sent it to (as one whose receipt did not match)."""
    count_slack: int = 16
    """Members a partial may count beyond its node's size in this view (joiners)."""

    def __post_init__(self) -> None:
        check_positive(self, "slatree")
        if not 1 <= self.bits <= 6:
            raise ValueError("slatree.bits must be within 1..6")

    @property
    def stale_s(self) -> float:
        return self.stale_windows * self.window_s

    @property
    def forget_s(self) -> float:
        return self.forget_windows * self.window_s


@dataclass
class TreeStats:
    """Counters since start (for metrics; never reset)."""

    sampled: int = 0
    """Own contributions made (one per tree and round)."""
    ups_sent: int = 0
    downs_sent: int = 0
    ups_received: int = 0
    downs_received: int = 0
    forwarded: int = 0
    """Partials this member sent up as an aggregator."""
    forwarded_incomplete: int = 0
    """Of them, at the deadline with an input missing."""
    published: int = 0
    """Records this member published as a root."""
    accepted: int = 0
    """Inputs merged."""
    older: int = 0
    """Inputs replaced by a newer one of the same sender before a forward."""
    late: int = 0
    """Inputs that came after their round was forwarded: dropped (the next
    round has their sender's newer windows; merging both would count it twice)."""
    malformed: int = 0
    """Messages that could not be read."""
    misrouted: int = 0
    """Inputs for a node the sender (or this member) is not under: dropped."""
    oversized: int = 0
    """Inputs counting more members than their node has: dropped."""
    unsolicited: int = 0
    """Records from a member this one did not send to: dropped."""
    receipt_mismatches: int = 0
    """Receipts that did not match what this member sent (parent avoided)."""
    receipt_missing: int = 0
    """Parents avoided for returning no receipt ``receipt_rounds`` rounds in a row."""
    retargets: int = 0
    """Sends that failed for sure and went to a backup at once."""
    send_failures: int = 0
    records_received: int = 0
    records_expired: int = 0
    local_skipped: int = 0
    """Board rows that could not be read."""
    rows_left_out: int = 0
    """Rows beyond ``max_rows`` of a class."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Out:
    """A message to send: ``msg.encode()`` to member ``to``."""

    to: str
    msg: Up | Down


@dataclass(slots=True)
class _Fwd:
    """Something this member sent up (or published): what it merged."""

    seq: int
    arc: int
    """The node it is the sum of (0: this member's own leaf)."""
    inputs: tuple[tuple[str, int, int], ...]
    """(sender, seq, digest) merged."""
    to: str
    """Whom it went to ("": this member itself, or published)."""
    digest: int
    at: float
    level: int
    """The index in the path of the node it went to (for a re-send)."""
    msg: Up | None = None
    missing: tuple[str, ...] = ()
    """Inputs of the node expected but not merged: their senders get the
    record too (without a receipt), so a member out of phase locks on, and
    one that is gone is found out (the send fails) instead of waited for."""


@dataclass(slots=True)
class HeldRecord:
    root: str
    epoch: int
    rows: tuple[RecordRow, ...]
    """Times on this member's clock."""
    census: Census | None
    count: int
    at: float
    newest: float = 0.0
    """End of the newest window in it (``at`` when none)."""
    oldest: float = 0.0

    def __post_init__(self) -> None:
        rows = [r for r in self.rows if r.nodes]
        self.newest = max((r.newest for r in rows), default=self.at)
        self.oldest = min((r.oldest for r in rows), default=self.at)


@dataclass
class _Tree:
    key: str
    path: Path | None = None
    next_sample: float = -math.inf
    pending: dict[int, dict[tuple[str, int], tuple[Up, float]]] = field(default_factory=dict)
    """node -> (sender, src) -> (its newest input since the node's last forward, when)"""
    deadline: dict[int, float] = field(default_factory=dict)
    forwarded_at: dict[int, float] = field(default_factory=dict)
    """node -> when this member last forwarded it."""
    late: set[str] = field(default_factory=set)
    """Members whose input came after its round was forwarded (dropped): they
    are out of phase, and get the next record to lock on."""
    round_start: dict[int, float] = field(default_factory=dict)
    """node -> this member's sample time of the round it is collecting: only
    inputs that came after half a round before it complete the node (a late
    one of the round before is merged, but waits for its sender's newer)."""
    fwds: dict[int, _Fwd] = field(default_factory=dict)
    record: HeldRecord | None = None
    epoch: int = 0
    merged_leaf: _Fwd | None = None
    merged_epoch: tuple[str, int] | None = None
    last_leaf: _Fwd | None = None
    unreceipted: int = 0
    """Rounds in a row whose own leaf the member it went to did not return a
    receipt for (it dropped it, or merged it where no record came from)."""
    leaf: tuple[tuple[Part, ...], Census | None, int, float] | None = None
    """This member's own parts of the tree and census, and until when they
    hold (a fresh window turns stale then): made again when windows change."""


class SlaTree:
    """This member's part in the aggregation trees (see the module doc)."""

    def __init__(self, node_id: str, config: TreeConfig | None = None, *,
                 seq_start: int = 0, classes: Iterable[str] = (),
                 on_publish: PublishHook | None = None) -> None:
        """``seq_start``: messages are numbered above it (a restarted member
        passes more than before, e.g. wall-clock microseconds); ``classes``:
        trees to take part in from the start (e.g. the policy's classes);
        ``on_publish(key, epoch, inputs, rows, now)``: called with each record
        this member publishes as a root (a simulator's probe)."""
        if not node_id:
            raise ValueError("node_id must be non-empty")
        self.node_id = node_id
        self.config = config or TreeConfig()
        self.stats = TreeStats()
        self._seq = seq_start
        self._topo: Topology | None = None
        self._trees: dict[str, _Tree] = {CENSUS: _Tree(CENSUS)}
        self._windows: dict[Key, tuple[Window, float]] = {}  # key -> (window, its end)
        self._unreachable: dict[str, float] = {}  # member -> until: a send to it failed
        self._distrust: dict[str, float] = {}  # member -> until: its receipt did not match
        self._known_classes: set[str] = set()
        self.on_publish = on_publish
        self.set_classes(classes)

    # -- what the host tells it -------------------------------------------------------
    def set_topology(self, topo: Topology) -> None:
        """The trees of the current member list (``Topology.local`` for this
        member; any ``Topology`` that answers for it).  Call again whenever the
        list changes; inputs held stay and go where the new paths say."""
        self._topo = topo
        for t in self._trees.values():
            t.path = None

    def set_classes(self, classes: Iterable[str]) -> None:
        """Classes to take part in even without windows of them (the policy's)."""
        self._known_classes = {c for c in classes if 0 < len(c) <= MAX_NAME}
        for c in sorted(self._known_classes):
            self._tree(c)

    def local_windows(self, board_view: Mapping[str, Any], now: float, *, wall: float) -> None:
        """This member's windows (``SlaBoard.view()``): what it contributes
        from its next sample on.  ``wall``: unix seconds, the clock of the
        board's ``received_at``."""
        windows, skipped = board_windows(board_view, wall, self.config.max_sketch_bins)
        self.stats.local_skipped += skipped
        self.set_windows(windows.values(), now)

    def set_windows(self, windows: Iterable[Window], now: float) -> None:
        """The same from parsed windows (each ``age_ms`` old at ``now``)."""
        self._windows = {w.key: (w, now - w.age_ms / 1000) for w in windows}
        for w, _ in self._windows.values():
            self._tree(w.sla_class)
        for t in self._trees.values():
            t.leaf = None

    def on_member_unreachable(self, node: str, now: float) -> None:
        """The host could not reach ``node``: its backups are used for a while
        (until it sends something, or ``unreachable_s``)."""
        if node != self.node_id:
            self._unreachable[node] = max(self._unreachable.get(node, 0.0),
                                          now + self.config.unreachable_s)

    def on_member_alive(self, node: str) -> None:
        """``node`` answers again (or was declared alive): used again."""
        self._unreachable.pop(node, None)

    def _avoided(self, node: str) -> bool:
        return node in self._unreachable or node in self._distrust

    # -- trees -----------------------------------------------------------------------
    def _tree(self, key: str) -> _Tree | None:
        t = self._trees.get(key)
        if t is None:
            if len(self._trees) > self.config.max_classes or not 0 < len(key) <= MAX_NAME:
                return None
            t = self._trees[key] = _Tree(key)
        return t

    def _path(self, t: _Tree) -> Path | None:
        if t.path is None and self._topo is not None:
            t.path = self._topo.path(t.key, self.node_id)
        return t.path

    @property
    def classes(self) -> list[str]:
        return sorted(k for k in self._trees if k != CENSUS)

    # -- time ------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """When :meth:`tick` next has work (-inf: now; inf: nothing until a
        topology or a message comes)."""
        if self._topo is None:
            return math.inf
        due = math.inf
        for t in self._trees.values():
            d = t.next_sample
            if t.deadline:
                d = min(d, min(t.deadline.values()))
            due = min(due, d)
        return due

    def tick(self, now: float) -> list[Out]:
        """Samples the trees whose round is due and forwards what waited long enough."""
        out: list[Out] = []
        if self._topo is None:
            return out
        for key in list(self._trees):
            t = self._trees.get(key)
            if t is None:
                continue
            if now >= t.next_sample:
                self._expire(t, now)
                if key not in self._trees:
                    continue
                out += self._sample(t, now)
            if t.deadline:
                for arc, at in sorted(t.deadline.items(), key=lambda kv: kv[1]):
                    if now >= at and arc in t.deadline:
                        out += self._forward(t, arc, now, complete=False)
        if self._unreachable:
            self._unreachable = {m: u for m, u in self._unreachable.items() if u > now}
        if self._distrust:
            self._distrust = {m: u for m, u in self._distrust.items() if u > now}
        return out

    def _expire(self, t: _Tree, now: float) -> None:
        rec = t.record
        if rec is not None and now - rec.newest > self.config.forget_s and \
                now - rec.at > self.config.forget_s:
            t.record = None
            self.stats.records_expired += 1
        if (t.key != CENSUS and t.record is None and not t.pending and not t.fwds
                and t.key not in self._known_classes
                and not any(w.sla_class == t.key for w, _ in self._windows.values())
                and t.key not in self._census_classes()):
            del self._trees[t.key]

    def _census_classes(self) -> tuple[str, ...]:
        rec = self._trees[CENSUS].record
        return rec.census.classes if rec is not None and rec.census is not None else ()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- a round ---------------------------------------------------------------------
    def _sample(self, t: _Tree, now: float) -> list[Out]:
        """This member's own contribution to tree ``t``, and its roles' deadlines."""
        cfg = self.config
        self._trim(t, now)
        t.next_sample = now + cfg.epoch_s if t.next_sample == -math.inf or \
            now - t.next_sample > cfg.epoch_s else t.next_sample + cfg.epoch_s
        path = self._path(t)
        if path is None:
            return []
        if t.key == CENSUS:
            for c in self._census_classes():
                self._tree(c)
        self._check_receipt(t, now)
        parts, census, digest = self._leaf(t, now)
        seq = self._next_seq()
        up = Up(t.key, 0, 0, seq, 1, parts, census, (), now, _digest=[digest])
        self.stats.sampled += 1
        t.round_start = {}
        t.forwarded_at = {k: v for k, v in t.forwarded_at.items() if now - v < cfg.epoch_s}
        for a in path.arcs:
            if self._aggregates(a):
                t.deadline.setdefault(a.id, now + self._wait(a))
                t.round_start[a.id] = now
        if not path.arcs:  # alone: the record is this member's own windows
            fwd = _Fwd(seq, 0, (), "", up_digest(up), now, -1, up)
            t.last_leaf = fwd
            t.fwds[seq] = fwd
            return self._publish(t, list(up.parts), (), fwd, now)
        fwd = _Fwd(seq, 0, (), "", up_digest(up), now, 0, up)
        t.last_leaf = fwd
        return self._send_up(t, fwd, 0, now)

    def _check_receipt(self, t: _Tree, now: float) -> None:
        """Whether the members this one's leaves went to returned their
        receipts: one that keeps a member's windows out of every record
        (drops them, or never passes them on) while records do come is
        avoided after ``receipt_rounds`` rounds in a row.  A leaf is judged two
        rounds after it went (a slow round's record comes late, not never)."""
        cfg = self.config
        due = [f for f in t.fwds.values() if f.arc == 0 and f.to
               and 2 * cfg.epoch_s - 0.5 <= now - f.at < 3 * cfg.epoch_s - 0.5]
        rec = t.record
        if not due or rec is None or now - rec.at > 2 * cfg.epoch_s:
            return  # no leaf to judge, or no record comes at all: nothing to learn
        leaf = max(due, key=lambda f: f.at)
        if t.merged_leaf is not None and t.merged_leaf.seq >= leaf.seq:
            t.unreceipted = 0
            return
        t.unreceipted += 1
        if t.unreceipted >= cfg.receipt_rounds and not self._avoided(leaf.to):
            self.stats.receipt_missing += 1
            self._distrust[leaf.to] = now + cfg.distrust_s
            t.unreceipted = 0

    def _leaf(self, t: _Tree, now: float) -> tuple[tuple[Part, ...], Census | None, int]:
        """This member's own parts of tree ``t`` and their digest (made once
        per windows, or again when one of them turns stale)."""
        cfg = self.config
        if t.leaf is not None and now <= t.leaf[3]:
            return t.leaf[0], t.leaf[1], t.leaf[2]
        ends = [end for _, end in self._windows.values() if now - end <= cfg.stale_s]
        until = min(ends, default=math.inf) + cfg.stale_s
        census = None
        parts: tuple[Part, ...] = ()
        if t.key == CENSUS:
            census = census_of(self._windows.values(), now, cfg.stale_s, cfg.max_classes)
        else:
            mine = [leaf_part(w, end, now, cfg.stale_s)
                    for w, end in self._windows.values() if w.sla_class == t.key]
            self.stats.rows_left_out += max(0, len(mine) - cfg.max_rows)
            parts = tuple(mine[:cfg.max_rows])
        digest = up_digest(Up(t.key, 0, 0, 0, 1, parts, census))
        t.leaf = (parts, census, digest, until)
        return parts, census, digest

    def _aggregates(self, a: Arc) -> bool:
        """Whether this member aggregates node ``a`` now: it is the first of its
        candidates not avoided (its aggregator, or the backup standing in)."""
        me = self.node_id
        if not self._unreachable and not self._distrust:
            return a.candidates[0] == me
        return next((c for c in a.candidates if c == me or not self._avoided(c)), None) == me

    def _wait(self, a: Arc) -> float:
        """How long node ``a``'s aggregator waits for its inputs after sampling."""
        cfg = self.config
        depth = self._topo.depth_estimate() if self._topo is not None else 1
        return cfg.base_s + cfg.slot_s * max(0, depth - a.depth)

    def _send_up(self, t: _Tree, fwd: _Fwd, level: int, now: float) -> list[Out]:
        """``fwd`` (a leaf or a node's sum) to the aggregator of node
        ``level`` of the path: the first candidate not avoided; this member
        itself when that is it; the node above when every candidate is avoided."""
        path = self._path(t)
        assert path is not None and fwd.msg is not None
        arcs = path.arcs
        while level < len(arcs):
            a = arcs[level]
            to = next((c for c in a.candidates if c == self.node_id or not self._avoided(c)),
                      None)
            if to is not None:
                break
            level += 1
        else:
            level, to = len(arcs) - 1, self.node_id  # nobody reachable: act for the root
        a = arcs[level]
        msg = fwd.msg
        if msg.dst != a.id:
            msg = msg.to_node(a.id)
        fwd.msg, fwd.level = msg, level
        t.fwds[fwd.seq] = fwd
        if to == self.node_id:
            fwd.to = ""
            return self._take(t, self.node_id, msg, now, local=True)
        fwd.to = to
        self.stats.ups_sent += 1
        return [Out(to, msg)]

    def _trim(self, t: _Tree, now: float) -> None:
        """Forgets what it sent more than ``history_rounds`` ago (and the
        sums of its nodes after a round: only their receipts are still needed)."""
        cfg = self.config
        old, compact = now - cfg.history_rounds * cfg.epoch_s, now - cfg.epoch_s
        for seq in list(t.fwds):
            f = t.fwds[seq]
            if f.at < old:
                del t.fwds[seq]
            elif f.at < compact and f.arc and f.msg is not None:
                f.msg = None
        while len(t.fwds) > 4096:  # bounded whatever the rounds
            del t.fwds[next(iter(t.fwds))]

    # -- inputs ----------------------------------------------------------------------
    def on_message(self, sender: str, msg: Up | Down | bytes, now: float) -> list[Out]:
        """A message from member ``sender`` (already authenticated by the
        host): bytes from the wire, or a decoded message (the simulator)."""
        if isinstance(msg, bytes | bytearray | memoryview):
            try:
                msg = decode(bytes(msg), now)
            except Exception:  # noqa: BLE001 - a peer's bytes never break the view
                self.stats.malformed += 1
                return []
        if sender == self.node_id or not sender:
            self.stats.misrouted += 1
            return []
        self._unreachable.pop(sender, None)  # it answers
        if isinstance(msg, Up):
            self.stats.ups_received += 1
            t = self._tree(msg.key) if msg.key != CENSUS else self._trees[CENSUS]
            if t is None:
                self.stats.misrouted += 1
                return []
            return self._take(t, sender, msg, now, local=False)
        self.stats.downs_received += 1
        t = self._trees.get(msg.key)
        if t is None and msg.ack == 0:  # a class it had not heard of: the record tells it
            t = self._tree(msg.key)
        if t is None:
            self.stats.unsolicited += 1
            return []
        return self._on_down(t, sender, msg, now)

    def _level_for(self, path: Path, dst: int) -> int:
        """The node of this member's path an input for ``dst`` belongs to: the
        lowest one at or above ``dst``'s depth (the root when none)."""
        depth, _ = position_of_arc(dst, self.config.bits)
        for i, a in enumerate(path.arcs):
            if a.depth <= depth:
                return i
        return len(path.arcs) - 1

    def _take(self, t: _Tree, sender: str, up: Up, now: float, *, local: bool) -> list[Out]:
        """An input for one of this member's nodes (checked unless local)."""
        path = self._path(t)
        if path is None or not path.arcs:
            self.stats.misrouted += 1
            return []
        bits = self.config.bits
        if not local and not (valid_arc(up.dst, bits) and valid_arc(up.src, bits)):
            self.stats.misrouted += 1  # names no node a tree of these digits can have
            return []
        level = self._level_for(path, up.dst)
        a = path.arcs[level]
        if not local:
            x = position(t.key, sender)
            if up.dst and not (contains(up.dst, path.x, bits) and contains(up.dst, x, bits)):
                self.stats.misrouted += 1  # a node this member or the sender is not under
                return []
            if up.src and not (contains(up.src, x, bits) and position_of_arc(up.src, bits)[0]
                               > position_of_arc(up.dst, bits)[0]):
                self.stats.misrouted += 1
                return []
            if not self._size_ok(a, up):
                self.stats.oversized += 1
                return []
        start = t.round_start.get(a.id)
        if start is not None and t.forwarded_at.get(a.id, -math.inf) >= start and \
                now - start < self.config.epoch_s / 2:
            self.stats.late += 1  # its round is gone: the next one has newer windows
            if not local:
                t.late.add(sender)
            return []
        held = t.pending.setdefault(a.id, {})
        old = held.get((sender, up.src))
        if old is not None:
            self.stats.older += 1
            if old[0].seq >= up.seq:
                return []
        held[(sender, up.src)] = (up, now)
        self.stats.accepted += 1
        if not local and up.dst == a.id and self.node_id in a.candidates[1:]:
            for c in a.candidates[:a.candidates.index(self.node_id)]:
                self.on_member_unreachable(c, now)  # its inputs come here: it failed them
        if a.id not in t.deadline and not (start is not None and self._aggregates(a)):
            # an input for a node whose round this member did not start: it stands in
            # for its aggregator (a backup, or a view apart), with the same deadline
            t.deadline[a.id] = now + self._wait(a)
            if self.node_id in a.candidates:
                t.round_start[a.id] = now
        if self._complete(t, a):
            return self._forward(t, a.id, now, complete=True)
        return []

    def _size_ok(self, a: Arc, up: Up) -> bool:
        slack = self.config.count_slack
        if up.src == 0:
            return up.count == 1 and all(p.nodes + p.stale <= 1 for p in up.parts) and (
                up.census is None or up.census.members == 1)
        size = next((c.size for c in a.children if c.arc == up.src), a.size)
        return up.count <= size + slack

    def _complete(self, t: _Tree, a: Arc) -> bool:
        return bool(a.children) and t.round_start.get(a.id) is not None and \
            not self._missing(t, a)

    def _missing(self, t: _Tree, a: Arc) -> list[str]:
        """Who is expected to send an input of node ``a`` this round and has
        not (leaves gone unreachable are not waited for)."""
        held = t.pending.get(a.id) or {}
        start = t.round_start.get(a.id)
        since = -math.inf if start is None else start - self.config.epoch_s / 2
        leaves = {s for (s, src), (_, at) in held.items() if src == 0 and at >= since}
        arcs = {src for (_, src), (_, at) in held.items() if src and at >= since}
        out = []
        for c in a.children:
            if c.arc == 0:
                if c.agg not in leaves and not (c.agg != self.node_id and self._avoided(c.agg)):
                    out.append(c.agg)
            elif c.arc not in arcs:
                out.append(c.agg)
        return out

    def _forward(self, t: _Tree, arc: int, now: float, *, complete: bool) -> list[Out]:
        """The sum of node ``arc``'s inputs, up (or published at the root)."""
        t.deadline.pop(arc, None)
        t.forwarded_at[arc] = now
        path = self._path(t)
        if path is None:
            return []
        level = next((i for i, a in enumerate(path.arcs) if a.id == arc), None)
        if level is None:  # the paths changed meanwhile: where this input belongs now
            level = self._level_for(path, arc)
        node = path.arcs[level]
        missing = tuple(m for m in self._missing(t, node) if m != self.node_id) \
            if node.id == arc and node.children else ()
        held = t.pending.pop(arc, None)
        if not held:
            return []
        ups = [u for _, (u, _) in sorted(held.items())]
        inputs = tuple((s, u.seq, up_digest(u)) for (s, _), (u, _) in sorted(held.items()))
        merged = _merge_ups(t.key, ups, self.config)
        count = sum(u.count for u in ups)
        census = None
        if t.key == CENSUS:
            census = Census()
            for u in ups:
                if u.census is not None:
                    census = census.add(u.census, self.config.max_classes)
        seq = self._next_seq()
        if not complete:
            self.stats.forwarded_incomplete += 1
        if level == len(path.arcs) - 1:
            fwd = _Fwd(seq, arc, inputs, "", 0, now, level, missing=missing)
            t.fwds[seq] = fwd
            return self._publish(t, merged, inputs, fwd, now, count=count, census=census)
        self.stats.forwarded += 1
        up = Up(t.key, arc, 0, seq, count, tuple(merged), census,
                tuple((s, q) for s, q, _ in inputs), now)
        fwd = _Fwd(seq, arc, inputs, "", up_digest(up), now, level + 1, up, missing)
        return self._send_up(t, fwd, level + 1, now)

    # -- records ---------------------------------------------------------------------
    def _publish(self, t: _Tree, merged: Iterable[Part], inputs: tuple[tuple[str, int, int], ...],
                 fwd: _Fwd, now: float, *, count: int = 1,
                 census: Census | None = None) -> list[Out]:
        t.epoch += 1
        self.stats.published += 1
        if t.key == CENSUS and census is None and fwd.msg is not None:
            census = fwd.msg.census
        rows = tuple(record_row(p) for p in sorted(merged, key=lambda p: _order(p.key)))
        t.record = HeldRecord(self.node_id, t.epoch, rows, census, count, now)
        if self.on_publish is not None:
            self.on_publish(t.key, t.epoch, fwd.inputs if fwd.arc else ((self.node_id, fwd.seq,
                                                                         fwd.digest),),
                            rows, now)
        down = Down(t.key, t.epoch, self.node_id, 0, max(0.0, t.next_sample - now), count, 0,
                    rows, census, now)
        return self._push_down(t, fwd, down, now) + self._push_late(t, down)

    def _push_late(self, t: _Tree, down: Down) -> list[Out]:
        out = [Out(m, down.to(0, 0, down.next_sample_s)) for m in sorted(t.late)]
        self.stats.downs_sent += len(out)
        t.late.clear()
        return out

    def _push_down(self, t: _Tree, fwd: _Fwd, down: Down, now: float) -> list[Out]:
        """The record to everyone whose input ``fwd`` merged (this member's own
        lower nodes and leaf included)."""
        out: list[Out] = []
        if fwd.arc == 0:
            t.merged_leaf = fwd
            t.merged_epoch = (down.root, down.epoch)
        for sender, seq, digest in fwd.inputs:
            if sender == self.node_id:
                sub = t.fwds.get(seq)
                if sub is not None:
                    out += self._push_down(t, sub, down, now)
            else:
                self.stats.downs_sent += 1
                out.append(Out(sender, down.to(seq, digest, down.next_sample_s)))
        for member in fwd.missing:
            self.stats.downs_sent += 1
            out.append(Out(member, down.to(0, 0, down.next_sample_s)))
        return out

    def _on_down(self, t: _Tree, sender: str, down: Down, now: float) -> list[Out]:
        fwd = t.fwds.get(down.ack) if down.ack else None
        if down.ack == 0:  # a record for a round this member missed: from a node above it only
            path = self._path(t)
            if path is None or not any(sender in a.candidates for a in path.arcs):
                self.stats.unsolicited += 1
                return []
        elif fwd is None or fwd.to != sender:
            self.stats.unsolicited += 1
            return []
        elif down.digest != fwd.digest:
            self.stats.receipt_mismatches += 1
            self._distrust[sender] = now + self.config.distrust_s
        self.stats.records_received += 1
        rec = t.record
        if rec is None or rec.root != down.root or down.epoch > rec.epoch:
            t.record = HeldRecord(down.root, down.epoch, down.rows, down.census, down.count, now)
            if t.key == CENSUS and down.census is not None:
                for c in down.census.classes:
                    self._tree(c)
        if down.next_sample_s > 0:
            t.next_sample = now + down.next_sample_s
        template = Down(down.key, down.epoch, down.root, 0, down.next_sample_s, down.count, 0,
                        down.rows, down.census, now)
        late = self._push_late(t, template)
        if fwd is None:
            return late
        return self._push_down(t, fwd, template, now) + late

    def on_failed(self, out: Out, now: float, *, delivered: bool | None) -> list[Out]:
        """A send the host could not make.  ``delivered`` False when the
        receiver cannot have merged it: refused, no connection, or the
        connection reset under the call (it died: what it got died with it);
        the message goes to the node's backup at once.  None when it may have
        (a deadline passed, the receiver may live on): never sent twice."""
        self.stats.send_failures += 1
        self.on_member_unreachable(out.to, now)
        if delivered is not False or not isinstance(out.msg, Up):
            return []
        t = self._trees.get(out.msg.key)
        fwd = t.fwds.get(out.msg.seq) if t is not None else None
        if t is None or fwd is None or fwd.to != out.to or self._path(t) is None:
            return []
        self.stats.retargets += 1
        return self._send_up(t, fwd, fwd.level, now)

    # -- the view --------------------------------------------------------------------
    def snapshot(self, now: float, targets: Mapping[str, float] | None = None, *,
                 nodes: bool = False) -> dict[str, Any]:
        """The global view at ``now`` (JSON-able; docs/cluster.md lists the
        fields): ``classes`` per (class, modality), ``stages`` per (stage,
        class, modality), from the newest record of each class.  ``nodes``:
        each row's ``breakdown`` lists the record it comes from (one part,
        named by the root that published it; the per-node breakdown is
        :meth:`own_breakdown`, asked of each node)."""
        records = {k: self._trees[k].record for k in self.classes}
        topo = self._topo
        out = view_snapshot(self.node_id, topo.size if topo is not None else 1,
                            {k: r for k, r in records.items() if r is not None},
                            self._trees[CENSUS].record, now, targets, nodes=nodes,
                            stale_s=self.config.stale_s)
        out["counters"] = self.stats.as_dict()
        out["aggregation"] = self.aggregation(now)
        return out

    def aggregation(self, now: float) -> dict[str, Any]:
        """How this member takes part: per tree its role, root, record age."""
        trees = []
        for key in sorted(self._trees):
            t = self._trees[key]
            path = self._path(t)
            rec = t.record
            trees.append({
                "tree": key or "census",
                "depth": len(path.arcs) if path else None,
                "aggregates": sum(1 for a in path.arcs if a.candidates[0] == self.node_id)
                if path else 0,
                "root": rec.root if rec else None, "epoch": rec.epoch if rec else None,
                "record_age_s": round(now - rec.at, 3) if rec else None,
                "contributors": rec.count if rec else None,
            })
        return {"epoch_s": self.config.epoch_s, "fanout": 1 << self.config.bits,
                "unreachable": sorted(self._unreachable), "distrusted": sorted(self._distrust),
                "trees": trees}

    def own_breakdown(self, now: float) -> dict[str, Any]:
        """This member's part of the view: per row, its window as the newest
        record that merged it holds it (the per-node breakdown, asked of this
        member on demand: ``GET /v1/cluster/sla?node=...``)."""
        cfg = self.config
        rows = []
        for key in self.classes:
            t = self._trees[key]
            fwd = t.merged_leaf
            if fwd is None or fwd.msg is None:
                continue
            for p in fwd.msg.parts:
                sk = p.sketch
                p99 = (sk.quantile_keys((0.99,))[0] if sk is not None else p.lo)
                mine = self._windows.get(p.key)
                end = p.newest if p.nodes else (mine[1] if mine is not None else fwd.at)
                age = round(now - end, 3)
                rows.append({
                    "stage": p.key[0], "sla_class": p.key[1], "modality": p.key[2],
                    "node": self.node_id, "seq": fwd.seq, "frames": p.frames,
                    "deadline_misses": p.misses,
                    "attainment": attainment(p.frames, p.frames - p.misses),
                    "p99_ms": key_value(p99) if p99 != NO_KEY else None,
                    "quantiles": "sketch" if sk is not None else
                    ("digest" if p.lo != NO_KEY else None),
                    "window_s": p.window_ms / 1000, "age_s": age, "sketch_age_s":
                    age if sk is not None else None,
                    "stale": p.stale > 0 or age > cfg.stale_s,
                    "merged_in": {"aggregator": t.merged_epoch[0], "epoch": t.merged_epoch[1]}
                    if t.merged_epoch else None,
                })
        return {"node": self.node_id, "rows": rows}

    def merged(self, key: str, seq: int) -> tuple[tuple[tuple[str, int, int], ...],
                                                   tuple[Part, ...] | None] | None:
        """What this member's message ``seq`` of tree ``key`` merged: its
        inputs (sender, seq, digest), and for its own leaf its parts (times
        relative to when it was made); None when no longer held."""
        t = self._trees.get(key)
        fwd = t.fwds.get(seq) if t is not None else None
        if fwd is None:
            return None
        return fwd.inputs, (fwd.msg.parts if fwd.arc == 0 and fwd.msg is not None else None)

    def record_ages(self, now: float) -> dict[str, tuple[float, float] | None]:
        """Per class: (age of the newest, of the oldest window merged) in the
        record held, seconds; None without a record (or one with no window)."""
        out: dict[str, tuple[float, float] | None] = {}
        for key in self.classes:
            rec = self._trees[key].record
            out[key] = (now - rec.newest, now - rec.oldest) \
                if rec is not None and any(r.nodes for r in rec.rows) else None
        return out

    def record_of(self, key: str) -> tuple[str, int] | None:
        """(root, epoch) of the record held of tree ``key``."""
        t = self._trees.get(key)
        rec = t.record if t is not None else None
        return None if rec is None else (rec.root, rec.epoch)

    def held_bytes(self) -> int:
        """~What this member holds for the view (records, inputs, forwards, own
        windows): the memory that must not grow with the fleet."""
        size = 0
        for t in self._trees.values():
            if t.record is not None:
                size += 64 + 96 * len(t.record.rows)
            for held in t.pending.values():
                for up, _ in held.values():
                    size += _up_size(up)
            for f in t.fwds.values():
                size += 96 + 24 * len(f.inputs) + (_up_size(f.msg) if f.msg is not None else 0)
        for w, _ in self._windows.values():
            size += 96 + (len(w.sketch.bins) if w.sketch is not None else 0)
        return size


def view_snapshot(node: str, members: int, records: Mapping[str, HeldRecord],
                  census: HeldRecord | None, now: float, targets: Mapping[str, float] | None,
                  *, nodes: bool, stale_s: float) -> dict[str, Any]:
    """The view's JSON from the records a node holds (one per class and the
    census): the trees' and the etcd back end's view alike."""
    targets = targets or {}
    rows: list[tuple[Key, dict[str, Any]]] = []
    for key in sorted(records):
        rec = records[key]
        stale = now - rec.newest > stale_s
        for r in rec.rows:
            row = snapshot_row(r, now, targets.get(r.key[1]), stale=stale)
            row["epoch"], row["aggregator"] = rec.epoch, rec.root
            row["record_age_s"] = round(now - rec.at, 3)
            if nodes:
                row["breakdown"] = [_part_entry(r, rec, now, stale)]
            rows.append((r.key, row))
    rows.sort(key=lambda kv: _order(kv[0]))
    c = census.census if census is not None and census.census is not None else Census()
    fresh = census is not None and now - census.at <= stale_s
    return {
        "node": node,
        "members": members,
        "nodes_known": c.members if fresh else 0,
        "nodes_reporting": c.reporting if fresh else 0,
        "nodes_with_sketches": c.sketched if fresh else 0,
        "classes": [r for k, r in rows if k[0] is None],
        "stages": [r for k, r in rows if k[0] is not None],
    }


def _up_size(up: Up) -> int:
    return 96 + sum(96 + (len(p.sketch.bins) if p.sketch is not None else 0) for p in up.parts)


def _merge_ups(key: str, ups: list[Up], cfg: TreeConfig) -> list[Part]:
    parts = add_parts(p for u in ups for p in u.parts)
    out = []
    for p in parts.values():
        if p.sketch is not None and len(p.sketch.bins) // 8 > cfg.max_sketch_bins:
            p = Part(p.key, p.frames, p.misses, p.nodes, p.stale, p.sketched,
                     collapse(p.sketch, cfg.max_sketch_bins), p.lo, p.hi, p.window_ms,
                     p.newest, p.oldest, p.total)
        out.append(p)
    out.sort(key=lambda p: _order(p.key))
    return out[:255]


def _order(k: Key) -> tuple[str, str, str]:
    return (k[0] or "", k[1], k[2])


def _part_entry(r: RecordRow, rec: HeldRecord, now: float, stale: bool) -> dict[str, Any]:
    """A record row as the one part of a row's breakdown (what the
    controller reads: its age, whether it is stale)."""
    age = round(now - r.newest, 3) if r.nodes else round(now - rec.at, 3)
    return {"node": rec.root, "seq": rec.epoch, "frames": 0 if stale else r.frames,
            "deadline_misses": 0 if stale else r.misses,
            "attainment": attainment(r.frames, r.frames - r.misses),
            "p99_ms": key_value(r.quantiles[1]), "quantiles": "sketch" if r.sketched else None,
            "window_s": r.window_ms / 1000, "age_s": age, "sketch_age_s": age,
            "stale": stale or r.nodes == 0, "aggregate": True, "nodes": r.nodes}
