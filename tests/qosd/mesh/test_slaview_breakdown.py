"""The per-node breakdown on demand (GET /v1/cluster/sla?nodes=true, ?node=X):
each node's own answer (``SlaTree.own_breakdown``) spliced into the view's
rows by ``with_breakdown``, and read by the API's model; a member that did
not answer is shown by its last answer, stale and ``answered: false``."""

from __future__ import annotations

from qosd.api.cluster_sla import ClusterSlaView, with_breakdown
from tests.qosd.mesh.test_slatree import Fleetsim


def test_each_nodes_answer_lands_in_its_rows_and_the_model_keeps_it() -> None:
    f = Fleetsim(12)
    f.run(20.0)
    now = f.ts.now
    view = f.ts.trees[0].snapshot(now, {"voice": 100.0})
    answers = {f.ids[i]: f.ts.trees[i].own_breakdown(now)["rows"] for i in (0, 1, 2)}
    assert all(rows for rows in answers.values())
    silent = [{**r, "stale": True, "answered": False} for r in answers.pop(f.ids[2])]
    parts = {"nodes": {**answers, f.ids[2]: silent}, "asked": 3, "answered": 2,
             "truncated": False}
    got = ClusterSlaView.model_validate(with_breakdown(view, parts)).model_dump()
    voice = next(r for r in got["classes"] if r["sla_class"] == "voice")
    by_node = {b["node"]: b for b in voice["breakdown"]}
    assert set(by_node) == set(f.ids[:3])
    assert by_node[f.ids[0]]["answered"] and not by_node[f.ids[2]]["answered"]
    assert by_node[f.ids[2]]["stale"]
    # each node's part is a window merged in a record: which one, it says
    assert by_node[f.ids[1]]["merged_in"]["aggregator"] in f.ids
    assert got["breakdown_nodes"] == {"asked": 3, "answered": 2, "truncated": False}
    # the view's own rows stay the aggregate's (frames of all 12, not the three)
    assert voice["nodes"] == 12 and voice["frames"] > sum(
        b["frames"] for b in voice["breakdown"])
