"""An asyncio etcd v3 client over etcd's own protos (``qosd.store.etcd.client.pb``) and grpc.aio.

Only what the cluster store needs: ranges, puts, deletes, transactions,
leases (grant, keep-alive, revoke), watches over several ranges from a
revision, compaction and status.  One channel reaches every endpoint
(gRPC's ``round_robin`` over their addresses): a member that dies or is cut
off drops out of the rotation and the next call goes to another, so the
caller sees one ``Unavailable`` (the call in flight) and then answers again.
Watches carry etcd's ``hasleader`` metadata: a member that loses its leader
ends them (``Unavailable``) instead of going quiet, and the caller watches
again through another member.  Every call has a deadline.

Not thread-safe: use a client from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import Any, Self

import grpc
import grpc.aio

from mmmesh.net import parse_hostport

from ._errors import Compacted, EtcdError, LeaseNotFound, Unavailable
from ._types import EtcdConfig, KeyValue, TxnResult, WatchEvent, prefix_end
from .pb import kv_pb2, rpc_pb2, rpc_pb2_grpc

__all__ = ["EtcdClient", "Watch"]

log = logging.getLogger("qosd.store.etcd.client")

MAX_MESSAGE = 64 << 20
"""Ranges over many nodes' SLA windows come back in one message."""
_LEADER = (("hasleader", "true"),)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ABORTED}
_TRANSIENT = ("leader changed", "no leader", "request timed out", "timed out",
              "too many requests", "not capable", "stopped")


def error_of(e: grpc.aio.AioRpcError | grpc.RpcError) -> EtcdError:
    """etcd's status as one of our errors."""
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = (e.details() if callable(getattr(e, "details", None)) else "") or ""
    if "compacted" in details:
        return Compacted(0)
    if "lease not found" in details:
        return LeaseNotFound(details)
    if code in _RETRYABLE or any(t in details for t in _TRANSIENT):
        return Unavailable(f"etcd: {details or code}")
    return EtcdError(f"etcd: {details or code}")


class EtcdClient:
    """The client; ``await close()`` when done (or ``async with``)."""

    def __init__(self, cfg: EtcdConfig) -> None:
        if not cfg.endpoints:
            raise EtcdError("etcd: no endpoints")
        self.cfg = cfg
        self._channel: grpc.aio.Channel | None = None
        self._keepalive: Any = None  # the LeaseKeepAlive stream, opened on first use
        self.requests: dict[str, int] = {}
        """Calls made, by kind (range, put, txn, ...): the metrics'."""
        self.failures: dict[str, int] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the channel ---------------------------------------------------------------
    async def _target(self) -> str:
        loop = asyncio.get_running_loop()
        v4: list[str] = []
        v6: list[str] = []
        for ep in self.cfg.endpoints:
            host, port = parse_hostport(ep.split("://")[-1], what="etcd endpoint")
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("etcd endpoint %s: %s", ep, e)
                continue
            for fam, _, _, _, addr in infos:
                ip = addr[0] if isinstance(addr[0], str) else ""
                if fam == socket.AF_INET and f"{ip}:{port}" not in v4:
                    v4.append(f"{ip}:{port}")
                elif fam == socket.AF_INET6 and f"[{ip}]:{port}" not in v6:
                    v6.append(f"[{ip}]:{port}")
        if not v4 and not v6:
            raise Unavailable(f"etcd: no endpoint resolves ({', '.join(self.cfg.endpoints)})")
        return f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"

    async def channel(self) -> grpc.aio.Channel:
        if self._channel is not None:
            return self._channel
        cfg = self.cfg
        options: list[tuple[str, Any]] = [
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", 3000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        target = await self._target()
        if cfg.ca_file is not None:
            creds = grpc.ssl_channel_credentials(
                cfg.ca_file.read_bytes(),
                cfg.key_file.read_bytes() if cfg.key_file else None,
                cfg.cert_file.read_bytes() if cfg.cert_file else None)
            name = cfg.server_name or parse_hostport(cfg.endpoints[0].split("://")[-1])[0]
            options.append(("grpc.ssl_target_name_override", name))
            options.append(("grpc.default_authority", name))
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        return self._channel

    async def reconnect(self) -> None:
        """Drops the channel; the next call resolves the endpoints again."""
        await self._close_keepalive()
        if self._channel is not None:
            channel, self._channel = self._channel, None
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    async def close(self) -> None:
        await self.reconnect()

    async def _call(self, kind: str, stub_of: Any, method: str, req: Any,
                    timeout: float | None = None) -> Any:
        self.requests[kind] = self.requests.get(kind, 0) + 1
        stub = stub_of(await self.channel())
        try:
            return await getattr(stub, method)(req, timeout=timeout or self.cfg.timeout_s,
                                               metadata=_LEADER)
        except grpc.aio.AioRpcError as e:
            err = error_of(e)
            self.failures[type(err).__name__] = self.failures.get(type(err).__name__, 0) + 1
            raise err from None

    # -- KV ------------------------------------------------------------------------
    async def get(self, key: bytes, timeout: float | None = None
                  ) -> tuple[int, KeyValue | None]:
        """(the store's revision, the key or None)."""
        r = await self._call("range", rpc_pb2_grpc.KVStub, "Range", rpc_pb2.RangeRequest(key=key),
                             timeout)
        return r.header.revision, (KeyValue.of(r.kvs[0]) if r.kvs else None)

    async def range_prefix(self, prefix: bytes, *, revision: int = 0,
                           timeout: float | None = None) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` at ``revision`` (0: now): (revision, kvs).
        Compacted when ``revision`` was compacted away."""
        return await self.range(prefix, prefix_end(prefix), revision=revision, timeout=timeout)

    async def range(self, key: bytes, range_end: bytes, *, revision: int = 0,
                    timeout: float | None = None) -> tuple[int, list[KeyValue]]:
        """Every key in [``key``, ``range_end``) at ``revision`` (0: now)."""
        r = await self._call("range", rpc_pb2_grpc.KVStub, "Range", rpc_pb2.RangeRequest(
            key=key, range_end=range_end, revision=revision), timeout)
        return r.header.revision, [KeyValue.of(kv) for kv in r.kvs]

    async def put(self, key: bytes, value: bytes, lease: int = 0,
                  timeout: float | None = None) -> int:
        r = await self._call("put", rpc_pb2_grpc.KVStub, "Put",
                             rpc_pb2.PutRequest(key=key, value=value, lease=lease), timeout)
        return int(r.header.revision)

    async def delete(self, key: bytes, range_end: bytes = b"") -> int:
        r = await self._call("delete", rpc_pb2_grpc.KVStub, "DeleteRange",
                             rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end))
        return int(r.header.revision)

    async def txn(self, compare: Sequence[rpc_pb2.Compare], success: Sequence[rpc_pb2.RequestOp],
                  failure: Sequence[rpc_pb2.RequestOp] = ()) -> TxnResult:
        r = await self._call("txn", rpc_pb2_grpc.KVStub, "Txn", rpc_pb2.TxnRequest(
            compare=list(compare), success=list(success), failure=list(failure)))
        ranges = [[KeyValue.of(kv) for kv in op.response_range.kvs]
                  for op in r.responses if op.HasField("response_range")]
        return TxnResult(bool(r.succeeded), int(r.header.revision), ranges)

    async def compact(self, revision: int, physical: bool = True) -> None:
        await self._call("compact", rpc_pb2_grpc.KVStub, "Compact",
                         rpc_pb2.CompactionRequest(revision=revision, physical=physical), 30)

    # -- leases --------------------------------------------------------------------
    async def lease_grant(self, ttl_s: int) -> int:
        r = await self._call("lease_grant", rpc_pb2_grpc.LeaseStub, "LeaseGrant",
                             rpc_pb2.LeaseGrantRequest(TTL=ttl_s))
        if r.error:
            raise EtcdError(f"etcd: lease grant: {r.error}")
        return int(r.ID)

    async def lease_revoke(self, lease: int, timeout: float | None = None) -> None:
        await self._call("lease_revoke", rpc_pb2_grpc.LeaseStub, "LeaseRevoke",
                         rpc_pb2.LeaseRevokeRequest(ID=lease), timeout)

    async def lease_keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renews ``lease`` once; returns its TTL.  LeaseNotFound when it is gone."""
        self.requests["lease_keepalive"] = self.requests.get("lease_keepalive", 0) + 1
        try:
            if self._keepalive is None:
                stub = rpc_pb2_grpc.LeaseStub(await self.channel())  # type: ignore[no-untyped-call]
                self._keepalive = stub.LeaseKeepAlive(metadata=_LEADER)
            await self._keepalive.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease))
            r = await asyncio.wait_for(self._keepalive.read(), timeout or self.cfg.timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            await self._close_keepalive()
            if isinstance(e, grpc.aio.AioRpcError):
                raise error_of(e) from None
            raise Unavailable("etcd: lease keep-alive: no answer") from None
        if r is grpc.aio.EOF:
            await self._close_keepalive()
            raise Unavailable("etcd: lease keep-alive stream ended")
        if r.TTL <= 0:
            raise LeaseNotFound(f"etcd: lease {lease:x} expired")
        return int(r.TTL)

    async def _close_keepalive(self) -> None:
        ka, self._keepalive = self._keepalive, None
        if ka is not None:
            ka.cancel()

    # -- watches and status --------------------------------------------------------
    async def watch(self, prefixes: Sequence[bytes], start_revision: int,
                    ranges: Sequence[tuple[bytes, bytes]] = ()) -> Watch:
        """A watch of every key under each of ``prefixes`` and in each of
        ``ranges`` ([key, range_end)) from ``start_revision`` on (one stream).
        Compacted when that revision is gone."""
        self.requests["watch"] = self.requests.get("watch", 0) + 1
        stub = rpc_pb2_grpc.WatchStub(await self.channel())  # type: ignore[no-untyped-call]
        w = Watch(stub.Watch(metadata=_LEADER))
        try:
            await w.create([(p, prefix_end(p)) for p in prefixes] + list(ranges),
                           start_revision, self.cfg.timeout_s)
        except BaseException:
            w.cancel()
            raise
        return w

    async def status(self) -> dict[str, int]:
        """The answering member's view: member id, leader id, raft term, revision."""
        r = await self._call("status", rpc_pb2_grpc.MaintenanceStub, "Status",
                             rpc_pb2.StatusRequest())
        return {"member": int(r.header.member_id), "leader": int(r.leader),
                "raft_term": int(r.raftTerm), "revision": int(r.header.revision),
                "db_size": int(r.dbSize)}


class Watch:
    """One watch stream over some prefixes; :meth:`next` gives each batch."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.ids: list[int] = []

    async def create(self, ranges: Sequence[tuple[bytes, bytes]], start: int,
                     timeout: float) -> None:
        for key, end in ranges:
            try:
                await self._call.write(rpc_pb2.WatchRequest(
                    create_request=rpc_pb2.WatchCreateRequest(
                        key=key, range_end=end, start_revision=start)))
            except grpc.aio.AioRpcError as e:
                raise error_of(e) from None
            except asyncio.InvalidStateError:
                raise Unavailable("etcd: watch stream ended") from None
            r = await self._read(timeout)
            if r.compact_revision:
                raise Compacted(int(r.compact_revision))
            if not r.created or r.canceled:
                raise Unavailable(f"etcd: watch not created: {r.cancel_reason or 'no reason'}")
            self.ids.append(int(r.watch_id))

    async def _read(self, timeout: float | None) -> Any:
        try:
            r = await asyncio.wait_for(self._call.read(), timeout)
        except grpc.aio.AioRpcError as e:
            raise error_of(e) from None
        except TimeoutError:
            raise Unavailable("etcd: watch: no answer") from None
        if r is grpc.aio.EOF:
            raise Unavailable("etcd: watch stream ended")
        return r

    async def next(self, timeout: float | None = None) -> tuple[int, list[WatchEvent]]:
        """The next batch: (its revision, its events).  Raises Compacted (list
        again), Unavailable (watch again, from the last revision seen + 1)."""
        while True:
            r = await self._read(timeout)
            if r.compact_revision:
                raise Compacted(int(r.compact_revision))
            if r.canceled:
                raise Unavailable(f"etcd: watch canceled: {r.cancel_reason or 'no reason'}")
            if not r.events and not r.created:
                return int(r.header.revision), []  # progress notification
            if r.events:
                return int(r.header.revision), [
                    WatchEvent("delete" if e.type == kv_pb2.Event.DELETE else "put",
                               KeyValue.of(e.kv)) for e in r.events]

    def cancel(self) -> None:
        self._call.cancel()
