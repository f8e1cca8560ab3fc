"""The membership core: SWIM with Lifeguard, as a state machine without I/O.

The host owns sockets, clocks, threads and DNS.  It calls ``tick(now)`` at
``next_deadline()`` (or more often: nothing is due in between, so a host may
also tick on a fixed period, e.g. every 10 ms, at the cost of timer error up to
that period), ``handle(packet, now)`` for every packet that arrives, and sends
each returned ``Send``.  ``now`` is any monotonic clock in seconds; all
randomness comes from the ``random.Random`` given.  The core never blocks and
never raises on a peer's input; it is not thread-safe (one caller at a time).

What each timer does is documented in ``docs/cluster.md``; the rules for
applying news are in ``_rules``, the probe cycle in ``_probe``, suspicion
timing in ``_suspicion``, local health in ``_awareness``, gossip packing in
``_dissemination``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from ._awareness import Awareness
from ._config import ClusterError, Config
from ._dissemination import BroadcastQueue
from ._events import AppMessage, AppStateReceived, Event, Joined, MemberChanged, MemberInfo, Stats
from ._messages import (
    Ack,
    Alive,
    AppBroadcast,
    Dead,
    Leave,
    Message,
    Nack,
    Packet,
    Ping,
    PingReq,
    PushPull,
    Send,
    State,
    Suspect,
    Update,
    packet_header_size,
)
from ._probe import Out, Prober
from ._rules import must_refute, overrides, row_update, update_state
from ._suspicion import Suspicion
from ._table import Entry, MemberTable

_NEVER = math.inf
Pending = list[Out | Send]  # a Send is final; an Out still gets piggybacked gossip
Handler = Callable[[Message, Packet, float, Pending], None]


class Membership:
    """One member's view of the cluster and its part in the protocol."""

    def __init__(
        self, config: Config, node_id: str, addr: str, rng: random.Random, *,
        app_seq_start: int = 0,
    ) -> None:
        """``app_seq_start``: first sequence number of this member's application
        broadcasts.  Receivers keep the newest per (origin, key) and drop
        lower ones, so a member that restarts with the same id should start
        above what it sent before (e.g. wall-clock microseconds at start)."""
        if not node_id or not addr:
            raise ClusterError("node_id and addr must be non-empty")
        self.config = config
        self.node_id = node_id
        self.addr = addr
        self._rng = rng
        self._me = Entry(node_id, addr, State.ALIVE, 0, 0.0)
        self._table = MemberTable(self._me, rng)
        self._queue: BroadcastQueue[Message] = BroadcastQueue(config.max_queued_broadcasts)
        self._awareness = Awareness(config.awareness_max_multiplier)
        self.stats = Stats()
        self._prober = Prober(config, self._table, self._awareness, self.stats, rng)
        self._suspicions: dict[str, Suspicion] = {}
        self._events: list[Event] = []
        self._header = packet_header_size(node_id, addr)
        self._limit_cache = (0, 0)
        self._started = False
        self._leaving = False
        self._seeds: list[str] = []
        self._join_pending = False
        self._join_retry_at = _NEVER
        self._next_gossip = _NEVER
        self._next_push_pull = _NEVER
        self._next_reconnect = _NEVER
        self._app_seq = app_seq_start
        self._app_seen: dict[tuple[str, str], int] = {}
        self._app_state = b""
        self._dispatch: dict[type, Handler] = {
            Ping: self._on_ping,  # type: ignore[dict-item]
            Ack: self._on_ack,  # type: ignore[dict-item]
            Nack: self._on_nack,  # type: ignore[dict-item]
            PingReq: self._on_ping_req,  # type: ignore[dict-item]
            PushPull: self._on_push_pull,  # type: ignore[dict-item]
        }

    # -- host API ------------------------------------------------------------------
    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def health_score(self) -> int:
        """Lifeguard awareness: 0 healthy, up to ``awareness_max_multiplier - 1``."""
        return self._awareness.score

    @property
    def leaving(self) -> bool:
        return self._leaving

    def leave_pending(self) -> bool:
        """True while the leave notice is still being gossiped (after ``leave``);
        the host should keep ticking until False (or its own timeout)."""
        return self._leaving and self._queue.pending("m/" + self.node_id)

    def queued_broadcasts(self) -> int:
        return len(self._queue)

    def members(self) -> list[MemberInfo]:
        """Every member known (this one included), tombstones of dead and left ones too."""
        return self._table.infos()

    def member(self, node_id: str) -> MemberInfo | None:
        entry = self._table.entries.get(node_id)
        return None if entry is None else entry.info()

    def live_members(self) -> int:
        """Other members alive or suspect."""
        return self._table.live

    def events(self) -> list[Event]:
        """Events since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def next_deadline(self) -> float:
        """When ``tick`` next has work (-inf before the first call)."""
        if not self._started:
            return -_NEVER
        t = min(self._next_gossip, self._prober.deadline(), self._next_push_pull,
                self._next_reconnect, self._join_retry_at)
        for sus in self._suspicions.values():
            t = min(t, sus.deadline)
        return t

    def broadcast(self, key: str, payload: bytes) -> int:
        """Gossip ``payload`` to every member under ``key``; returns its sequence
        number.  A later broadcast under the same key replaces this one
        (here and at every receiver, which deliver it once as ``AppMessage``).
        The message must fit one packet (``packet_budget``), else ClusterError:
        bulk state belongs in ``set_app_state`` (push-pull)."""
        msg = AppBroadcast(self.node_id, key, self._app_seq + 1, payload)
        if self._header + msg.wire > self.config.packet_budget:
            raise ClusterError(
                f"broadcast {key!r} is {msg.wire} bytes; a packet holds "
                f"{self.config.packet_budget - self._header}"
            )
        self._app_seq += 1
        self._queue.push(f"a/{self.node_id}/{key}", msg, msg.wire)
        return self._app_seq

    def set_app_state(self, data: bytes) -> None:
        """Bytes attached to every push-pull this member sends from now on."""
        self._app_state = bytes(data)

    def join(self, seeds: Sequence[str], now: float) -> list[Send]:
        """Join through ``seeds`` (resolved addresses; this member's own address
        is skipped): a push-pull with up to ``join_fanout`` of them, repeated
        every ``join_retry_s`` with other random seeds until one answers or
        another member is known."""
        self._start(now)
        self._seeds = [s for s in dict.fromkeys(seeds) if s != self.addr]
        self._join_pending = bool(self._seeds) and not self._leaving
        out: list[Send] = []
        self._join_attempt(now, out, forced=True)
        return out

    def leave(self, now: float) -> list[Send]:
        """Leave on purpose: stop probing, gossip a ``Leave`` (members mark this
        one left, not dead).  Returns a first gossip round carrying it."""
        self._start(now)
        out: list[Send] = []
        if not self._leaving:
            self._leaving = True
            self._join_pending = False
            self._join_retry_at = self._next_push_pull = self._next_reconnect = _NEVER
            self._prober.next_probe_at = _NEVER  # the probe under way ends; no new one
            me = self._me
            me.state, me.since = State.LEFT, now
            self._push(Leave(self.node_id, me.incarnation))
            self._gossip(now, out)
        return out

    def tick(self, now: float) -> list[Send]:
        """Run every timer that is due at ``now``."""
        self._start(now)
        pending: list[Out] = []
        out: list[Send] = []
        failed = self._prober.step(now, not self._leaving, pending)
        if failed is not None:
            self._apply(Suspect(failed.node, failed.incarnation, self.node_id), now, True)
        if self._suspicions:
            self._expire_suspicions(now)
        for addr, node, msgs in pending:
            out.append(self._packet(addr, node, msgs))
        if now >= self._next_gossip:
            interval = self.config.gossip_interval_s
            self._next_gossip += interval
            if self._next_gossip <= now:  # the host ticked late: skip missed rounds
                self._next_gossip = now + interval
            self._gossip(now, out)
        if not self._leaving:
            if now >= self._next_push_pull:
                self._push_pull_round(now, out)
            if now >= self._next_reconnect:
                self._reconnect_round(now, out)
            if now >= self._join_retry_at:
                self._join_attempt(now, out)
        return out

    def handle(self, packet: Packet, now: float) -> list[Send]:
        """Process one packet from a peer.  Unknown or stale content is ignored."""
        self._start(now)
        self.stats.packets_received += 1
        self.stats.bytes_received += packet.size
        if not packet.sender or not packet.sender_addr or packet.sender == self.node_id:
            return []  # nobody to answer (or our own packet looped back)
        entries = self._table.entries
        me = self.node_id
        pending: Pending = []
        for msg in packet.msgs:
            kind = type(msg)
            if kind is Alive:
                node = msg.node  # type: ignore[union-attr]
                if node != me:  # fast path: the bulk of gossip is news already known
                    entry = entries.get(node)
                    if entry is not None and msg.incarnation <= entry.incarnation:  # type: ignore[union-attr]
                        continue
                self._apply(msg, now, True)  # type: ignore[arg-type]
            elif kind is Suspect or kind is Dead or kind is Leave:
                self._apply(msg, now, True)  # type: ignore[arg-type]
            elif kind is AppBroadcast:
                self._on_app(msg)  # type: ignore[arg-type]
            else:
                handler = self._dispatch.get(kind)
                if handler is not None:
                    handler(msg, packet, now, pending)
        return [p if isinstance(p, Send) else self._packet(*p) for p in pending]

    # -- sending -------------------------------------------------------------------
    def _retransmit_limit(self) -> int:
        n = self._table.size()
        if self._limit_cache[0] != n:
            self._limit_cache = (n, self.config.retransmit_limit(n))
        return self._limit_cache[1]

    def _packet(self, addr: str, node: str, msgs: tuple[Message, ...]) -> Send:
        """A packet with ``msgs`` first, filled up with gossip to the budget."""
        size = self._header + sum(m.wire for m in msgs)
        if self._queue:
            extra, used = self._queue.take(self.config.packet_budget - size,
                                           self._retransmit_limit())
            msgs += tuple(extra)
            size += used
        return self._send(addr, node, msgs, size)

    def _send(self, addr: str, node: str, msgs: tuple[Message, ...], size: int) -> Send:
        self.stats.packets_sent += 1
        self.stats.bytes_sent += size
        return Send(addr, node, Packet(self.node_id, self.addr, msgs, size))

    def _push(self, msg: Update) -> None:
        self._queue.push("m/" + msg.node, msg, msg.wire)

    def _gossip(self, now: float, out: list[Send]) -> None:
        if not self._queue:
            return
        window = self.config.gossip_to_the_dead_s
        targets = self._table.random_members(
            self.config.gossip_nodes,
            lambda e: e.state <= State.SUSPECT
            or (e.state == State.DEAD and now - e.since <= window),
        )
        budget = self.config.packet_budget - self._header
        limit = self._retransmit_limit()
        for target in targets:
            msgs, used = self._queue.take(budget, limit)
            if not msgs:
                return
            out.append(self._send(target.addr, target.node, tuple(msgs), self._header + used))

    def _push_pull(self, addr: str, node: str, join: bool, reply: bool) -> Send:
        """A push-pull packet (never with piggybacked gossip: it is large already)."""
        msg = PushPull(join, reply, self._table.rows(), self._app_state)
        return self._send(addr, node, (msg,), self._header + msg.wire)

    def _push_pull_round(self, now: float, out: list[Send]) -> None:
        self._next_push_pull = now + self.config.push_pull_s(self._table.size())
        peers = self._table.random_members(1, lambda e: e.state == State.ALIVE)
        for peer in peers:
            self.stats.push_pulls += 1
            out.append(self._push_pull(peer.addr, peer.node, False, False))

    def _reconnect_round(self, now: float, out: list[Send]) -> None:
        """Serf's reconnect: with probability dead/live, a push-pull with one
        random dead member (a partition heals when the two sides meet)."""
        self._next_reconnect = now + self.config.reconnect_interval_s
        dead = [e for e in self._table.dead.values() if e.addr]
        if not dead or self._rng.random() >= len(dead) / max(1, self._table.live):
            return
        peer = dead[int(self._rng.random() * len(dead))]
        self.stats.reconnects += 1
        out.append(self._push_pull(peer.addr, peer.node, False, False))

    def _join_attempt(self, now: float, out: list[Send], forced: bool = False) -> None:
        if not self._join_pending or (self._table.live > 0 and not forced):
            self._join_pending = False
            self._join_retry_at = _NEVER
            return
        self._join_retry_at = now + self.config.join_retry_s
        k = min(self.config.join_fanout, len(self._seeds))
        for seed in self._rng.sample(self._seeds, k):
            out.append(self._push_pull(seed, "", True, False))

    # -- timers --------------------------------------------------------------------
    def _start(self, now: float) -> None:
        if self._started:
            return
        self._started = True
        self._me.since = now
        cfg = self.config
        rnd = self._rng.random
        self._prober.start(now)
        self._next_gossip = now + rnd() * cfg.gossip_interval_s
        self._next_push_pull = now + rnd() * cfg.push_pull_interval_s
        self._next_reconnect = now + rnd() * cfg.reconnect_interval_s
        self._push(Alive(self.node_id, self.addr, self._me.incarnation))

    def _expire_suspicions(self, now: float) -> None:
        for node, sus in list(self._suspicions.items()):
            if not sus.expired(now):
                continue
            del self._suspicions[node]
            entry = self._table.entries.get(node)
            if entry is not None and entry.state == State.SUSPECT \
                    and entry.incarnation == sus.incarnation:
                self.stats.deaths_declared += 1
                self._apply(Dead(node, entry.incarnation, self.node_id), now, True)

    # -- applying news -------------------------------------------------------------
    def _apply(self, msg: Update, now: float, rebroadcast: bool) -> None:
        """Apply one membership update by the rules of ``_rules``."""
        node = msg.node
        if node == self.node_id:
            if must_refute(msg, self._me.incarnation, self.addr, self._leaving):
                self._refute(msg.incarnation)
            return
        state = update_state(msg)
        inc = msg.incarnation
        if inc < 0 or (isinstance(msg, Alive) and not msg.addr):
            return  # malformed
        table = self._table
        entry = table.entries.get(node)
        if entry is None:
            if state == State.SUSPECT:
                return  # nothing known, no address: wait for an alive
            addr = msg.addr if isinstance(msg, Alive) else ""
            entry = Entry(node, addr, state, inc, now)
            table.add(entry)
            if state == State.ALIVE:
                self._changed(entry, None)
            if rebroadcast:
                self._push(msg)
            return
        if not overrides(state, inc, entry.state, entry.incarnation):
            if isinstance(msg, Suspect) and entry.state == State.SUSPECT \
                    and inc == entry.incarnation:
                self._confirm(msg, rebroadcast)
            return
        previous = entry.state
        moved = False
        if isinstance(msg, Alive) and msg.addr != entry.addr:
            if not self._may_move(entry, now):
                self.stats.conflicts += 1
                return
            entry.addr = msg.addr
            moved = True
        table.set_state(entry, state, inc, now)
        if state == State.SUSPECT:
            self._suspect(entry, msg, now)
        else:
            self._suspicions.pop(node, None)
        if previous != state or moved:
            self._changed(entry, previous)
        if rebroadcast:
            self._push(msg)

    def _may_move(self, entry: Entry, now: float) -> bool:
        """Whether a member may come back under a new address (memberlist's
        reclaim rule): when left, unknown, or dead for ``dead_node_reclaim_s``."""
        if entry.state == State.LEFT or not entry.addr:
            return True
        return entry.state == State.DEAD and now - entry.since >= self.config.dead_node_reclaim_s

    def _suspect(self, entry: Entry, msg: Update, now: float) -> None:
        n = self._table.size()
        cfg = self.config
        accuser = msg.accuser if isinstance(msg, Suspect) else self.node_id
        self._suspicions[entry.node] = Suspicion(
            now, accuser, cfg.suspicion_k(n), cfg.suspicion_min_s(n), cfg.suspicion_max_s(n),
            entry.incarnation,
        )
        self.stats.suspicions += 1

    def _confirm(self, msg: Suspect, rebroadcast: bool) -> None:
        sus = self._suspicions.get(msg.node)
        if sus is not None and sus.confirm(msg.accuser):
            self.stats.confirmations += 1
            if rebroadcast:
                self._push(msg)

    def _refute(self, accused: int) -> None:
        me = self._me
        me.incarnation = max(me.incarnation + 1, accused + 1)
        self._awareness.apply(1)
        self.stats.refutations += 1
        self._push(Alive(self.node_id, self.addr, me.incarnation))

    def _changed(self, entry: Entry, previous: State | None) -> None:
        self._events.append(
            MemberChanged(entry.node, entry.addr, entry.state, entry.incarnation, previous)
        )

    # -- message handlers ----------------------------------------------------------
    def _on_ping(self, msg: Ping, packet: Packet, now: float, out: Pending) -> None:
        if msg.target == self.node_id:
            out.append((packet.sender_addr, packet.sender, (Ack(msg.seq),)))

    def _on_ack(self, msg: Ack, packet: Packet, now: float, out: Pending) -> None:
        relayed: list[Out] = []
        self._prober.on_ack(msg, packet.sender, now, relayed)
        out.extend(relayed)

    def _on_nack(self, msg: Nack, packet: Packet, now: float, out: Pending) -> None:
        self._prober.on_nack(msg)

    def _on_ping_req(self, msg: PingReq, packet: Packet, now: float, out: Pending) -> None:
        if not self._leaving and msg.target_addr and msg.target != self.node_id:
            relayed: list[Out] = []
            self._prober.on_ping_req(msg, packet.sender, packet.sender_addr, now, relayed)
            out.extend(relayed)

    def _on_app(self, msg: AppBroadcast) -> None:
        if msg.origin == self.node_id:
            return
        key = (msg.origin, msg.key)
        seen = self._app_seen.get(key)
        if seen is not None and msg.seq <= seen:
            return
        self._app_seen[key] = msg.seq
        self._events.append(AppMessage(msg.origin, msg.key, msg.seq, msg.payload))
        self._queue.push(f"a/{msg.origin}/{msg.key}", msg, msg.wire)

    def _on_push_pull(self, msg: PushPull, packet: Packet, now: float, out: Pending) -> None:
        """Merge a full state.  A request is answered with ours (after the
        merge, so refutations it caused are in it).  The state a seed returns
        to a joiner is not re-gossiped by the joiner: it is news to nobody else."""
        rebroadcast = not (msg.join and msg.reply)
        me = self.node_id
        entries = self._table.entries
        for row in msg.rows:
            entry = entries.get(row.node)
            if entry is not None and row.node != me:  # fast path: nothing new
                inc = entry.incarnation
                if row.incarnation < inc or (row.incarnation == inc and row.state == State.ALIVE):
                    continue
            self._apply(row_update(row, me), now, rebroadcast)
        if msg.app_state:
            self._events.append(AppStateReceived(packet.sender, msg.app_state, msg.join))
        if not msg.reply:
            self.stats.push_pulls += 1
            out.append(self._push_pull(packet.sender_addr, packet.sender, msg.join, True))
        elif msg.join and self._join_pending:
            self._join_pending = False
            self._join_retry_at = _NEVER
            # the first periodic push-pull, now that the cluster size is known: members
            # that joined together must not all exchange state within the same 30 s
            n = self._table.size()
            self._next_push_pull = now + self._rng.random() * self.config.push_pull_s(n)
            self._events.append(Joined(packet.sender, self._table.live + 1))
