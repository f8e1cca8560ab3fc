"""``Peers``: the host around the membership core (qosd.mesh.membership.core.Membership).

Every call into the core happens on the event loop's thread, in synchronous
code between two awaits, so calls never interleave (the core is not
thread-safe); the public methods hop onto the loop when called from another
thread (the API's and the metrics' worker threads).  After each core call
the host sends what it returned (:class:`~qosd.mesh.membership._transport.Pool`, never
waiting), hands its events to the subscribers, and re-arms one ``call_at``
timer at ``next_deadline()``: no polling.

Seeds are ``host:port`` strings; a DNS name stands for every A/AAAA record it
has (a Kubernetes headless Service), resolved again at each join attempt.
While no other member is known the host joins again every
``rejoin_interval_s`` (the core itself retries with the same addresses every
``join_retry_s``).  ``stop()`` leaves gracefully (the leave is gossiped for
at most ``leave_timeout_s``); a killed process leaves nothing behind: the
others detect it.

Applications (the global SLA view, the policy rollout) ride on the core's
broadcasts and push-pull state; the push-pull state is shared: each
application owns one *section* of it (``set_app_state(section, data)``), and
its subscribers see only that section of what peers send.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from qosd.config import PeersConfig
from qosd.mesh.membership.core import (
    AppStateReceived,
    Event,
    MemberChanged,
    MemberInfo,
    Membership,
    Packet,
    PushPull,
    Send,
)

from ._identity import Credentials, PeersError, load_credentials, valid_node_id
from ._rtt import RttRecorder
from ._transport import BULK, GOSSIP, PeerServer, Pool, Traffic
from ._wire import DecodeError, decode_app_state, encode, encode_app_state

__all__ = ["Peers", "Section", "resolve"]

log = logging.getLogger("qosd.mesh.membership.peers")

T = TypeVar("T")
Subscriber = Callable[[list[Event]], None]
Resolver = Callable[[str, int], Awaitable[list[str]]]
SWEEP_S = 10.0
CHANNEL_IDLE_S = 60.0


async def resolve(host: str, port: int) -> list[str]:
    """Every address of ``host`` (an IP literal, or all A/AAAA records of a
    name) as ``ip:port`` / ``[ip6]:port``; [] when the name does not resolve."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except OSError:
        return []
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        addr = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if addr not in out:
            out.append(addr)
    return out


def _canonical(host: str, port: int) -> str | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class Section:
    """One application's handle on the mesh: what ``qosd.mesh.rollout.core``'s
    ``Gossip`` protocol asks for (``node_id``, ``broadcast``, ``set_app_state``
    of this section only, ``members``)."""

    def __init__(self, peers: Peers, name: str) -> None:
        self._peers, self.name = peers, name

    @property
    def node_id(self) -> str:
        return self._peers.node_id

    def broadcast(self, key: str, payload: bytes) -> int:
        return self._peers.broadcast(key, payload)

    def set_app_state(self, data: bytes) -> None:
        self._peers.set_app_state(self.name, data)

    def members(self) -> list[MemberInfo]:
        return self._peers.members()


class Peers:
    """This node in the mesh: the core, its gRPC server and channels, seeds."""

    def __init__(self, cfg: PeersConfig, node_id: str, *, rng: random.Random | None = None,
                 resolver: Resolver = resolve, clock: Callable[[], float] | None = None) -> None:
        """``clock``: the core's time (default: the event loop's); a test that
        drives the host by hand (``_tick``, ``_receive``) passes a fake one."""
        if not valid_node_id(node_id):
            raise PeersError(f"peers: node_name {node_id!r} must be a DNS-1123 name "
                             "(lower-case letters, digits, '-', '.')")
        self.cfg = cfg
        self.node_id = node_id
        self.config = cfg.core_config()
        self.addr = cfg.advertised
        self.core = Membership(self.config, node_id, self.addr, rng or random.Random(),
                               app_seq_start=time.time_ns() // 1000)
        self.traffic = Traffic()
        self.rtt = RttRecorder()
        self.credentials: Credentials | None = None
        self._resolver = resolver
        self._clock = clock
        self._parts: dict[str, bytes] = {}
        self._subscribers: dict[int, tuple[str | None, Subscriber]] = {}
        self._tokens = itertools.count()
        self._fetchers: dict[str, Callable[[str, str], bytes | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._tasks: list[asyncio.Task[None]] = []
        self._server: PeerServer | None = None
        self._pool: Pool | None = None
        self.port = 0
        self.stopped = False

    # -- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Loads the credentials (PeersError), serves, and starts joining."""
        cfg = self.cfg
        creds = load_credentials(cfg.cert_file, cfg.key_file, cfg.ca_file, cfg.trust_domain,
                                 self.node_id)
        self.credentials = creds
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._server = PeerServer(creds, cfg, self._receive, self._serve_fetch, self.traffic,
                                  self.now)
        self._pool = Pool(creds, cfg, self.config.probe_timeout_s, self.traffic, self.now)
        self.port = await self._server.start(cfg.listen)
        self._tasks = [asyncio.create_task(self._join_loop(), name="peers-join"),
                       asyncio.create_task(self._sweep_loop(), name="peers-sweep")]
        self._tick()
        log.info("peers: %s at %s (listening on %s), seeds %s", self.node_id, self.addr,
                 cfg.listen, ", ".join(cfg.seeds) or "none")

    async def stop(self, *, leave: bool = True) -> None:
        """Leaves the mesh (unless ``leave`` is False), then closes everything."""
        if self.stopped or self._loop is None:
            return
        self.stopped = True
        for task in self._tasks:
            task.cancel()
        if leave:
            self._after(self.core.leave(self.now()))
            deadline = self.now() + self.cfg.leave_timeout_s
            while self.core.leave_pending() and self.now() < deadline:
                await asyncio.sleep(self.config.gossip_interval_s / 2)
        if self._timer is not None:
            self._timer.cancel()
        assert self._pool is not None and self._server is not None
        await self._pool.drain(1.0)
        await self._server.stop(0.5)
        await self._pool.close()
        log.info("peers: %s stopped%s", self.node_id, " (left the mesh)" if leave else "")

    def now(self) -> float:
        """The core's clock (the event loop's monotonic time, unless injected)."""
        if self._clock is not None:
            return self._clock()
        return self._loop.time() if self._loop is not None else time.monotonic()

    # -- driving the core ------------------------------------------------------------
    def _after(self, sends: Iterable[Send]) -> None:
        """Sends, events, timer: what follows every core call."""
        now = self.now()
        pool = self._pool
        for send in sends:
            packet = send.packet
            self.rtt.sent(packet, send.node, now)
            lane = BULK if packet.msgs and type(packet.msgs[0]) is PushPull else GOSSIP
            if pool is not None and (not self.stopped or self.core.leaving):
                pool.send(send.to, send.node, encode(packet), lane)
        events = self.core.events()
        if events:
            self._publish(events)
        self._arm()

    def _arm(self) -> None:
        loop = self._loop
        if loop is None:
            return
        due = self.core.next_deadline()
        if due >= self._timer_at:
            return  # the armed timer comes first (an early tick is harmless)
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        self._timer = loop.call_at(max(due, loop.time()), self._tick)

    def _tick(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self._after(self.core.tick(self.now()))

    def _receive(self, packet: Packet) -> None:
        """A packet the server accepted (sender already matched to its certificate)."""
        if self.stopped and not self.core.leaving:
            return
        self.rtt.received(packet, self.now())
        self._after(self.core.handle(packet, self.now()))

    async def _join_loop(self) -> None:
        while True:
            if self.core.live_members() == 0 and self.cfg.seeds:
                seeds = await self.resolve_seeds()
                if seeds and not self.core.leaving:
                    log.info("peers: joining through %s", ", ".join(seeds))
                    self._after(self.core.join(seeds, self.now()))
            await asyncio.sleep(self.cfg.rejoin_interval_s)

    async def resolve_seeds(self) -> list[str]:
        """The seed addresses now: IP literals as they are, names resolved."""
        from mmmesh.net import parse_hostport

        out: list[str] = []
        for seed in self.cfg.seeds:
            host, port = parse_hostport(seed, what="seed")
            found = _canonical(host, port)
            addrs = [found] if found else await self._resolver(host, port)
            out += [a for a in addrs if a not in out and a != self.addr]
        return out

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            assert self._pool is not None
            await self._pool.sweep(CHANNEL_IDLE_S)
            self.rtt.prune(self.now())

    # -- applications ----------------------------------------------------------------
    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the event loop's thread (at once when already there)."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._thread or not loop.is_running():
            return fn()

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the peers' loop and returns its result (from any thread):
        how an application reads its own sans-I/O state safely."""
        return self._on_loop(fn)

    def broadcast(self, key: str, payload: bytes) -> int:
        """Gossips ``payload`` under ``key`` to every member (``Membership.broadcast``:
        last writer wins per (origin, key); at most one packet, ClusterError
        otherwise).  Returns its sequence number."""
        def go() -> int:
            seq = self.core.broadcast(key, payload)
            self._arm()
            return seq

        return self._on_loop(go)

    def set_app_state(self, section: str, data: bytes) -> None:
        """This node's part ``section`` of the push-pull state (b"" removes it)."""
        def go() -> None:
            if data:
                self._parts[section] = bytes(data)
            else:
                self._parts.pop(section, None)
            self.core.set_app_state(encode_app_state(self._parts))

        self._on_loop(go)

    def section(self, name: str) -> Section:
        """An application's handle (``broadcast``, its own ``set_app_state``)."""
        return Section(self, name)

    def subscribe(self, fn: Subscriber, section: str | None = None) -> Callable[[], None]:
        """Calls ``fn(events)`` on the loop with each batch of core events:
        ``MemberChanged``, ``Joined``, ``AppMessage`` (every key), and
        ``AppStateReceived`` whose ``data`` is the peer's part ``section`` (none
        without a section, or when the peer sent no such part).  ``fn`` must not
        block; what it raises is logged.  Returns the unsubscribe function."""
        token = next(self._tokens)
        self._subscribers[token] = (section, fn)

        def unsubscribe() -> None:
            self._subscribers.pop(token, None)

        return unsubscribe

    def serve_fetch(self, section: str, handler: Callable[[str, str], bytes | None]) -> None:
        """Answers peers' ``fetch(…, section, key)`` with ``handler(peer, key)``
        (bytes, or None for "not here"); called on the loop, must not block."""
        self._fetchers[section] = handler

    async def fetch(self, node: str, section: str, key: str) -> bytes | None:
        """Asks member ``node`` for item ``key`` of ``section`` (None: it has none,
        is unknown, or did not answer within peers.push_pull_timeout_s)."""
        info = self.core.member(node)
        if info is None or not info.addr or self._pool is None:
            return None
        return await self._pool.fetch(info.addr, node, section, key)

    async def fetch_detail(self, node: str, section: str, key: str,
                           timeout: float | None = None) -> tuple[bytes | None, str]:
        """:meth:`fetch`, with why it gave nothing (``Pool.fetch_detail``'s
        reasons, and "unknown": no such member or no address, so nothing was
        sent); ``timeout``: this call's deadline (default the bulk lane's)."""
        info = self.core.member(node)
        if info is None or not info.addr or self._pool is None:
            return None, "unknown"
        return await self._pool.fetch_detail(info.addr, node, section, key, timeout)

    def _serve_fetch(self, peer: str, section: str, key: str) -> bytes | None:
        handler = self._fetchers.get(section)
        return None if handler is None else handler(peer, key)

    def _publish(self, events: list[Event]) -> None:
        parts: dict[int, dict[str, bytes]] = {}
        for section, fn in list(self._subscribers.values()):
            batch: list[Event] = []
            for i, e in enumerate(events):
                if not isinstance(e, AppStateReceived):
                    batch.append(e)
                    continue
                if i not in parts:
                    try:
                        parts[i] = decode_app_state(e.data)
                    except DecodeError:
                        parts[i] = {}
                data = parts[i].get(section) if section else None
                if data is not None:
                    batch.append(AppStateReceived(e.peer, data, e.join))
            if batch:
                try:
                    fn(batch)
                except Exception:
                    log.exception("peers: a subscriber failed")
        for e in events:
            if isinstance(e, MemberChanged):
                log.info("peers: %s is %s (incarnation %d, at %s)", e.node, e.state.name,
                         e.incarnation, e.addr or "?")

    # -- observation -----------------------------------------------------------------
    def members(self) -> list[MemberInfo]:
        """Every member known (this one included, tombstones too)."""
        return self._on_loop(self.core.members)

    def snapshot(self) -> dict[str, Any]:
        """Members, counters and traffic at one instant (for the API and metrics)."""
        def take() -> dict[str, Any]:
            now = self.now()
            pool, server = self._pool, self._server
            return {
                "node": self.node_id, "addr": self.addr, "now": now,
                "incarnation": self.core.incarnation, "health_score": self.core.health_score,
                "members": self.core.members(), "stats": self.core.stats.as_dict(),
                "queued_broadcasts": self.core.queued_broadcasts(),
                "packets": dict(self.traffic.packets), "bytes": dict(self.traffic.bytes),
                "dropped": dict(self.traffic.dropped),
                "send_failures": dict(self.traffic.send_failures),
                "rate_limited_peers": server.limiter.limited_peers(now) if server else 0,
                "channels": pool.channels if pool else 0,
                "rtt": self.rtt.histogram(),
                "cert_not_after": self.credentials.not_after.timestamp()
                if self.credentials else None,
            }

        return self._on_loop(take)

