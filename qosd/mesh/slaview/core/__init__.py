"""The global SLA view: every node's SLA windows, merged the same way on every
node, as a sans-I/O core beside :class:`~qosd.mesh.membership.core.Membership`.

The host (qosd's peer service, the simulator, the tests) feeds it the local
board and what the membership core delivers, and sends what it returns; the
view owns no sockets, clocks or threads (one caller at a time)::

    view = SlaView("node-a", SlaViewConfig(), seq_start=wall_clock_us)
    for key, payload in view.local_windows(board.view(), now, wall=time.time(),
                                           members=core.live_members() + 1):
        core.broadcast(key, payload)             # a digest, when one is due
    core.set_app_state(view.app_state(now))      # sketches for the push-pull
    for event in core.events():
        view.on_event(event, now)                # AppMessage "sla/...", AppStateReceived,
                                                 # MemberChanged (dead/left: data goes)
    view.snapshot(now, targets={"voice": 120.0}) # GET /v1/cluster/sla

Two channels, one record per origin node:

* **Digests** (gossip, ``broadcast("sla/<node>", ...)``): counts, deadline
  misses, p50/p99/p999 and age per window, no sketches; at most
  ``digest_max_bytes``, at most one per :meth:`SlaViewConfig.digest_interval_s`.
* **Bundles** (push-pull app state): a publication with its sketches; this
  node's own and, in turn, those it holds of others, within
  ``max_state_bytes``.

Every publication carries the origin's sequence number; for each origin the
view keeps the newest publication (its counts) and the newest that carried
sketches (its quantiles), whichever channel brought them: last writer wins
by (origin, seq), so order and duplicates do not matter.  The law (how
often, how long) and the bounds are ``_config``, the rules of the merge
``_merge`` (those of ``mmmesh.sla``: one merge, one quantile rule, one
attainment, the same as the node's board), the bytes ``_codec``;
docs/cluster.md ("Global SLA view") has them all with the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qosd.mesh.membership.core import (
    AppBroadcast,
    AppMessage,
    AppStateReceived,
    ClusterError,
    Event,
    MemberChanged,
    State,
)
from qosd.mesh.slaview.core._aggregate import Census, Part, RecordRow, add_parts
from qosd.mesh.slaview.core._board import row_order, window_of
from qosd.mesh.slaview.core._codec import (
    MAX_BUNDLES,
    MAX_WINDOWS,
    Key,
    Limits,
    Publication,
    Window,
    bundle_size,
    decode_digest,
    decode_state,
    encode_digest,
    encode_head,
    encode_state,
    encode_tail,
)
from qosd.mesh.slaview.core._config import SlaViewConfig, SlaViewStats
from qosd.mesh.slaview.core._keyagg import LeafSum, PartialSum, RecordBook
from qosd.mesh.slaview.core._merge import NodeWindow, merge_row, sketch_keys
from qosd.mesh.slaview.core._topology import Arc, Child, Path, Topology, position
from qosd.mesh.slaview.core._tree import (
    CENSUS,
    HeldRecord,
    Out,
    SlaTree,
    TreeConfig,
    TreeStats,
    view_snapshot,
)
from qosd.mesh.slaview.core._tree_wire import Down, Up, decode, up_digest

__all__ = [
    "CENSUS",
    "KEY_PREFIX",
    "Arc",
    "Census",
    "Child",
    "Down",
    "HeldRecord",
    "LeafSum",
    "Out",
    "Part",
    "PartialSum",
    "Path",
    "RecordBook",
    "RecordRow",
    "SlaTree",
    "SlaView",
    "SlaViewConfig",
    "SlaViewStats",
    "StateLimits",
    "Topology",
    "TreeConfig",
    "TreeStats",
    "Up",
    "Window",
    "add_parts",
    "decode",
    "decode_state",
    "position",
    "sketch_keys",
    "up_digest",
    "view_snapshot",
]

StateLimits = Limits
"""What a per-node publication may hold when it is read (``decode_state``)."""

KEY_PREFIX = "sla/"


class _Held:
    """A publication as held here: when it came, and its bundle tail once made."""

    __slots__ = ("at", "pub", "tail")

    def __init__(self, pub: Publication, at: float) -> None:
        self.pub = pub
        self.at = at  # the host's clock when it arrived (or was made)
        self.tail: tuple[bytes, int, int] | None = None  # encode_tail(sketches=True)

    def age_s(self, w: Window, now: float) -> float:
        return (w.age_ms + self.pub.delay_ms) / 1000 + max(0.0, now - self.at)

    def body(self, now: float, limits: Limits) -> tuple[bytes, int, int]:
        """Its bundle body as of ``now`` (the tail is made once)."""
        if self.tail is None:
            self.tail = encode_tail(self.pub, limits, sketches=True)
        delay = self.pub.delay_ms + _ms(now - self.at)
        tail, left, no_sketch = self.tail
        return encode_head(self.pub, delay) + tail, left, no_sketch


@dataclass
class _Origin:
    counts: _Held | None = None  # the newest publication
    sketches: _Held | None = None  # the newest one with a sketch


class SlaView:
    """This node's part in the global SLA view (see the module doc)."""

    def __init__(self, node_id: str, config: SlaViewConfig | None = None, *,
                 seq_start: int = 0) -> None:
        """``seq_start``: this node's publications are numbered above it; a
        node restarting with the same id should pass more than before
        (e.g. wall-clock microseconds), as for ``Membership``."""
        if not node_id:
            raise ClusterError("node_id must be non-empty")
        self.node_id = node_id
        self.key = KEY_PREFIX + node_id
        self.config = config or SlaViewConfig()
        self.stats = SlaViewStats()
        self._seq = seq_start
        self._members = 1
        self._origins: dict[str, _Origin] = {}
        self._gone: dict[str, None] = {}  # dead or left members (insertion-ordered set)
        self._next_digest = -math.inf
        self._interval_s = self.config.min_interval_s
        self._sent_empty = False
        self._cursor = 0

    # -- the local windows ---------------------------------------------------------
    def local_windows(self, board_view: Mapping[str, Any], now: float, *, wall: float,
                      members: int) -> list[tuple[str, bytes]]:
        """Takes this node's windows (``SlaBoard.view()``: its ``classes`` and
        ``stages`` rows) as its newest publication; returns the digest to
        broadcast, ``[(key, payload)]``, when one is due (else ``[]``).

        ``now`` is the host's monotonic clock, ``wall`` unix seconds (the
        board's ``received_at`` clock), ``members`` the cluster size with
        this node.  Call it whenever the board changes or every few seconds."""
        self._members = max(1, members)
        windows: dict[Key, Window] = {}
        for node_wide, rows in ((True, board_view.get("classes")),
                                (False, board_view.get("stages"))):
            for row in sorted(rows or (), key=row_order):
                try:
                    w = self._local(row, node_wide, wall)
                except (ValueError, KeyError, TypeError, AttributeError):
                    self.stats.local_skipped += 1
                    continue
                if w.key not in windows and len(windows) < MAX_WINDOWS:
                    windows[w.key] = w
        self._seq += 1
        pub = Publication(self._seq, max(0, int(wall * 1000)), _ms(self._interval_s),
                          tuple(windows.values()))
        due = now >= self._next_digest and not (self._sent_empty and not windows)
        if due:  # the interval the digest states is the one its size gives
            payload, _ = encode_digest(pub, self.config.digest_max_bytes)
            self._interval_s = self.config.digest_interval_s(
                self._members, AppBroadcast(self.node_id, self.key, self._seq, payload).wire)
            pub = Publication(pub.seq, pub.sent_ms, _ms(self._interval_s), pub.windows)
        held = _Held(pub, now)
        self._origins[self.node_id] = _Origin(held, held)
        if not due:
            return []
        payload, left = encode_digest(pub, self.config.digest_max_bytes)
        self._next_digest = now + self._interval_s
        self._sent_empty = not windows
        self.stats.published += 1
        self.stats.windows_left_out += left
        return [(self.key, payload)]

    def _local(self, row: Mapping[str, Any], node_wide: bool, wall: float) -> Window:
        """One board row (``SlaMerged``) as a window; raises what makes it unreadable."""
        return window_of(row, node_wide, wall, self.config.max_sketch_bins)

    def known(self, origin: str) -> tuple[int | None, int | None]:
        """The sequence numbers held of ``origin``: (newest publication,
        newest with sketches); None where nothing is held."""
        rec = self._origins.get(origin)
        if rec is None:
            return (None, None)
        return (None if rec.counts is None else rec.counts.pub.seq,
                None if rec.sketches is None else rec.sketches.pub.seq)

    @property
    def next_digest_at(self) -> float:
        """When :meth:`local_windows` next returns a digest (-inf: at once)."""
        return self._next_digest

    # -- what peers send -----------------------------------------------------------
    def on_event(self, event: Event, now: float) -> None:
        """Whatever the membership core reported: SLA digests, push-pull
        state (when the app state is this view's alone), dead/left/alive."""
        if isinstance(event, AppMessage):
            if event.key.startswith(KEY_PREFIX):
                self.on_app_message(event.origin, event.key, event.payload, now)
        elif isinstance(event, AppStateReceived):
            self.on_app_state(event.peer, event.data, now)
        elif isinstance(event, MemberChanged):
            if event.state in (State.DEAD, State.LEFT):
                self.on_member_gone(event.node)
            elif event.state == State.ALIVE:
                self.on_member_alive(event.node)

    def on_app_message(self, origin: str, key: str, payload: bytes, now: float) -> bool:
        """A gossiped digest (``AppMessage``); True if it changed the view."""
        self.stats.received += 1
        if key != KEY_PREFIX + origin or origin == self.node_id:
            self.stats.malformed += 1
            return False
        if origin in self._gone:
            self.stats.from_gone += 1
            return False
        try:
            pub = decode_digest(payload, Limits(self.config.cluster.packet_budget,
                                                self.config.max_sketches,
                                                self.config.max_sketch_bins))
        except Exception:  # noqa: BLE001 - a peer's bytes never break the view
            self.stats.malformed += 1
            return False
        return self._take(origin, pub, now)

    def on_app_state(self, peer: str, data: bytes, now: float) -> int:
        """A peer's push-pull state (``AppStateReceived.data``); returns how
        many bundles changed the view.  A bundle about this node is ignored."""
        try:
            bundles = decode_state(data, self.config.max_state_bytes, self.config.limits())
        except Exception:  # noqa: BLE001 - a peer's bytes never break the view
            self.stats.received += 1
            self.stats.malformed += 1
            return 0
        changed = 0
        for origin, pub in bundles:
            self.stats.received += 1
            if isinstance(pub, ValueError):
                self.stats.malformed += 1
            elif origin == self.node_id:
                self.stats.older += 1
            elif origin in self._gone:
                self.stats.from_gone += 1
            else:
                changed += self._take(origin, pub, now)
        return changed

    def _take(self, origin: str, pub: Publication, now: float) -> bool:
        rec = self._origins.get(origin)
        if rec is None:
            if len(self._origins) > self.config.max_origins:
                self._evict()
            rec = self._origins[origin] = _Origin()
        held = _Held(pub, now)
        newer = rec.counts is None or pub.seq > rec.counts.pub.seq
        if newer:
            rec.counts = held
        if any(w.sketch is not None for w in pub.windows) and (
                rec.sketches is None or pub.seq > rec.sketches.pub.seq):
            rec.sketches = held
            newer = True
        if newer:
            self.stats.accepted += 1
        else:
            self.stats.older += 1
        return newer

    def _evict(self) -> None:
        """Forget the node whose newest publication arrived first."""
        def last(item: tuple[str, _Origin]) -> tuple[float, str]:
            held = item[1].counts or item[1].sketches
            return (-math.inf if held is None else held.at, item[0])
        victims = [kv for kv in self._origins.items() if kv[0] != self.node_id]
        if victims:
            del self._origins[min(victims, key=last)[0]]
            self.stats.evicted += 1

    def on_member_gone(self, node: str) -> None:
        """``node`` was declared dead or left: its data leaves the view now,
        and whatever still arrives of it is dropped until it is alive again."""
        if node == self.node_id:
            return
        self._origins.pop(node, None)
        self._gone.pop(node, None)
        self._gone[node] = None
        while len(self._gone) > 4 * self.config.max_origins:
            del self._gone[next(iter(self._gone))]

    def on_member_alive(self, node: str) -> None:
        """``node`` is alive (again): its publications are taken again."""
        self._gone.pop(node, None)

    # -- what this node sends in push-pull ----------------------------------------
    def app_state(self, now: float, *, relay: bool = True) -> bytes:
        """The push-pull state: this node's bundle, then (``relay``) others'
        (their newest publication with sketches, else their newest), taking
        turns from call to call, within ``max_state_bytes``.  With ``relay``
        False, this node's bundle alone (e.g. to answer a peer's fetch)."""
        cfg = self.config
        limits = cfg.limits()
        self._expire(now)
        parts: list[tuple[str, bytes]] = []
        size = 2
        own = self._origins.get(self.node_id)
        if own is not None and own.counts is not None:
            body, left, no_sketch = own.counts.body(now, limits)
            self.stats.windows_left_out += left
            self.stats.sketches_left_out += no_sketch
            parts.append((self.node_id, body))
            size += bundle_size(self.node_id, body)
        others = sorted(o for o in self._origins if o != self.node_id) if relay else []
        start = self._cursor % len(others) if others else 0
        considered = 0
        for origin in others[start:] + others[:start]:
            if len(parts) >= MAX_BUNDLES:
                break
            held = self._relayed(self._origins[origin], now)
            if held is not None:
                body = held.body(now, limits)[0]
                if size + bundle_size(origin, body) > cfg.max_state_bytes:
                    break
                parts.append((origin, body))
                size += bundle_size(origin, body)
            considered += 1
        if relay:
            self._cursor = start + considered
        return encode_state(parts)

    def _relayed(self, rec: _Origin, now: float) -> _Held | None:
        """What to pass on of a node while one of its windows is fresh: its
        publication with sketches while one may still serve, else its newest."""
        cfg = self.config

        def fresh(held: _Held | None, sketches: bool) -> bool:
            if held is None:
                return False
            interval = held.pub.interval_ms / 1000
            return any(held.age_s(w, now) <= (
                cfg.sketch_stale_s(w.window_ms / 1000, interval, self._members) if sketches
                else cfg.stale_s(w.window_ms / 1000, interval)) for w in held.pub.windows)

        if not fresh(rec.counts, False):
            return None
        return rec.sketches if fresh(rec.sketches, True) else rec.counts

    # -- expiry and the view -------------------------------------------------------
    def _forgotten(self, held: _Held | None, now: float, sketches: bool) -> bool:
        if held is None:
            return True
        cfg = self.config
        interval = held.pub.interval_ms / 1000
        ages = [(held.age_s(w, now), w.window_ms / 1000) for w in held.pub.windows] or [
            (max(0.0, now - held.at), 0.0)]
        return all(age > cfg.forget_factor * (
            cfg.sketch_stale_s(win, interval, self._members) if sketches
            else cfg.stale_s(win, interval)) for age, win in ages)

    def _expire(self, now: float) -> None:
        for origin in list(self._origins):
            rec = self._origins[origin]
            if rec.counts is not None and self._forgotten(rec.counts, now, False):
                rec.counts = None
            if rec.sketches is not None and self._forgotten(rec.sketches, now, True):
                rec.sketches = None
            if rec.counts is None:
                del self._origins[origin]
                self.stats.expired += origin != self.node_id

    def snapshot(self, now: float, targets: Mapping[str, float] | None = None, *,
                 nodes: bool = True) -> dict[str, Any]:
        """The global view at ``now`` (JSON-able; docs/cluster.md "Global SLA
        view" lists its fields): ``classes`` per (class, modality), ``stages``
        per (stage, class, modality), each with the per-node ``breakdown``
        unless ``nodes`` is False.  ``targets``: p99 objective in ms per
        class (the policy's, when it has one)."""
        self._expire(now)
        cfg = self.config
        groups: dict[Key, list[NodeWindow]] = {}
        reporting = with_sketch = 0
        for origin in sorted(self._origins):
            rec = self._origins[origin]
            if rec.counts is None:
                continue
            sketched: dict[Key, Window] = {}
            if rec.sketches is not None:
                sketched = {w.key: w for w in rec.sketches.pub.windows if w.sketch is not None}
            fresh = has_sketch = False
            interval = rec.counts.pub.interval_ms / 1000
            for w in rec.counts.pub.windows:
                age = rec.counts.age_s(w, now)
                stale = age > cfg.stale_s(w.window_ms / 1000, interval)
                sw = sketched.get(w.key)
                sk_age = None
                if sw is not None and rec.sketches is not None:
                    sk_age = rec.sketches.age_s(sw, now)
                    limit = cfg.sketch_stale_s(sw.window_ms / 1000,
                                               rec.sketches.pub.interval_ms / 1000,
                                               self._members)
                    if sk_age > limit or stale:
                        sw, sk_age = None, None
                fresh |= not stale
                has_sketch |= sw is not None
                groups.setdefault(w.key, []).append(NodeWindow(
                    origin, rec.counts.pub.seq, w.frames, w.misses, w.window_ms / 1000, age,
                    stale, w.quantiles, None if sw is None else sw.sketch,
                    w.quantiles if sw is None else sw.quantiles, sk_age))
            reporting += fresh
            with_sketch += has_sketch
        targets = targets or {}
        rows = {k: merge_row(_fields(k), groups[k], targets.get(k[1]), breakdown=nodes)
                for k in sorted(groups, key=lambda k: (k[0] or "", k[1], k[2]))}
        return {
            "node": self.node_id,
            "members": self._members,
            "nodes_known": sum(1 for r in self._origins.values() if r.counts is not None),
            "nodes_reporting": reporting,
            "nodes_with_sketches": with_sketch,
            "classes": [r for k, r in rows.items() if k[0] is None],
            "stages": [r for k, r in rows.items() if k[0] is not None],
            "counters": self.stats.as_dict(),
        }


def _fields(k: Key) -> dict[str, Any]:
    out: dict[str, Any] = {} if k[0] is None else {"stage": k[0]}
    out.update(sla_class=k[1], modality=k[2])
    return out


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))
