"""One node on the etcd back end: lease, list + watch, realise, report, publish.

:class:`EtcdNode` is the whole etcd side of a node and nothing of qosd: it
takes a *realiser* (``(version, text, author) -> (ok, reason)``, run in a
worker thread), the *applied* version (what the node runs) and, optionally,
an SLA *source* (``SlaBoard.view()``).  qosd gives it the service's
(``qosd/store/etcd/store.py``); ``bench/etcd_rollout.py`` runs hundreds of
them with a realiser that answers at once.  All of it runs on one event loop.

Tasks:

* **session** — grant the lease, list the watched prefixes once (and again
  after a compaction: :class:`Mirror.reset`), then watch them from the
  mirror's revision + 1; on an error it waits (0.2 s doubling to 2 s) and
  watches again from where it was, so nothing is lost or replayed twice.
  ``up`` is True while a watch runs.
* **keepalive** — renews the lease every ttl/3; a lease that etcd says is
  gone (or that could not be renewed for a whole ttl) is lost: a new one is
  granted and every leased key written again.
* **step** — level-triggered, whatever woke it: desired (etcd's
  ``P/policy/current``) vs applied -> realise (one at a time); the report
  this node owes (ACK of what it runs, or NACK of the desired version) vs the
  one written under the current lease -> write it; the member key likewise.
  A failed write is retried after ``RETRY_S``.
* **sla** — every ``sla_period_s`` the source's windows become this node's
  publication (``SlaView.local_windows``), written as its bundle under
  ``P/sla/n/<bucket>/<node>``; the shard and class roles the member list
  gives this node aggregate them (``sla.py``: ``EtcdSla``), and the view is
  the class records under ``P/sla/c/``, through the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from qosd.mesh.membership.core import Config as CoreConfig
from qosd.mesh.rollout.core import (
    NO_VERSION,
    Announcement,
    MeshVersion,
    NotSynced,
    Report,
    RolloutConflict,
    RolloutTable,
    build_table,
)
from qosd.mesh.slaview.core import SlaView, SlaViewConfig
from qosd.store.etcd.client import (
    Compacted,
    EtcdClient,
    EtcdError,
    KeyValue,
    LeaseNotFound,
    Unavailable,
    cmp_mod_revision,
    op_delete,
    op_put,
)
from qosd.store.etcd.keys import (
    HISTORY,
    Dropped,
    Layout,
    MemberRecord,
    PolicyRecord,
    decode_ack,
    encode_ack,
)
from qosd.store.etcd.mirror import Mirror
from qosd.store.etcd.sla import EtcdSla

log = logging.getLogger("qosd.store.cluster")
T = TypeVar("T")
Realiser = Callable[[MeshVersion, str, str], Any]
"""``(version, text, author) -> (ok, reason)``: a function (run in a worker
thread) or a coroutine function (awaited on the loop)."""

RETRY_S = 0.5
WRITE_TIMEOUT_S = 2.0


class StoreUnavailable(NotSynced):
    """The cluster store cannot be reached (503 not_synced: try again later)."""


class EtcdNode:
    def __init__(self, node_id: str, client: EtcdClient, layout: Layout, *,
                 realiser: Realiser, applied: Callable[[], MeshVersion | None],
                 lease_ttl_s: int = 10, sla_source: Callable[[], Mapping[str, Any]] | None = None,
                 sla_period_s: float = 5.0, watch_sla: bool = True, addr: str = "") -> None:
        self.node_id, self.client, self.layout = node_id, client, layout
        self.realiser, self.applied = realiser, applied
        self.lease_ttl_s, self.sla_source, self.sla_period_s = lease_ttl_s, sla_source, sla_period_s
        self.addr = addr
        self.view: SlaView | None = None  # this node's own publication (its windows' key)
        if sla_source is not None:
            self.view = SlaView(node_id, SlaViewConfig(cluster=CoreConfig()),
                                seq_start=time.time_ns() // 1000)
        self.sla = EtcdSla(self)
        self.mirror = Mirror(node_id, layout, records=self.sla.on_record if watch_sla else None)
        self.watch_sla = watch_sla
        self.up = False
        self.since = time.time()
        self.last_error = ""
        self.lease = 0
        self.listed = False
        self.started_at = time.monotonic()
        self._lease_ok = 0.0
        self._lease_lock = asyncio.Lock()
        self._report: Report | None = None  # what this node says
        self._written: tuple[int, Report] | None = None  # (lease, report) in etcd
        self._member_lease = 0  # the lease the member key was written under
        self._realising: MeshVersion | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._acks: list[KeyValue] = []
        self._sla_data = b""
        self._sla_empty = 0  # the lease an empty publication was written under
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters: dict[str, int] = {}

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    # -- life ----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for name, coro in (("session", self._session_loop()), ("keepalive", self._keepalive()),
                           ("step", self._step_loop())):
            self._tasks.append(asyncio.create_task(coro, name=f"etcd-{name}-{self.node_id}"))
        if self.sla_source is not None:
            self._tasks.append(asyncio.create_task(self._sla_loop(), name="etcd-sla"))
            self._tasks.append(asyncio.create_task(self.sla.run(), name="etcd-sla-roles"))

    async def stop(self, *, leave: bool = True) -> None:
        """Stops; with ``leave``, marks the member key left and revokes the lease
        (its keys go at once: members see it gone, not failed)."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.up = False
        if leave and self.lease:
            with contextlib.suppress(EtcdError):
                await self.client.put(self.layout.member_key(self.node_id), MemberRecord(
                    self.node_id, self.addr, self.since, left=True).encode(), self.lease, 1.0)
                await self.client.lease_revoke(self.lease, 1.0)
        await self.client.close()

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 15.0) -> T:
        """Runs the coroutine ``fn()`` on the node's loop from another thread."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def _set_up(self, up: bool, error: str = "") -> None:
        if up != self.up:
            log.log(logging.INFO if up else logging.WARNING, "etcd: cluster store %s%s",
                    "up" if up else "down", f": {error}" if error else "")
            self.since = time.time()
            self.up = up
        if error:
            self.last_error = error

    # -- session: lease, list, watch -----------------------------------------------
    async def _session_loop(self) -> None:
        backoff = 0.2
        need_list = not self.listed  # started again: resume the watch where it ended
        while True:
            try:
                await self._ensure_lease()
                if need_list:
                    await self._list()
                    need_list = False
                watch = await self.client.watch(self._prefixes(), self.mirror.revision + 1)
                self._set_up(True)
                self._wake.set()
                backoff = 0.2
                try:
                    while True:
                        rev, events = await watch.next()
                        self.mirror.apply(rev, events, time.monotonic())
                        self.count("watch_events", len(events))
                        self._wake.set()
                finally:
                    watch.cancel()
            except Compacted as e:  # the watch cannot resume: list everything again
                log.info("etcd: %s: listing again", e)
                self.count("relists_compacted")
                need_list = True
            except Exception as e:  # EtcdError; anything else is a bug, but keep trying
                if not isinstance(e, EtcdError):
                    log.exception("etcd: session failed")
                self.count("session_errors")
                self._set_up(False, str(e))
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(2.0, backoff * 2)

    def _prefixes(self) -> list[bytes]:
        lay = self.layout
        return [lay.policy_dir, lay.members] + ([lay.sla_records] if self.watch_sla else [])

    async def _list(self) -> None:
        rev, kvs = await self.client.range_prefix(self.layout.policy_dir, timeout=10)
        for p in self._prefixes()[1:]:
            kvs += (await self.client.range_prefix(p, revision=rev, timeout=10))[1]
        self.mirror.reset(rev, kvs, time.monotonic())
        self.listed = True
        self.count("lists")

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if not self.lease:
                self.lease = await self.client.lease_grant(self.lease_ttl_s)
                self._lease_ok = time.monotonic()
                self.count("leases_granted")
                self._wake.set()
            return self.lease

    def _lease_lost(self, why: str) -> None:
        if self.lease:
            log.warning("etcd: lease %x lost (%s): taking a new one", self.lease, why)
            self.count("leases_lost")
            self.lease = 0
            self._wake.set()

    async def _keepalive(self) -> None:
        period = self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            lease = self.lease
            if not lease:
                continue
            try:
                await self.client.lease_keepalive(lease, timeout=period)
                self._lease_ok = time.monotonic()
            except LeaseNotFound:
                self._lease_lost("expired")
            except EtcdError:
                if time.monotonic() - self._lease_ok > self.lease_ttl_s:
                    self._lease_lost("not renewed for a ttl")

    # -- step: realise and report ----------------------------------------------------
    async def _step_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._step()
            except Exception as e:  # EtcdError: retried; anything else is a bug, retried too
                if isinstance(e, LeaseNotFound):
                    self._lease_lost("refused")
                elif not isinstance(e, EtcdError):
                    log.exception("etcd: step failed")
                self.count("write_failures")
                self.last_error = str(e)
                asyncio.get_running_loop().call_later(RETRY_S, self._wake.set)

    async def _step(self) -> None:
        d = self.mirror.desired
        if d is not None and self._realising is None:
            v = d.ann.version
            applied = self.applied()
            r = self._report
            if applied == v:
                if r is None or r.version != v or not r.ok:
                    self._report = self._make_report(d.ann, True, "", v)
            elif not (r is not None and r.version == v and not r.ok
                      and r.sha == d.ann.sha256[:16]):
                self._realising = v
                asyncio.create_task(self._realise(d))
        if not self.listed:
            return
        lease = await self._ensure_lease()
        if self._member_lease != lease:
            await self.client.put(self.layout.member_key(self.node_id), MemberRecord(
                self.node_id, self.addr, self.since).encode(), lease, WRITE_TIMEOUT_S)
            self._member_lease = lease
            self.count("member_writes")
        r = self._report
        if r is not None and self._written != (lease, r):
            await self.client.put(self.layout.ack_key(self.node_id), encode_ack(r), lease,
                                  WRITE_TIMEOUT_S)
            self._written = (lease, r)
            self.count("acks_written" if r.ok else "nacks_written")

    def _make_report(self, ann: Announcement, ok: bool, reason: str,
                     applied: MeshVersion | None) -> Report:
        return Report(self.node_id, 0, ann.version, ann.sha256[:16], ok, reason[:400], applied,
                      time.time())

    async def _realise(self, d: PolicyRecord) -> None:
        v = d.ann.version
        try:
            if asyncio.iscoroutinefunction(self.realiser):  # a bench's stand-in
                ok, reason = await self.realiser(v, d.text, d.ann.author)
            else:
                ok, reason = await asyncio.get_running_loop().run_in_executor(
                    None, self.realiser, v, d.text, d.ann.author)
        except Exception as e:  # noqa: BLE001 (the realiser never raises; if it does, NACK)
            ok, reason = False, f"internal error: {e}"
        self._realising = None
        cur = self.mirror.desired
        if cur is not None and cur.ann.version == v:  # a superseded version is never reported
            self._report = self._make_report(d.ann, ok, reason, v if ok else self.applied())
            self.count("realised")
        self._wake.set()

    # -- SLA -----------------------------------------------------------------------
    async def _sla_loop(self) -> None:
        assert self.view is not None and self.sla_source is not None
        while True:
            await asyncio.sleep(self.sla_period_s)
            try:
                board = await self._sla_bytes()
                self.publish_sla(board)
                self.sla.own(dict(board))
                empty = not (board.get("classes") or board.get("stages"))
                lease = self.lease
                if lease and self.up and not (empty and self._sla_empty == lease):
                    await self.client.put(self.layout.sla_key(self.node_id), self._sla_data,
                                          lease, WRITE_TIMEOUT_S)
                    self._sla_empty = lease if empty else 0  # no windows: written once
                    self.count("sla_writes")
            except EtcdError as e:
                self.count("write_failures")
                self.last_error = str(e)
            except Exception:  # keep publishing; the board may recover
                log.exception("etcd: publishing SLA windows failed")

    async def _sla_bytes(self) -> Mapping[str, Any]:
        assert self.sla_source is not None
        return await asyncio.get_running_loop().run_in_executor(None, self.sla_source)

    def publish_sla(self, board: Mapping[str, Any]) -> None:
        """The board's windows as this node's newest publication (one member:
        the interval is the window, not the gossip law's)."""
        assert self.view is not None
        now = time.monotonic()
        self.view.local_windows(board, now, wall=time.time(), members=1)
        self._sla_data = self.view.app_state(now, relay=False)

    def sla_snapshot(self, targets: Mapping[str, float] | None, nodes: bool) -> dict[str, Any]:
        """The view: the class records this node watches (``EtcdSla``)."""
        return self.sla.snapshot(targets, nodes, len(self.mirror.members) or 1)

    async def sla_breakdown(self, node: str | None) -> dict[str, Any]:
        """Each node's own windows, read now from its key."""
        return await self.sla.breakdown(node)

    # -- the API's side ------------------------------------------------------------
    async def propose(self, text: str, base: MeshVersion | None, author: str | None
                      ) -> RolloutTable:
        """A compare-and-swap of ``P/policy/current`` (the text is canonical);
        RolloutConflict when ``base`` is not etcd's version, StoreUnavailable
        when etcd cannot be reached."""
        if not self.listed:
            raise StoreUnavailable("the cluster store (etcd) has not been reached yet")
        sha = hashlib.sha256(text.encode()).hexdigest()
        lay = self.layout
        for _ in range(8):
            try:
                _, kv = await self.client.get(lay.current, WRITE_TIMEOUT_S)
                cur = PolicyRecord.decode(kv.value).ann.version if kv else None
            except Dropped:
                cur = None
            except EtcdError as e:
                raise StoreUnavailable(f"the cluster store (etcd) is unavailable: {e}") from None
            if base is not None and base != (cur or NO_VERSION):
                raise RolloutConflict(None if base == NO_VERSION else base, cur)
            mine = self.applied()
            counter = max(cur.counter if cur else 0, mine.counter if mine else 0) + 1
            ann = Announcement(MeshVersion(counter, self.node_id), sha, len(text.encode()),
                               (author or "")[:64], time.time())
            rec = PolicyRecord(ann, text).encode()
            ops = [op_put(lay.current, rec), op_put(lay.version_key(counter), rec)]
            if counter > HISTORY:
                ops.append(op_delete(lay.versions, lay.version_key(counter - HISTORY + 1)))
            try:
                done = (await self.client.txn([cmp_mod_revision(
                    lay.current, kv.mod_revision if kv else 0)], ops)).succeeded
            except Unavailable:  # applied or not? etcd knows: never write it twice
                done = await self._committed(ann)
            self.count("proposals" if done else "cas_conflicts")
            if done:
                members = self.mirror.member_infos(time.monotonic(), time.time())
                return build_table(self.node_id, members, {}, ann)
        raise StoreUnavailable("the mesh policy keeps changing under this proposal; try again")

    async def _committed(self, ann: Announcement) -> bool:
        for _ in range(20):
            try:
                _, kv = await self.client.get(self.layout.current, WRITE_TIMEOUT_S)
            except EtcdError:
                await asyncio.sleep(0.25)
                continue
            if kv is None:
                return False
            with contextlib.suppress(Dropped):
                a = PolicyRecord.decode(kv.value).ann
                return a.version == ann.version and a.sha256 == ann.sha256
            return False
        raise StoreUnavailable("the cluster store (etcd) is unavailable: the proposal's "
                               "outcome is unknown (see GET /v1/cluster/rollout)")

    async def table(self, version: MeshVersion | None = None) -> RolloutTable:
        """Every member's report (read now; the last one read if etcd is down)."""
        try:
            _, self._acks = await self.client.range_prefix(self.layout.acks,
                                                           timeout=WRITE_TIMEOUT_S)
        except EtcdError as e:
            self.count("table_from_cache")
            self.last_error = str(e)
        reports: dict[str, Report] = {}
        for kv in self._acks:
            node = Layout.node_of(kv.key, self.layout.acks)
            if node is not None:
                with contextlib.suppress(Dropped):
                    reports[node] = decode_ack(node, kv.mod_revision, kv.value)
        d = self.mirror.desired
        members = self.mirror.member_infos(time.monotonic(), time.time())
        return build_table(self.node_id, members, reports, d.ann if d else None, version)
