"""The rollout as qosd's admin API sees it: one :class:`Rollout` core,
answering in JSON-ready dicts.

The API calls it from worker threads while the peer transport drives the
same node's cores from its own task, so every call into the core goes
through ``call``, which runs a function serialised with the host's own calls
to both cores: on the transport's event loop (qosd.mesh.membership.peers runs every core
call there; ``Peers._on_loop`` is such a function), or under the one lock a
threaded host keeps (:func:`locked`).  Actions the core returns are handed
to ``dispatch`` after that (the host carries them out: Realise on the
service, Fetch and SendReport on the transport).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mmmesh.policy import parse_policy
from qosd.mesh.rollout.core import NO_VERSION, Action, Rollout, RolloutTable, parse_base

__all__ = ["RolloutProvider", "locked"]

T = TypeVar("T")
Call = Callable[[Callable[[], Any]], Any]


def locked(lock: threading.Lock | threading.RLock) -> Call:
    """A ``call`` for a threaded host: ``fn`` runs holding ``lock``."""
    def call(fn: Callable[[], T]) -> T:
        with lock:
            return fn()
    return call


class RolloutProvider:
    """``propose`` and ``table`` for ``PUT /v1/cluster/policy`` and
    ``GET /v1/cluster/rollout`` (qosd/api/cluster_policy.py)."""

    def __init__(self, rollout: Rollout, call: Call,
                 dispatch: Callable[[list[Action]], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the ``now`` the host passes the core (same clock)."""
        self.rollout = rollout
        self._call = call
        self._dispatch = dispatch
        self._clock = clock

    def propose(self, text: str, base_version: str | None = None,
                author: str | None = None) -> dict[str, Any]:
        """Start the rollout of ``text`` (validated whole first: PolicyError) as
        the next mesh version; returns its table (every member pending).

        The canonical YAML is what travels (its sha256 names the version's
        content).  Raises RolloutConflict when ``base_version`` is not the
        desired version, NotSynced before the first state exchange."""
        canonical = parse_policy(text, source="mesh policy").to_yaml()
        base = parse_base(base_version)
        def go() -> tuple[list[Action], dict[str, Any]]:
            ann, actions = self.rollout.propose(canonical, self._clock(), author=author,
                                                base=base)
            return actions, self.rollout.table(ann.version).as_dict()

        actions, table = self._call(go)
        self._dispatch(actions)
        return table  # type: ignore[no-any-return]

    def table(self, version: str | None = None) -> dict[str, Any] | None:
        """The table of ``version`` (default: the desired one); None when
        there is no mesh version at all yet."""
        wanted = None if version is None else parse_base(version)
        if wanted == NO_VERSION:
            wanted = None
        t: RolloutTable = self._call(lambda: self.rollout.table(wanted))
        return None if t.version is None else t.as_dict()

    def stats(self) -> dict[str, Any]:
        """The core's counters (for metrics)."""
        out: dict[str, Any] = self._call(self.rollout.stats.as_dict)
        return out
