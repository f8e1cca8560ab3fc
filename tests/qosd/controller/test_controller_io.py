"""The controller's faces: its input from the node's board and from the global
view, explain() and its text, the state across a restart, the closed-loop
simulation's figures, and the public names."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from mmmesh.sla.report import SlaReport
from mmmesh.sla.sketch import encode_sketch, new_sketch
from qosd.controller.core import (
    Controller,
    Law,
    Measure,
    SlaInput,
    from_board,
    from_cluster,
    render,
    sim,
)
from qosd.mesh.slaview.core import SlaView
from qosd.sla.board import SlaBoard
from testkit.controller_cases import (
    BUSY,
    COMFY,
    EASED,
    EXAMPLE,
    MISS,
    OKAY,
    TIGHT,
    Run,
)

WALL = 1_700_000_000.0


# --------------------------------------------------------------------------
# Input: the node's board and the global view feed the same SlaInput
# --------------------------------------------------------------------------
def _window(cls: str, modality: str, values: list[float], deadline_ms: float) -> dict[str, Any]:
    sk = new_sketch()
    for v in values:
        sk.add(v)
    misses = sum(v > deadline_ms for v in values)
    return {"sla_class": cls, "modality": modality, "window_s": 5.0, "frames": len(values),
            "deadline_misses": misses, "drops": 0, "errors": 0,
            "attainment": 1 - misses / len(values), "sketch_e2e": encode_sketch(sk),
            "e2e_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0, "max": max(values)}}  # fmt: skip


def _board() -> SlaBoard:
    board = SlaBoard()
    slow = [10.0] * 280 + [200.0] * 20  # p99 200 ms, 20 late frames of 300
    fast = [5.0] * 200
    board.report(SlaReport.model_validate({"stage": "asr", "reports": [
        _window("voice", "audio", slow, 120.0), _window("voice", "text", fast, 120.0)]}),
        now=WALL - 2.0)  # fmt: skip
    board.report(SlaReport.model_validate({"stage": "tts", "reports": [
        _window("voice", "audio", fast, 120.0)]}), now=WALL - 1.0)  # fmt: skip
    return board


def test_from_board_merges_a_class_across_modalities_and_stages() -> None:
    inp = from_board(_board().view(WALL), WALL)
    voice = inp.classes["voice"]
    assert voice.frames == 700 and voice.nodes == 1 and inp.source == "board"
    assert voice.attainment == pytest.approx(1 - 20 / 700)
    assert voice.p99_ms == pytest.approx(200.0, rel=0.02)  # the worst modality's p99
    assert voice.age_s == pytest.approx(2.0)  # the oldest row merged
    assert set(inp.stages) == {("voice", "asr"), ("voice", "tts")}
    assert inp.stages[("voice", "tts")].p99_ms == pytest.approx(5.0, rel=0.02)
    assert inp.stages[("voice", "asr")].frames == 500


def test_from_cluster_reads_the_global_view() -> None:
    view = SlaView("node-a")
    view.local_windows(_board().view(WALL), 100.0, wall=WALL, members=1)
    inp = from_cluster(view.snapshot(100.5), 100.5, suspect_fraction=0.25)
    voice = inp.classes["voice"]
    assert voice.frames == 700 and voice.nodes == 1
    assert voice.attainment == pytest.approx(1 - 20 / 700, abs=1e-5)
    assert voice.p99_ms == pytest.approx(200.0, rel=0.02)
    assert 2.0 <= voice.age_s <= 3.0
    assert inp.suspect_fraction == 0.25 and inp.source == "cluster"
    assert inp.stages[("voice", "asr")].frames == 500


def test_both_views_drive_the_same_decision() -> None:
    board = from_board(_board().view(WALL), WALL)
    view = SlaView("node-a")
    view.local_windows(_board().view(WALL), 100.0, wall=WALL, members=1)
    cluster = from_cluster(view.snapshot(100.5), 100.5, 0.0)
    for inp in (board, cluster):
        ctrl = Controller(EXAMPLE)
        for i in range(4):
            d = ctrl.step(SlaInput(inp.now + 5 * i, inp.classes, inp.stages))
        assert d.classes["voice"].rate == 2_400_000  # missed: p99 ~200 ms > 120 ms
        assert d.stage_weights == {}  # asr missed too, but the class caught up with it


def test_unreadable_rows_are_skipped() -> None:
    inp = from_board({"classes": [None, {"sla_class": 3}, {"sla_class": "v", "frames": "x"},
                                  {"sla_class": "v", "frames": math.nan},
                                  {"sla_class": "voice", "frames": 5, "attainment": True}]},
                     WALL)  # fmt: skip
    assert list(inp.classes) == ["voice"] and inp.classes["voice"].attainment is None


# --------------------------------------------------------------------------
# explain()
# --------------------------------------------------------------------------
def test_explain_says_what_changed_and_why() -> None:
    r = Run(TIGHT)
    r.run(3, {"voice": MISS, "video": Measure(2000, None, 300.0)})
    ex = r.ctrl.explain()
    assert [c["class"] for c in ex["classes"]] == [
        "control", "voice", "video", "lidar", "best-effort"]
    voice = ex["classes"][1]
    assert voice["objective"] == {"p99_ms": 120, "attainment": 0.99}
    assert voice["measured"]["why"] == "p99 180 ms > 120 ms; attainment 0.900 < 0.99"
    assert voice["measured"]["slack"] == -9.0 and voice["measured"]["verdict"] == "miss"
    assert voice["params"]["rate"] == {
        "current": 1_800_000, "policy": 1_200_000, "range": [1_200_000, 4_800_000]}
    assert voice["state"] == "increasing"
    [dec] = voice["decisions"]
    assert dec["window"] == 1 and dec["change"] == "rate 1.2mbit -> 1.8mbit, weight 3 -> 4"
    assert dec["why"] == ("missed 2 windows: p99 180 ms > 120 ms; attainment 0.900 < 0.99; "
                          "+600kbit from best-effort (no objective)")
    assert ex["classes"][4]["decisions"][0]["why"] == "-600kbit gave to voice (no objective)"
    video = ex["classes"][2]["measured"]
    assert video["why"] == "p99 300 ms <= 400 ms" and video["verdict"] == "ok"
    assert video["slack"] == 0.25  # inside, but below the donor margin (0.3): gave nothing
    assert ex["classes"][2]["decisions"] == []
    json.dumps(ex)  # JSON-able, for the API


def test_explain_states() -> None:
    r = Run()
    r.run(2, {"voice": MISS, "video": BUSY})  # raised at 1
    assert r.ctrl.explain()["classes"][1]["state"] == "blackout"
    r.step({"voice": MISS, "video": BUSY})
    assert r.ctrl.explain()["classes"][1]["state"] == "increasing"
    r.run(3, {"voice": MISS, "video": BUSY})  # raised at 3 and 5
    r.run(3, {"voice": COMFY, "video": EASED})  # blackout 6, comfortable 7, 8: decayed at 8
    assert r.ctrl.explain()["classes"][1]["state"] == "blackout"
    r.step({"voice": COMFY, "video": EASED})
    assert r.ctrl.explain()["classes"][1]["state"] == "decaying"
    r.run(4, {"voice": COMFY, "video": EASED})
    assert r.ctrl.explain()["classes"][1]["state"] == "steady"
    r.step({"voice": OKAY}, suspect=0.5)
    assert r.ctrl.explain()["classes"][1]["state"] == "frozen"
    r.step({})
    assert r.ctrl.explain()["classes"][1]["state"] == "stale"
    assert r.ctrl.explain()["classes"][0]["state"] == "steady"  # no objective: never stale


def test_render_is_the_cli_text() -> None:
    r = Run(TIGHT)
    r.run(3, {"voice": MISS, "video": Measure(2000, None, 240.0)})
    text = render(r.ctrl.explain())
    assert text.endswith("  w1 (5 s ago): rate 16.8mbit -> 16.2mbit: -600kbit gave to voice "
                         "(no objective)\n")
    lines = text.splitlines()
    assert lines[0] == "controller: window 2, source board, not frozen"
    assert lines[1].split() == ["CLASS", "STATE", "P99", "ms/OBJ", "ATTAIN/OBJ", "RATE", "CEIL",
                                "WEIGHT", "PRIO"]
    assert lines[3].split() == ["voice", "increasing", "180/120", "0.900/0.99",
                                "1.8mbit^(1.2mbit)", "250mbit", "4^(3)", "1"]
    assert lines[4].split()[:3] == ["video", "steady", "240/400"]
    assert lines[6].split()[4] == "16.2mbitv(16.8mbit)"  # v: lent, below its policy
    assert ("  w1 (5 s ago): rate 1.2mbit -> 1.8mbit, weight 3 -> 4: missed 2 windows: p99 180 "
            "ms > 120 ms; attainment 0.900 < 0.99; +600kbit from best-effort (no objective)"
            ) in lines


# --------------------------------------------------------------------------
# Restart: the state is kept, or deliberately reset
# --------------------------------------------------------------------------
def _adapted() -> Run:
    r = Run(TIGHT)
    r.run(5, {"voice": MISS, "video": Measure(2000, None, 200.0)},
          stages={("voice", "asr"): MISS})
    return r


def test_restored_state_continues_exactly() -> None:
    r = _adapted()
    saved = json.loads(json.dumps(r.ctrl.snapshot()))
    twin, why = Controller.restore(TIGHT, saved, r.now)
    assert why == "restored the state of window 4, saved 5 s ago"
    assert twin.decision.classes == r.ctrl.decision.classes
    assert twin.stages[("voice", "asr")].values == {"weight": 5}
    assert twin.stages[("voice", "asr")].to_dict() == r.ctrl.stages[("voice", "asr")].to_dict()
    def kept(ex: dict[str, Any]) -> list[dict[str, Any]]:
        """The last measurement's numbers and notes are not kept (its verdict is)."""
        out = []
        for c in ex["classes"]:
            c = {k: v for k, v in c.items() if k not in ("note", "stages")}
            m = c["measured"]
            c["measured"] = m and {k: m[k] for k in ("verdict", "slack", "why")}
            out.append(c)
        return out

    assert kept(twin.explain()) == kept(r.ctrl.explain())
    for m in (MISS, MISS, OKAY, COMFY, COMFY, COMFY, COMFY):
        inp = SlaInput(r.now, {"voice": m, "video": EASED})
        assert twin.step(inp) == r.ctrl.step(inp)
        r.now += 5


@pytest.mark.parametrize(("change", "why"), [
    (lambda s, now: (s, now, TIGHT, None), "restored"),
    (lambda s, now: (s, now + 16, TIGHT, None), "the saved state is 21 s old (kept up to 15 s"),
    (lambda s, now: (s, now - 10, TIGHT, None), "the saved state is -5 s old"),
    (lambda s, now: (s, now, EXAMPLE, None), "the saved state is of another policy"),
    (lambda s, now: (s, now, TIGHT, Law(add_step=0.25)), "the law's constants changed"),
    (lambda s, now: ({**s, "format": "x"}, now, TIGHT, None), "no saved state in a known"),
    (lambda s, now: ([], now, TIGHT, None), "no saved state in a known format"),
    (lambda s, now: ({**s, "classes": {}}, now, TIGHT, None), "unreadable (classes: not the"),
    (lambda s, now: ({**s, "saved_at": "soon"}, now, TIGHT, None), "unreadable ('soon' is not"),
    (lambda s, now: ({**s, "stages": [{"class": "nope", "stage": "x"}]}, now, TIGHT, None),
     "unreadable (stages: unknown class"),
])  # fmt: skip
def test_restore_or_start_from_the_policy(change: Any, why: str) -> None:
    r = _adapted()
    data, now, policy, law = change(r.ctrl.snapshot(), r.now)
    ctrl, said = Controller.restore(policy, data, now, law)
    assert why in said
    if why != "restored":
        assert said.startswith("started from the policy")
        assert ctrl.decision.classes == Controller(policy).decision.classes


def test_a_tampered_state_cannot_pass_the_bounds() -> None:
    r = _adapted()
    data = r.ctrl.snapshot()
    data["classes"]["voice"]["values"]["weight"] = 100
    data["classes"]["voice"]["values"]["priority"] = 0
    ctrl, said = Controller.restore(TIGHT, data, r.now)
    assert said.startswith("restored")
    assert (ctrl.decision.classes["voice"].weight, ctrl.decision.classes["voice"].priority) == (
        10, 1)  # clamped into voice's ranges
    data["classes"]["voice"]["values"]["rate"] = 4_800_000  # fits voice, not the link
    ctrl, said = Controller.restore(TIGHT, data, r.now)
    assert "the saved rates do not fit the link" in said
    data["classes"]["voice"]["values"]["rate"] = True
    assert "unreadable" in Controller.restore(TIGHT, data, r.now)[1]


# --------------------------------------------------------------------------
# The closed loop: the demo's targets in the fluid model
# --------------------------------------------------------------------------
def test_closed_loop_simulation_meets_the_demo_targets() -> None:
    res = sim.run()
    assert res["settle_windows"] <= 5
    assert res["oscillations"] == 0
    assert res["back_at_policy_windows"] <= 10
    assert res["attainment_on"] >= 0.99
    assert res["attainment_off"] < 0.9
    assert res["max_step"] <= Law().add_step
    assert len(res["windows"]) == 50
    assert res["windows"][5]["off"]["p99_ms"] > 120 > res["windows"][20]["on"]["p99_ms"]


@pytest.mark.parametrize("seed", range(2, 8))
def test_closed_loop_is_robust_to_noise(seed: int) -> None:
    from dataclasses import replace

    res = sim.run(replace(sim.default_scenario(), seed=seed, noise=0.1))
    assert res["oscillations"] == 0 and res["settle_windows"] <= 7
    assert res["back_at_policy_windows"] <= 10


def test_htb_fluid_model() -> None:
    from qosd.controller.core import Params

    p = {"a": Params(10, 100, 1, 0), "b": Params(10, 100, 3, 1), "c": Params(10, 100, 1, 1)}
    assert sim.htb_share(p, {"a": 50, "b": 50, "c": 50}, 100) == pytest.approx(
        {"a": 50, "b": 32.5, "c": 17.5})  # guarantees; a's prio; the 30 left 3:1 (weights)
    p["a"] = Params(10, 20, 1, 0)  # a ceiling
    assert sim.htb_share(p, {"a": 50, "b": 50, "c": 50}, 100)["a"] == 20


def test_sim_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"windows", "attainment_off", "attainment_on", "settle_windows", "oscillations",
            "max_step", "back_at_policy_windows"} <= set(out)
    assert sim.main([]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:4] == ["w", "phase", "p99", "off"]


# --------------------------------------------------------------------------
# docs/controller.md: the constants' table and the CLI sample are the code's
# --------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[3] / "docs" / "controller.md"


def test_docs_constants_table_is_the_law() -> None:
    law = Law().as_dict()
    table = DOC.read_text().split("## The law and its constants", 1)[1].split("\n\n")[2]
    rows = re.findall(r"^\| `(\w+)` \| ([0-9.]+)", table, re.MULTILINE)
    assert {name for name, _ in rows} == set(law)  # every constant, once
    for name, value in rows:
        assert float(value) == law[name], name


def test_docs_explain_sample_is_render() -> None:
    r = Run(TIGHT)
    r.run(3, {"voice": MISS, "video": Measure(2000, None, 300.0)})
    sample = DOC.read_text().split("`--json` prints `explain()`):", 1)[1]
    sample = sample.split("```\n", 2)[1]
    assert sample == render(r.ctrl.explain())


# --------------------------------------------------------------------------
# The public face
# --------------------------------------------------------------------------
def test_public_names() -> None:
    import qosd.controller.core as pkg

    assert pkg.__all__ == [
        "ClassSpec", "Controller", "Decision", "Judgement", "Law", "Measure", "Params",
        "Record", "ReplicaLaw", "ReplicaWeights", "SlaInput", "Verdict", "effective_policy",
        "from_board", "from_cluster", "judge", "judge_replica", "policy_digest", "render",
        "replica_measures", "weight_list",
    ]  # fmt: skip
    assert {n for n in vars(pkg) if not n.startswith("_")} - set(pkg.__all__) == {"sim"}


def test_law_refuses_nonsense() -> None:
    for bad in ({"add_step": 0}, {"decay": 1.0}, {"period_s": math.inf}, {"miss_windows": -1}):
        with pytest.raises(ValueError, match="law"):
            Law(**bad)
