"""Mesh-wide policy rollout (qosd.mesh.rollout.core): the version order, the
state machine scripted input by input, its payloads and bounds, the table,
the per-node link, the API's provider.  Whole meshes on the virtual clock:
tests/qosd/mesh/test_cluster_rollout_sim.py; the API and CLI:
tests/qosd/mesh/test_cluster_rollout_api.py."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmmesh.errors import PolicyError
from mmmesh.policy import TrafficClass, parse_policy
from qosd.mesh.membership.core import (
    AppMessage,
    AppStateReceived,
    ClusterError,
    MemberChanged,
    MemberInfo,
    State,
)
from qosd.mesh.rollout.core import (
    NO_VERSION,
    Announcement,
    Fetch,
    LinkOverride,
    MeshVersion,
    NotSynced,
    Realise,
    Report,
    Rollout,
    RolloutConfig,
    RolloutConflict,
    SendReport,
    localise_policy,
)
from qosd.mesh.rollout.core._table import build_table
from qosd.mesh.rollout.core.codec import encode_announcement, encode_report
from testkit.rollout_cases import (
    POLICY,
    SLOW_LINK,
    SMALL,
    SMALLER,
    FakeGossip,
    announce,
    report,
    sha,  # noqa: F401
)

NODES = ("node-a", "node-b", "node-c", "node-d")


def core(node: str = "node-a", **kw: object) -> tuple[Rollout, FakeGossip]:
    g = FakeGossip(node, tuple(n for n in NODES if n != node))
    return Rollout(g, random.Random(1), **kw), g  # type: ignore[arg-type]


def synced(node: str = "node-a", **kw: object) -> tuple[Rollout, FakeGossip]:
    r, g = core(node, **kw)
    r.on_events([AppStateReceived("node-d", b'{"v":1,"r":[]}', True)], 0.0)
    return r, g








def mine(g: FakeGossip) -> list[dict[str, object]]:
    return [json.loads(m.payload) for m in g.sent if m.key.startswith("ack/")]


# --------------------------------------------------------------------------
# The version order
# --------------------------------------------------------------------------
def test_mesh_versions_order_by_counter_then_origin_and_spell_as_counter_at_node() -> None:
    a1, b1, a2 = MeshVersion(1, "node-a"), MeshVersion(1, "node-b"), MeshVersion(2, "node-a")
    assert a1 < b1 < a2 and max(a1, b1, a2) == a2
    assert str(b1) == "1@node-b" and MeshVersion.parse("12@node-a") == MeshVersion(12, "node-a")
    for bad in ("", "12", "@node-a", "0@node-a", "x@node-a", "-1@n", f"{2**53}@n"):
        with pytest.raises(ValueError):
            MeshVersion.parse(bad)
    assert MeshVersion.from_note(a2.note()) == a2 and a2.note() == "mesh 2@node-a"
    assert MeshVersion.from_note("rollback to 3") is None and MeshVersion.from_note(None) is None


def test_a_proposal_takes_one_above_the_highest_counter_seen() -> None:
    r, g = synced()
    r.on_events([announce("node-b", 7)], 1.0)
    r.on_events([report("node-c", MeshVersion(9, "node-x"), POLICY)], 1.0)  # a row names 9
    ann, actions = r.propose(SMALL, 2.0, author="alice")
    assert ann.version == MeshVersion(10, "node-a") and r.desired == ann
    assert actions == [Realise(ann.version, SMALL, sha(SMALL))]
    sent = json.loads(g.sent[-1].payload)
    assert g.sent[-1].key == "policy" and (sent["c"], sent["o"], sent["a"]) == (10, "node-a",
                                                                               "alice")


@settings(max_examples=60, deadline=None)
@given(st.permutations([(3, "node-b"), (3, "node-c"), (2, "node-d"), (1, "node-c")]),
       st.integers(0, 3))
def test_every_order_of_concurrent_announcements_ends_on_the_same_version(
        order: list[tuple[int, str]], late: int) -> None:
    """No split brain: whatever order announcements arrive in (and however
    they interleave with realisations), every node settles on the highest."""
    r, _ = core("node-a")
    done = 0
    for k, (counter, origin) in enumerate(order):
        actions = r.on_events([announce(origin, counter, POLICY + f"# {origin}\n")], k)
        for a in actions:
            if isinstance(a, Fetch):
                r.on_fetch_reply(a.version, (POLICY + f"# {origin}\n").encode(), k)
        if k == late and r._inflight is not None:
            r.on_realised(r._inflight[0], True, "", k)
            done += 1
    assert r.desired is not None and r.desired.version == MeshVersion(3, "node-c")


# --------------------------------------------------------------------------
# The state machine, input by input
# --------------------------------------------------------------------------
def test_ack_after_realise_and_straight_to_the_origin() -> None:
    r, g = core("node-a")
    actions = r.on_events([announce("node-b", 1)], 1.0)
    v = MeshVersion(1, "node-b")
    assert actions == [Fetch(v, sha(POLICY), "node-b")]  # only the origin holds it yet
    assert r.on_fetch_reply(v, POLICY.encode(), 1.1) == [Realise(v, POLICY, sha(POLICY))]
    assert r.on_realised(v, True, "", 1.2)[0] == SendReport("node-b", b"1\n" + g.sent[-1].payload)
    assert r.applied == v and mine(g)[-1] == {"v": 1, "c": 1, "o": "node-b",
                                              "h": sha(POLICY)[:16], "ok": 1, "t": 1.2}
    assert r.tick(5.0) == [] and len(g.sent) == 1  # level-triggered, but nothing to do


def test_a_nack_keeps_the_previous_version_until_a_newer_one() -> None:
    r, g = core("node-a")
    v1, v2, v3 = (MeshVersion(i, "node-b") for i in (1, 2, 3))
    for v, text, ok in ((v1, SMALL, True), (v2, POLICY, False)):
        r.on_events([announce("node-b", v.counter, text)], 1.0)
        r.on_fetch_reply(v, text.encode(), 1.0)
        r.on_realised(v, ok, "" if ok else "classes: guarantees exceed 200mbit", 1.0)
    assert r.applied == v1 and r.desired is not None and r.desired.version == v2
    nack = mine(g)[-1]
    assert (nack["c"], nack["ok"], nack["ac"], nack["ao"]) == (2, 0, 1, "node-b")
    assert "200mbit" in str(nack["r"])
    assert r.tick(60.0) == [] and r.on_events([], 61.0) == []  # xDS: no retry by itself
    assert r.retry(62.0) == [Realise(v2, POLICY, sha(POLICY))]  # the host's config changed
    r.on_realised(v2, False, "still too small", 62.1)
    r.on_events([announce("node-b", 3, SMALLER)], 63.0)
    assert r.on_fetch_reply(v3, SMALLER.encode(), 63.1) == [Realise(v3, SMALLER, sha(SMALLER))]


def test_a_version_superseded_during_its_realisation_is_never_reported() -> None:
    r, g = core("node-a")
    v1, v2 = MeshVersion(1, "node-b"), MeshVersion(1, "node-c")
    r.on_events([announce("node-b", 1)], 1.0)
    r.on_fetch_reply(v1, POLICY.encode(), 1.0)
    assert r.on_events([announce("node-c", 1, SMALL)], 1.1)[0] == Fetch(v2, sha(SMALL), "node-c")
    r.on_fetch_reply(v2, SMALL.encode(), 1.2)  # waits: one realisation at a time
    assert r.on_realised(v1, True, "", 1.3) == [Realise(v2, SMALL, sha(SMALL))]
    assert r.applied == v1 and mine(g) == []  # v1 was in the kernel for a moment, not acked
    r.on_realised(v2, True, "", 1.4)
    assert [(m["c"], m["o"]) for m in mine(g)] == [(1, "node-c")] and r.stats.superseded == 1


def test_fetch_asks_the_holders_in_turn_and_checks_the_text() -> None:
    r, _ = core("node-a")
    v = MeshVersion(4, "node-b")
    first = r.on_events([announce("node-b", 4), report("node-c", v, POLICY),
                         report("node-d", v, POLICY, ok=False)], 1.0)
    assert len(first) == 1 and isinstance(first[0], Fetch)
    second = r.on_fetch_reply(v, None, 1.1)  # that one had nothing
    third = r.on_fetch_reply(v, b"a forged text", 1.2)
    assert r.stats.dropped == {"sha_mismatch": 1}
    asked = [a.peer for a in first + second + third if isinstance(a, Fetch)]
    assert sorted(asked) == ["node-b", "node-c", "node-d"]  # the origin and the reporters
    assert r.on_fetch_reply(v, None, 1.3) == []  # a round without success: wait ...
    assert r.next_deadline() == pytest.approx(1.3 + RolloutConfig().fetch_timeout_s)
    assert isinstance(r.tick(7.0)[0], Fetch)  # ... then ask again
    assert r.on_fetch_reply(v, POLICY.encode(), 7.1) == [Realise(v, POLICY, sha(POLICY))]
    assert r.stats.fetch_failures == 3 and r.stats.fetches == 4


def test_push_pull_state_brings_the_version_its_text_and_every_report() -> None:
    a, ga = synced("node-a")
    ann, _ = a.propose(SMALL, 1.0)
    a.on_realised(ann.version, True, "", 1.1)
    b, gb = core("node-b")
    old = MeshVersion(1, "node-0")  # below 1@node-a
    b.on_events([report("node-c", ann.version, SMALL, seq=5),
                 report("node-a", old, SMALL, seq=99)], 1.0)
    actions = b.on_events([AppStateReceived("node-a", ga.state, True)], 2.0)
    assert actions == [Realise(ann.version, SMALL, sha(SMALL))]  # no fetch: the text came
    rows = b.reports()
    assert rows["node-a"].seq == 99  # a lower seq from the state does not replace it
    assert rows["node-c"].seq == 5 and b.can_propose()
    b.on_realised(ann.version, True, "", 2.1)
    b.tick(2.0 + RolloutConfig().state_flush_s)  # reports reach the state at most this often
    c, _ = core("node-c")
    c.on_events([AppStateReceived("node-b", gb.state, False)], 3.0)
    assert {n: (r.version, r.ok) for n, r in c.reports().items()} == {
        "node-a": (old, True), "node-b": (ann.version, True)}
    assert "node-c" not in c.reports()  # rows about ourselves are ours to write


def test_a_report_of_an_unheard_version_is_enough_to_catch_up() -> None:
    """Reports flood the mesh right after the announcement and, being fresh,
    overtake it: a node that missed the announcement learns the version from
    the first report (a hint: version and sha prefix), fetches the text from
    the reporter, checks it against the prefix and applies it."""
    r, g = core("node-a")
    v = MeshVersion(2, "node-b")
    actions = r.on_events([report("node-c", v, SMALL)], 1.0)
    assert r.desired is not None and r.desired.hint and r.desired.key[2] == sha(SMALL)[:16]
    assert [a.peer for a in actions if isinstance(a, Fetch)] in (["node-b"], ["node-c"])
    assert b'"d"' not in g.state  # a hint is not passed on: no full sha to check against
    assert r.on_fetch_reply(v, POLICY.encode(), 1.1) != [] and r.stats.dropped == {
        "sha_mismatch": 1}
    actions = r.on_fetch_reply(v, SMALL.encode(), 1.2)
    assert actions == [Realise(v, SMALL, sha(SMALL))] and r.desired.sha256 == sha(SMALL)
    assert r.desired.size == len(SMALL) and not r.desired.hint
    r.on_events([announce("node-b", 2, SMALL)], 1.3)  # late: only completes the metadata
    assert r.desired.author == "op" and r.stats.superseded == 0 and r._inflight is not None
    r.on_realised(v, True, "", 1.4)
    assert json.loads(g.state)["d"]["h"] == sha(SMALL)


def test_a_restarted_node_reports_what_its_store_holds_without_applying_again() -> None:
    v = MeshVersion(3, "node-b")
    r, g = core("node-a", applied=v)
    assert r.highest_counter == 3
    assert r.on_events([announce("node-b", 3)], 1.0) == [SendReport("node-b", b"1\n"
                                                                   + g.sent[-1].payload)]
    assert mine(g)[-1]["ok"] == 1 and r.stats.realise_requests == 0
    # a local apply outside the rollout: the mesh version comes back (level-triggered)
    assert isinstance(r.set_applied(None, 2.0)[0], Fetch)


def test_a_proposal_checks_its_base_and_waits_for_the_first_state_exchange() -> None:
    r, _ = core("node-a")
    with pytest.raises(NotSynced):
        r.propose(POLICY, 1.0)
    r.on_events([AppStateReceived("node-b", b'{"v":1}', True)], 1.0)
    ann, _ = r.propose(POLICY, 1.0, base=NO_VERSION)
    with pytest.raises(RolloutConflict) as e:
        r.propose(SMALL, 2.0, base=NO_VERSION)
    assert e.value.current == ann.version and "1@node-a" in str(e.value)
    assert r.propose(SMALL, 2.0, base=ann.version)[0].version == MeshVersion(2, "node-a")
    with pytest.raises(ClusterError, match="at most"):
        r.propose("x" * (RolloutConfig().max_text_bytes + 1), 3.0)
    alone, gz = core("node-z")
    gz.states = {"node-z": State.ALIVE, "node-y": State.DEAD}
    assert alone.can_propose()  # a mesh of one


def test_the_origin_calls_the_roll_of_pending_members() -> None:
    a, ga = synced("node-a")
    ann, _ = a.propose(SMALL, 10.0)
    a.on_realised(ann.version, True, "", 10.1)
    a.on_events([report("node-b", ann.version, SMALL)], 10.2)
    assert a.next_deadline() == pytest.approx(11.0)
    a.tick(11.0)
    call = json.loads(ga.sent[-1].payload)
    assert ga.sent[-1].key == "policy" and call["p"] == ["node-c", "node-d"]
    assert a.stats.roll_calls == 1 and a.next_deadline() == pytest.approx(13.0)  # backs off
    c, gc = core("node-c")
    c.on_events([announce("node-a", 1, SMALL)], 10.5)
    c.on_fetch_reply(ann.version, SMALL.encode(), 10.6)
    c.on_realised(ann.version, True, "", 10.7)
    assert len(mine(gc)) == 1
    c.on_events([AppMessage("node-a", "policy", ga.sent[-1].seq, ga.sent[-1].payload)], 11.1)
    assert len(mine(gc)) == 2  # named: it says it again
    for n in ("node-c", "node-d"):
        a.on_events([report(n, ann.version, SMALL)], 12.0)
    a.tick(13.0)  # nobody pending: no roll call, and none later
    a.tick(15.0)  # the state refresh
    assert a.stats.roll_calls == 1 and a.next_deadline() == float("inf")


def test_a_member_back_alive_hears_the_desired_version_from_its_origin() -> None:
    a, ga = synced("node-a")
    a.propose(SMALL, 1.0)
    n = len(ga.sent)
    a.on_events([MemberChanged("node-b", "node-b:1", State.ALIVE, 2, State.DEAD)], 5.0)
    a.on_events([MemberChanged("node-c", "node-c:1", State.ALIVE, 2, State.SUSPECT)], 6.0)
    assert [m.key for m in ga.sent[n:]] == ["policy"]  # at most once per reannounce_gap_s


# --------------------------------------------------------------------------
# Peer input: bounded, checked, dropped and counted; never raises
# --------------------------------------------------------------------------
GOOD = json.loads(announce("node-b", 5).payload)
HOSTILE: list[tuple[AppMessage, str]] = [
    (AppMessage("node-b", "policy", 2, b"\xff\xfe not json"), "malformed"),
    (AppMessage("node-b", "policy", 3, b"[1, 2]"), "malformed"),
    (AppMessage("node-b", "policy", 4, json.dumps({**GOOD, "v": 2}).encode()), "malformed"),
    (AppMessage("node-b", "policy", 5, json.dumps({**GOOD, "c": 0}).encode()), "malformed"),
    (AppMessage("node-b", "policy", 6, json.dumps({**GOOD, "c": True}).encode()), "malformed"),
    (AppMessage("node-b", "policy", 7, json.dumps({**GOOD, "c": 2**53}).encode()), "malformed"),
    (AppMessage("node-b", "policy", 8, json.dumps({**GOOD, "h": "AB" * 32}).encode()),
     "malformed"),
    (AppMessage("node-b", "policy", 9, json.dumps({**GOOD, "n": 2**21}).encode()), "malformed"),
    (AppMessage("node-b", "policy", 10, json.dumps({**GOOD, "t": float("nan")}).encode()),
     "malformed"),
    (AppMessage("node-b", "policy", 11, json.dumps({**GOOD, "p": "node-a"}).encode()),
     "malformed"),
    (AppMessage("node-b", "policy", 12, b"{" + b" " * 2000 + b"}"), "oversize"),
    (AppMessage("node-c", "policy", 13, announce("node-b", 6).payload), "impersonation"),
    (AppMessage("node-c", "ack/node-b", 14, report("node-b", MeshVersion(5, "node-b"),
                                                   POLICY).payload), "impersonation"),
    (AppMessage("node-c", "ack/node-c", 15, b'{"v":1,"c":1,"o":"x","h":"00","ok":1,"t":1}'),
     "malformed"),
    (AppMessage("node-c", "ack/node-c", 16, b'{"v":1,"c":1,"o":"","h":"0011223344556677",'
                                            b'"ok":1,"t":1}'), "malformed"),
]


def test_hostile_or_malformed_announcements_and_reports_are_dropped_and_counted() -> None:
    r, g = core("node-a")
    r.on_events([announce("node-b", 5)], 1.0)
    desired = r.desired
    for msg, _ in HOSTILE:
        assert r.on_events([msg], 2.0) == []
    assert r.desired == desired and r.reports() == {} and g.sent == []
    want: dict[str, int] = {}
    for _, reason in HOSTILE:
        want[reason] = want.get(reason, 0) + 1
    assert r.stats.dropped == want and r.highest_counter == 5
    bad_states = [b"nope", b'{"v":1,"x":"text without a version"}', b'{"v":1,"r":[["n"]]}',
                  b'{"v":1,"r":{}}', json.dumps({"v": 1, "d": GOOD, "x": "not its text"}).encode()]
    for data in bad_states:
        r.on_events([AppStateReceived("node-c", data, False)], 3.0)
    assert r.stats.dropped["malformed"] == want["malformed"] + 4
    assert r.stats.dropped["sha_mismatch"] == 1 and r.text_for(MeshVersion(5, "node-b")) is None
    assert r.on_peer_report("node-c", b"x\n{}", 4.0) == [] and r.stats.dropped["malformed"] > 12


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["policy", "ack/node-c", "sla/x"]), st.binary(max_size=600),
       st.binary(max_size=600))
def test_no_bytes_make_the_core_raise(key: str, payload: bytes, state: bytes) -> None:
    r, _ = core("node-a")
    r.on_events([AppMessage("node-c", key, 1, payload), AppStateReceived("node-c", state, True),
                 AppMessage("node-c", "ack/node-c", 2, b'{"v":1,' + payload + b"}")], 1.0)
    r.on_peer_report("node-c", payload, 1.0)
    r.on_fetch_reply(MeshVersion(1, "node-c"), payload, 1.0)
    r.tick(10.0)
    assert r.desired is None or r.desired.version.origin == "node-c"


def test_payload_sizes_fit_a_packet_and_a_long_reason_is_cut() -> None:
    ann = Announcement(MeshVersion(2**40, "node-" + "x" * 60), "f" * 64, 2**20, "a" * 64, 1e9)
    assert len(encode_announcement(ann)) < 300
    r = Report("n" * 60, 1, ann.version, "0" * 16, True, "", ann.version, 1.7e9)
    assert len(encode_report(r)) < 160
    plain = Report("node-1", 1, MeshVersion(12, "node-a"), "0" * 16, True, "",
                   MeshVersion(12, "node-a"), 1.7e9)
    assert len(encode_report(plain)) <= 80  # what every member gossips, N times each
    c, g = core("node-a")
    c.on_events([announce("node-b", 1)], 1.0)
    c.on_fetch_reply(MeshVersion(1, "node-b"), POLICY.encode(), 1.0)
    c.on_realised(MeshVersion(1, "node-b"), False, "\u00e9\"\n" * 5000, 1.0)
    assert 0 < len(str(mine(g)[0]["r"]).encode()) <= RolloutConfig().max_reason_bytes


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------
def _members(**states: State) -> list[MemberInfo]:
    return [MemberInfo(n.replace("_", "-"), "", s, 0, 0.0, None, None) for n, s in states.items()]


def test_table_states_follow_each_members_latest_report() -> None:
    v1, v2, v3 = MeshVersion(1, "a"), MeshVersion(2, "a"), MeshVersion(3, "b")
    d = Announcement(v2, sha(SMALL))
    rep = {"acked": Report("acked", 1, v2, sha(SMALL)[:16], True, "", v2, 1.0),
           "nacked": Report("nacked", 1, v2, sha(SMALL)[:16], False, "too small", v1, 1.0),
           "old": Report("old", 1, v1, "0" * 16, True, "", v1, 1.0),
           "ahead": Report("ahead", 1, v3, "0" * 16, True, "", v3, 1.0),
           "dead": Report("dead", 1, v2, sha(SMALL)[:16], True, "", v2, 1.0)}
    members = _members(acked=State.ALIVE, nacked=State.SUSPECT, old=State.ALIVE,
                       ahead=State.ALIVE, dead=State.DEAD, silent=State.ALIVE, left=State.LEFT)
    t = build_table("acked", members, rep, d)
    assert {r.node: r.state for r in t.rows} == {
        "acked": "acked", "nacked": "nacked", "old": "pending", "ahead": "superseded",
        "dead": "gone", "silent": "pending", "left": "gone"}
    assert t.live == 5 and not t.complete and t.superseded_by is None
    row = {r.node: r for r in t.rows}["nacked"]
    assert (row.reason, row.applied, row.member) == ("too small", v1, "SUSPECT")
    lost = build_table("acked", members, rep, d, v1)  # v1 lost to v2: nothing stays pending
    assert lost.superseded_by == v2 and lost.complete
    assert {r.node: r.state for r in lost.rows}["old"] == "acked"
    assert {r.node: r.state for r in lost.rows}["silent"] == "superseded"
    body = t.as_dict()
    assert body["counts"] == {"pending": 2, "acked": 1, "nacked": 1, "superseded": 1, "gone": 2}
    assert (body["version"], body["sha256"], body["rows"][0]["node"]) == ("2@a", sha(SMALL),
                                                                        "acked")
    assert build_table("x", members, rep, None).as_dict()["version"] is None


# --------------------------------------------------------------------------
# One policy, each node's link
# --------------------------------------------------------------------------
def test_a_node_applies_the_mesh_policy_on_its_own_link() -> None:
    pol = localise_policy(POLICY, LinkOverride(device="ens5", rate=10_000_000_000))
    assert (pol.link.device, int(pol.link.rate)) == ("ens5", 10_000_000_000)
    assert pol.classes == parse_policy(POLICY).classes  # classes are mesh-wide
    assert localise_policy(POLICY, None) == parse_policy(POLICY)
    assert localise_policy(POLICY, LinkOverride()) == parse_policy(POLICY)
    only_dev = localise_policy(POLICY, LinkOverride(device="eth7"))
    assert (only_dev.link.device, only_dev.link.rate) == ("eth7", parse_policy(POLICY).link.rate)
    ceiled = POLICY.replace("rate: 150mbit", "rate: 150mbit\n    ceil: 800mbit")
    small = localise_policy(ceiled, LinkOverride(rate=300_000_000))
    assert int(small.class_named("video").ceil or 0) == 300_000_000  # a cap above the link
    if "adapt" in TrafficClass.model_fields:  # the controller's ranges (docs/controller.md)
        ranged = ("apiVersion: mmmesh/v1\nlink: {device: eth0, rate: 1gbit}\nclasses:\n"
                  "  - {name: voice, id: 11, rate: 1.2mbit, ceil: 800mbit,\n"
                  "     adapt: {ceil: [500mbit, 1gbit]}}\n"
                  "  - {name: best-effort, id: 14, rate: 20mbit}\ndefault_class: best-effort\n")
        voice = localise_policy(ranged, LinkOverride(rate=300_000_000)).class_named("voice")
        assert voice.ceil == 300_000_000
        assert [int(r) for r in voice.adapt.ceil] == [300_000_000] * 2  # type: ignore[union-attr]
    with pytest.raises(PolicyError, match="exceeds the link rate 200mbit"):
        localise_policy(POLICY, SLOW_LINK)  # the guarantees (253.2 Mbit/s) do not fit
    assert str(SLOW_LINK) == "eth1 at 200mbit"


def test_the_provider_canonicalises_and_answers_tables() -> None:
    from qosd.mesh.rollout.core import parse_base
    from qosd.mesh.rollout.provider import RolloutProvider, locked

    r, g = synced("node-a")
    dispatched: list[object] = []
    import threading

    p = RolloutProvider(r, locked(threading.Lock()), dispatched.extend, clock=lambda: 5.0)
    assert p.table() is None
    t = p.propose(POLICY, None, "alice")
    canonical = parse_policy(POLICY).to_yaml()
    assert t["version"] == "1@node-a" and t["sha256"] == sha(canonical)
    assert t["counts"]["pending"] == 4 and t["author"] == "alice"
    assert dispatched == [Realise(MeshVersion(1, "node-a"), canonical, sha(canonical))]
    assert p.table("1@node-a") == p.table() and p.stats()["proposals"] == 1
    with pytest.raises(RolloutConflict):
        p.propose(SMALL, "0")
    with pytest.raises(PolicyError):
        p.propose("classes: []", None)
    assert parse_base(None) is None and parse_base("0") == NO_VERSION
    with pytest.raises(ClusterError):
        parse_base("twelve")
    assert g.sent[0].key == "policy"
