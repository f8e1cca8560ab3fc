"""The membership core driven by hand: each test scripts the packets and the
clock, so every interleaving is the one written down."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosd.mesh.membership.core import (
    Ack,
    Alive,
    AppBroadcast,
    AppMessage,
    AppStateReceived,
    ClusterError,
    Config,
    Dead,
    Joined,
    Leave,
    MemberChanged,
    MemberRow,
    Membership,
    Message,
    Nack,
    Packet,
    Ping,
    PingReq,
    PushPull,
    Send,
    State,
    Suspect,
)

CFG = Config()


def node(i: int, cfg: Config = CFG) -> Membership:
    return Membership(cfg, f"n{i}", f"10.0.0.{i}:7946", random.Random(i))


def pkt(i: int, *msgs: Message) -> Packet:
    """A packet as member n<i> sends it."""
    return Packet(f"n{i}", f"10.0.0.{i}:7946", msgs)


def know(m: Membership, *others: int, now: float = 0.0) -> None:
    """Make ``m`` know members n<i> alive at incarnation 0."""
    for i in others:
        m.handle(pkt(i, Alive(f"n{i}", f"10.0.0.{i}:7946", 0)), now)
    m.events()


def msgs_of(sends: list[Send], kind: type) -> list[Message]:
    return [m for s in sends for m in s.packet.msgs if isinstance(m, kind)]


def state(m: Membership, i: int) -> tuple[State, int]:
    info = m.member(f"n{i}")
    assert info is not None
    return info.state, info.incarnation


def tick_until(m: Membership, t_end: float) -> list[Send]:
    out: list[Send] = []
    t = m.next_deadline()
    while t <= t_end:
        out += m.tick(max(t, 0.0))
        t = m.next_deadline()
    return out


# -- probes ----------------------------------------------------------------------
def test_ping_is_answered_and_the_ack_gives_rtt_and_last_ack() -> None:
    a, b = node(0), node(1)
    assert a.next_deadline() == -math.inf  # not started: tick now
    know(a, 1)
    know(b, 0)
    sends = tick_until(a, 1.0)
    pings = [(s, m) for s in sends for m in s.packet.msgs if isinstance(m, Ping)]
    assert len(pings) == 1
    send, ping = pings[0]
    assert (send.to, send.node, ping.target) == ("10.0.0.1:7946", "n1", "n1")
    sent_at = a._prober.probe.sent  # type: ignore[union-attr]
    replies = b.handle(send.packet, sent_at + 0.002)
    assert msgs_of(replies, Ack) == [Ack(ping.seq)]
    assert replies[0].to == "10.0.0.0:7946"
    a.handle(replies[0].packet, sent_at + 0.004)
    info = a.member("n1")
    assert info is not None and info.rtt_s == pytest.approx(0.004)
    assert info.last_ack == pytest.approx(sent_at + 0.004)
    tick_until(a, sent_at + 1.0)  # probe ends answered: no suspicion, health stays 0
    assert state(a, 1) == (State.ALIVE, 0) and a.health_score == 0


def test_a_ping_for_another_node_id_is_not_answered() -> None:
    b = node(1)
    assert b.handle(pkt(0, Ping(5, "someone-else")), 0.0) == []


def test_unanswered_probe_with_no_relays_suspects_and_raises_health_score() -> None:
    a = node(0)
    know(a, 1)
    sends = tick_until(a, 3.0)
    assert msgs_of(sends, Ping)  # pinged n1, nobody answered, no one to ask indirectly
    assert state(a, 1) == (State.SUSPECT, 0)
    assert a.health_score >= 1 and a.stats.probe_failures >= 1
    assert [e.state for e in a.events() if isinstance(e, MemberChanged)] == [State.SUSPECT]


def test_ping_to_a_suspect_carries_the_suspicion() -> None:
    a = node(0)
    know(a, 1, 2)
    a.handle(pkt(2, Suspect("n1", 0, "n2")), 0.0)
    sends = tick_until(a, 3.0)
    to_n1 = [s for s in sends if s.node == "n1" and msgs_of([s], Ping)]
    assert to_n1 and Suspect("n1", 0, "n0") in to_n1[0].packet.msgs


# -- the update rules, refutation -------------------------------------------------
def test_suspected_member_refutes_and_stays_alive() -> None:
    a, b = node(0), node(1)
    know(a, 1, 2)
    a.handle(pkt(2, Suspect("n1", 0, "n2")), 1.0)
    assert state(a, 1) == (State.SUSPECT, 0)
    a.handle(pkt(2, Alive("n1", "10.0.0.1:7946", 0)), 1.1)  # same incarnation: no effect
    assert state(a, 1) == (State.SUSPECT, 0)

    b.handle(pkt(0, Ping(1, "n1"), Suspect("n1", 0, "n0")), 1.2)  # b hears it is suspected
    assert b.incarnation == 1 and b.stats.refutations == 1 and b.health_score == 1
    refutation = b.handle(pkt(0, Ping(2, "n1")), 1.3)  # the ack carries the refutation
    assert Alive("n1", "10.0.0.1:7946", 1) in refutation[0].packet.msgs
    a.handle(refutation[0].packet, 1.31)
    assert state(a, 1) == (State.ALIVE, 1)
    changes = [(e.state, e.previous) for e in a.events() if isinstance(e, MemberChanged)]
    assert changes == [(State.SUSPECT, State.ALIVE), (State.ALIVE, State.SUSPECT)]
    assert not a._suspicions  # the old timer is gone: it cannot kill n1 later


def test_refutation_beats_the_accusation_incarnation() -> None:
    b = node(1)
    b.handle(pkt(0, Dead("n1", 7, "n0")), 0.0)
    assert b.incarnation == 8
    b.handle(pkt(0, Suspect("n1", 3, "n0")), 0.0)  # older than what we are: ignored
    assert b.incarnation == 8 and b.stats.refutations == 1


@pytest.mark.parametrize(
    ("accusation", "stale", "fresh"),
    [(Suspect("n1", 4, "n2"), 3, 5), (Suspect("n1", 4, "n2"), 4, 5), (Dead("n1", 2, "n2"), 2, 3)],
)
def test_only_a_higher_incarnation_brings_a_member_back(
    accusation: Suspect | Dead, stale: int, fresh: int
) -> None:
    a = node(0)
    know(a, 1, 2)
    a.handle(pkt(2, accusation), 0.0)
    accused = (State.SUSPECT if isinstance(accusation, Suspect) else State.DEAD,
               accusation.incarnation)
    assert state(a, 1) == accused
    a.handle(pkt(1, Alive("n1", "10.0.0.1:7946", stale)), 1.0)
    assert state(a, 1) == accused
    a.handle(pkt(1, Alive("n1", "10.0.0.1:7946", fresh)), 2.0)
    assert state(a, 1) == (State.ALIVE, fresh)
    assert not a._suspicions


def test_confirmations_shrink_the_timer_and_are_regossiped() -> None:
    a = node(0)
    know(a, 1, 2, 3, 4)  # n = 5: k = 2, min = 4 log10(5) s, max = 6 x min
    lo, hi = CFG.suspicion_min_s(5), CFG.suspicion_max_s(5)
    a.handle(pkt(2, Suspect("n1", 0, "n2")), 10.0)
    sus = a._suspicions["n1"]
    assert sus.deadline == pytest.approx(10.0 + hi, abs=1e-3)
    a.handle(pkt(3, Suspect("n1", 0, "n3")), 11.0)
    assert sus.confirmations == 1 and sus.deadline < 10.0 + hi
    assert a._queue.get("m/n1") == Suspect("n1", 0, "n3")  # new confirmation goes on
    a.handle(pkt(2, Suspect("n1", 0, "n2")), 11.5)  # the first accuser again: nothing
    a.handle(pkt(4, Suspect("n1", 0, "n4")), 12.0)
    assert sus.confirmations == 2 and sus.deadline == pytest.approx(10.0 + lo, abs=1e-3)
    a.events()
    a.tick(10.0 + lo - 0.01)
    assert state(a, 1)[0] == State.SUSPECT
    a.tick(10.0 + lo)
    assert state(a, 1) == (State.DEAD, 0) and a.stats.deaths_declared == 1
    assert a._queue.get("m/n1") == Dead("n1", 0, "n0")


def test_a_live_member_cannot_move_address_but_a_left_one_can() -> None:
    a = node(0)
    know(a, 1)
    a.handle(pkt(9, Alive("n1", "10.9.9.9:7946", 5)), 0.0)
    assert a.member("n1").addr == "10.0.0.1:7946" and a.stats.conflicts == 1  # type: ignore[union-attr]
    a.handle(pkt(1, Leave("n1", 0)), 0.0)
    a.handle(pkt(9, Alive("n1", "10.9.9.9:7946", 1)), 0.0)
    assert a.member("n1").addr == "10.9.9.9:7946"  # type: ignore[union-attr]


def test_news_about_unknown_members() -> None:
    a = node(0)
    a.handle(pkt(2, Suspect("x", 0, "n2")), 0.0)  # no address, nothing to probe: ignored
    assert a.member("x") is None
    a.handle(pkt(2, Dead("x", 3, "n2")), 0.0)  # remembered, so a stale alive cannot revive it
    a.handle(pkt(2, Alive("x", "10.0.0.99:7946", 3)), 0.0)
    assert a.member("x").state == State.DEAD  # type: ignore[union-attr]
    assert a.live_members() == 0


UPDATES = st.lists(
    st.one_of(
        st.builds(Alive, st.just("x"), st.just("10.0.0.9:7946"), st.integers(0, 3)),
        st.builds(Suspect, st.just("x"), st.integers(0, 3), st.sampled_from(["n1", "n2"])),
        st.builds(Dead, st.just("x"), st.integers(0, 3), st.sampled_from(["n1", "n2"])),
        st.builds(Leave, st.just("x"), st.integers(0, 3)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(UPDATES, st.randoms(use_true_random=False))
def test_members_that_saw_the_same_news_agree_whatever_the_order(
    updates: list[Message], shuffler: random.Random
) -> None:
    """Merge is order-independent: every order ends at the maximum of the update
    order, so all members converge once gossip has reached them."""
    views = []
    for _ in range(3):
        m = node(0)
        m.handle(pkt(9, Alive("x", "10.0.0.9:7946", 0)), 0.0)
        order = list(updates)
        shuffler.shuffle(order)
        for u in order:
            m.handle(pkt(1, u), 0.0)
        info = m.member("x")
        assert info is not None
        views.append((info.state, info.incarnation))
    assert views[0] == views[1] == views[2]
    ranks = [(0, 0)] + [(u.incarnation, int(_state_of(u))) for u in updates]  # type: ignore[union-attr]
    best = max(ranks)
    assert (views[0][1], int(views[0][0])) == best


def _state_of(msg: Message) -> State:
    return {Alive: State.ALIVE, Suspect: State.SUSPECT, Dead: State.DEAD,
            Leave: State.LEFT}[type(msg)]


# -- leave, join ------------------------------------------------------------------
def test_graceful_leave_is_not_a_failure() -> None:
    a, b = node(0), node(1)
    know(a, 1)
    know(b, 0, 2, 3)
    b.tick(0.0)
    sends = b.leave(0.5)
    assert sends and all(Leave("n1", 0) in s.packet.msgs for s in sends)
    assert b.leaving and b.leave_pending()
    for s in sends:
        if s.node == "n0":
            a.handle(s.packet, 0.51)
    assert state(a, 1) == (State.LEFT, 0)
    assert [e.state for e in a.events() if isinstance(e, MemberChanged) and e.node == "n1"] \
        == [State.LEFT]
    assert not a._suspicions
    later = tick_until(b, 30.0)  # keeps gossiping the leave, probes no one
    assert not msgs_of(later, Ping) and not b.leave_pending()
    assert b.handle(pkt(0, Dead("n1", 0, "n0")), 31.0) == [] and b.incarnation == 0


def test_join_through_seeds() -> None:
    a = node(0)
    know(a, 1, 2, 3)
    a.set_app_state(b"sketches")
    e = node(4)
    seeds = ["10.0.0.4:7946", "10.0.0.0:7946", "10.0.0.0:7946", "10.0.0.77:7946"]
    sends = e.join(seeds, 5.0)
    assert sorted(s.to for s in sends) == ["10.0.0.0:7946", "10.0.0.77:7946"]  # self skipped
    request = next(s for s in sends if s.to == "10.0.0.0:7946").packet
    assert isinstance(request.msgs[0], PushPull) and request.msgs[0].join
    replies = a.handle(request, 5.001)
    assert len(replies) == 1 and isinstance(replies[0].packet.msgs[0], PushPull)
    assert a._queue.get("m/n4") == Alive("n4", "10.0.0.4:7946", 0)  # a gossips the joiner
    e.handle(replies[0].packet, 5.002)
    events = e.events()
    assert Joined("n0", 5) in events
    assert AppStateReceived("n0", b"sketches", True) in events
    assert {m.node for m in e.members() if m.state == State.ALIVE} == {f"n{i}" for i in range(5)}
    assert e._queue.get("m/n2") is None  # the seed's state is news to nobody: not re-gossiped
    assert e._join_retry_at == math.inf


def test_join_retries_until_a_seed_answers() -> None:
    e = node(4, Config(join_retry_s=2.0, join_fanout=1))
    first = e.join(["10.0.0.1:7946", "10.0.0.2:7946"], 0.0)
    assert len(first) == 1
    again = msgs_of(tick_until(e, 2.0), PushPull)
    assert len(again) == 1 and isinstance(again[0], PushPull) and again[0].join
    know(e, 1, now=2.5)  # somebody found us: no more retries
    assert not msgs_of(tick_until(e, 10.0), PushPull)


# -- push-pull ---------------------------------------------------------------------
def test_push_pull_merges_a_full_state() -> None:
    a = node(0)
    know(a, 1, 2, 3)
    rows = (
        MemberRow("n1", "10.0.0.1:7946", 3, State.ALIVE),
        MemberRow("n2", "10.0.0.2:7946", 2, State.LEFT),
        MemberRow("n3", "10.0.0.3:7946", 0, State.DEAD),  # taken as a suspicion
        MemberRow("n5", "10.0.0.5:7946", 1, State.ALIVE),  # new to a
        MemberRow("n0", "10.0.0.0:7946", 0, State.ALIVE),
    )
    out = a.handle(pkt(1, PushPull(False, True, rows, b"state")), 1.0)
    assert out == []  # a reply is not answered
    assert [state(a, i) for i in (1, 2, 3, 5)] == [
        (State.ALIVE, 3), (State.LEFT, 2), (State.SUSPECT, 0), (State.ALIVE, 1)]
    assert AppStateReceived("n1", b"state", False) in a.events()
    assert a._queue.get("m/n5") == Alive("n5", "10.0.0.5:7946", 1)  # news: gossiped on


def test_push_pull_request_is_answered_after_the_merge() -> None:
    a = node(0)
    know(a, 1)
    rows = (MemberRow("n0", "10.0.0.0:7946", 0, State.DEAD),
            MemberRow("n1", "10.0.0.1:7946", 0, State.ALIVE))
    out = a.handle(pkt(1, PushPull(False, False, rows)), 1.0)
    assert len(out) == 1 and out[0].to == "10.0.0.1:7946" and out[0].node == "n1"
    reply = out[0].packet.msgs[0]
    assert isinstance(reply, PushPull) and reply.reply and not reply.join
    assert MemberRow("n0", "10.0.0.0:7946", 1, State.ALIVE) in reply.rows  # refuted in it
    assert len(out[0].packet.msgs) == 1  # no gossip piggybacked on a full state


# -- application broadcasts ---------------------------------------------------------
def test_app_broadcasts_are_delivered_once_newest_wins_and_are_gossiped_on() -> None:
    a = node(0)
    know(a, 1, 2)
    a.handle(pkt(1, AppBroadcast("n1", "sla/voice", 5, b"v5")), 0.0)
    a.handle(pkt(2, AppBroadcast("n1", "sla/voice", 5, b"v5")), 0.0)  # duplicate
    a.handle(pkt(2, AppBroadcast("n1", "sla/voice", 4, b"v4")), 0.0)  # older
    a.handle(pkt(2, AppBroadcast("n0", "sla/voice", 9, b"mine")), 0.0)  # our own, echoed
    a.handle(pkt(2, AppBroadcast("n1", "policy", 1, b"p1")), 0.0)  # another key
    a.handle(pkt(1, AppBroadcast("n1", "sla/voice", 6, b"v6")), 0.0)
    got = [(e.key, e.seq, e.payload) for e in a.events() if isinstance(e, AppMessage)]
    assert got == [("sla/voice", 5, b"v5"), ("policy", 1, b"p1"), ("sla/voice", 6, b"v6")]
    assert a._queue.get("a/n1/sla/voice") == AppBroadcast("n1", "sla/voice", 6, b"v6")


def test_own_broadcasts_count_up_from_the_start_value_and_must_fit_a_packet() -> None:
    m = Membership(CFG, "n0", "10.0.0.0:7946", random.Random(0), app_seq_start=1000)
    assert m.broadcast("k", b"x") == 1001
    assert m.broadcast("k", b"y") == 1002
    assert m.queued_broadcasts() == 1
    with pytest.raises(ClusterError):
        m.broadcast("k", bytes(1400))


def test_constructor_checks_identity() -> None:
    with pytest.raises(ClusterError):
        Membership(CFG, "", "10.0.0.0:1", random.Random(0))


def test_next_deadline_says_when_work_is_due() -> None:
    a = node(0)
    know(a, 1)
    a.tick(0.0)
    t = a.next_deadline()
    assert 0.0 < t <= CFG.gossip_interval_s
    a.tick(t - 1e-6)  # ticking early is allowed and changes nothing that was due
    assert a.next_deadline() == t


# -- garbage in -------------------------------------------------------------------
IDS = st.sampled_from(["n0", "n1", "n2", "n3", "x"])
ADDRS = st.sampled_from(["10.0.0.1:7946", "10.0.0.2:7946", "10.0.0.0:7946", ""])
INCS = st.integers(-1, 4)
ANY_MESSAGE = st.one_of(
    st.builds(Ping, st.integers(0, 5), IDS),
    st.builds(Ack, st.integers(0, 5)),
    st.builds(Nack, st.integers(0, 5)),
    st.builds(PingReq, st.integers(0, 5), IDS, ADDRS, st.booleans()),
    st.builds(Alive, IDS, ADDRS, INCS),
    st.builds(Suspect, IDS, INCS, IDS),
    st.builds(Dead, IDS, INCS, IDS),
    st.builds(Leave, IDS, INCS),
    st.builds(AppBroadcast, IDS, st.sampled_from(["k", "j"]), st.integers(0, 3), st.binary(max_size=8)),
    st.builds(PushPull, st.booleans(), st.booleans(),
              st.lists(st.builds(MemberRow, IDS, ADDRS, INCS, st.sampled_from(list(State))),
                       max_size=4).map(tuple), st.binary(max_size=4)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(ANY_MESSAGE, min_size=1, max_size=4),
                          st.floats(0, 5)), max_size=25))
def test_any_input_keeps_the_core_consistent(script: list[tuple[int, list[Message], float]]) -> None:
    """Whatever peers send, in whatever order, with ticks in between: no exception,
    and the counters agree with the table."""
    m = node(0)
    now = 0.0
    for sender, msgs, dt in script:
        now += dt
        m.tick(now)
        for send in m.handle(pkt(sender, *msgs), now):
            assert send.to and send.packet.sender == "n0"
        m.events()
        others = [e for e in m.members() if e.node != "n0"]
        assert m.live_members() == sum(e.state <= State.SUSPECT for e in others)
        assert set(m._table.dead) == {e.node for e in others if e.state == State.DEAD}
        assert all(e.node != "n0" and e.addr for e in m._table.ring)
        assert m.member("n0").state == State.ALIVE  # type: ignore[union-attr]
        assert m.next_deadline() > now


def test_a_fixed_10ms_tick_works_like_ticking_at_the_deadlines() -> None:
    """A host that ticks on a period instead of sleeping until next_deadline()
    gets the same protocol: one probe per interval, answered, nobody suspected."""
    a, b = node(0), node(1)
    know(a, 1)
    know(b, 0)
    peers = {a.addr: a, b.addr: b}
    pings = 0
    for step in range(1000):  # 10 s
        now = step * 0.01
        for m in (a, b):
            for send in m.tick(now):
                pings += m is a and bool(msgs_of([send], Ping))
                for reply in peers[send.to].handle(send.packet, now + 0.001):
                    peers[reply.to].handle(reply.packet, now + 0.002)
    assert 9 <= pings <= 11
    for m, other in ((a, 1), (b, 0)):
        assert state(m, other) == (State.ALIVE, 0)
        assert m.health_score == 0 and m.stats.probe_failures == 0 and m.incarnation == 0
