"""The same aggregates over a key-value store (the etcd back end): each node's
windows under its own key, a shard's partial sums, a class's record, each
the latest value of one key (sans-I/O: the host lists and watches the keys
and writes what these return).

* :class:`LeafSum` is a shard aggregator's state: the latest windows of each
  node key of its shard (a node's SLA publication, ``SlaView``'s bytes), and
  per class their sum, as an :class:`Up` (the trees' partial).
* :class:`PartialSum` is a class root's state: the latest partial of each
  shard, and their sum as the class's record, a :class:`Down` (the trees').
* :class:`RecordBook` is every node's view: the records of every class.

A key's value replaces its previous one (last writer wins), so a node is in
at most one partial (its key is in one shard) and each shard in the record
once; a deleted key (its lease expired: the node is gone) leaves the sums at
the next write.  The sums, the records and the view are the trees' own
(``add_parts``, ``record_row``, ``view_snapshot``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._aggregate import Census, Part, add_parts, census_of, leaf_part, record_row
from ._codec import Limits, Window, decode_state
from ._tree import CENSUS, HeldRecord, TreeConfig, view_snapshot
from ._tree_wire import MAX_CLASSES, Down, Up, decode

__all__ = ["LeafSum", "PartialSum", "RecordBook"]

_STATE = Limits(1 << 16, 255, 4097)


class LeafSum:
    """A shard's nodes' windows (see the module doc)."""

    def __init__(self, config: TreeConfig | None = None) -> None:
        self.config = config or TreeConfig()
        self._nodes: dict[str, list[tuple[Window, float]]] = {}  # node -> (window, its end)
        self.malformed = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def put(self, node: str, value: bytes, now: float) -> bool:
        """Node ``node``'s publication (the bytes of ``SlaView.app_state(relay=False)``)."""
        try:
            bundles = decode_state(value, 1 << 17, _STATE)
        except ValueError:
            self.malformed += 1
            return False
        for origin, pub in bundles:
            if origin != node or isinstance(pub, ValueError):
                continue  # a key speaks for its node only
            delay = pub.delay_ms
            self._nodes[node] = [(w, now - (w.age_ms + delay) / 1000) for w in pub.windows]
            return True
        self._nodes.pop(node, None)  # an empty or foreign value: nothing of it counts
        return True

    def delete(self, node: str) -> bool:
        return self._nodes.pop(node, None) is not None

    def clear(self) -> None:
        self._nodes.clear()

    def partials(self, shard: int, now: float) -> dict[str, Up]:
        """Per class (and the census, key ``""``) the sum of the shard's nodes,
        as the partial of arc ``shard``."""
        cfg = self.config
        by_class: dict[str, list[Part]] = {}
        census = Census()
        for node in sorted(self._nodes):
            ws = self._nodes[node]
            census = census.add(census_of(ws, now, cfg.stale_s, cfg.max_classes),
                                cfg.max_classes)
            for w, end in ws:
                by_class.setdefault(w.sla_class, []).append(leaf_part(w, end, now, cfg.stale_s))
        n = len(self._nodes)
        out = {CENSUS: Up(CENSUS, shard, 0, 0, n, (), census, (), now)}
        for cls, parts in sorted(by_class.items()):
            summed = tuple(sorted(add_parts(parts).values(),
                                  key=lambda p: (p.key[0] or "", p.key[2])))
            out[cls] = Up(cls, shard, 0, 0, n, summed, None, (), now)
        return out


class PartialSum:
    """A class's shards' partials (see the module doc)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._parts: dict[str, Up] = {}
        self.malformed = 0

    def __len__(self) -> int:
        return len(self._parts)

    def put(self, name: str, value: bytes, now: float) -> bool:
        try:
            up = decode(value, now)
        except ValueError:
            self.malformed += 1
            return False
        if not isinstance(up, Up) or up.key != self.key:
            self.malformed += 1
            return False
        self._parts[name] = up
        return True

    def delete(self, name: str) -> bool:
        return self._parts.pop(name, None) is not None

    def clear(self) -> None:
        self._parts.clear()

    def names(self) -> list[str]:
        return sorted(self._parts)

    def record(self, root: str, epoch: int, now: float, *,
               only: Iterable[str] | None = None) -> Down:
        """The sum of the partials (``only``: of these names) as the class's record."""
        keep = set(self._parts) if only is None else set(only) & set(self._parts)
        ups = [self._parts[n] for n in sorted(keep)]
        count = sum(u.count for u in ups)
        census = None
        if self.key == CENSUS:
            census = Census()
            for u in ups:
                if u.census is not None:
                    census = census.add(u.census, MAX_CLASSES)
        merged = add_parts(p for u in ups for p in u.parts)
        rows = tuple(record_row(p) for p in sorted(merged.values(),
                                                    key=lambda p: (p.key[0] or "", p.key[2])))
        return Down(self.key, epoch, root, 0, 0.0, count, 0, rows, census, now)


class RecordBook:
    """The records a node holds, by class (the census under ``""``): its view."""

    def __init__(self, config: TreeConfig | None = None) -> None:
        self.config = config or TreeConfig()
        self._records: dict[str, HeldRecord] = {}
        self.malformed = 0
        self.received = 0

    def put(self, key: str, value: bytes, now: float) -> bool:
        self.received += 1
        try:
            down = decode(value, now)
        except ValueError:
            self.malformed += 1
            return False
        if not isinstance(down, Down) or down.key != key:
            self.malformed += 1
            return False
        self._records[key] = HeldRecord(down.root, down.epoch, down.rows, down.census,
                                        down.count, now)
        return True

    def delete(self, key: str) -> None:
        self._records.pop(key, None)

    def clear(self) -> None:
        self._records.clear()

    @property
    def classes(self) -> list[str]:
        return sorted(k for k in self._records if k != CENSUS)

    def census_classes(self) -> tuple[str, ...]:
        rec = self._records.get(CENSUS)
        return rec.census.classes if rec is not None and rec.census is not None else ()

    def snapshot(self, node: str, members: int, now: float,
                 targets: Mapping[str, float] | None, *, nodes: bool) -> dict[str, Any]:
        cfg = self.config
        recs = {k: r for k, r in self._records.items() if k != CENSUS
                and now - r.at <= cfg.forget_s + cfg.stale_s}
        out = view_snapshot(node, members, recs, self._records.get(CENSUS), now, targets,
                            nodes=nodes, stale_s=cfg.stale_s)
        out["counters"] = {"received": self.received, "malformed": self.malformed,
                           "accepted": self.received - self.malformed}
        return out

    def ages(self, now: float) -> dict[str, tuple[float, float] | None]:
        """Per class, how old the newest and the oldest window of its record are."""
        out: dict[str, tuple[float, float] | None] = {}
        for k in self.classes:
            r = self._records[k]
            out[k] = (now - r.newest, now - r.oldest) if any(x.nodes for x in r.rows) else None
        return out
