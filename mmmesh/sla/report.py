"""The SLA report: what a sidecar tells qosd about one window, and what qosd
shows back.  The one schema of it, used by the sidecar (to build reports), by
qosd (to accept them and to answer ``GET /v1/sla``) and by mmmeshctl (to show
them).

A report names a stage and carries, per (SLA class, modality), one window:
frame counts, deadline misses, attainment, latency quantiles and optionally a
mergeable DDSketch of the end-to-end latency (``mmmesh/sla/sketch.py``).
The attainment is the sidecar's measure (``_attainment.py`` has the one
definition: frames within their deadline over frames, a dropped frame never
within); the counts beside it say what happened, they do not make it.
Every number is bounded (``MAX_COUNT``, ``MAX_MS``, ``MAX_WINDOW_S``, and in
a sketch its keys and counts, ``mmmesh.sla.sketch.parse_sketch``; all of
them in ``_limits.py``): a report outside the bounds is refused with 422
naming the field.  A sketch is
re-encoded when the report is validated (``sketch_e2e`` of the model is the
canonical form: unknown protobuf fields are gone), so what qosd keeps is
bounded by the sketch's bins, never by what was sent.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._limits import (
    MAX_COUNT,
    MAX_MS,
    MAX_NAME,
    MAX_REPORTS,
    MAX_SKETCH_B64,
    MAX_WINDOW_S,
)
from .sketch import parse_sketch

__all__ = [
    "MAX_COUNT",
    "MAX_MS",
    "MAX_NAME",
    "MAX_REPORTS",
    "MAX_SKETCH_B64",
    "MAX_WINDOW_S",
    "Quantiles",
    "SlaClassReport",
    "SlaEntry",
    "SlaMerged",
    "SlaReport",
    "SlaView",
    "SlaWindow",
]

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]


class Quantiles(BaseModel):
    model_config = ConfigDict(extra="forbid")

    p50: Ms
    p90: Ms
    p99: Ms
    max: Ms


class SlaWindow(BaseModel):
    """One window of one (stage, class, modality) as a sidecar measured it."""

    model_config = ConfigDict(extra="forbid")

    sla_class: str = Field(min_length=1, max_length=MAX_NAME)
    modality: str = Field(min_length=1, max_length=MAX_NAME)
    window_s: float = Field(ge=0, le=MAX_WINDOW_S, allow_inf_nan=False)
    frames: Count
    deadline_misses: Count
    drops: Count
    errors: Count
    attainment: float = Field(ge=0, le=1, allow_inf_nan=False,
                              description="frames within their deadline (delivered, not late; "
                                          "a frame without a deadline is within it) / frames "
                                          "(1.0 without frames)")
    e2e_ms: Quantiles | None = None
    queue_ms: Quantiles | None = None
    service_ms: Quantiles | None = None
    sketch_e2e: str | None = Field(default=None, max_length=MAX_SKETCH_B64,
                                   description="base64 DDSketch protobuf (mergeable): 1 % "
                                               "relative accuracy, logarithmic mapping, "
                                               "values in ms >= 0, keys within +-2048, "
                                               "counts at most 10^12 in all; kept in "
                                               "canonical form (unknown fields dropped)")

    @model_validator(mode="after")
    def _misses_within_frames(self) -> SlaWindow:
        if self.deadline_misses > self.frames:
            raise ValueError(f"deadline_misses ({self.deadline_misses}) exceeds frames "
                             f"({self.frames})")
        return self


class SlaClassReport(SlaWindow):
    """A window as reported: its sketch must be one qosd can merge, and is
    replaced by its canonical encoding."""

    @field_validator("sketch_e2e")
    @classmethod
    def _mergeable(cls, v: str | None) -> str | None:
        if v is not None:
            return parse_sketch(v).encode()  # ValueError -> 422 naming the field
        return v


class SlaReport(BaseModel):
    """The body of ``POST /v1/sla``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "node": None, "stage": "audio-frontend", "reports": [{
            "sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": 500,
            "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0,
            "e2e_ms": {"p50": 1.2, "p90": 2.0, "p99": 3.1, "max": 4.0}}]}]})

    node: str | None = Field(default=None, max_length=253)
    stage: str = Field(min_length=1, max_length=128)
    instance: str | None = Field(default=None, max_length=253,
                                 description="which sidecar of the stage (replicas of a stage "
                                             "are kept apart and merged); default: one per stage")
    reports: list[SlaClassReport] = Field(max_length=MAX_REPORTS)


class SlaAccepted(BaseModel):
    accepted: int


class SlaEntry(SlaWindow):
    """A window qosd kept (its sketch was checked and made canonical when
    reported)."""

    stage: str
    instance: str | None = Field(description="which sidecar: the identity qosd derived from "
                                             "the sender's credentials (pod:<uid>/<container>, "
                                             "unit:<name>, uid:<n>:<cgroup>); for root and the "
                                             "admin socket, the instance the report names")
    sender: str | None = Field(default=None, description="the sender's identity (admin: the "
                                                         "admin socket)")
    label: str | None = Field(default=None, description="the instance name the report gave "
                                                        "(a label only)")
    node: str | None = None
    received_at: float = Field(description="unix seconds")
    stale: bool = Field(default=False, description="not refreshed for 3 of its windows "
                                                   "(>= 15 s): listed, not merged")


class SlaMerged(BaseModel):
    """Windows of several sidecars merged: counts summed, attainment
    frame-weighted, e2e quantiles from the merged DDSketches."""

    stage: str | None = Field(default=None, description="absent in the node-wide class view")
    sla_class: str
    modality: str
    sources: int = Field(description="windows merged (sidecar instances, times stages)")
    window_s: float
    frames: int
    deadline_misses: int
    drops: int
    errors: int
    attainment: float
    e2e_ms: Quantiles | None
    sketch_e2e: str | None = None
    received_at: float = Field(description="unix seconds, the newest merged window")


class SlaView(BaseModel):
    """The body of ``GET /v1/sla`` (and ``status()["sla"]``)."""

    instances: list[SlaEntry] = Field(description="latest window per (stage, instance, class, "
                                                  "modality), as the sidecars reported it")
    stages: list[SlaMerged] = Field(description="per (stage, class, modality), replicas merged")
    classes: list[SlaMerged] = Field(description="per (class, modality), node-wide")
    skipped: int = Field(default=0, description="kept windows left out of this view because "
                                                "they could not be read (counted and logged; "
                                                "never a failed read)")
