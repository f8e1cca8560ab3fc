"""The gRPC side of the peers: a server that takes packets and a pool of
channels that sends them (proto/qosd/mesh/protocol/peer.proto, service ``Peer``).

Server (:class:`PeerServer`): for every call, in this order, and a drop is
counted under its reason and answered with an error status:

    no_identity     the client certificate names no node (CA-signed, but not
                    by the rule in _identity)                  PERMISSION_DENIED
    too_large       a Gossip packet over max_gossip_bytes      RESOURCE_EXHAUSTED
    rate_limited    the peer's token buckets are empty         RESOURCE_EXHAUSTED
    malformed       not a mmmesh.peer.v1.Packet                     INVALID_ARGUMENT
    impersonation   Packet.sender is not the certificate's id  PERMISSION_DENIED

A certificate from another CA never gets this far: the TLS handshake fails
(gRPC logs it; nothing to count here), and so does a message over the
server's limit (max_push_pull_bytes).  Accepted packets go to ``deliver``.

Pool (:class:`Pool`): one channel per (address, node id, lane), lane
``gossip`` (deadline: the probe timeout) or ``bulk`` (push-pull and fetch,
deadline peers.push_pull_timeout_s), so a large state never queues in front
of a probe on the same connection.  Each channel checks the server's
certificate for the node id it expects (``grpc.ssl_target_name_override``);
a seed address, whose node is not known yet, is identified first by one TLS
handshake.  ``send`` never blocks: each call runs as a task, at most
``max_inflight`` per address (more are dropped as ``backlog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError as ProtoDecodeError

from qosd.config import PeersConfig
from qosd.mesh.membership.core import Packet
from qosd.mesh.protocol import peer_pb2

from ._identity import Credentials, identify, peer_node
from ._limits import PeerLimiter
from ._wire import DecodeError, decode

log = logging.getLogger("qosd.mesh.membership.peers")

SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name  # mmmesh.peer.v1.Peer
GOSSIP, BULK = "gossip", "bulk"
DROP_REASONS = ("no_identity", "too_large", "rate_limited", "malformed", "impersonation")
SEND_FAILURES = ("unavailable", "deadline", "identity", "refused", "backlog", "unidentified",
                 "error")
_SLACK = 64 * 1024  # framing above the largest message we mean to allow
_IDENTITY_TTL_S = 60.0
# a failed identification (nothing listening yet, a timeout) is tried again this
# soon: cached a minute, a node started before its seeds could not join for a minute
_IDENTITY_FAILED_TTL_S = 1.0
_CODES = {"no_identity": grpc.StatusCode.PERMISSION_DENIED,
          "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "rate_limited": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "malformed": grpc.StatusCode.INVALID_ARGUMENT,
          "impersonation": grpc.StatusCode.PERMISSION_DENIED}

Deliver = Callable[[Packet], None]
FetchHandler = Callable[[str, str, str], bytes | None]  # (peer, section, key) -> data


class Traffic:
    """What crossed the wire (read by the metrics collector)."""

    def __init__(self) -> None:
        self.packets: Counter[str] = Counter()  # "in" / "out"
        self.bytes: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.send_failures: Counter[str] = Counter({r: 0 for r in SEND_FAILURES})


class PeerServer:
    """The ``mmmesh.peer.v1.Peer`` servicer on a grpc.aio server with mTLS."""

    def __init__(self, creds: Credentials, cfg: PeersConfig, deliver: Deliver,
                 fetch: FetchHandler, traffic: Traffic,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._creds, self._cfg, self._deliver, self._fetch = creds, cfg, deliver, fetch
        self.traffic = traffic
        self._clock = clock
        self.limiter = PeerLimiter(cfg.rate_packets_per_s, cfg.rate_burst_packets,
                                   cfg.rate_bytes_per_s, cfg.rate_burst_bytes)
        limit = cfg.max_push_pull_bytes + _SLACK
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.max_concurrent_streams", 32), ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000)],
            maximum_concurrent_rpcs=256)
        raw = {"request_deserializer": None, "response_serializer": None}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Gossip": grpc.unary_unary_rpc_method_handler(self.Gossip, **raw),
            "PushPull": grpc.unary_unary_rpc_method_handler(self.PushPull, **raw),
            "Fetch": grpc.unary_unary_rpc_method_handler(self.Fetch, **raw),
        }),))

    async def start(self, listen: str) -> int:
        """Binds ``listen`` (host:port) and serves; returns the port."""
        port = self._server.add_secure_port(listen, self._creds.server_credentials())
        if port == 0:
            raise OSError(f"peers: cannot listen on {listen}")
        await self._server.start()
        return port

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)

    # -- the service -----------------------------------------------------------------
    async def Gossip(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """Probes and gossip (at most max_gossip_bytes)."""
        return await self._take(request, context, self._cfg.max_gossip_bytes)

    async def PushPull(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
                       ) -> bytes:
        """A state exchange (the server's message limit bounds it)."""
        return await self._take(request, context, None)

    async def Fetch(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """One item of a module's state, if this node holds it."""
        peer = await self._admit(request, context, None)
        try:
            req = peer_pb2.FetchRequest.FromString(request)
        except (ProtoDecodeError, ValueError):
            await self._refuse(context, "malformed", "not a FetchRequest")
        data = self._fetch(peer, req.section, req.key)
        reply = peer_pb2.FetchReply(found=data is not None, data=data or b"")
        return bytes(reply.SerializeToString())

    async def _admit(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any],
                     limit: int | None) -> str:
        peer = peer_node(context.auth_context(), self._cfg.trust_domain)
        if peer is None:
            await self._refuse(context, "no_identity",
                                      "the client certificate names no mmmesh node")
        if limit is not None and len(request) > limit:
            await self._refuse(context, "too_large", f"over {limit} bytes")
        if not self.limiter.allow(peer, len(request), self._clock()):
            await self._refuse(context, "rate_limited", f"rate limit of {peer}")
        self.traffic.packets["in"] += 1
        self.traffic.bytes["in"] += len(request)
        return peer

    async def _take(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any],
                    limit: int | None) -> bytes:
        peer = await self._admit(request, context, limit)
        try:
            packet = decode(request)
        except DecodeError as e:
            await self._refuse(context, "malformed", str(e))
        if packet.sender != peer:
            await self._refuse(context, "impersonation",
                                      f"sender {packet.sender!r} is not the certificate's {peer!r}")
        self._deliver(packet)
        return b""

    async def _refuse(self, context: grpc.aio.ServicerContext[Any, Any], reason: str,
                      message: str) -> NoReturn:
        self.traffic.dropped[reason] += 1
        log.debug("dropped a packet from %s: %s (%s)", context.peer(), reason, message)
        await context.abort(_CODES[reason], f"{reason}: {message}")
        raise AssertionError("abort returns only by raising")  # pragma: no cover


def _failure(e: grpc.aio.AioRpcError) -> str:
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "identity" if "Verification" in (e.debug_error_string() or "") \
            or "Verification" in (e.details() or "") else "unavailable"
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED):
        return "refused"
    return "error"


class _Channel:
    __slots__ = ("calls", "channel", "used")

    def __init__(self, channel: grpc.aio.Channel, now: float) -> None:
        self.channel = channel
        self.calls: dict[str, Callable[..., Awaitable[bytes]]] = {}
        self.used = now


class Pool:
    """Outgoing calls: pooled channels, identification of seeds, bounded tasks."""

    def __init__(self, creds: Credentials, cfg: PeersConfig, probe_timeout_s: float,
                 traffic: Traffic, clock: Callable[[], float] = time.monotonic) -> None:
        self._creds, self._cfg, self.traffic, self._clock = creds, cfg, traffic, clock
        self._deadline = {GOSSIP: probe_timeout_s, BULK: cfg.push_pull_timeout_s}
        self._max_send = {GOSSIP: cfg.max_gossip_bytes, BULK: cfg.max_push_pull_bytes + _SLACK}
        self._channels: dict[tuple[str, str, str], _Channel] = {}
        self._identities: dict[str, tuple[str | None, float]] = {}
        self._inflight: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._ssl = creds.ssl_context()
        self._channel_creds = creds.channel_credentials()

    @property
    def channels(self) -> int:
        return len(self._channels)

    def _channel(self, addr: str, node: str, lane: str) -> _Channel:
        key = (addr, node, lane)
        ch = self._channels.get(key)
        if ch is None:
            options = [
                ("grpc.ssl_target_name_override", node), ("grpc.default_authority", node),
                ("grpc.max_send_message_length", self._max_send[lane]),
                ("grpc.max_receive_message_length", self._max_send[BULK]),
                ("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0),
                # a peer that went away is tried again within a second of coming back
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 1000), ("grpc.max_reconnect_backoff_ms", 1000),
                # keepalive also sets TCP_USER_TIMEOUT: a connection whose data goes
                # unacknowledged for 2 s (a partition) is dropped and dialled again,
                # instead of waiting out TCP's retransmission backoff after it heals
                ("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 2000),
                ("grpc.keepalive_permit_without_calls", 0),
            ]
            channel = grpc.aio.secure_channel(addr, self._channel_creds, options=options)
            ch = self._channels[key] = _Channel(channel, self._clock())
        ch.used = self._clock()
        return ch

    def _call(self, ch: _Channel, method: str) -> Callable[..., Awaitable[bytes]]:
        call = ch.calls.get(method)
        if call is None:
            call = ch.calls[method] = ch.channel.unary_unary(f"/{SERVICE}/{method}")
        return call

    def send(self, addr: str, node: str, data: bytes, lane: str) -> None:
        """Sends one packet (Gossip or PushPull by lane) without waiting."""
        if self._inflight[addr] >= self._cfg.max_inflight:
            self.traffic.send_failures["backlog"] += 1
            return
        self._inflight[addr] += 1
        task = asyncio.get_running_loop().create_task(self._send(addr, node, data, lane))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, addr: str, node: str, data: bytes, lane: str) -> None:
        try:
            if not node:
                node = await self.identity(addr) or ""
                if not node:
                    self.traffic.send_failures["unidentified"] += 1
                    return
                if node == self._creds.node:
                    return  # a seed address that is this node
            method = "Gossip" if lane == GOSSIP else "PushPull"
            self.traffic.packets["out"] += 1
            self.traffic.bytes["out"] += len(data)
            await self._call(self._channel(addr, node, lane), method)(
                data, timeout=self._deadline[lane])
        except grpc.aio.AioRpcError as e:
            reason = _failure(e)
            self.traffic.send_failures[reason] += 1
            log.debug("send to %s (%s) failed: %s %s", addr, node, reason, e.details())
        finally:
            self._inflight[addr] -= 1
            if self._inflight[addr] <= 0:
                del self._inflight[addr]

    async def identity(self, addr: str) -> str | None:
        """The node id at ``addr`` (from its certificate; cached a minute)."""
        now = self._clock()
        known = self._identities.get(addr)
        if known is not None and now - known[1] < (
                _IDENTITY_TTL_S if known[0] is not None else _IDENTITY_FAILED_TTL_S):
            return known[0]
        node = await identify(addr, self._ssl, self._cfg.trust_domain,
                              self._cfg.identify_timeout_s)
        self._identities[addr] = (node, self._clock())
        return node

    async def fetch(self, addr: str, node: str, section: str, key: str) -> bytes | None:
        """Asks ``node`` at ``addr`` for an item; None when it has none or fails."""
        return (await self.fetch_detail(addr, node, section, key))[0]

    async def fetch_detail(self, addr: str, node: str, section: str, key: str,
                           timeout: float | None = None) -> tuple[bytes | None, str]:
        """:meth:`fetch` with why it gave nothing: ``(data, "")``, ``(None,
        "absent")`` (the peer has no such item) or ``(None, reason)``, a
        SEND_FAILURES reason ("unavailable": no connection, or it broke;
        "deadline": ``timeout``, default the bulk lane's, passed)."""
        req = peer_pb2.FetchRequest(section=section, key=key).SerializeToString()
        try:
            raw = await self._call(self._channel(addr, node, BULK), "Fetch")(
                req, timeout=self._deadline[BULK] if timeout is None else timeout)
        except grpc.aio.AioRpcError as e:
            reason = _failure(e)
            self.traffic.send_failures[reason] += 1
            return None, reason
        reply = peer_pb2.FetchReply.FromString(raw)
        return (bytes(reply.data), "") if reply.found else (None, "absent")

    async def sweep(self, idle_s: float) -> None:
        """Closes channels unused for ``idle_s`` and forgets stale identities."""
        now = self._clock()
        for key in [k for k, ch in self._channels.items() if now - ch.used > idle_s]:
            await self._channels.pop(key).channel.close()
        for addr in [a for a, (_, t) in self._identities.items() if now - t > _IDENTITY_TTL_S]:
            del self._identities[addr]

    async def drain(self, timeout_s: float) -> None:
        """Waits (at most ``timeout_s``) for the sends under way."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels.values():
            await ch.channel.close()
        self._channels.clear()
