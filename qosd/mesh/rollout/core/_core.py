"""The rollout core: :class:`Rollout`, one node's state machine (see
``qosd.mesh.rollout.core`` for the protocol and docs/cluster.md for the host
API).  Inputs are the membership core's events, the host's answers to the
actions returned, and ``tick``; outputs are gossip (through ``Gossip``),
the push-pull section and :data:`Action` objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Iterable

from qosd.mesh.membership.core import (
    AppMessage,
    AppStateReceived,
    ClusterError,
    Event,
    MemberChanged,
    State,
)
from qosd.mesh.rollout.core._fetch import Fetcher
from qosd.mesh.rollout.core._table import build_table
from qosd.mesh.rollout.core._types import (
    ACK_PREFIX,
    MAX_COUNTER,
    NO_VERSION,
    POLICY_KEY,
    SHA_PREFIX,
    Action,
    Announcement,
    Gossip,
    MeshVersion,
    NotSynced,
    Realise,
    Report,
    RolloutConfig,
    RolloutConflict,
    RolloutStats,
    RolloutTable,
    SendReport,
)
from qosd.mesh.rollout.core.codec import (
    MAX_GOSSIP_PAYLOAD,
    Dropped,
    Reader,
    cut,
    decode_announcement,
    decode_report,
    decode_state,
    encode_announcement,
    encode_report,
    encode_state,
)

_REPORT_BUDGET = MAX_GOSSIP_PAYLOAD - 400  # leaves room for the key, origin and packet header
_NEVER = math.inf


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Rollout:
    """One node's part in mesh-wide policy rollout (see the module docstring)."""

    def __init__(self, gossip: Gossip, rng: random.Random, *,
                 config: RolloutConfig | None = None, applied: MeshVersion | None = None,
                 wall_offset: float = 0.0) -> None:
        """``applied``: the mesh version this node's store holds (from the note
        of its current version, :meth:`MeshVersion.from_note`), None when it
        holds none.  ``wall_offset`` is added to ``now`` for the times shown
        in the table (``time.time() - time.monotonic()`` for a host whose
        ``now`` is monotonic)."""
        self._gossip = gossip
        self.node_id = gossip.node_id
        self.config = config or RolloutConfig()
        self.stats = RolloutStats()
        self._wall = wall_offset
        self._reader = Reader(self.config)
        self._desired: Announcement | None = None
        self._texts: dict[MeshVersion, tuple[str, str]] = {}  # version -> (sha256, text)
        self._applied = applied
        self._applied_sha = ""  # "" when restored from the store: trusted by version
        self._counter = applied.counter if applied else 0
        self._inflight: tuple[MeshVersion, str] | None = None
        self._failed: tuple[tuple[int, str, str], str] | None = None  # (desired key, reason)
        self._reports: dict[str, Report] = {}
        self._fetch = Fetcher(rng, self.config.fetch_timeout_s, self.stats)
        self._synced = False
        self._dirty = True
        self._urgent = True
        self._flushed_at = -_NEVER
        self._reannounce_at = -_NEVER
        self._recalled = False  # named in a roll call: gossip our report again
        self._roll_call_at = _NEVER
        self._roll_call_gap = self.config.roll_call_s
        self._flush(0.0)

    # -- reading -----------------------------------------------------------------
    @property
    def desired(self) -> Announcement | None:
        """The highest version this node knows of (what every node should run)."""
        return self._desired

    @property
    def applied(self) -> MeshVersion | None:
        """The mesh version this node runs (its store's current version)."""
        return self._applied

    @property
    def highest_counter(self) -> int:
        return self._counter

    def can_propose(self) -> bool:
        """True once a peer's push-pull state came in, or when no other member
        is alive (a mesh of one)."""
        return self._synced or not any(
            m.state <= State.SUSPECT for m in self._gossip.members() if m.node != self.node_id)

    def table(self, version: MeshVersion | None = None) -> RolloutTable:
        """The rollout table of ``version`` (default: the desired version)."""
        return build_table(self.node_id, self._gossip.members(), self._reports, self._desired,
                           version)

    def reports(self) -> dict[str, Report]:
        """The latest report of every node known (this one's too)."""
        return dict(self._reports)

    def text_for(self, version: MeshVersion) -> str | None:
        """The text of ``version`` if this node holds it (the FetchPolicy server)."""
        entry = self._texts.get(version)
        return None if entry is None else entry[1]

    def next_deadline(self) -> float:
        """When :meth:`tick` next has work (inf: nothing timed)."""
        t = _NEVER
        if self._dirty:
            t = self._flushed_at + self.config.state_flush_s
        return min(t, self._fetch.deadline(self._desired), self._roll_call_at)

    # -- host API ------------------------------------------------------------------
    def propose(self, text: str, now: float, *, author: str | None = None,
                base: MeshVersion | None = None) -> tuple[Announcement, list[Action]]:
        """Make ``text`` the desired mesh policy (the host has checked its schema).

        ``base``: refuse (RolloutConflict) unless the desired version is still
        ``base`` (NO_VERSION: none yet); None: no check.  Raises NotSynced
        before the first state exchange with a peer, ClusterError for a text
        over ``max_text_bytes``."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ClusterError("the policy text is not encodable as UTF-8") from None
        if size > self.config.max_text_bytes:
            raise ClusterError(f"the policy is {size} bytes; at most "
                               f"{self.config.max_text_bytes}")
        current = self._desired.version if self._desired else None
        if base is not None and base != (current or NO_VERSION):
            raise RolloutConflict(None if base == NO_VERSION else base, current)
        if not self.can_propose():
            raise NotSynced("this node has not exchanged state with the mesh yet; "
                            "try again in a few seconds")
        if self._counter >= MAX_COUNTER:
            raise ClusterError("the mesh version counter is exhausted")
        self._counter += 1
        ann = Announcement(MeshVersion(self._counter, self.node_id), sha256_text(text), size,
                           cut(author or "", self.config.max_author_bytes), now + self._wall)
        self.stats.proposals += 1
        self._adopt(ann)
        self._texts[ann.version] = (ann.sha256, text)
        self._gossip.broadcast(POLICY_KEY, encode_announcement(ann))
        self._roll_call_gap = self.config.roll_call_s
        self._roll_call_at = now + self._roll_call_gap
        return ann, self._settle(now)

    def on_events(self, events: Iterable[Event], now: float) -> list[Action]:
        """The membership core's events (all of them; others' keys are ignored).

        A host that shares push-pull state passes each ``AppStateReceived``
        with ``data`` replaced by the rollout's section."""
        for e in events:
            if isinstance(e, AppMessage):
                if e.key == POLICY_KEY:
                    self._on_announcement(e)
                elif e.key.startswith(ACK_PREFIX):
                    self._on_report(e)
            elif isinstance(e, AppStateReceived):
                self._on_state(e.data)
            elif isinstance(e, MemberChanged):
                self._on_member(e, now)
        return self._settle(now)

    def on_peer_report(self, node: str, data: bytes, now: float) -> list[Action]:
        """A report a peer sent straight to us (:class:`SendReport`); its host
        has checked that the caller is ``node``.  Same rules as gossip."""
        seq, _, payload = data.partition(b"\n")
        if not seq.isdigit() or len(seq) > 19:
            self.stats.drop("malformed")
            return []
        self._on_report(AppMessage(node, ACK_PREFIX + node, int(seq), payload))
        return self._settle(now)

    def serve_fetch(self, key: str) -> bytes | None:
        """The answer to a peer's fetch of item ``key`` (a version): its text."""
        try:
            text = self.text_for(MeshVersion.parse(key))
        except ValueError:
            return None
        return None if text is None else text.encode("utf-8")

    def on_fetch_reply(self, version: MeshVersion, data: bytes | None,
                       now: float) -> list[Action]:
        """What a :class:`Fetch` brought back (None: nothing)."""
        peer = self._fetch.peer
        if data is None:
            return self.on_fetch_failed(version, peer, now)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.drop("malformed")
            return self.on_fetch_failed(version, peer, now)
        return self.on_fetched(version, text, now)

    def on_realised(self, version: MeshVersion, ok: bool, reason: str,
                    now: float) -> list[Action]:
        """The host's answer to :class:`Realise`: ``ok`` when the node's store
        and kernel now hold ``version``; else ``reason`` (the NACK's)."""
        if self._inflight is None or self._inflight[0] != version:
            self.stats.drop("stale")
            return []
        sha = self._inflight[1]
        self._inflight = None
        if ok:
            self._applied, self._applied_sha = version, sha
        d = self._desired
        if d is not None and d.version == version and d.sha256 == sha and not ok:
            self._failed = (d.key, reason or "refused")
        return self._settle(now)

    def on_fetched(self, version: MeshVersion, text: str, now: float) -> list[Action]:
        """The text a :class:`Fetch` brought (checked against the sha256)."""
        d = self._desired
        if d is None or d.version != version:
            self.stats.drop("stale")
            return []
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            raw = b""
        if len(raw) > self.config.max_text_bytes:
            self.stats.drop("oversize")
        elif not self._take_text(text, raw):
            self.stats.drop("sha_mismatch")
        else:
            self._fetch.reset()
            return self._settle(now)
        return self.on_fetch_failed(version, self._fetch.peer, now)

    def _take_text(self, text: str, raw: bytes) -> bool:
        """Keep ``text`` if it is the desired version's (completing a hint)."""
        d = self._desired
        full = hashlib.sha256(raw).hexdigest()
        if d is None or not full.startswith(d.sha256):
            return False
        if d.hint or not d.size:
            self._desired = d.completed(Announcement(d.version, full, len(raw)))
            self._dirty = True
            self._urgent = self._urgent or d.hint  # the push-pull state can carry it now
        self._texts[d.version] = (full, text)
        return True

    def on_fetch_failed(self, version: MeshVersion, peer: str | None,
                        now: float) -> list[Action]:
        """A :class:`Fetch` got nothing (peer unreachable, or it lacks the text):
        the next holder is asked at once."""
        d = self._desired
        self._fetch.failed(d if d is not None and d.version == version else None, peer, now)
        return self._settle(now)

    def set_applied(self, version: MeshVersion | None, now: float) -> list[Action]:
        """The store changed outside the rollout (a local apply or rollback):
        ``version`` is the mesh version it now holds (None: not a mesh one).
        Level-triggered, the desired version is realised again."""
        self._applied, self._applied_sha = version, ""
        return self._settle(now)

    def retry(self, now: float) -> list[Action]:
        """Try a NACKed desired version again (after this node's configuration
        changed, e.g. its link override)."""
        self._failed = None
        return self._settle(now)

    def tick(self, now: float) -> list[Action]:
        """Timers: fetch retries, roll calls and the push-pull state refresh."""
        if now >= self._roll_call_at:
            self._roll_call(now)
        return self._settle(now)

    # -- inputs --------------------------------------------------------------------
    def _on_announcement(self, e: AppMessage) -> None:
        try:
            ann, call = decode_announcement(self._reader, e.payload)
        except Dropped as bad:
            self.stats.drop(bad.reason)
            return
        if ann.version.origin != e.origin:
            self.stats.drop("impersonation")  # only an origin announces its versions
            return
        self.stats.announcements += 1
        self._see(ann.version)
        self._consider(ann)
        if self.node_id in call and self._desired is not None \
                and self._desired.key == ann.key:
            self._recalled = True

    def _on_report(self, e: AppMessage) -> None:
        node = e.key[len(ACK_PREFIX):]
        if node != e.origin:
            self.stats.drop("impersonation")  # a node reports for itself only
            return
        try:
            r = decode_report(self._reader, node, e.seq, e.payload)
        except Dropped as bad:
            self.stats.drop(bad.reason)
            return
        self._take(r)
        d = self._desired
        if d is None or r.about(d) > 0:
            # A hint: it answered a version we have not heard of.  Reports reach
            # everyone, often before the announcement does (fresh gossip goes
            # first), so a node that missed the announcement does not wait for
            # a roll call.  The text is fetched and checked against the prefix.
            self._consider(Announcement(r.version, r.sha))

    def _on_state(self, data: bytes) -> None:
        try:
            desired, text, rows = decode_state(self._reader, data)
        except Dropped as e:
            self.stats.drop(e.reason)
            return
        self._synced = True
        self.stats.states_merged += 1
        for r in rows:
            self._take(r)
        if desired is None:
            return
        self._see(desired.version)
        self._consider(desired)
        d = self._desired
        if text is not None and d is not None and d.key == desired.key \
                and d.version not in self._texts \
                and not self._take_text(text, text.encode("utf-8", "surrogatepass")):
            self.stats.drop("sha_mismatch")

    def _on_member(self, e: MemberChanged, now: float) -> None:
        """A member back alive (a refutation, a healed partition) hears the
        desired version again from its origin: push-pull would get it there
        too, but only within a push-pull interval."""
        d = self._desired
        if e.state == State.ALIVE and e.previous is not None and e.previous != State.ALIVE \
                and d is not None and d.version.origin == self.node_id \
                and now >= self._reannounce_at:
            self._reannounce_at = now + self.config.reannounce_gap_s
            self._gossip.broadcast(POLICY_KEY, encode_announcement(d))

    def _take(self, r: Report) -> None:
        """Keep ``r`` if it is the newest report of its node (ours are our own)."""
        self._see(r.version)
        if r.applied is not None:
            self._see(r.applied)
        if r.node == self.node_id:
            return
        old = self._reports.get(r.node)
        if old is not None and old.seq >= r.seq:
            return
        self._reports[r.node] = r
        self.stats.reports += 1
        self._dirty = True

    def _see(self, v: MeshVersion) -> None:
        self._counter = max(self._counter, v.counter)

    def _consider(self, ann: Announcement) -> None:
        d = self._desired
        if d is not None and ann.key <= d.key:
            if ann.key == d.key:  # the same version: keep what either knows (a hint's)
                better = d.completed(ann)
                if better != d:
                    self._desired = better
                    self._dirty = True
                    self._urgent = self._urgent or d.hint
            return
        if d is not None:
            self.stats.superseded += 1
        self._adopt(ann)

    def _adopt(self, ann: Announcement) -> None:
        self._desired = ann
        self._failed = None
        self._fetch.reset()
        self._recalled = False
        self._roll_call_at = _NEVER
        keep = {ann.version, self._applied}
        if self._inflight is not None:
            keep.add(self._inflight[0])
        self._texts = {v: t for v, t in self._texts.items() if v in keep}
        self._dirty = self._urgent = True

    # -- the reconcile -------------------------------------------------------------
    def _settle(self, now: float) -> list[Action]:
        out: list[Action] = []
        self._reconcile(now, out)
        if self._dirty and (self._urgent or now >= self._flushed_at + self.config.state_flush_s):
            self._flush(now)
        return out

    def _reconcile(self, now: float, out: list[Action]) -> None:
        """Desired vs applied, every time: report, fetch or realise what is missing."""
        d = self._desired
        if d is None:
            return
        if self._applied == d.version and self._applied_sha in ("", d.sha256):
            self._report(d, True, "", now, out)
        elif self._failed is not None and self._failed[0] == d.key:
            self._report(d, False, self._failed[1], now, out)
        else:
            entry = self._texts.get(d.version)
            if entry is None or entry[0] != d.sha256:
                self._want_text(d, now, out)  # also while another version is realised
            elif self._inflight is None:  # one realisation at a time
                self._inflight = (d.version, d.sha256)
                self.stats.realise_requests += 1
                out.append(Realise(d.version, entry[1], d.sha256, d.author))

    def _report(self, d: Announcement, ok: bool, reason: str, now: float,
                out: list[Action]) -> None:
        mine = self._reports.get(self.node_id)
        sha = d.sha256[:SHA_PREFIX]
        if mine is not None and mine.version == d.version and mine.sha == sha \
                and mine.ok == ok and mine.applied == self._applied and not self._recalled:
            return
        self._recalled = False
        reason = cut(reason, self.config.max_reason_bytes)
        r = Report(self.node_id, 0, d.version, sha, ok, reason, self._applied, now + self._wall)
        payload = encode_report(r)
        while len(payload) > _REPORT_BUDGET and r.reason:
            r = dataclasses.replace(r, reason=cut(r.reason, len(r.reason.encode()) // 2))
            payload = encode_report(r)
        seq = self._gossip.broadcast(ACK_PREFIX + self.node_id, payload)
        self._reports[self.node_id] = dataclasses.replace(r, seq=seq)
        if d.version.origin != self.node_id:
            out.append(SendReport(d.version.origin, b"%d\n" % seq + payload))
        if ok:
            self.stats.acks_sent += 1
        else:
            self.stats.nacks_sent += 1
        self._dirty = True

    def _holders(self, d: Announcement) -> list[str]:
        """Live members that have the text of ``d``: its origin and every
        member that reported on it."""
        live = {m.node for m in self._gossip.members() if m.state <= State.SUSPECT}
        out = {n for n, r in self._reports.items() if r.about(d) == 0}
        out.add(d.version.origin)
        out.discard(self.node_id)
        return sorted(out & live)

    def _want_text(self, d: Announcement, now: float, out: list[Action]) -> None:
        if now >= self._fetch.deadline(d) or self._fetch.peer is None:
            fetch = self._fetch.want(d, self._holders(d), now)
            if fetch is not None:
                out.append(fetch)

    def _roll_call(self, now: float) -> None:
        """As the origin: gossip the desired version again naming the live
        members whose answer has not come (as many as fit one packet); they
        repeat their reports, so one lost report does not leave the table
        pending until a push-pull.  Backs off while members stay pending."""
        d = self._desired
        self._roll_call_at = _NEVER
        if d is None or d.version.origin != self.node_id:
            return
        pending = [r.node for r in self.table().rows
                   if r.state == "pending" and r.node != self.node_id]
        if not pending:
            return
        call: list[str] = []
        budget = _REPORT_BUDGET - len(encode_announcement(d))
        for node in pending:
            budget -= len(node.encode("utf-8")) + 3
            if budget < 0:
                break
            call.append(node)
        self.stats.roll_calls += 1
        self._gossip.broadcast(POLICY_KEY, encode_announcement(d, tuple(call)))
        self._roll_call_gap = min(2 * self._roll_call_gap, self.config.roll_call_max_s)
        self._roll_call_at = now + self._roll_call_gap

    def _flush(self, now: float) -> None:
        """The push-pull section: desired, its text when small, every report."""
        d = self._desired
        if d is not None and d.hint:
            d = None  # a hint is not announced on: its text has not come yet
        text = None
        entry = self._texts.get(d.version) if d is not None else None
        limit = self.config.inline_text_bytes
        if d is not None and entry is not None and entry[0] == d.sha256 \
                and len(entry[1]) <= limit and len(entry[1].encode("utf-8")) <= limit:
            text = entry[1]
        known = {m.node for m in self._gossip.members()}
        for node in [n for n in self._reports if n not in known and n != self.node_id]:
            del self._reports[node]  # forgotten by the membership (reaped)
        self._gossip.set_app_state(encode_state(d, text, list(self._reports.values())))
        self._dirty = self._urgent = False
        self._flushed_at = now
