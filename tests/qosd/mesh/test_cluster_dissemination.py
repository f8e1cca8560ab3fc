"""The piggyback broadcast queue on its own, and as the membership core uses it:
retransmit counts, key replacement, fewest-sent first, the byte budget."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from qosd.mesh.membership.core import AppBroadcast, BroadcastQueue, Config, Membership


def drain(q: BroadcastQueue[str], budget: int, limit: int) -> list[list[str]]:
    rounds = []
    while len(q):
        msgs, _ = q.take(budget, limit)
        rounds.append(msgs)
    return rounds


def test_each_item_is_sent_limit_times_then_dropped() -> None:
    q: BroadcastQueue[str] = BroadcastQueue()
    q.push("a", "A", 10)
    q.push("b", "B", 10)
    rounds = drain(q, 1000, limit=3)
    assert rounds == [["B", "A"]] * 3
    assert not q.pending("a") and q.take(1000, 3) == ([], 0)


def test_fewest_sent_first_then_newest() -> None:
    q: BroadcastQueue[str] = BroadcastQueue()
    q.push("old", "OLD", 10)
    assert q.take(10, 5) == (["OLD"], 10)
    q.push("x", "X", 10)
    q.push("y", "Y", 10)
    assert q.take(10, 5)[0] == ["Y"]  # never sent, newest
    assert q.take(10, 5)[0] == ["X"]
    assert q.take(10, 5)[0] == ["X"]  # all sent once now: the last to get there first
    assert q.transmits("old") == 1 and q.transmits("y") == 1 and q.transmits("x") == 2


def test_a_newer_item_replaces_the_older_and_starts_over() -> None:
    q: BroadcastQueue[str] = BroadcastQueue()
    q.push("k", "v1", 10)
    q.take(100, 4)
    q.take(100, 4)
    assert q.transmits("k") == 2
    q.push("k", "v2", 10)
    assert len(q) == 1 and q.get("k") == "v2" and q.transmits("k") == 0
    assert drain(q, 100, 4) == [["v2"]] * 4


def test_byte_budget_is_respected_and_small_items_fill_the_gap() -> None:
    q: BroadcastQueue[str] = BroadcastQueue()
    for i in range(5):
        q.push(f"big{i}", f"B{i}", 100)
    q.push("small", "S", 20)
    msgs, used = q.take(250, 10)
    assert msgs == ["S", "B4", "B3"] and used == 220
    msgs, used = q.take(90, 10)  # no big item fits; the small one (sent once) does
    assert msgs == ["S"] and used == 20
    assert q.take(7, 10) == ([], 0)


def test_queue_is_bounded_dropping_the_most_sent() -> None:
    q: BroadcastQueue[str] = BroadcastQueue(max_items=3)
    q.push("a", "A", 1)
    q.take(1, 10)  # a sent once
    for key in "bcd":
        q.push(key, key.upper(), 1)
    assert len(q) == 3 and not q.pending("a")


def test_many_replacements_keep_the_queue_small() -> None:
    q: BroadcastQueue[str] = BroadcastQueue()
    for i in range(10_000):
        q.push(f"k{i % 7}", f"v{i}", 5)
    assert len(q) == 7
    assert sum(len(t) for t in q._tiers) < 200  # replaced items are compacted away
    assert sorted(q.take(1000, 1)[0]) == sorted(f"v{i}" for i in range(9993, 10_000))


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 300)), max_size=60),
       st.integers(8, 1400), st.integers(1, 8))
def test_take_never_exceeds_budget_nor_limit(
    items: list[tuple[int, int]], budget: int, limit: int
) -> None:
    """Every item fits an empty packet (the core refuses bigger broadcasts):
    then each latest item goes out exactly ``limit`` times, never over budget."""
    items = [(key, min(size, budget)) for key, size in items]
    q: BroadcastQueue[tuple[int, int]] = BroadcastQueue()
    latest: dict[int, tuple[int, int]] = {}
    for n, (key, size) in enumerate(items):
        msg = (key, n)
        q.push(str(key), msg, size)
        latest[key] = msg
    sizes = {(k, n): s for n, (k, s) in enumerate(items)}
    sent: dict[tuple[int, int], int] = {}
    for _ in range(10_000):
        if not len(q):
            break
        msgs, used = q.take(budget, limit)
        assert used == sum(sizes[m] for m in msgs) <= budget
        assert len(set(msgs)) == len(msgs)
        for m in msgs:
            sent[m] = sent.get(m, 0) + 1
    assert set(sent) <= set(latest.values())  # replaced items are never sent
    assert all(sent.get(msg, 0) == limit for msg in latest.values())


def test_membership_retransmits_4_x_ceil_log10_n_plus_1() -> None:
    """A core that knows N members piggybacks an app broadcast on exactly
    retransmit_limit(N) packets, then stops."""
    cfg = Config()
    node = Membership(cfg, "n0", "10.0.0.0:1", random.Random(1))
    for n in range(1, 120):
        node.handle(_alive_packet(n), 0.0)
    node.events()
    node.tick(0.0)
    while node.queued_broadcasts():  # let the membership news go out first
        node.tick(node.next_deadline())
    node.broadcast("sla/voice", b"digest")
    carried = 0
    t = node.next_deadline()
    for _ in range(2000):
        for send in node.tick(t):
            carried += any(isinstance(m, AppBroadcast) for m in send.packet.msgs)
        t = node.next_deadline()
    assert cfg.retransmit_limit(120) == 12
    assert carried == 12


def _alive_packet(n: int):  # type: ignore[no-untyped-def]
    from qosd.mesh.membership.core import Alive, Packet

    return Packet(f"n{n}", f"10.0.0.{n}:1", (Alive(f"n{n}", f"10.0.0.{n}:1", 0),))
