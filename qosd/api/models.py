"""The admin API's request and response bodies, their limits, and the
conversions from the service's own types (qosd/model.py) into them.

The SLA bodies (``SlaReport``, ``SlaAccepted``, ``SlaView``) are not here: they
are mmmesh/sla/report.py's, shared with the sidecar and mmmeshctl.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from mmmesh.policy import Policy
from mmmesh.sla.report import SlaView

from ..model import MAX_YAML_BYTES, FlowRow, PolicyVersion, ReconcileResult

MAX_VERSION = 2**53 - 1  # exact in JSON numbers everywhere
MAX_AUTHOR = 256


def _utf8_size(text: str) -> str:
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > MAX_YAML_BYTES:
        raise ValueError(f"the policy is {n} bytes; at most {MAX_YAML_BYTES} bytes (1 MiB)")
    return text


PolicyYaml = Annotated[
    str,
    Field(max_length=MAX_YAML_BYTES, description="the policy as YAML text (at most 1 MiB)"),
    AfterValidator(_utf8_size),
]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION, description="a policy version number")]
BaseVersion = Annotated[
    int | None,
    Field(
        ge=0,
        le=MAX_VERSION,
        description="the version this edit is based on (0 = no policy yet); the change is "
        "refused with 409 when the current version differs.  null: no check",
    ),
]
Author = Annotated[
    str | None, Field(max_length=MAX_AUTHOR, description="who makes the change (recorded)")
]


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # true is not 1


EXAMPLE_POLICY = """\
apiVersion: mmmesh/v1
link: {device: eth0, rate: 1gbit}
classes:
  - {name: voice, id: 11, match: {modalities: [audio]}, rate: 1.2mbit, weight: 3, priority: 1}
  - {name: video, id: 12, match: {modalities: [video]}, rate: 150mbit, weight: 7, priority: 2}
  - {name: best-effort, id: 14, rate: 20mbit}
default_class: best-effort
"""


class YamlBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"yaml": EXAMPLE_POLICY}]})

    yaml: PolicyYaml


class ApplyBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"yaml": EXAMPLE_POLICY, "base_version": None, "author": "alice"},
    ]})

    yaml: PolicyYaml
    base_version: BaseVersion = None
    author: Author = None


class RollbackBody(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"to_version": 1, "base_version": None, "author": "alice"},
    ]})

    to_version: Version
    base_version: BaseVersion = None
    author: Author = None


# --------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------
class VersionInfo(BaseModel):
    version: int
    created_at: float = Field(description="unix seconds")
    author: str | None
    note: str | None
    sha256: str = Field(description="of the canonical YAML text (UTF-8)")

    @classmethod
    def of(cls, pv: PolicyVersion) -> VersionInfo:
        return cls(version=pv.version, created_at=pv.created_at, author=pv.author,
                   note=pv.note, sha256=pv.sha256)


class PolicyDocument(VersionInfo):
    policy: Policy
    yaml: str = Field(description="canonical YAML of the policy")

    @classmethod
    def of(cls, pv: PolicyVersion) -> PolicyDocument:
        return cls(version=pv.version, created_at=pv.created_at, author=pv.author,
                   note=pv.note, sha256=pv.sha256, policy=pv.policy, yaml=pv.text)


class ValidateResult(BaseModel):
    valid: Literal[True]
    policy: Policy


def _as_dict(obj: Any) -> dict[str, Any]:
    """A dataclass of qosd/model.py, or the dict a service returned instead."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return dict(obj)


class Reconcile(BaseModel):
    ok: bool
    version: int = Field(description="policy version now in the kernel (last good on failure)")
    started_at: float
    duration_s: float
    trigger: str = Field(description='"apply" | "rollback" | "resync" | "startup"')
    repaired: list[str] = Field(description="drift found and fixed")
    error: str | None


class ApplyResult(BaseModel):
    version: int
    reconcile: Reconcile

    @classmethod
    def of(cls, result: tuple[PolicyVersion, ReconcileResult]) -> ApplyResult:
        pv, res = result
        return cls(version=pv.version, reconcile=Reconcile.model_validate(_as_dict(res)))


class DiffResult(BaseModel):
    diff: str = Field(description="unified diff of the canonical YAML, current -> proposed")
    changed: bool


class History(BaseModel):
    versions: list[VersionInfo] = Field(description="newest first")


class Status(BaseModel):
    model_config = ConfigDict(extra="allow")

    node: str
    policy_version: int = Field(description="0 when there is no policy yet")
    uplinks: dict[str, dict[str, Any]]
    last_reconcile: Reconcile | None
    store_problems: list[str]
    started_at: float
    adopted: bool
    sla: SlaView | None = None


class Flow(BaseModel):
    src: str
    dst: str
    sport: int
    dport: int
    proto: str
    class_name: str | None
    class_id: int
    modality: str | None
    packets: int
    bytes: int
    idle_s: float = Field(description="seconds since the last packet")
    rate_bps: float = Field(description="bit/s between the last two samples; 0 on the first")

    @classmethod
    def of(cls, row: FlowRow | dict[str, Any]) -> Flow:
        return cls.model_validate(_as_dict(row))


class TopFlows(BaseModel):
    flows: list[Flow]


class Health(BaseModel):
    ok: bool
