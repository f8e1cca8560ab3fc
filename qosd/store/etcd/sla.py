"""The global SLA view on the etcd back end: the same per-class aggregates as
the gossip trees, with etcd carrying the fan-in and the fan-out.

    P/sla/n/<bucket>/<node>   every node's windows (its lease), as with gossip's own part
    P/sla/p/<class>/<K>/<k>   shard k of K: the sum of its nodes' windows (its aggregator's)
    P/sla/c/<class>           the class's record: the sum of its K shards (its root's lease)

The roles come from the member list (``P/members/``) alone, the same on every
node: ``K`` = the power of two that gives shards of about ``SHARD_NODES``
nodes (at most 256), shard ``k``'s aggregator and class ``c``'s root are the
members with the smallest ``blake2b("shard/K/k/<member>")`` and
``blake2b("root/c/<member>")`` (rendezvous hashing: a member joining or
leaving moves only the roles it takes or held).  A shard aggregator watches
its key range (one range of buckets), a root its class's partials; each
writes its sum at most every ``AGG_PERIOD_S`` while its inputs change, under
its own lease.  Every node watches ``P/sla/c/``: one key per class (the
mirror, ``RecordBook``), whatever the fleet's size.

A key is the latest value of its writer, so a node counts once (its key is
in one shard) and a shard once (one key per shard and K); a root uses the
partials of its own K only (a K change moves every shard: the old keys are
deleted by their writers, or go with their leases).  Two members that both
take a role for a moment write the same key with the same sum.  A node whose
lease expires (dead to etcd) loses its key, and its share leaves the sums
within two aggregation periods; an aggregator that dies takes its keys with
its lease, and the member list gives its roles to another member at the same
revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from qosd.mesh.slaview.core import (
    CENSUS,
    LeafSum,
    PartialSum,
    RecordBook,
    SlaView,
    TreeConfig,
    decode_state,
)
from qosd.mesh.slaview.core import StateLimits as Limits
from qosd.store.etcd.client import Compacted, EtcdClient, EtcdError
from qosd.store.etcd.keys import Layout, class_of_segment

log = logging.getLogger("qosd.store.cluster")

SHARD_NODES = 64
"""Nodes per shard (about): a shard aggregator's fan-in."""
MAX_SHARDS = 256
AGG_PERIOD_S = 1.0
"""A shard's partial and a class's record are written at most this often."""
ROLES_S = 1.0
MAX_BREAKDOWN = 64


def shard_count(members: int) -> int:
    """K for ``members`` nodes: a power of two, shards of ~SHARD_NODES."""
    want = max(1.0, members / SHARD_NODES)
    return min(MAX_SHARDS, 1 << max(0, math.ceil(math.log2(want))))


def owner(members: list[str], what: str) -> str:
    """The member that holds role ``what`` (rendezvous hashing)."""
    return min(members, key=lambda m: (hashlib.blake2b(f"{what}/{m}".encode(),
                                                       digest_size=8).digest(), m))


class Members(Protocol):
    """What the roles read of the member list (``Mirror``)."""

    @property
    def members(self) -> Any: ...


class Node(Protocol):
    """What :class:`EtcdSla` needs of its node (``EtcdNode``: given, so this
    module does not import the node that builds it)."""

    node_id: str
    client: EtcdClient
    mirror: Members

    @property
    def layout(self) -> Layout: ...

    @property
    def lease(self) -> int: ...

    @property
    def listed(self) -> bool: ...

    def count(self, what: str, n: int = 1) -> None: ...


class EtcdSla:
    """One node's part in the aggregates (see the module doc); it runs on
    the node's loop, beside ``EtcdNode``'s tasks."""

    def __init__(self, node: Node, config: TreeConfig | None = None,
                 agg_period_s: float = AGG_PERIOD_S) -> None:
        self.node = node
        self.config = config or TreeConfig()
        self.agg_period_s = agg_period_s
        self.book = RecordBook(self.config)
        self.roles: dict[tuple[Any, ...], asyncio.Task[None]] = {}
        self.written: dict[bytes, int] = {}  # partial/record keys this node wrote -> lease
        self.own_classes: set[str] = set()

    @property
    def layout(self) -> Layout:
        return self.node.layout

    def count(self, what: str, n: int = 1) -> None:
        self.node.count(what, n)

    # -- the roles ------------------------------------------------------------------
    def wanted(self) -> set[tuple[Any, ...]]:
        """The roles the member list gives this node now."""
        me = self.node.node_id
        members = sorted(set(self.node.mirror.members) | {me})
        k_all = shard_count(len(members))
        out: set[tuple[Any, ...]] = set()
        for k in range(k_all):
            if owner(members, f"shard/{k_all}/{k}") == me:
                out.add(("shard", k_all, k))
        classes = {CENSUS, *self.book.census_classes(), *self.own_classes}
        for cls in classes:
            if owner(members, f"root/{cls}") == me:
                out.add(("root", cls, k_all))
        return out

    async def run(self) -> None:
        """Keeps the role tasks what the member list says (every ``ROLES_S``)."""
        try:
            while True:
                if self.node.listed:
                    self._settle(self.wanted())
                await asyncio.sleep(ROLES_S)
        finally:
            for t in self.roles.values():
                t.cancel()
            await asyncio.gather(*self.roles.values(), return_exceptions=True)
            self.roles.clear()

    def _settle(self, wanted: set[tuple[Any, ...]]) -> None:
        for role in [r for r in self.roles if r not in wanted]:
            self.roles.pop(role).cancel()
            self.count("sla_roles_dropped")
        for role in sorted(wanted - set(self.roles), key=str):
            coro: Coroutine[Any, Any, None]
            if role[0] == "shard":
                coro = self._shard(role[1], role[2])
            else:
                coro = self._root(role[1], role[2])
            self.roles[role] = asyncio.get_running_loop().create_task(
                coro, name=f"etcd-sla-{role}")
            self.count("sla_roles_taken")

    async def _role(self, ranges: list[tuple[bytes, bytes]], take: Callable[[Any, float], bool],
                    drop: Callable[[bytes], bool], reset: Callable[[], None],
                    write: Callable[[float], Coroutine[Any, Any, None]]) -> None:
        """List ``ranges``, watch them, and ``write`` the sum at most every
        ``agg_period_s`` while they change (and again under a new lease)."""
        client = self.node.client
        backoff = 0.2
        while True:
            try:
                reset()
                rev = 0
                for start, end in ranges:
                    rev_i, kvs = await client.range(start, end, revision=rev, timeout=10)
                    rev = rev or rev_i
                    now = time.monotonic()
                    for kv in kvs:
                        take(kv, now)
                watch = await client.watch([], rev + 1, ranges)
                dirty = asyncio.Event()
                dirty.set()
                tasks = [asyncio.ensure_future(self._consume(watch, dirty, take, drop)),
                         asyncio.ensure_future(self._writer(dirty, write))]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                    for t in done:
                        t.result()
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    watch.cancel()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except Compacted:
                self.count("sla_role_relists")
            except Exception as e:  # EtcdError: again from a fresh list
                if not isinstance(e, EtcdError):
                    log.exception("etcd: an SLA role failed")
                self.count("sla_role_errors")
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    @staticmethod
    async def _consume(watch: Any, dirty: asyncio.Event, take: Callable[[Any, float], bool],
                       drop: Callable[[bytes], bool]) -> None:
        while True:
            _, events = await watch.next()
            now = time.monotonic()
            changed = False
            for ev in events:
                changed |= take(ev.kv, now) if ev.type == "put" else drop(ev.kv.key)
            if changed:
                dirty.set()

    async def _writer(self, dirty: asyncio.Event,
                      write: Callable[[float], Coroutine[Any, Any, None]]) -> None:
        lease, last = 0, -math.inf
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dirty.wait(), self.agg_period_s)
            if not (dirty.is_set() or lease != self.node.lease) or not self.node.lease:
                continue
            await asyncio.sleep(max(0.0, last + self.agg_period_s - time.monotonic()))
            dirty.clear()
            lease, last = self.node.lease, time.monotonic()
            await write(last)

    async def _put(self, key: bytes, value: bytes) -> None:
        lease = self.node.lease
        await self.node.client.put(key, value, lease, 2.0)
        self.written[key] = lease
        self.count("sla_aggregate_writes")

    async def _shard(self, shards: int, k: int) -> None:
        """Shard ``k`` of ``shards``: its nodes' windows summed per class."""
        lay = self.layout
        leaves = LeafSum(self.config)
        out: set[bytes] = set()

        def take(kv: Any, now: float) -> bool:
            node = lay.sla_node_of(kv.key)
            return node is not None and leaves.put(node, kv.value, now)

        def drop(key: bytes) -> bool:
            node = lay.sla_node_of(key)
            return node is not None and leaves.delete(node)

        async def write(now: float) -> None:
            parts = leaves.partials(k, now)
            keys = {lay.partial_key(cls, shards, k): up for cls, up in parts.items()}
            for key, up in keys.items():
                await self._put(key, up.encode())
            for key in out - set(keys):  # a class the shard no longer has
                with contextlib.suppress(EtcdError):
                    await self.node.client.delete(key)
            out.clear()
            out.update(keys)

        try:
            await self._role([lay.shard_range(shards, k)], take, drop, leaves.clear, write)
        finally:
            for key in out:  # the role moved (or K did): its keys go
                with contextlib.suppress(EtcdError, asyncio.CancelledError):
                    await self.node.client.delete(key)

    async def _root(self, cls: str, shards: int) -> None:
        """Class ``cls``'s root: its shards' partials (those of K ``shards``) summed."""
        lay = self.layout
        prefix = lay.partial_prefix(cls)
        partials = PartialSum(cls)
        epoch = time.time_ns() // 1000  # above any record a root of it wrote before

        def name(key: bytes) -> str | None:
            rest = key[len(prefix):].decode(errors="replace")
            return rest if rest.count("/") == 1 else None

        def take(kv: Any, now: float) -> bool:
            n = name(kv.key)
            return n is not None and partials.put(n, kv.value, now)

        def drop(key: bytes) -> bool:
            n = name(key)
            return n is not None and partials.delete(n)

        async def write(now: float) -> None:
            nonlocal epoch
            epoch += 1
            mine = [n for n in partials.names() if n.startswith(f"{shards:03d}/")]
            down = partials.record(self.node.node_id, epoch, now, only=mine)
            await self._put(lay.record_key(cls), down.encode())

        from qosd.store.etcd.client import prefix_end

        await self._role([(prefix, prefix_end(prefix))], take, drop, partials.clear, write)

    # -- this node's windows, its view ------------------------------------------------
    def own(self, board: dict[str, Any]) -> None:
        self.own_classes = {str(r.get("sla_class")) for part in ("classes", "stages")
                            for r in board.get(part) or () if r.get("sla_class")}

    def on_record(self, key: bytes, value: bytes | None, now: float) -> None:
        """A ``P/sla/c/`` key put (or deleted: ``value`` None), from the mirror."""
        cls = self.layout.record_class(key)
        if cls is None:
            return
        if value is None:
            self.book.delete(cls)
        else:
            self.book.put(cls, value, now)

    def snapshot(self, targets: Any, nodes: bool, members: int) -> dict[str, Any]:
        snap = self.book.snapshot(self.node.node_id, members, time.monotonic(), targets,
                                  nodes=nodes)
        snap["aggregation"] = {"backend": "etcd", "agg_period_s": self.agg_period_s,
                               "roles": sorted(str(r) for r in self.roles),
                               "shards": shard_count(members)}
        return snap

    async def breakdown(self, node: str | None) -> dict[str, Any]:
        """Each node's own windows, read now from its key (``node``: that one;
        else the members', at most MAX_BREAKDOWN)."""
        wanted = [node] if node is not None else sorted(self.node.mirror.members)
        truncated = len(wanted) > MAX_BREAKDOWN
        wanted = wanted[:MAX_BREAKDOWN]

        async def read(n: str) -> tuple[str, list[dict[str, Any]] | None]:
            try:
                _, kv = await self.node.client.get(self.layout.sla_key(n), 3.0)
            except EtcdError:
                return n, None
            return n, None if kv is None else node_rows(n, kv.value)

        got = await asyncio.gather(*(read(n) for n in wanted))
        rows = {n: r for n, r in got if r is not None}
        return {"nodes": rows, "asked": len(wanted), "answered": len(rows),
                "truncated": truncated}


def node_rows(node: str, value: bytes, wall: float | None = None
              ) -> list[dict[str, Any]] | None:
    """A node's windows (its ``P/sla/n/`` value) as breakdown rows (the per-node
    view's own rendering of them), aged by the time since it wrote them (its
    publication's wall clock against this node's ``wall``: shown only)."""
    try:
        pubs = [pub for origin, pub in decode_state(value, 1 << 17, Limits(1 << 16, 255, 4097))
                if origin == node and not isinstance(pub, ValueError)]
    except ValueError:
        return None
    if not pubs:
        return None
    wall = time.time() if wall is None else wall
    since = max(0.0, wall - pubs[0].sent_ms / 1000)
    view = SlaView("breakdown-reader")
    if view.on_app_state(node, value, 0.0) == 0:
        return None
    snap = view.snapshot(since, nodes=True)
    out = []
    for part in ("classes", "stages"):
        for row in snap[part]:
            for b in row.get("breakdown") or ():
                if b.get("node") == node:
                    out.append({**b, "stage": row.get("stage"), "sla_class": row["sla_class"],
                                "modality": row["modality"]})
    return out


__all__ = ["AGG_PERIOD_S", "SHARD_NODES", "EtcdSla", "class_of_segment", "node_rows", "owner",
           "shard_count"]
