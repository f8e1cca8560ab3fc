"""qosd's SLA board: windows per sender (never another's), quotas and rates,
canonical sketches, bounded numbers, and reads that no row can break."""

from __future__ import annotations

import base64
import math
import tracemalloc
from typing import Any

import pytest
from ddsketch import DDSketch

from mmmesh.sla.report import SlaClassReport, SlaReport, SlaView
from mmmesh.sla.sketch import Sketch, encode_sketch, parse_sketch
from qosd.identity import ADMIN, Peer, ReportRefused, Sender, sender_of_cgroup
from qosd.sla.board import ROW_OVERHEAD, SlaBoard
from qosd.sla.quota import SlaLimits
from qosd.sla.reporters import DEFAULT_REPORTERS, ReporterRule
from testkit.sla_sender import padded

SIDECAR = sender_of_cgroup(Peer(100, 998, 998),
                           "/system.slice/system-mmmesh\\x2dsidecar.slice/"
                           "mmmesh-sidecar@asr.service")
OTHER_SIDECAR = sender_of_cgroup(Peer(101, 998, 998), "/system.slice/mmmesh-sidecar@tts.service")
# what the tests' rule lets a local user report (by default it may report nothing)
LOCAL = [*DEFAULT_REPORTERS, ReporterRule(uid=[1000, 1001], stages=["batch-*", "asr"])]


def proc(uid: int = 1000, cgroup: str = "/user.slice/user-1000.slice/session-1.scope",
         pid: int = 200) -> Sender:
    return sender_of_cgroup(Peer(pid, uid, uid), cgroup)


def raw(stage: str, instance: str | None, frames: int, cls: str = "voice",
        attainment: float | None = None, sketch: str | None = None) -> dict[str, Any]:
    return {"node": None, "stage": stage, "instance": instance, "reports": [
        {"sla_class": cls, "modality": "audio", "window_s": 5.0, "frames": frames,
         "deadline_misses": frames // 10, "drops": 0, "errors": 0,
         "attainment": (0.9 if frames else 1.0) if attainment is None else attainment,
         "e2e_ms": None, "sketch_e2e": sketch}]}


def body(stage: str, instance: str | None, frames: int, cls: str = "voice", **kw: Any
         ) -> SlaReport:
    return SlaReport.model_validate(raw(stage, instance, frames, cls, **kw))


def unchecked(d: dict[str, Any]) -> SlaReport:
    """A report as a model without validation (what the API would refuse)."""
    return SlaReport.model_construct(**{**d, "reports": [
        SlaClassReport.model_construct(**r) for r in d["reports"]]})


def sketch_b64(*values: float, accuracy: float = 0.01) -> str:
    sk = DDSketch(accuracy)
    for v in values:
        sk.add(v)
    enc = encode_sketch(sk)
    assert enc is not None
    return enc


def refused(fn: Any, *args: Any, **kw: Any) -> ReportRefused:
    with pytest.raises(ReportRefused) as exc:
        fn(*args, **kw)
    return exc.value


# --------------------------------------------------------------------------
# Windows, replicas, expiry
# --------------------------------------------------------------------------
def test_replicas_are_kept_apart_and_merged() -> None:
    b = SlaBoard()
    b.report(body("asr", "asr-1", 100), now=10.0)
    b.report(body("asr", "asr-2", 300), now=11.0)
    b.report(body("asr", "asr-1", 200), now=12.0)  # asr-1's newer window replaces its old one
    b.report(body("asr", None, 50), now=12.0)  # a sidecar that names no instance
    v = b.view(now=13.0)
    assert [(r["instance"], r["frames"]) for r in v["instances"]] == [
        (None, 50), ("asr-1", 200), ("asr-2", 300)]
    assert {r["sender"] for r in v["instances"]} == {"admin"} and v["skipped"] == 0
    (stage,) = v["stages"]
    assert stage["sources"] == 3 and stage["frames"] == 550
    assert stage["deadline_misses"] == 20 + 30 + 5 and stage["received_at"] == 12.0
    assert abs(stage["attainment"] - 0.9) < 1e-9


def test_old_windows_expire() -> None:
    b = SlaBoard(SlaLimits(keep_s=60))
    b.report(body("asr", "a", 10), now=0.0)
    b.report(body("tts", "b", 10), now=50.0)
    assert [r["stage"] for r in b.instances(now=61.0)] == ["tts"]
    assert b.view(now=200.0) == {"instances": [], "stages": [], "classes": [], "skipped": 0}
    assert b.stats()["rows"] == 0 and b.stats()["expired"] == 2


def test_a_sidecar_that_stopped_reporting_is_listed_but_not_merged() -> None:
    b = SlaBoard()
    b.report(body("asr", "asr-old", 100), now=0.0)
    b.report(body("asr", "asr-new", 50), now=100.0)
    v = b.view(now=101.0)
    assert [(r["instance"], r["stale"]) for r in v["instances"]] == [
        ("asr-new", False), ("asr-old", True)]
    (stage,) = v["stages"]
    assert stage["sources"] == 1 and stage["frames"] == 50


def test_a_sender_is_its_identity_and_cannot_touch_another_senders_window() -> None:
    """The body's instance is a label: a non-root sender has one window per
    series whatever it calls itself, and a report naming another sender's
    stage and instance lands in the reporter's own row."""
    b = SlaBoard(reporters=[*LOCAL, ReporterRule(uid=1000, stages=["*"])])
    b.report(body("asr", "asr-7d9f/1", 100, attainment=1.0), SIDECAR, now=1.0)
    b.report(body("asr", "other", 30, attainment=0.5), SIDECAR, now=2.0)  # relabelled: replaces
    evil = proc()
    for label in ("asr-7d9f/1", "other", None):
        b.report(body("asr", label, 10**6, attainment=0.0), evil, now=3.0)
    rows = b.instances(now=4.0)
    assert sorted((r["instance"], r["label"], r["frames"]) for r in rows) == [
        (evil.key, None, 10**6), (SIDECAR.key, "other", 30)]
    assert SIDECAR.key == "unit:mmmesh-sidecar@asr.service"
    assert evil.key == "uid:1000:/user.slice/user-1000.slice/session-1.scope"


def test_stages_are_authorized_per_sender() -> None:
    b = SlaBoard()
    b.report(body("asr", None, 1), SIDECAR, now=1.0)
    e = refused(b.report, body("tts", None, 1), SIDECAR, now=1.0)  # another unit's stage
    assert (e.status, e.code) == (403, "stage_not_allowed") and "'tts'" in str(e)
    e = refused(b.report, body("asr", None, 1), proc(), now=1.0)  # no rule for a local user
    assert (e.status, e.code) == (403, "not_allowed") and "uid 1000" in str(e)
    assert refused(b.admit, proc()).status == 403
    b.admit(OTHER_SIDECAR)
    assert [r["stage"] for r in b.instances(now=2.0)] == ["asr"]
    assert b.stats()["refused:not_allowed"] == 2


# --------------------------------------------------------------------------
# Quotas and rates
# --------------------------------------------------------------------------
def series(b: SlaBoard, s: Sender, n: int, t0: float = 0.0, stage: str = "batch-a",
           step: float = 1.0) -> None:
    for i in range(n):
        b.report(body(stage, None, 10, cls=f"c{i}"), s, now=t0 + i * step)


def test_a_sender_over_its_rows_evicts_only_its_own_oldest() -> None:
    b = SlaBoard(SlaLimits(sender_rows=3), reporters=LOCAL)
    b.report(body("asr", None, 500, attainment=1.0), SIDECAR, now=0.0)
    series(b, proc(), 5)
    rows = b.instances(now=10.0)
    assert [r["sla_class"] for r in rows if r["sender"] != SIDECAR.key] == ["c2", "c3", "c4"]
    assert [r["frames"] for r in rows if r["sender"] == SIDECAR.key] == [500]
    assert b.stats()["evicted_own"] == 2
    # a report larger than the quota on its own is refused whole: nothing changes
    big = SlaReport.model_validate({**raw("batch-b", None, 1), "reports": [
        {**raw("batch-b", None, 1)["reports"][0], "sla_class": f"x{i}"} for i in range(4)]})
    before = b.instances(now=10.0)
    e = refused(b.report, big, proc(), now=10.0)
    assert (e.status, e.code) == (429, "sender_quota") and "3 windows" in str(e)
    assert b.instances(now=10.0) == before


def test_bytes_are_a_quota_too() -> None:
    sk = sketch_b64(*[float(v) for v in range(1, 1000)])  # ~700 bins
    limits = SlaLimits(sender_bytes=3 * (ROW_OVERHEAD + 6000) + 500)
    b = SlaBoard(limits, reporters=LOCAL)
    for i in range(5):
        b.report(body("batch-a", None, 999, cls=f"c{i}", sketch=sk), proc(), now=float(i))
    kept = b.instances(now=9.0)
    assert 1 <= len(kept) < 5 and kept[-1]["sla_class"] == "c4"
    assert b.stats()["bytes"] <= limits.sender_bytes


def test_rate_is_a_token_bucket_per_sender() -> None:
    b = SlaBoard(SlaLimits(sender_rate=1.0, sender_burst=3), reporters=LOCAL)
    for _ in range(3):
        b.report(body("batch-a", None, 1), proc(), now=100.0)
    e = refused(b.report, body("batch-a", None, 1), proc(), now=100.0)
    assert (e.status, e.code, e.retry_after) == (429, "rate_limited", 1.0)
    b.report(body("batch-a", None, 1), proc(), now=101.0)  # one token back per second
    b.report(body("asr", None, 1), SIDECAR, now=100.0)  # another sender has its own bucket
    for _ in range(50):
        b.report(body("asr", None, 1), ADMIN, now=100.0)  # the admin socket has none


def test_a_user_with_many_cgroups_shares_one_cap() -> None:
    limits = SlaLimits(sender_rows=4, uid_rows=6, uid_rate=1000, uid_burst=1000)
    b = SlaBoard(limits, reporters=LOCAL)
    series(b, proc(1001), 2)  # another user's windows
    for g in range(3):
        cg = f"/user.slice/user-1000.slice/user@1000.service/app.slice/x{g}.scope"
        assert proc(cgroup=cg).key.endswith(f"x{g}.scope")  # not the user manager unit
        try:
            series(b, proc(cgroup=cg), 3, t0=10.0 * g)
        except ReportRefused as e:
            assert (g, e.code) == (2, "uid_quota")
    rows = b.instances(now=30.0)
    assert sum(r["sender"].startswith("uid:1000:") for r in rows) == 6
    assert sum(r["sender"].startswith("uid:1001:") for r in rows) == 2


def test_a_full_board_refuses_newcomers_and_evicts_nobody_else() -> None:
    b = SlaBoard(SlaLimits(board_rows=4, sender_rows=3), reporters=LOCAL)
    b.report(body("asr", None, 100), SIDECAR, now=0.0)
    series(b, proc(1000), 3)
    e = refused(b.report, body("batch-z", None, 1), proc(1001), now=5.0)
    assert (e.status, e.code) == (429, "board_full")
    series(b, proc(1000), 1, t0=6.0, stage="batch-q")  # its own oldest makes room
    senders = [r["sender"] for r in b.instances(now=7.0)]
    assert senders.count(SIDECAR.key) == 1 and len(senders) == 4


def test_a_flood_leaves_the_real_window_and_the_class_view_intact() -> None:
    """10,000 reports under invented names and stages, as fast as they come:
    the sidecar's window and the node-wide voice view keep their numbers."""
    b = SlaBoard(reporters=LOCAL)
    b.report(body("asr", "asr-0", 500, attainment=0.98), SIDECAR, now=0.0)
    codes: dict[str, int] = {}
    for i in range(10_000):
        evil = body(f"batch-{i}", f"invented-{i}", 10**9, cls="bulk", attainment=0.0)
        try:
            b.report(evil, proc(), now=i * 0.001)
            codes["ok"] = codes.get("ok", 0) + 1
        except ReportRefused as e:
            codes[e.code] = codes.get(e.code, 0) + 1
    v = b.view(now=10.0)
    (real,) = [r for r in v["instances"] if r["sender"] == SIDECAR.key]
    assert (real["frames"], real["attainment"]) == (500, 0.98)
    (voice,) = [c for c in v["classes"] if c["sla_class"] == "voice"]
    assert (voice["frames"], voice["attainment"], voice["sources"]) == (500, 0.98, 1)
    assert len(v["instances"]) <= 1 + SlaLimits().sender_rows
    assert codes["ok"] <= SlaLimits().sender_burst + 10 * SlaLimits().sender_rate + 1
    assert codes["rate_limited"] > 9_000


# --------------------------------------------------------------------------
# Canonical sketches and bounded numbers
# --------------------------------------------------------------------------
def test_sketches_are_kept_canonical() -> None:
    good = sketch_b64(*[float(v) for v in range(1, 101)])
    assert parse_sketch(good).encode() == good  # a local sketch is already canonical
    big = padded(good, 90_000)
    rep = SlaReport.model_validate(raw("asr", None, 100, sketch=big))
    assert rep.reports[0].sketch_e2e == good  # the model keeps the canonical form only
    b = SlaBoard()
    b.report(unchecked(raw("asr", "u", 100, sketch=big)), now=0.0)  # board re-does it
    (row,) = b.instances(now=1.0)
    assert row["sketch_e2e"] == good
    assert b.stats()["bytes"] < ROW_OVERHEAD + 4 * len(good)


def _far_apart_bins() -> str:
    from ddsketch.pb import proto as _proto

    from mmmesh.sla import new_sketch

    _pb = _proto.pb

    msg = _pb.DDSketch(mapping=_proto.KeyMappingProto.to_proto(new_sketch()._mapping))
    msg.positiveValues.binCounts[-100_000] = 1
    msg.positiveValues.binCounts[100_000] = 1
    return base64.b64encode(msg.SerializeToString()).decode()


def _proto(**fields: Any) -> str:
    from ddsketch.pb import proto as _proto

    from mmmesh.sla import new_sketch

    _pb = _proto.pb

    msg = _pb.DDSketch(mapping=_proto.KeyMappingProto.to_proto(new_sketch()._mapping))
    for k, v in fields.get("bins", {}).items():
        msg.positiveValues.binCounts[k] = v
    msg.zeroCount = fields.get("zero", 0.0)
    if "gamma" in fields:
        msg.mapping.gamma = fields["gamma"]
    return base64.b64encode(msg.SerializeToString()).decode()


BAD_SKETCHES = {
    "not base64": "not*base64!",
    "another accuracy": sketch_b64(5.0, accuracy=0.05),
    "negative values": sketch_b64(-5.0, 3.0),
    "bins far apart": _far_apart_bins(),
    "a huge bin count": _proto(bins={10: 1e300}),
    "an infinite bin count": _proto(bins={10: math.inf}),
    "a huge zero count": _proto(zero=1e13),
    "counts over the total": _proto(bins={1: 6e11, 2: 6e11}),
    "a NaN gamma": _proto(gamma=math.nan),
    "an unknown field over the size limit": padded(sketch_b64(1.0), 900_000),
}


def test_out_of_bound_reports_are_refused_naming_the_field() -> None:
    """The API's model refuses them (422 naming the field); a body that skipped
    it is refused by the board the same way, and nothing is kept."""
    from pydantic import ValidationError

    b = SlaBoard()
    cases: list[tuple[str, dict[str, Any], str]] = [
        (why, raw("asr", "x", 10, sketch=sk), "reports[0].sketch_e2e")
        for why, sk in BAD_SKETCHES.items()]
    for field, value in (("frames", 10**400), ("drops", -1), ("window_s", math.inf),
                         ("attainment", math.nan), ("errors", 10**12 + 1)):
        d = raw("asr", "x", 10)
        d["reports"][0][field] = value
        cases.append((field, d, f"reports[0].{field}"))
    for why, d, field in cases:
        with pytest.raises(ValidationError) as exc:
            SlaReport.model_validate(d)
        assert field.split(".")[-1] in str(exc.value), why
        e = refused(b.report, unchecked(d), now=0.0)
        assert (e.status, str(e).split(":")[0]) == (422, field), (why, str(e))
    assert b.view(now=1.0)["instances"] == [] and b.stats()["refused:invalid_request"] == len(
        cases)


def test_a_bad_row_never_breaks_a_read() -> None:
    """Rows that went bad after they were taken (here: changed in place) are
    left out of every view and counted; the rest is merged as before."""
    b = SlaBoard()
    good = sketch_b64(*[float(v) for v in range(1, 101)])
    b.report(body("asr", "good", 100, sketch=good), now=0.0)
    b.report(body("asr", "huge", 5), now=0.0)
    b.report(body("asr", "inf", 5, sketch=good), now=0.0)
    b.report(body("asr", "far", 5, sketch=good), now=0.0)
    rows = {k[2]: r for k, r in b._rows.items()}
    rows["huge"].entry["frames"] = 10**400  # the merge's OverflowError of the issue
    object.__setattr__(rows["inf"], "sketch", Sketch(3, b"\x00" * 6 + b"\xf0\x7f", 0.0))
    object.__setattr__(rows["far"], "sketch", Sketch(10**6, parse_sketch(good).bins, 0.0))
    for _ in range(2):
        v = b.view(now=1.0)
        SlaView.model_validate(v)  # what GET /v1/sla and /v1/status answer
        assert [r["instance"] for r in v["instances"]] == ["good"] and v["skipped"] == 3
        (stage,) = v["stages"]
        assert stage["frames"] == 100 and 98 <= stage["e2e_ms"]["p99"] <= 101
    assert b.stats()["skipped_reads"] == 6


# --------------------------------------------------------------------------
# Memory: what a row costs
# --------------------------------------------------------------------------
def test_row_bytes_match_what_rows_cost() -> None:
    """The ledger's bytes per row (ROW_OVERHEAD + strings + 8 bytes per bin)
    is within 25 % of what a kept row really allocates (tracemalloc), with
    and without sketches; so the byte budgets bound qosd's memory."""
    senders = [proc(cgroup=f"/s{i}.scope", pid=1000 + i) for i in range(400)]
    sk = sketch_b64(*[1.0 + v * 0.37 for v in range(2000)])  # ~300 bins, as a busy window
    for sketch in (None, sk):
        b = SlaBoard(SlaLimits(sender_rate=1e6, uid_rate=1e6, uid_rows=10**5, uid_bytes=1 << 30),
                     reporters=[ReporterRule(uid=1000, stages=["*"])])
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i, s in enumerate(senders):  # the bodies are freed, as after a request
            b.report(body(f"batch-{i}", f"pod-{i}", 100, cls=f"c{i % 7}", sketch=sketch), s,
                     now=float(i) * 1e-3)
        used = sum(st.size_diff for st in
                   tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        per_row, booked = used / len(senders), b.stats()["bytes"] / len(senders)
        print(f"\nrow with{'out' if sketch is None else ''} a sketch: {per_row:.0f} B "
              f"allocated, {booked:.0f} B booked")
        assert 0.75 * per_row <= booked <= 1.25 * per_row, (per_row, booked)


def test_every_refusal_code_is_declared() -> None:
    """Each ``ReportRefused(..., "code", ...)`` in qosd names a code of
    REFUSAL_CODES (the metric exports them all from the start); an unknown
    code is a programming error, refused at once."""
    import re

    import pytest

    from qosd.identity import REFUSAL_CODES, ReportRefused
    from testkit import ROOT

    used = set()
    for path in (ROOT / "qosd").rglob("*.py"):
        used |= set(re.findall(r'ReportRefused\(\s*\d+,\s*"(\w+)"', path.read_text()))
    used |= set(re.findall(r'_Level\("(\w+)"', (ROOT / "qosd/sla/quota.py").read_text()))
    assert used == set(REFUSAL_CODES)
    with pytest.raises(ValueError, match="REFUSAL_CODES"):
        ReportRefused(403, "made_up", "no")
