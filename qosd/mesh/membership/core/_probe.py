"""The probe cycle: SWIM's failure detector with Lifeguard's nacks.

One probe per (awareness-scaled) probe interval, to the next member of the
ring.  The probe is a ``Ping``; if no ``Ack`` came within ``probe_timeout_s``,
``indirect_checks`` random alive members get a ``PingReq`` and ping the target
themselves, relaying its ack, or a ``Nack`` after ``indirect_nack_s``.  The
probe ends at the end of its interval: unanswered, the target is handed back
to the caller to be suspected, and the awareness score moves by the rule in
``_awareness``.  A ping to a member already suspected carries the suspicion,
so that the member can refute at once.  This is the part of memberlist's
``probeNode`` / ``handleIndirectPing`` that does not depend on sockets (no TCP
fallback ping: a host can add one around the core).
"""

from __future__ import annotations

import random

from ._awareness import Awareness
from ._config import Config
from ._events import Stats
from ._messages import Ack, Message, Nack, Ping, PingReq, State, Suspect
from ._table import Entry, MemberTable

# (address, node id, primary messages) for the caller to send in one packet
Out = tuple[str, str, tuple[Message, ...]]

_RTT_GAIN = 0.125
_FAR = float("inf")


class _Probe:
    __slots__ = (
        "acked",
        "end_at",
        "expected_nacks",
        "indirect",
        "nacks",
        "sent",
        "seq",
        "target",
        "timeout_at",
    )

    def __init__(self, target: Entry, seq: int, now: float, timeout: float, end: float) -> None:
        self.target = target
        self.seq = seq
        self.sent = now
        self.timeout_at = now + timeout
        self.end_at = end
        self.indirect = False
        self.acked = False
        self.expected_nacks = 0
        self.nacks = 0


class _Relay:
    __slots__ = ("addr", "deadline", "nack", "node", "seq")

    def __init__(self, addr: str, node: str, seq: int, deadline: float, nack: bool) -> None:
        self.addr = addr
        self.node = node
        self.seq = seq
        self.deadline = deadline
        self.nack = nack


class Prober:
    """Probe state of one member: its own probe and the relays it runs for others."""

    def __init__(
        self, cfg: Config, table: MemberTable, awareness: Awareness, stats: Stats,
        rng: random.Random,
    ) -> None:
        self._cfg = cfg
        self._table = table
        self._awareness = awareness
        self._stats = stats
        self._rng = rng
        self._seq = 0
        self.probe: _Probe | None = None
        self.next_probe_at = _FAR
        self.relays: dict[int, _Relay] = {}

    def start(self, now: float) -> None:
        """Schedule the first probe at a random point of the first interval
        (members started together must not probe in lockstep)."""
        self.next_probe_at = now + self._rng.random() * self._cfg.probe_interval_s

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def deadline(self) -> float:
        """The next time ``step`` has something to do."""
        p = self.probe
        t = self.next_probe_at
        if p is not None:
            t = p.end_at if p.acked or p.indirect else min(p.timeout_at, p.end_at)
        for relay in self.relays.values():
            t = min(t, relay.deadline)
        return t

    def step(self, now: float, active: bool, out: list[Out]) -> Entry | None:
        """Advance timers.  Returns a target whose probe just failed, if any.
        ``active`` False (leaving) finishes the current probe but starts none."""
        failed: Entry | None = None
        p = self.probe
        if p is not None:
            if not p.acked and not p.indirect and now >= p.timeout_at:
                self._indirect(p, out)
            if now >= p.end_at:
                failed = self._finish(p)
        if self.probe is None and active and now >= self.next_probe_at:
            self._begin(now, out)
        if self.relays:
            self._expire_relays(now, out)
        return failed

    def _begin(self, now: float, out: list[Out]) -> None:
        cfg = self._cfg
        interval = self._awareness.scale(cfg.probe_interval_s)
        self.next_probe_at = now + interval
        target = self._table.next_probe_target(now, cfg)
        if target is None:
            return
        p = _Probe(target, self._next_seq(), now, cfg.probe_timeout_s, now + interval)
        self.probe = p
        self._stats.probes += 1
        msgs: tuple[Message, ...] = (Ping(p.seq, target.node),)
        if target.state == State.SUSPECT:
            msgs += (Suspect(target.node, target.incarnation, self._table.me.node),)
        out.append((target.addr, target.node, msgs))

    def _indirect(self, p: _Probe, out: list[Out]) -> None:
        p.indirect = True
        target = p.target
        peers = self._table.random_members(
            self._cfg.indirect_checks, lambda e: e.state == State.ALIVE and e is not target
        )
        if peers:
            self._stats.indirect_probes += 1
        req = PingReq(p.seq, target.node, target.addr, True)
        for peer in peers:
            out.append((peer.addr, peer.node, (req,)))
        p.expected_nacks = len(peers)

    def _finish(self, p: _Probe) -> Entry | None:
        self.probe = None
        self._awareness.apply(Awareness.probe_delta(p.acked, p.expected_nacks, p.nacks))
        if p.acked:
            return None
        self._stats.probe_failures += 1
        return p.target if p.target.state <= State.SUSPECT else None

    def _expire_relays(self, now: float, out: list[Out]) -> None:
        for seq in [s for s, r in self.relays.items() if now >= r.deadline]:
            relay = self.relays.pop(seq)
            if relay.nack:
                out.append((relay.addr, relay.node, (Nack(relay.seq),)))

    # -- messages ---------------------------------------------------------------
    def on_ack(self, ack: Ack, sender: str, now: float, out: list[Out]) -> None:
        """An ack for our probe (direct or relayed), or for a relay we run."""
        p = self.probe
        if p is not None and ack.seq == p.seq:
            if not p.acked:
                p.acked = True
                target = p.target
                if sender == target.node:
                    sample = now - p.sent
                    rtt = target.rtt
                    target.rtt = sample if rtt is None else rtt + _RTT_GAIN * (sample - rtt)
                    target.last_ack = now
            return
        relay = self.relays.pop(ack.seq, None)
        if relay is not None:
            out.append((relay.addr, relay.node, (Ack(relay.seq),)))

    def on_nack(self, nack: Nack) -> None:
        p = self.probe
        if p is not None and nack.seq == p.seq:
            p.nacks += 1
            self._stats.nacks_received += 1

    def on_ping_req(
        self, req: PingReq, sender: str, sender_addr: str, now: float, out: list[Out]
    ) -> None:
        """Ping ``req.target`` on behalf of ``sender``."""
        seq = self._next_seq()
        self.relays[seq] = _Relay(
            sender_addr, sender, req.seq, now + self._cfg.indirect_nack_s, req.nack
        )
        out.append((req.target_addr, req.target, (Ping(seq, req.target),)))
