"""What each sender may keep on the SLA board, and how fast it may report.

Three levels, each with a row (window) count and a byte budget:

    sender   every identity of qosd/identity.py but the admin socket
    uid      all ``process`` senders of one uid together (not root): a user who
             can create cgroups gets a new identity per cgroup, not a new quota
    board    everything kept

and a token bucket of reports per second per sender and per capped uid.  A
report that does not fit evicts the *sender's own* oldest windows (those it
does not refresh), never another sender's; when its own are not enough (or
the report alone is larger than a quota, or the bucket is empty) it is
refused with 429 and nothing changes.  Pure bookkeeping: the board holds the
lock and the clock (``now``, seconds).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from qosd.identity import ReportRefused, Sender

__all__ = ["Ledger", "SlaLimits", "TokenBucket", "uid_capped"]

MiB = 1 << 20


class SlaLimits(BaseModel):
    """The board's bounds (``sla_limits`` in qosd.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sender_rows: int = Field(default=64, ge=1, le=1 << 20,
                             description="windows one sender may keep")
    sender_bytes: int = Field(default=1 * MiB, ge=4096, le=1 << 34,
                              description="bytes one sender's windows may take")
    sender_rate: float = Field(default=2.0, gt=0, le=1e6, allow_inf_nan=False,
                               description="reports per second per sender (sustained)")
    sender_burst: int = Field(default=20, ge=1, le=1 << 20,
                              description="reports one sender may send at once")
    uid_rows: int = Field(default=256, ge=1, le=1 << 20,
                          description="windows all process senders of one uid may keep")
    uid_bytes: int = Field(default=4 * MiB, ge=4096, le=1 << 34)
    uid_rate: float = Field(default=10.0, gt=0, le=1e6, allow_inf_nan=False)
    uid_burst: int = Field(default=100, ge=1, le=1 << 20)
    board_rows: int = Field(default=4096, ge=1, le=1 << 20, description="windows kept in all")
    board_bytes: int = Field(default=16 * MiB, ge=4096, le=1 << 36,
                             description="bytes all kept windows may take")
    max_senders: int = Field(default=4096, ge=1, le=1 << 20,
                             description="senders tracked at once (windows or rate state)")
    keep_s: float = Field(default=300.0, gt=0, le=86400 * 7, allow_inf_nan=False,
                          description="a window not refreshed for this long is forgotten")


def uid_capped(s: Sender) -> bool:
    """Whether the per-uid cap counts ``s`` (a process sender, not root)."""
    return s.kind == "process" and s.uid != 0


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; a report takes one."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now  # a clock stepping back refills nothing and costs nothing

    def wait_s(self) -> float:
        """Seconds until a token is there (0 when one is)."""
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    @property
    def full(self) -> bool:
        return self.tokens >= self.burst


@dataclass
class _Usage:
    rows: dict[Hashable, int] = field(default_factory=dict)  # key -> bytes, oldest first
    bytes: int = 0


class Ledger:
    """Rows and bytes per sender, per capped uid and in all; the rate buckets."""

    def __init__(self, limits: SlaLimits) -> None:
        self.limits = limits
        self.owners: dict[str, _Usage] = {}
        self.uids: dict[int, _Usage] = {}  # per capped uid: (sender key, row key) -> bytes
        self.rows = 0
        self.bytes = 0
        self._buckets: dict[Hashable, TokenBucket] = {}

    # ------------------------------------------------------------ rate
    def take(self, s: Sender, now: float) -> None:
        """Takes a token from the sender's bucket (and its uid's), or raises 429."""
        if s.kind == "admin":
            return
        L = self.limits
        pairs: list[tuple[Hashable, float, int]] = [(("s", s.key), L.sender_rate,
                                                      L.sender_burst)]
        if uid_capped(s):
            pairs.append((("u", s.uid), L.uid_rate, L.uid_burst))
        buckets = [self._bucket(k, rate, burst, now) for k, rate, burst in pairs]
        wait = max(b.wait_s() for b in buckets)
        if wait > 0:
            who = s.describe() if buckets[0].wait_s() > 0 else f"uid {s.uid}"
            raise ReportRefused(429, "rate_limited", f"{who} reports too often (at most "
                                f"{L.sender_rate:g}/s per sender, {L.uid_rate:g}/s per uid)",
                                retry_after=max(1.0, math.ceil(wait)))
        for b in buckets:
            b.tokens -= 1

    def _bucket(self, key: Hashable, rate: float, burst: float, now: float) -> TokenBucket:
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.limits.max_senders:
                self._prune(now)
            if len(self._buckets) >= self.limits.max_senders:
                raise ReportRefused(429, "too_many_senders", f"qosd tracks {len(self._buckets)} "
                                    "senders already (sla_limits.max_senders)", retry_after=1.0)
            b = self._buckets[key] = TokenBucket(rate, burst, burst, now)
        b.refill(now)
        return b

    def _prune(self, now: float) -> None:
        """Forgets the buckets that are full again (their senders went quiet)."""
        for key, b in list(self._buckets.items()):
            b.refill(now)
            if b.full:
                del self._buckets[key]

    # ----------------------------------------------------------- space
    def plan(self, s: Sender, new: Mapping[Hashable, int]) -> list[Hashable]:
        """The sender's own keys to evict (oldest first) so that its ``new``
        rows (key -> bytes; replacing its rows of the same key) fit every
        level, or :class:`ReportRefused` (429) when they cannot."""
        L = self.limits
        own = self.owners.get(s.key, _Usage())
        n_new, b_new = len(new), sum(new.values())
        levels = [_Level("board_full", None, L.board_rows, L.board_bytes,
                         "the board (sla_limits.board_*)")]
        if s.kind != "admin":
            levels.append(_Level("sender_quota", own, L.sender_rows, L.sender_bytes,
                                 f"{s.describe()}'s quota (sla_limits.sender_*)"))
        if uid_capped(s):
            levels.append(_Level("uid_quota", self.uids.get(s.uid, _Usage()), L.uid_rows,
                                 L.uid_bytes, f"uid {s.uid}'s cap over all its processes "
                                 "(sla_limits.uid_*)"))
        for lv in levels:
            if n_new > lv.rows or b_new > lv.nbytes:
                raise ReportRefused(429, lv.code, f"this report ({n_new} windows, {b_new} "
                                    f"bytes) is larger than {lv.what}: {lv.rows} windows, "
                                    f"{lv.nbytes} bytes")
        replaced = [k for k in new if k in own.rows]
        d_rows = n_new - len(replaced)
        d_bytes = b_new - sum(own.rows[k] for k in replaced)
        spare: Iterator[Hashable] = (k for k in own.rows if k not in new)
        evict: list[Hashable] = []
        while (over := next((lv for lv in levels if lv.over(self, d_rows, d_bytes)), None)):
            k = next(spare, None)
            if k is None:
                raise ReportRefused(429, over.code, f"no room for this report in {over.what}: "
                                    f"{over.rows} windows, {over.nbytes} bytes (a window expires "
                                    f"{L.keep_s:g} s after its last refresh)", retry_after=5.0)
            evict.append(k)
            d_rows -= 1
            d_bytes -= own.rows[k]
        return evict

    def add(self, s: Sender, key: Hashable, nbytes: int) -> None:
        own = self.owners.setdefault(s.key, _Usage())
        own.rows[key] = nbytes
        own.bytes += nbytes
        self.rows += 1
        self.bytes += nbytes
        if uid_capped(s):
            u = self.uids.setdefault(s.uid, _Usage())
            u.rows[(s.key, key)] = nbytes
            u.bytes += nbytes

    def remove(self, s: Sender, key: Hashable) -> None:
        own = self.owners.get(s.key)
        if own is None or key not in own.rows:
            return
        nbytes = own.rows.pop(key)
        own.bytes -= nbytes
        self.rows -= 1
        self.bytes -= nbytes
        if not own.rows:
            del self.owners[s.key]
        u = self.uids.get(s.uid) if uid_capped(s) else None
        if u is not None:
            u.bytes -= u.rows.pop((s.key, key), 0)
            if not u.rows:
                del self.uids[s.uid]

    def stats(self) -> dict[str, Any]:
        return {"rows": self.rows, "bytes": self.bytes, "senders": len(self.owners),
                "rate_buckets": len(self._buckets)}


class _Level(NamedTuple):
    """One bound a report must fit: ``usage`` None is the whole board."""

    code: str
    usage: _Usage | None
    rows: int
    nbytes: int
    what: str

    def over(self, ledger: Ledger, d_rows: int, d_bytes: int) -> bool:
        have_rows, have_bytes = ((ledger.rows, ledger.bytes) if self.usage is None
                                 else (len(self.usage.rows), self.usage.bytes))
        return have_rows + d_rows > self.rows or have_bytes + d_bytes > self.nbytes
