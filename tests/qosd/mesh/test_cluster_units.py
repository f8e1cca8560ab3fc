"""The small timing and ordering units of qosd.mesh.membership.core, each on its own:
config formulas, the Lifeguard suspicion timer, local health awareness, the
update order, message size estimates."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmmesh import MeshError
from qosd.mesh.membership import core as cluster
from qosd.mesh.membership.core import (
    Ack,
    Alive,
    AppBroadcast,
    Awareness,
    ClusterError,
    Config,
    Dead,
    Leave,
    MemberRow,
    Packet,
    Ping,
    PingReq,
    PushPull,
    State,
    Suspect,
    Suspicion,
    overrides,
    precedence,
    suspicion_timeout,
)
from qosd.mesh.membership.core._rules import must_refute, row_update

A, S, D, L = State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT


# -- config formulas -------------------------------------------------------------
def test_lan_defaults_are_memberlists() -> None:
    c = Config()
    assert (c.probe_interval_s, c.probe_timeout_s, c.indirect_checks) == (1.0, 0.5, 3)
    assert (c.gossip_interval_s, c.gossip_nodes, c.gossip_to_the_dead_s) == (0.2, 3, 30.0)
    assert (c.suspicion_mult, c.suspicion_max_timeout_mult, c.retransmit_mult) == (4, 6, 4)
    assert (c.push_pull_interval_s, c.awareness_max_multiplier, c.packet_budget) == (30.0, 8, 1400)


@pytest.mark.parametrize(
    ("n", "min_s", "k", "retransmits", "push_pull"),
    [
        (1, 4.0, 0, 4, 30.0),  # log10 clamps at 1; ceil(log10(2)) = 1
        (3, 4.0, 0, 4, 30.0),  # n - 2 < k: no confirmations expected
        (4, 4.0, 2, 4, 30.0),
        (10, 4.0, 2, 8, 30.0),
        (32, 4 * math.log10(32), 2, 8, 30.0),
        (33, 4 * math.log10(33), 2, 8, 60.0),  # scaled above 32 members
        (100, 8.0, 2, 12, 90.0),
        (1000, 12.0, 2, 16, 180.0),
    ],
)
def test_scaling_formulas(n: int, min_s: float, k: int, retransmits: int, push_pull: float) -> None:
    c = Config()
    assert c.suspicion_min_s(n) == pytest.approx(min_s)
    assert c.suspicion_max_s(n) == pytest.approx(6 * min_s)
    assert c.suspicion_k(n) == k
    assert c.retransmit_limit(n) == retransmits
    assert c.push_pull_s(n) == push_pull


@pytest.mark.parametrize(
    "kwargs",
    [{"probe_interval_s": 0}, {"gossip_nodes": -1}, {"probe_timeout_s": 1.0},
     {"suspicion_mult": 1}, {"packet_budget": 100}],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ClusterError) as err:
        Config(**kwargs)  # type: ignore[arg-type]
    assert isinstance(err.value, MeshError) and isinstance(err.value, ValueError)


# -- suspicion -------------------------------------------------------------------
def test_suspicion_shrinks_with_confirmations_to_min() -> None:
    s = Suspicion(start=100.0, accuser="a", k=3, min_s=2.0, max_s=30.0, incarnation=4)
    assert s.deadline == 130.0 and s.confirmations == 0
    assert s.confirm("b")
    assert s.deadline == pytest.approx(100 + 30 - 28 * math.log(2) / math.log(4))  # 116
    assert s.confirm("c")
    assert s.deadline == pytest.approx(100 + math.floor((30 - 28 * math.log(3) / math.log(4))
                                                        * 1000) / 1000)
    assert s.confirm("d")
    assert s.deadline == 102.0 and s.confirmations == 3
    assert not s.confirm("e")  # already at the minimum: not counted, not re-gossiped
    assert s.deadline == 102.0


def test_suspicion_ignores_its_accuser_and_duplicates() -> None:
    s = Suspicion(0.0, "a", k=2, min_s=1.0, max_s=6.0, incarnation=0)
    assert not s.confirm("a")
    assert s.confirm("b")
    assert not s.confirm("b")
    assert s.confirmations == 1


def test_suspicion_without_expected_confirmations_uses_min() -> None:
    s = Suspicion(10.0, "a", k=0, min_s=4.0, max_s=24.0, incarnation=0)
    assert s.deadline == 14.0
    assert not s.confirm("b")
    assert not s.expired(13.999) and s.expired(14.0)


def test_suspicion_needs_sane_bounds() -> None:
    with pytest.raises(ValueError):
        Suspicion(0.0, "a", 2, min_s=5.0, max_s=1.0, incarnation=0)


@given(k=st.integers(0, 10), n=st.integers(0, 20), lo=st.floats(0.1, 100), mult=st.floats(1, 10))
def test_suspicion_timeout_is_between_min_and_max_and_monotone(
    k: int, n: int, lo: float, mult: float
) -> None:
    hi = lo * mult
    t = suspicion_timeout(n, k, lo, hi)
    assert lo <= t <= hi
    assert suspicion_timeout(n + 1, k, lo, hi) <= t
    if k >= 1 and n >= k:
        assert t == lo


# -- awareness -------------------------------------------------------------------
def test_awareness_is_clamped_and_scales_the_interval() -> None:
    a = Awareness(8)
    a.apply(-1)
    assert a.score == 0 and a.scale(1.0) == 1.0
    a.apply(3)
    assert a.scale(1.0) == 4.0
    a.apply(100)
    assert a.score == 7 and a.scale(0.5) == 4.0


@pytest.mark.parametrize(
    ("acked", "expected", "nacks", "delta"),
    [(True, 3, 0, -1), (False, 3, 3, 0), (False, 3, 1, 2), (False, 3, 0, 3), (False, 0, 0, 1)],
)
def test_awareness_probe_rule(acked: bool, expected: int, nacks: int, delta: int) -> None:
    assert Awareness.probe_delta(acked, expected, nacks) == delta


# -- the update order ------------------------------------------------------------
# known (state, i=5) x update (state, j): does the update apply?  The table of _rules.
TABLE = {
    #           j=4                        j=5                         j=6
    A: {A: (False, False, True), S: (False, True, True), D: (False, True, True),
        L: (False, True, True)},
    S: {A: (False, False, True), S: (False, False, True), D: (False, True, True),
        L: (False, True, True)},
    D: {A: (False, False, True), S: (False, False, True), D: (False, False, True),
        L: (False, True, True)},
    L: {A: (False, False, True), S: (False, False, True), D: (False, False, True),
        L: (False, False, True)},
}


@pytest.mark.parametrize("known", list(State))
@pytest.mark.parametrize("new", list(State))
def test_incarnation_ordering_table(known: State, new: State) -> None:
    got = tuple(overrides(new, j, known, 5) for j in (4, 5, 6))
    assert got == TABLE[known][new]


@given(st.sampled_from(list(State)), st.integers(0, 9), st.sampled_from(list(State)),
       st.integers(0, 9), st.sampled_from(list(State)), st.integers(0, 9))
def test_update_order_is_a_strict_total_order(
    s1: State, i1: int, s2: State, i2: int, s3: State, i3: int
) -> None:
    a, b, c = (s1, i1), (s2, i2), (s3, i3)
    assert overrides(*a, *b) == (precedence(*a) > precedence(*b))
    assert not (overrides(*a, *b) and overrides(*b, *a))
    if a != b:
        assert overrides(*a, *b) or overrides(*b, *a)
    if overrides(*a, *b) and overrides(*b, *c):
        assert overrides(*a, *c)


def test_refutation_rules() -> None:
    assert must_refute(Suspect("me", 3, "x"), 3, "addr", leaving=False)
    assert must_refute(Dead("me", 4, "x"), 3, "addr", leaving=False)
    assert must_refute(Leave("me", 3), 3, "addr", leaving=False)  # not our own leave
    assert not must_refute(Suspect("me", 2, "x"), 3, "addr", leaving=False)  # old news
    assert not must_refute(Dead("me", 3, "x"), 3, "addr", leaving=True)
    assert not must_refute(Alive("me", "addr", 3), 3, "addr", leaving=False)
    assert must_refute(Alive("me", "addr", 4), 3, "addr", leaving=False)  # a previous run of ours
    assert must_refute(Alive("me", "other", 3), 3, "addr", leaving=False)


def test_push_pull_rows_become_updates() -> None:
    assert row_update(MemberRow("x", "a", 2, A), "me") == Alive("x", "a", 2)
    assert row_update(MemberRow("x", "a", 2, S), "me") == Suspect("x", 2, "me")
    assert row_update(MemberRow("x", "a", 2, D), "me") == Suspect("x", 2, "me")  # not dead at once
    assert row_update(MemberRow("x", "a", 2, L), "me") == Leave("x", 2)


# -- message sizes ---------------------------------------------------------------
def test_wire_sizes_follow_protobuf_rules() -> None:
    # body: seq (tag + 1-byte varint) + target (tag + len + 6) = 2 + 8; + oneof field (2)
    # + repeated envelope field (2)
    assert Ping(1, "node-1").wire == 14
    assert Ack(0).wire == 4  # proto3: a zero field costs nothing
    assert Ack(300).wire == 4 + 3
    assert PingReq(1, "b", "10.0.0.2:7946", True).wire == 4 + 2 + 3 + 15 + 2
    assert Alive("ü", "a", 0).wire == 4 + 4 + 3  # UTF-8 bytes, not characters
    payload = bytes(200)
    # framing with 2-byte lengths (6) + origin + key + seq + payload (tag, 2-byte length, 200)
    assert AppBroadcast("o", "k", 1, payload).wire == 6 + 3 + 3 + 2 + 203
    rows = (MemberRow("x", "a", 1, S), MemberRow("y", "b", 0, A))
    assert rows[0].wire == 2 + 3 + 3 + 2 + 2 and rows[1].wire == 2 + 3 + 3
    assert PushPull(True, False, rows, b"st").wire == 4 + 2 + 12 + 8 + 4


def test_sizes_do_not_take_part_in_equality_and_packets_add_up() -> None:
    assert Ping(1, "x") == Ping(1, "x", wire=999)
    msgs = (Ping(7, "node-2"), Alive("node-3", "10.0.0.3:7946", 2), Suspect("node-4", 1, "node-2"))
    p = Packet("node-1", "10.0.0.1:7946", msgs)
    assert p.size == 8 + 15 + sum(m.wire for m in msgs)
    assert Packet("node-1", "10.0.0.1:7946", msgs, size=5).size == 5


def test_public_names() -> None:
    for name in cluster.__all__:
        assert getattr(cluster, name) is not None
    assert sorted(cluster.__all__) == cluster.__all__
