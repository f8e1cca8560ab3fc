"""The SLA controller: keeps each class within its objective by moving its HTB
parameters inside the bounds its policy allows.  Sans-I/O: no clocks, no
sockets, no threads; the caller feeds one :class:`SlaInput` a window and
writes the :class:`Decision` through ``mmmesh.dataplane``::

    ctrl = Controller(policy)                           # or Controller.restore(...)
    inp = from_board(board.view(), time.time())         # or from_cluster(snapshot, ...)
    decision = ctrl.step(inp)                           # once a window
    compile_policy(effective_policy(policy, decision.classes))  # HTB rate/ceil/quantum/prio
    decision.stage_weights                              # {class: {stage: weight}} overrides
    ctrl.explain(); render(ctrl.explain())              # mmmeshctl sla explain
    ctrl.snapshot()                                     # JSON to keep across a restart

The law and its constants are :class:`Law` (``_law.py``, the same table as
docs/controller.md); the rate budget is ``_budget.py``; the state machine
``_core.py``; the persisted form ``_state.py`` / ``_persist.py``; the
explanation ``_explain.py``.  :mod:`qosd.controller.core.sim` runs the loop
against a fluid model of a shared link.  :class:`ReplicaWeights` (``_replicas.py``)
shares a stage's frames among its replicas for the socket layer.
"""

from ._core import Controller
from ._explain import render
from ._inputs import Measure, SlaInput, from_board, from_cluster
from ._law import Judgement, Law, Verdict, judge
from ._params import ClassSpec, Decision, Params, effective_policy
from ._persist import policy_digest
from ._replicas import ReplicaLaw, ReplicaWeights, judge_replica, replica_measures, weight_list
from ._state import Record

__all__ = [
    "ClassSpec",
    "Controller",
    "Decision",
    "Judgement",
    "Law",
    "Measure",
    "Params",
    "Record",
    "ReplicaLaw",
    "ReplicaWeights",
    "SlaInput",
    "Verdict",
    "effective_policy",
    "from_board",
    "from_cluster",
    "judge",
    "judge_replica",
    "policy_digest",
    "render",
    "replica_measures",
    "weight_list",
]
