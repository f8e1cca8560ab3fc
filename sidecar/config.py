"""The sidecar's configuration: a YAML file (``--config``) plus environment
overrides ``MMMESH_SIDECAR_<FIELD>`` for top-level scalars.  A model team
needs about a dozen lines:

    stage: vision-encoder
    listen: {tcp: "0.0.0.0:9000"}
    runner: {kind: python, target: "demo.pipeline.stages:vision_encoder"}
    outputs:
      - {name: fusion, address: "10.0.3.2:9000", modality: tensor, sla_class: video}
    qosd: {socket: /run/mmmesh/sla.sock}

An output to a stage with several replicas names them all (``replicas``, one
connection -- a *lane* -- to each) and how frames are spread over them
(``spread``: ``user``, by ``weights`` in the sidecar; ``kernel``, by the
socket layer's weights): docs/sidecar.md, "Replicas and lanes".
"""

from __future__ import annotations

import contextlib
import ipaddress
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mmmesh.abi import SOCK_MAX_REPLICAS, SOCK_MAX_WEIGHT
from mmmesh.net import check_hostport, parse_hostport
from mmmesh.sla.report import MAX_WINDOW_S
from mmmesh.wire import parse_modality


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _hostport(v: str | None, info: ValidationInfo) -> str | None:
    """A ``host:port`` field (``[v6-address]:port`` for IPv6), checked by
    ``mmmesh.net`` as everywhere in mmmesh; None stays None."""
    return None if v is None else check_hostport(v, what=str(info.field_name))


def _endpoint(hostport: str) -> tuple[str, int]:
    """What a checked ``host:port`` names: (the address or lower-case name, port)."""
    host, port = parse_hostport(hostport)
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    return host.lower(), port


class Listen(_M):
    tcp: str | None = Field(default="0.0.0.0:9000", description="host:port for MMH over TCP")
    udp: str | None = Field(default=None,
                            description="host:port for MMH over UDP (real-time audio)")

    _v = field_validator("tcp", "udp")(_hostport)


class RunnerConfig(_M):
    kind: Literal["python", "onnx", "kserve-rest", "kserve-grpc"]
    target: str = Field(description="python: 'package.module:function'; onnx: model file; "
                                    "kserve-*: server URL (http://host:port or host:port)")
    model_name: str | None = Field(default=None, description="kserve: model name")
    model_version: str | None = None
    input_name: str = Field(default="input", description="kserve/onnx: input tensor name")
    output_name: str | None = Field(default=None, description="kserve/onnx: output to forward "
                                                              "(default: the first)")
    timeout_s: float = Field(default=5.0, gt=0, le=600)
    concurrency: int = Field(default=1, ge=1, le=64)
    binary_data: bool = Field(default=True, description="kserve-rest: binary tensor extension")


class Output(_M):
    name: str
    address: str | None = Field(default=None, description="host:port of the downstream "
                                "sidecar (or ``replicas``)")
    replicas: tuple[str, ...] | None = Field(
        default=None, description=f"host:port of each replica of the next stage (1.."
        f"{SOCK_MAX_REPLICAS}, in replica order): one connection (lane) to each")
    weights: tuple[int, ...] | None = Field(
        default=None, description=f"spread user: one weight per replica (0..{SOCK_MAX_WEIGHT}; "
        "default: all 1)")
    spread: Literal["user", "kernel"] = Field(
        default="user", description="who spreads frames over the replicas: user = this "
        "sidecar (smooth weighted round robin by ``weights``), kernel = the node's socket "
        "layer (every frame written to the lead lane; weights from set_weights)")
    transport: Literal["tcp", "udp"] = "tcp"
    modality: str = Field(description="modality of what this stage sends (wire names)")
    sla_class: str = Field(description="SLA class name (for metrics and the header's request)")
    sla_class_id: int = Field(default=0, ge=0, le=63,
                              description="header sla_class byte (0 = let the policy decide)")
    deadline_ms: float | None = Field(default=None, gt=0,
                                      description="deadline added to the frame's timestamp")
    realtime: bool = Field(default=False, description="drop frames past their deadline")

    _a = field_validator("address")(_hostport)

    @field_validator("modality")
    @classmethod
    def _mod(cls, v: str) -> str:
        parse_modality(v)  # raises ValueError with the valid names
        return v

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return None
        if not 1 <= len(v) <= SOCK_MAX_REPLICAS:
            raise ValueError(f"replicas: 1 to {SOCK_MAX_REPLICAS} addresses (the socket "
                             f"layer's lanes per stage), got {len(v)}")
        out = tuple(check_hostport(a, what=f"replicas[{i}]") for i, a in enumerate(v))
        keys = [_endpoint(a) for a in out]  # "h:01" is "h:1", "[0::1]" is "[::1]"
        for i, a in enumerate(out):
            if keys[i] in keys[:i]:
                raise ValueError(f"replicas[{i}] {a!r}: listed twice")
        return out

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return None
        for i, w in enumerate(v):
            if not 0 <= w <= SOCK_MAX_WEIGHT:
                raise ValueError(f"weights[{i}]: {w} is not in 0..{SOCK_MAX_WEIGHT}")
        if v and not any(v):
            raise ValueError("weights: at least one must be above 0")
        return v

    @model_validator(mode="after")
    def _targets(self) -> Output:
        if (self.address is None) == (self.replicas is None):
            raise ValueError(f"output {self.name}: give either address or replicas")
        if self.replicas is None:
            if self.weights is not None:
                raise ValueError(f"output {self.name}: weights: only with replicas")
            if self.spread != "user":
                raise ValueError(f"output {self.name}: spread: kernel needs replicas")
            return self
        if self.transport != "tcp":
            raise ValueError(f"output {self.name}: replicas: only with transport tcp")
        if self.weights is not None:
            if self.spread == "kernel":
                raise ValueError(f"output {self.name}: weights: spread kernel takes the "
                                 "socket layer's weights (set_weights), not the sidecar's")
            if len(self.weights) != len(self.replicas):
                raise ValueError(f"output {self.name}: weights: {len(self.weights)} for "
                                 f"{len(self.replicas)} replicas")
        return self

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every downstream address, in replica order (one without replicas)."""
        if self.replicas is not None:
            return self.replicas
        assert self.address is not None
        return (self.address,)

    @property
    def lane_weights(self) -> tuple[int, ...]:
        """The user-space weight of each address (1 each unless ``weights``)."""
        return self.weights if self.weights is not None else (1,) * len(self.addresses)


class Limits(_M):
    max_frame_bytes: int = Field(default=64 << 20, ge=1024, description="larger frames: "
                                 "connection closed as malformed")
    inbound_queue: int = Field(default=64, ge=1, description="frames waiting for the stage")
    inbound_queue_mb: int = Field(default=8, ge=0, description="payload MiB waiting for the "
                                  "stage (0: no byte bound; one frame always fits)")
    outbound_queue: int = Field(default=64, ge=1, description="frames waiting per downstream")
    outbound_queue_mb: int = Field(default=8, ge=0, description="payload MiB waiting per "
                                   "downstream (0: no byte bound; one frame always fits)")
    read_timeout_s: float = Field(default=30.0, gt=0, description="a peer stalled mid-frame "
                                  "longer than this is disconnected")
    drain_timeout_s: float = Field(default=10.0, gt=0)
    buffer_pool_mb: int = Field(default=64, ge=0, le=4096, description="receive buffers of "
                                "large frames kept for reuse (0: allocate per frame)")


class QosdLink(_M):
    socket: Path | None = Field(default=Path("/run/mmmesh/sla.sock"),
                                description="qosd's report-only socket (POST /v1/sla)")
    report_interval_s: float = Field(default=5.0, gt=0, le=MAX_WINDOW_S,
                                     description="seconds per SLA window (at most a day: "
                                                 "the report schema's bound)")


class SidecarConfig(_M):
    stage: str
    listen: Listen = Listen()
    runner: RunnerConfig
    outputs: tuple[Output, ...] = ()
    default_sla_class: str = Field(default="best-effort",
                                   description="class name used for inputs' metrics")
    limits: Limits = Limits()
    qosd: QosdLink = QosdLink()
    metrics_addr: str | None = Field(default=None, description="host:port for /metrics "
                                     "(\":9090\": every interface)")
    instance: str | None = Field(default=None, max_length=253, description="this sidecar's "
                                 "name in SLA reports (replicas of a stage are kept apart by "
                                 "qosd and merged); default: hostname/pid (in Kubernetes the "
                                 "hostname is the pod name)")
    otel: bool = Field(default=False, description="export spans with OpenTelemetry "
                                                  "(OTEL_* environment configures it)")

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, v: str | None) -> str | None:
        return None if v is None else check_hostport(v, default_host="0.0.0.0",
                                                     what="metrics_addr")

    @model_validator(mode="after")
    def _unique_outputs(self) -> SidecarConfig:
        names = [o.name for o in self.outputs]
        if len(set(names)) != len(names):
            raise ValueError("output names must be unique")
        return self


def load_config(path: str | Path) -> SidecarConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    return SidecarConfig.model_validate(data)
