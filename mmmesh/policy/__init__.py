"""The SLA policy: schema, validation and the reference classifier (dataplane part).

A policy names a shaped link and the traffic classes that share it.  Every class
gets an HTB class under the root ``1:`` with its guaranteed rate, ceiling,
quantum (from ``weight``) and prio; the BPF classifier maps a frame's MMH header
to one class and writes that class's handle into ``skb->priority``.

A policy is refused whole: :func:`parse_policy` and :func:`load_policy` either
return a fully validated, immutable :class:`Policy` or raise
:class:`~mmmesh.errors.PolicyError` listing every problem as ``(field path,
message)``, the path written like ``classes[2].rate``.  Structural problems
(types, ranges, unknown fields) are reported first, all together; the
cross-field rules run once the structure is valid, and report all together too.

Privilege order ("rank"): :meth:`Policy.ranked` sorts the classes by
``(priority, -rate, id)``; rank 0 is the most privileged class.  A source rule
caps what senders inside its prefix may get: when the class picked for their
frame ranks better (lower) than the rule's ``max_class``, it is lowered to
``max_class``.

:func:`classify_reference` is the pure-Python statement of what the BPF
program (``bpf/lib/classify.h``) does with a header; tests compare the two.
docs/policy.md describes the schema field by field.

This module is the public face; the code lives in one module per role:

- ``_types``: the field types (:class:`Rate`, class names, interface names,
  modality names, prefixes) and their validators;
- ``_schema``: the models, the cross-field rules (those of ``adapt`` too: in
  range, within the link, anti-escalation; :func:`bounds`,
  :func:`policy_values`), ValidationError -> PolicyError,
  :func:`policy_json_schema`;
- ``_adapt``: the models of a class's SLA objective (:class:`Objective`,
  ``sla``) and of the ranges qosd may adapt it within (:class:`Adapt`,
  ``adapt``), a leaf the schema builds on;
- ``_yaml``: the strict YAML loader, :func:`parse_policy`, :func:`load_policy`;
- ``reference``: the reference classifier;
- ``egress`` (a public module: ``mmmesh.policy.egress``): what the fields
  mean in each egress mode (``htb``, ``fq``) and what a mode cannot realise
  (``egress_errors``, ``check_egress``, ``fq_band``).
"""

from ..wire import MODALITY_ALIASES
from ._adapt import KNOBS, Adapt, Objective
from ._schema import (
    API_VERSION,
    MAX_WEIGHT,
    QUANTUM_UNIT,
    Link,
    Match,
    MetaRange,
    Policy,
    SourceRule,
    TrafficClass,
    bounds,
    policy_json_schema,
    policy_values,
)
from ._types import IfName, Rate, format_rate
from ._yaml import load_policy, parse_policy
from .reference import Verdict, classify_reference, reference_verdict

__all__ = [
    "API_VERSION",
    "KNOBS",
    "MAX_WEIGHT",
    "MODALITY_ALIASES",
    "QUANTUM_UNIT",
    "Adapt",
    "IfName",
    "Link",
    "Match",
    "MetaRange",
    "Objective",
    "Policy",
    "Rate",
    "SourceRule",
    "TrafficClass",
    "Verdict",
    "bounds",
    "classify_reference",
    "format_rate",
    "load_policy",
    "parse_policy",
    "policy_json_schema",
    "policy_values",
    "reference_verdict",
]
