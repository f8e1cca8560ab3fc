"""Which senders may report which stages: the ``sla_reporters`` rules of
qosd.yaml.

A rule matches a sender (qosd/identity.py) by any of ``uid``, ``unit`` (a
glob over systemd service names), ``pod`` (a glob over pod UIDs) and
``cgroup`` (a glob over the cgroup path); every field a rule sets must match.
Its ``stages`` are globs of the stages the sender may report; ``{instance}``
in them stands for the instance of a template unit
(``mmmesh-sidecar@asr.service`` -> ``asr``).  A sender may report a stage
when any rule that matches it allows that stage; a sender no rule matches
may report nothing (403 naming why).  The admin socket needs no rule.

The default (:data:`DEFAULT_REPORTERS`), what qosd uses when qosd.yaml does
not say::

    sla_reporters:
      - {uid: 0, stages: ["*"]}                                    # root
      - {unit: "mmmesh-sidecar@*.service", stages: ["{instance}"]} # its own stage
      - {pod: "*", stages: ["*"]}                                  # any Kubernetes pod

Narrow the last rule in a DaemonSet's config (for example
``{pod: "*", stages: ["asr", "fusion-*"]}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qosd.identity import ReportRefused, Sender

__all__ = ["DEFAULT_REPORTERS", "ReporterRule", "allowed_stages", "authorize", "may_report"]

Glob = Annotated[str, Field(min_length=1, max_length=256)]


class ReporterRule(BaseModel):
    """One ``sla_reporters`` entry: who (every field set must match) may
    report which stages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uid: int | list[int] | None = Field(default=None, description="the sender's uid (or one "
                                                                 "of these)")
    unit: Glob | None = Field(default=None, description="glob over the systemd service "
                                                        "(system units only)")
    pod: Glob | None = Field(default=None, description="glob over the pod UID (Kubernetes pods "
                                                       "only; \"*\": any pod)")
    cgroup: Glob | None = Field(default=None, description="glob over the cgroup v2 path")
    stages: list[Glob] = Field(min_length=1, max_length=256,
                               description="globs of the stages it may report; {instance} is "
                                           "the template unit's instance")

    @model_validator(mode="after")
    def _matches_someone(self) -> ReporterRule:
        if self.uid is None and self.unit is None and self.pod is None and self.cgroup is None:
            raise ValueError("a rule needs at least one of uid, unit, pod, cgroup")
        return self

    def matches(self, s: Sender) -> bool:
        """Every field the rule sets matches the sender."""
        uids = [self.uid] if isinstance(self.uid, int) else self.uid
        return ((uids is None or s.uid in uids)
                and (self.unit is None or (s.unit is not None and fnmatchcase(s.unit, self.unit)))
                and (self.pod is None or (s.pod is not None and fnmatchcase(s.pod, self.pod)))
                and (self.cgroup is None
                     or (s.cgroup is not None and fnmatchcase(s.cgroup, self.cgroup))))

    def stage_globs(self, s: Sender) -> list[str]:
        """The stage globs for ``s``; a glob naming ``{instance}`` counts only
        for a template unit, with the instance taken literally."""
        inst = s.unit_instance
        out = []
        for g in self.stages:
            if "{instance}" in g:
                if inst is None:
                    continue
                g = g.replace("{instance}", _glob_escape(inst))
            out.append(g)
        return out


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in text)


DEFAULT_REPORTERS: tuple[ReporterRule, ...] = (
    ReporterRule(uid=0, stages=["*"]),
    ReporterRule(unit="mmmesh-sidecar@*.service", stages=["{instance}"]),
    ReporterRule(pod="*", stages=["*"]),
)


def allowed_stages(rules: Sequence[ReporterRule], s: Sender) -> list[str]:
    """The stage globs ``s`` may report (empty: nothing)."""
    return [g for r in rules if r.matches(s) for g in r.stage_globs(s)]


def _nobody(s: Sender) -> ReportRefused:
    return ReportRefused(403, "not_allowed", f"{s.describe()} matches no sla_reporters rule "
                         "that lets it report (qosd.yaml; by default root, systemd units "
                         "mmmesh-sidecar@<stage>.service and Kubernetes pods)")


def may_report(rules: Sequence[ReporterRule], s: Sender) -> None:
    """Raises :class:`ReportRefused` (403) when ``s`` may report no stage at
    all (answered before the report is even read)."""
    if s.kind != "admin" and not allowed_stages(rules, s):
        raise _nobody(s)


def authorize(rules: Sequence[ReporterRule], s: Sender, stage: str) -> None:
    """Raises :class:`ReportRefused` (403) unless ``s`` may report ``stage``."""
    if s.kind == "admin":
        return
    globs = allowed_stages(rules, s)
    if not globs:
        raise _nobody(s)
    if not any(fnmatchcase(stage, g) for g in globs):
        shown = ", ".join(sorted(set(globs))[:8])
        raise ReportRefused(403, "stage_not_allowed", f"{s.describe()} may report stages "
                            f"{shown}; not {stage!r} (sla_reporters in qosd.yaml)")
