"""The aggregation trees: one per *tree key* (an SLA class, or the census ``""``),
derived from the member list alone, the same on every member that has the
same list (no election, no coordination).

Each member ``m`` has a position ``x(key, m)``: the first 8 bytes of
``blake2b(key NUL m)`` as an unsigned 64-bit integer.  The tree of ``key`` is
the compressed trie of the positions in base ``2^bits`` (SDIMS builds its
trees from a DHT's prefix routes the same way: Yalagandula and Dahlin,
SIGCOMM 2004):

* a **node** for every prefix (``depth`` digits) that splits the members
  under it into at least two non-empty digit groups; a prefix that does not
  split is skipped (the trie is compressed), so every node has 2..2^bits
  children and the tree is ~log_{2^bits}(n) deep;
* its **children**: the nodes of its digit groups, or the member alone in a
  group (a *leaf*: that member's own contribution);
* its **aggregator**: the member under it with the smallest score
  ``mix(x(m) XOR salt(node))``, the next two its backups (``candidates``).
  A fresh score per node spreads the roles: a member aggregates ~1/(2^bits - 1)
  nodes per tree, each with at most 2^bits inputs.

What makes it stable: a position depends on the member's id alone, a node on
the positions under it, so a member joining or dying changes only the nodes
on its own path (it may split a node, or take or leave an aggregator role);
the children of those move, nobody else.

A member needs of a tree only its :class:`Path`: the nodes from its leaf up
to the root (it can only ever aggregate nodes above its own leaf), with each
node's candidates and, for the nodes it aggregates, their children.
:meth:`Topology.local` computes one member's paths (what qosd does:
O(n) per tree and membership change, kept: the paths only);
:meth:`Topology.full` computes every member's at once (the simulator:
O(n log n) per tree, shared by all the simulated members of one view).  Both
give the same paths (tested).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Arc", "Child", "Path", "Topology", "contains", "position", "position_of_arc",
           "valid_arc"]

_M64 = (1 << 64) - 1
_DEPTH_BITS = 5  # an arc id is (prefix << 5) | depth
CANDIDATES = 3


@functools.lru_cache(maxsize=1 << 17)
def position(key: str, member: str) -> int:
    """``x(key, member)``: the member's place in the tree of ``key``."""
    h = hashlib.blake2b(f"{key}\x00{member}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


def _mix(z: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit permutation."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _salt(arc_id: int) -> int:
    return _mix((arc_id * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M64)


def position_of_arc(arc_id: int, bits: int) -> tuple[int, int]:
    """(depth, prefix) of an arc id."""
    return arc_id & ((1 << _DEPTH_BITS) - 1), arc_id >> _DEPTH_BITS


def valid_arc(arc_id: int, bits: int) -> bool:
    """Whether ``arc_id`` can name a node of a tree of ``bits`` digits: its
    depth within the trie's (63 // bits) and its prefix within depth digits
    (a peer's bytes may say anything)."""
    depth, prefix = position_of_arc(arc_id, bits)
    return arc_id >= 0 and depth <= 63 // bits and prefix < (1 << (bits * depth))


def contains(arc_id: int, x: int, bits: int) -> bool:
    """Whether position ``x`` lies under the arc ``arc_id`` (never for an id
    no node can have)."""
    if not valid_arc(arc_id, bits):
        return False
    depth, prefix = position_of_arc(arc_id, bits)
    return depth == 0 or (x >> (64 - bits * depth)) == prefix


@dataclass(frozen=True, slots=True)
class Child:
    """One input of a node: a node below it, or a member's own contribution."""

    arc: int
    """The child node's id; 0 for a leaf (then ``agg`` is the member)."""
    agg: str
    """Who is expected to send it: the child node's aggregator, or the leaf member."""
    size: int
    """Members under it (1 for a leaf): what a partial of it may count at most."""


@dataclass(frozen=True, slots=True)
class Arc:
    """One node of a tree on a member's path."""

    id: int
    depth: int
    size: int
    """Members under it."""
    candidates: tuple[str, ...]
    """Its aggregator first, then its backups."""
    children: tuple[Child, ...] = ()
    """Filled for the nodes the member is a candidate of (it aggregates them, or
    may stand in for their aggregator), else empty."""


@dataclass(frozen=True, slots=True)
class Path:
    """What one member needs of one tree: its nodes from its leaf's parent up
    to the root (empty when the member is alone)."""

    key: str
    member: str
    x: int
    arcs: tuple[Arc, ...]
    members: int
    """The tree's size (the view's member count)."""


class _Shape:
    """A tree of one key over sorted positions: node construction shared by
    the full and the local build."""

    def __init__(self, key: str, members: Sequence[str], bits: int) -> None:
        self.key, self.bits = key, bits
        self.mask = (1 << bits) - 1
        self.max_depth = 63 // bits
        pairs = sorted((position(key, m), m) for m in members)
        self.xs = [p[0] for p in pairs]
        self.ids = [p[1] for p in pairs]
        self._cands: dict[tuple[int, int], tuple[int, tuple[str, ...]]] = {}

    def groups(self, lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        """[lo, hi) split by the digit at ``depth``."""
        shift = 64 - self.bits * (depth + 1)
        xs, out, i = self.xs, [], lo
        while i < hi:
            j = bisect.bisect_left(xs, ((xs[i] >> shift) + 1) << shift, i, hi)
            out.append((i, j))
            i = j
        return out

    def branch(self, lo: int, hi: int, depth: int) -> tuple[int, list[tuple[int, int]]]:
        """The first depth >= ``depth`` at which [lo, hi) (>= 2 members) splits,
        and its groups (at the deepest digit every member is its own group)."""
        while depth < self.max_depth:
            gs = self.groups(lo, hi, depth)
            if len(gs) > 1:
                return depth, gs
            depth += 1
        return depth, [(i, i + 1) for i in range(lo, hi)]  # positions equal to 63 bits

    def arc_id(self, lo: int, depth: int) -> int:
        prefix = self.xs[lo] >> (64 - self.bits * depth) if depth else 0
        return (prefix << _DEPTH_BITS) | depth

    def candidates(self, lo: int, hi: int, arc_id: int) -> tuple[str, ...]:
        got = self._cands.get((lo, hi))
        if got is not None and got[0] == arc_id:
            return got[1]
        salt, xs, ids = _salt(arc_id), self.xs, self.ids
        best = heapq.nsmallest(CANDIDATES, range(lo, hi), key=lambda j: (_mix(xs[j] ^ salt), j))
        out = tuple(ids[j] for j in best)
        self._cands[(lo, hi)] = (arc_id, out)
        return out

    def agg(self, lo: int, hi: int, depth: int) -> tuple[int, str]:
        """(node id, aggregator) of the group [lo, hi) found at ``depth``."""
        if hi - lo == 1:
            return 0, self.ids[lo]
        d, _ = self.branch(lo, hi, depth)
        aid = self.arc_id(lo, d)
        return aid, self.candidates(lo, hi, aid)[0]

    def children(self, groups: list[tuple[int, int]], depth: int) -> tuple[Child, ...]:
        out = []
        for lo, hi in groups:
            aid, who = self.agg(lo, hi, depth + 1)
            out.append(Child(aid, who, hi - lo))
        return tuple(out)


def _chain(k: int, parents: list[int]) -> list[int]:
    out = []
    while k >= 0:
        out.append(k)
        k = parents[k]
    return out


class Topology:
    """The trees of one membership view (lazily, per key).  ``members``: every
    member of the view, this one included."""

    def __init__(self, members: Iterable[str], *, bits: int = 3, me: str | None = None) -> None:
        """``me`` set: :meth:`path` answers for that member only (qosd);
        unset: for any member (the simulator)."""
        if not 1 <= bits <= 6:
            raise ValueError("bits must be within 1..6")
        self.members = tuple(sorted(set(members)))
        self.bits = bits
        self.me = me
        self._paths: dict[tuple[str, str], Path] = {}
        self._full: dict[str, dict[str, Path]] = {}

    @classmethod
    def local(cls, members: Iterable[str], me: str, *, bits: int = 3) -> Topology:
        return cls(members, bits=bits, me=me)

    @classmethod
    def full(cls, members: Iterable[str], *, bits: int = 3) -> Topology:
        return cls(members, bits=bits)

    @property
    def size(self) -> int:
        return len(self.members)

    def paths(self) -> list[Path]:
        """The paths computed so far (a local topology keeps these only)."""
        return list(self._paths.values()) + [p for ps in self._full.values()
                                             for p in ps.values()]

    def depth_estimate(self) -> int:
        """~The depth of a tree of this many members (deadlines scale with it)."""
        n = max(2, len(self.members))
        return math.ceil(math.log(n, 1 << self.bits)) + 1

    def path(self, key: str, member: str) -> Path:
        """``member``'s path in the tree of ``key`` (a member not in the view:
        its path as if it were, so a joiner knows where to send)."""
        cached = self._paths.get((key, member))
        if cached is not None:
            return cached
        if self.me is None and member in self.members:
            paths = self._full.get(key)
            if paths is None:
                paths = self._full[key] = self._build_full(key)
            return paths[member]
        p = self._build_local(key, member)
        if len(self._paths) > 4096:
            self._paths.clear()
        self._paths[(key, member)] = p
        return p

    # -- one member's paths ----------------------------------------------------------
    def _build_local(self, key: str, me: str) -> Path:
        members = self.members if me in self.members else (*self.members, me)
        shape = _Shape(key, members, self.bits)
        x = position(key, me)
        idx = bisect.bisect_left(shape.xs, x)
        while shape.ids[idx] != me:  # equal positions: find me among them
            idx += 1
        arcs: list[Arc] = []
        lo, hi, depth = 0, len(shape.xs), 0
        while hi - lo > 1:
            d, groups = shape.branch(lo, hi, depth)
            aid = shape.arc_id(lo, d)
            cands = shape.candidates(lo, hi, aid)
            kids = shape.children(groups, d) if me in cands else ()
            arcs.append(Arc(aid, d, hi - lo, cands, kids))
            lo, hi = next(g for g in groups if g[0] <= idx < g[1])
            depth = d + 1
        arcs.reverse()
        return Path(key, me, x, tuple(arcs), len(members))

    # -- everyone's paths (the simulator) ---------------------------------------------
    def _build_full(self, key: str) -> dict[str, Path]:
        shape = _Shape(key, self.members, self.bits)
        n = len(shape.xs)
        parent_arc: list[int] = [-1] * n  # member index -> its leaf's parent node
        nodes: list[Arc] = []
        parents: list[int] = []
        stack: list[tuple[int, int, int, int]] = [(0, n, 0, -1)] if n > 1 else []
        while stack:
            lo, hi, depth, up = stack.pop()
            d, groups = shape.branch(lo, hi, depth)
            aid = shape.arc_id(lo, d)
            cands = shape.candidates(lo, hi, aid)
            k = len(nodes)
            nodes.append(Arc(aid, d, hi - lo, cands, shape.children(groups, d)))
            parents.append(up)
            for glo, ghi in groups:
                if ghi - glo == 1:
                    parent_arc[glo] = k
                else:
                    stack.append((glo, ghi, d + 1, k))
        bare = [Arc(a.id, a.depth, a.size, a.candidates) for a in nodes]  # without children
        chains: dict[int, tuple[Arc, ...]] = {}  # node -> the bare chain above it
        out: dict[str, Path] = {}
        for i, member in enumerate(shape.ids):
            k = parent_arc[i]
            chain = chains.get(k)
            if chain is None and k >= 0:
                ks = []
                j = k
                while j >= 0:
                    ks.append(j)
                    j = parents[j]
                chain = chains[k] = tuple(bare[j] for j in ks)
            arcs = chain or ()
            if any(member in a.candidates for a in arcs):  # its own nodes, with children
                arcs = tuple(nodes[j] if member in nodes[j].candidates else bare[j]
                             for j in _chain(k, parents))
            out[member] = Path(key, member, shape.xs[i], arcs, n)
        return out
