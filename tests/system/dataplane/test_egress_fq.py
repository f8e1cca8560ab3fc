"""Egress mode fq on this host: everything BPF, through BPF_PROG_TEST_RUN
(this kernel has no sch_fq: the qdisc side runs in a VM,
tests/system/dataplane/test_egress_vm.py).

* the classifier's whole packet table (testkit/classifier_cases.py) gives
  the same verdicts in egress mode fq, and each frame the band of its class:
  skb->priority = FQ_PRIO_BASE + band (ingress: none);
* a paced class's frames get departure times (skb->tstamp) spaced by their
  length at the class's ceil, from one clock per class; past the horizon a
  frame does not move the clock and is stamped for sch_fq to drop; a
  departure time the sender set (TCP's own EDT) is kept when later;
* anti-escalation: a clamped frame gets its max_class's band and pacer,
  never the one it claimed; traffic the mesh cannot read gets the default
  class's band and pacer, never another's;
* overrides: a boost's priority is its band, its weight its share of the
  class's ceil (its own clock); a boost that would change nothing is refused,
  naming the override (the boost's own anti-escalation check is the same as
  htb's: tests/mmmesh/policy/test_egress.py);
* egress mode htb never touches skb->tstamp.

Timing: every expectation about a departure time is derived from the
CLOCK_MONOTONIC readings taken just before and after each run (the BPF
program's clock), so none depends on how fast this host runs a test."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mmmesh import abi as _abi
from mmmesh.policy import Policy, parse_policy
from mmmesh.policy.egress import fq_band
from testkit.classifier_cases import BATCH, EXAMPLE, ROWS, SRC, M, hdr, tcp, udp
from testkit.overrides import with_adapt
from testkit.privileged import require_privileged, veth_pair

pytestmark = pytest.mark.privileged


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # bpf_ktime_get_ns()'s clock


def paced_policy(**ceils: str) -> Policy:
    """The example with ``ceils`` ({class: ceil}); a class's rate is lowered
    to fit under its ceil."""
    data = EXAMPLE.model_dump(mode="json", by_alias=True, exclude_none=True)
    for c in data["classes"]:
        if c["name"] in ceils:
            c["ceil"] = ceils[c["name"]]
            c["rate"] = "8kbit"
            c.pop("adapt", None)
    return parse_policy(data)


@pytest.fixture(scope="module")
def fq_clf() -> Iterator[Any]:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    c = Classifier(EXAMPLE, egress="fq")
    yield c
    c.close()


def test_the_packet_table_gives_the_same_verdicts_and_each_class_its_band(fq_clf: Any) -> None:
    failures = []
    for row in ROWS:
        v = fq_clf.run(row.frame, row.direction)
        got = (v.verdict, v.reason, v.class_, v.modality, v.clamped)
        want = ("pass", row.reason, row.cls, row.modality, row.clamped)
        if got != want:
            failures.append(f"{row.desc}: got {got}, want {want}")
        if row.direction == "egress":
            band = fq_band(EXAMPLE.class_named(row.cls).priority)
            assert (v.priority, v.band) == (_abi.FQ_PRIO_BASE + band, band), row.desc
            assert v.classid is None, row.desc
        else:
            assert v.priority == 0, f"{row.desc}: ingress must not set skb->priority"
        assert (v.tstamp, v.paced) == (0, False), row.desc  # the example paces no class
    assert not failures, "\n".join(failures)


def test_bands_follow_priority_and_unread_traffic_is_best_effort(fq_clf: Any) -> None:
    bands = {c.name: fq_band(c.priority) for c in EXAMPLE.classes}
    assert bands == {"control": 0, "voice": 0, "video": 1, "lidar": 1, "best-effort": 2}
    for frame in (udp(b"not a mesh frame"), udp(b"MMH\x09" + bytes(20)), tcp(b"x" * 50, 49000)):
        v = fq_clf.run(frame)
        assert (v.class_, v.band) == ("best-effort", 2), v.reason
    # a capped sender that claims voice (band 0) gets video's band (1)
    v = fq_clf.run(udp(hdr(M.AUDIO), src=BATCH))
    assert (v.class_, v.clamped, v.band) == ("video", True, 1)


def pacer(clf: Any, class_id: int, level: int = 0) -> int:
    st = clf.maps.pace.lookup(_abi.pace_slot(class_id, level))
    return int(st.next_ns) if st is not None else 0


def set_pacer(clf: Any, class_id: int, next_ns: int, level: int = 0) -> None:
    clf.maps.pace.update(_abi.pace_slot(class_id, level), _abi.PaceState(next_ns=next_ns))


def run_timed(clf: Any, frame: bytes, **kw: Any) -> tuple[Any, int, int]:
    before = now_ns()
    v = clf.run(frame, **kw)
    return v, before, now_ns()


def check_slot(v: Any, clock_before: int, t0: int, t1: int, clock_after: int, delay: int,
               horizon_ns: int) -> None:
    """The pacer's rule, for a run whose BPF clock read ``now`` in [t0, t1]:
    start = max(now, clock); past the horizon the frame is stamped now +
    PACE_DROP_NS and the clock stays; else the clock moves by the frame's
    delay and a start later than now is the frame's departure time."""
    assert v.paced
    if v.over_horizon:
        assert clock_before - t0 > horizon_ns, "over the horizon only when the clock is"
        assert clock_after == clock_before, "an over-horizon frame does not take a slot"
        assert t0 + _abi.PACE_DROP_NS <= v.tstamp <= t1 + _abi.PACE_DROP_NS
        return
    assert clock_before - t1 <= horizon_ns, "a frame within the horizon is never refused"
    start = clock_after - delay
    assert max(clock_before, t0) <= start <= max(clock_before, t1), (start, clock_before)
    if v.tstamp:
        assert v.tstamp == start > t0
    else:
        assert start <= t1  # it goes now


def test_a_paced_class_spaces_its_frames_at_its_ceil() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(video="1mbit")
    video = pol.class_named("video")
    with Classifier(pol, egress="fq") as c:
        info = c.maps.classes.lookup(video.id)
        assert (int(info.pace_Bps), int(info.horizon_us)) == (125_000, 1_000_000)
        frame = udp(hdr(M.VIDEO, payload_len=1000) + bytes(1000))
        delay = len(frame) * 10**9 // 125_000
        # a clock far enough ahead that every frame waits (however slow this host is,
        # the rule is checked against the clock readings around each run)
        set_pacer(c, video.id, now_ns() + 100_000_000)
        starts = []
        for _ in range(5):
            before = pacer(c, video.id)
            v, t0, t1 = run_timed(c, frame)
            check_slot(v, before, t0, t1, pacer(c, video.id), delay, 1_000_000_000)
            starts.append(pacer(c, video.id) - delay)
        assert all(b - a >= delay for a, b in itertools.pairwise(starts))
        # other classes keep their own clocks (unpaced here): untouched
        v = c.run(udp(hdr(M.AUDIO)))
        assert (v.class_, v.paced, v.tstamp) == ("voice", False, 0)
        assert pacer(c, pol.class_named("voice").id) == 0


def test_an_idle_pacer_restarts_at_now_without_burst_credit() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(video="1mbit")
    vid = pol.class_named("video").id
    with Classifier(pol, egress="fq") as c:
        frame = udp(hdr(M.VIDEO))
        delay = len(frame) * 10**9 // 125_000
        set_pacer(c, vid, 1)  # an old clock: the class was idle
        before = pacer(c, vid)
        v, t0, t1 = run_timed(c, frame)
        check_slot(v, before, t0, t1, pacer(c, vid), delay, 10**9)
        assert t0 + delay <= pacer(c, vid) <= t1 + delay  # from now, not from the old clock


def test_past_the_horizon_a_frame_is_left_for_the_qdisc_to_drop() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(video="1mbit")
    vid = pol.class_named("video").id
    with Classifier(pol, egress="fq") as c:
        frame = udp(hdr(M.VIDEO))
        ahead = now_ns() + 10**9 + 10 * 10**9  # 10 s past its 1 s horizon
        set_pacer(c, vid, ahead)
        v, t0, t1 = run_timed(c, frame)
        check_slot(v, ahead, t0, t1, pacer(c, vid), 0, 10**9)
        assert v.over_horizon and v.verdict == "pass"  # the classifier never drops
        st = c.maps.pace.lookup(_abi.pace_slot(vid))
        assert int(st.over_horizon) == 1
        assert _abi.PACE_DROP_NS > _abi.FQ_HORIZON_US * 1000 > _abi.PACE_MAX_HORIZON_US * 1000


def test_a_senders_own_later_departure_time_is_kept() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(lidar="2mbit")
    lid = pol.class_named("lidar").id
    with Classifier(pol, egress="fq") as c:
        first = tcp(hdr(M.POINT_CLOUD, payload_len=100) + bytes(100), sport=45500)
        c.run(first)  # learns the flow
        later = now_ns() + 500_000_000  # TCP's EDT stamp, far beyond the class's slot
        set_pacer(c, lid, 1)
        v, t0, t1 = run_timed(c, tcp(bytes(1000), sport=45500), tstamp=later)
        assert v.reason == "flow_hit" and v.paced
        assert v.tstamp == later  # kept: later than the class's slot (now)
        delay = len(tcp(bytes(1000), sport=45500)) * 10**9 // 250_000
        assert t0 + delay <= pacer(c, lid) <= t1 + delay  # the class's clock counts bytes only


def test_clamped_and_unread_frames_never_take_a_better_band_or_pacer() -> None:
    """A capped sender claiming voice is paced by video (its max_class), not by
    voice; unread traffic by the default class only."""
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(voice="100kbit", video="1mbit", **{"best-effort": "500kbit"})
    ids = {c.name: c.id for c in pol.classes}
    with Classifier(pol, egress="fq") as c:
        v = c.run(udp(hdr(M.AUDIO), src=BATCH))
        assert (v.class_, v.clamped, v.band, v.paced) == ("video", True, 1, True)
        assert pacer(c, ids["video"]) > 0 and pacer(c, ids["voice"]) == 0
        for frame in (udp(b"unreadable" * 10), udp(b"MMH\x01\x05"), tcp(b"z" * 300, 46500)):
            v = c.run(frame)
            assert (v.class_, v.band, v.paced) == ("best-effort", 2, True), v.reason
        assert pacer(c, ids["best-effort"]) > 0 and pacer(c, ids["voice"]) == 0
        assert pacer(c, ids["control"]) == 0


def boost_policy() -> Policy:
    """The example, video paced at 4 Mbit/s with weight and priority ranges."""
    pol = paced_policy(video="4mbit")
    return with_adapt(pol, {"video": {"weight": [7, 20], "priority": [1, 2]},
                            "voice": {"priority": [1, 3]}})


def test_a_boost_takes_its_band_and_its_share_of_the_ceil() -> None:
    require_privileged()
    from mmmesh.dataplane import Boost, Overrides, StageOverride
    from mmmesh.dataplane.classify import Classifier

    pol = boost_policy()
    vid = pol.class_named("video").id
    ovr = Overrides(stages=(StageOverride("video", f"{SRC}/32", Boost(weight=14, priority=1)),))
    with Classifier(pol, egress="fq", overrides=ovr) as c:
        (entry,) = c.overrides()
        boost = c.maps.boosts.lookup(_abi.boost_slot(vid, entry.level))
        own = c.maps.classes.lookup(vid)
        # video weight 7 + boost 14: the boost paces 2/3 of the 4 Mbit/s ceil
        assert int(boost.pace_Bps) == 500_000 * 14 // 21
        assert int(own.pace_Bps) == 500_000 - 500_000 * 14 // 21
        assert int(boost.classid) == _abi.FQ_PRIO_BASE + fq_band(1)
        v = c.run(udp(hdr(M.VIDEO)))  # from SRC: boosted
        assert (v.boosted, v.band, v.paced) == (True, 0, True)
        assert pacer(c, vid, entry.level) > 0 and pacer(c, vid) == 0  # its own clock
        v = c.run(udp(hdr(M.VIDEO), src="10.0.7.7"))  # another sender of video: the class's
        assert (v.boosted, v.band) == (False, 1) and pacer(c, vid) > 0
        # a capped sender's video is not boosted (the stage's prefix is SRC's)
        assert not c.run(udp(hdr(M.VIDEO), src=BATCH)).boosted


def test_a_boost_that_changes_nothing_in_fq_is_refused_naming_it() -> None:
    """voice has no ceil (no pacer to split) and a weight-only boost keeps its
    band: refused, the override named; with another band it is accepted."""
    require_privileged()
    from mmmesh.dataplane import Boost, Overrides, StageOverride
    from mmmesh.dataplane.classify import Classifier
    from mmmesh.errors import DataplaneError

    pol = boost_policy()
    with Classifier(pol, egress="fq") as c:
        with pytest.raises(DataplaneError, match=r"stages\[0\]: egress mode fq: .*voice.*"
                                                 r"split nothing"):
            c.set_overrides(Overrides(stages=(
                StageOverride("voice", "10.0.1.0/24", Boost(weight=8)),)))
        c.set_overrides(Overrides(stages=(
            StageOverride("voice", "10.0.1.0/24", Boost(priority=3)),)))  # band 1: a change
        assert c.run(udp(hdr(M.AUDIO))).band == 1
    # in htb the same weight-only boost is a boost leaf as before
    with Classifier(pol) as c:
        c.set_overrides(Overrides(stages=(StageOverride("voice", "10.0.1.0/24",
                                                        Boost(weight=8)),)))
        assert c.run(udp(hdr(M.AUDIO))).boosted


def test_htb_mode_never_stamps_a_departure_time() -> None:
    require_privileged()
    from mmmesh.dataplane.classify import Classifier

    pol = paced_policy(video="1mbit")
    with Classifier(pol) as c:
        assert not c.maps.config.lookup(0).flags & _abi.CFG_PACING
        for _ in range(3):
            v = c.run(udp(hdr(M.VIDEO, payload_len=1000) + bytes(1000)))
            assert (v.priority, v.tstamp, v.paced, v.band) == (0x1000C, 0, False, None)
        assert "band" not in v.as_json() and "tstamp" not in v.as_json()


# --------------------------------------------------------------------------
# The device side on this host: no sch_fq here (the VM has it)
# --------------------------------------------------------------------------
@pytest.fixture()
def veth() -> Iterator[tuple[str, str]]:
    require_privileged()
    with veth_pair(f"mmq{os.getpid()}", "10.81.0") as pair:
        yield pair


def test_auto_is_htb_on_one_queue_and_fq_needs_the_kernels_bands(veth: tuple[str, str]) -> None:
    from mmmesh.dataplane import Dataplane
    from mmmesh.dataplane._netlink import probe_fq_bands
    from mmmesh.errors import DataplaneError

    ns, _ = veth
    data = EXAMPLE.model_dump(mode="json", by_alias=True)
    data["link"] = {"device": "a0", "rate": "500mbit"}
    pol = parse_policy(data)
    assert Dataplane("a0", ns, egress="auto").egress_mode() == "htb"  # a veth: one TX queue
    if not probe_fq_bands():  # (a kernel with bands: test_egress_vm.py's checks hold here)
        with pytest.raises(DataplaneError, match="needs sch_fq with priority bands"):
            Dataplane("a0", ns, egress="fq").up(pol)
        assert not Dataplane("a0", ns).loaded()  # refused before anything was pinned
    r = Dataplane("a0", ns, egress="auto").up(pol)
    assert not r.adopted and Dataplane("a0", ns).status(pol).egress == "htb"
