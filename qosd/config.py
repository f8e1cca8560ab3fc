"""qosd's configuration: /etc/mmmesh/qosd.yaml, every field overridable by
environment (``MMMESH_QOSD_<FIELD>``, e.g. ``MMMESH_QOSD_RESYNC_INTERVAL_S=5``).

Precedence: environment > file > defaults.  The file is the one named by
``--config`` or ``MMMESH_QOSD_CONFIG``; a missing default file is fine, a
missing named file is an error."""

from __future__ import annotations

import ipaddress
import os
import socket
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from mmmesh.abi import SOCK_MAX_REPLICAS, SOCK_TUNABLES
from mmmesh.net import parse_hostport
from mmmesh.policy import IfName, Rate
from qosd.sla.quota import SlaLimits
from qosd.sla.reporters import DEFAULT_REPORTERS, ReporterRule

DEFAULT_CONFIG = Path("/etc/mmmesh/qosd.yaml")
MIB = 1 << 20


class PeersConfig(BaseModel):
    """The ``peers:`` section: this qosd as a member of the mesh (qosd/mesh/membership,
    docs/operations.md "Peers").  Without it qosd runs alone."""

    model_config = ConfigDict(extra="forbid")

    listen: str = Field(default="0.0.0.0:7946", description="host:port of the peer gRPC server")
    advertise: str | None = Field(
        default=None, description="host:port peers reach this node at (needed when listen "
        "is a wildcard address)")
    seeds: list[str] = Field(default_factory=list, description="host:port of members to join "
                             "through; a DNS name stands for all its A/AAAA records")
    cert_file: Path = Field(description="this node's certificate (PEM; URI SAN "
                            "spiffe://<trust_domain>/node/<node_name>)")
    key_file: Path = Field(description="its private key (PEM)")
    ca_file: Path = Field(description="the mesh CA: peers must present certificates it issued")
    trust_domain: str = Field(default="mmmesh", pattern=r"^[a-z0-9.-]+$")
    max_gossip_bytes: int = Field(default=64 * 1024, ge=4096, le=MIB)
    max_push_pull_bytes: int = Field(default=4 * MIB, ge=64 * 1024, le=64 * MIB)
    push_pull_timeout_s: float = Field(default=5.0, gt=0, le=60)
    identify_timeout_s: float = Field(default=2.0, gt=0, le=60,
                                      description="TLS handshake that identifies a seed")
    rejoin_interval_s: float = Field(default=5.0, gt=0, le=3600, description="while no other "
                                     "member is known: resolve the seeds and join again")
    rate_packets_per_s: float = Field(default=200.0, gt=0, description="per peer identity")
    rate_burst_packets: int = Field(default=400, ge=1)
    rate_bytes_per_s: float = Field(default=2.0 * MIB, gt=0, description="per peer identity")
    rate_burst_bytes: int = Field(default=16 * MIB, ge=64 * 1024)
    max_inflight: int = Field(default=64, ge=1, le=4096,
                              description="calls under way to one peer; more are dropped")
    leave_timeout_s: float = Field(default=3.0, ge=0, le=60,
                                   description="on stop: gossip the leave this long at most")
    protocol: dict[str, float] = Field(
        default_factory=dict, description="overrides of qosd.mesh.membership.core.Config (timers: "
        "probe_interval_s, suspicion_mult, ...; docs/cluster.md)")

    @field_validator("listen", "advertise", "seeds")
    @classmethod
    def _addresses(cls, v: Any, info: ValidationInfo) -> Any:
        for text in [v] if isinstance(v, str) else v or []:
            _, port = parse_hostport(text, what=str(info.field_name))
            if port == 0:
                raise ValueError(f"{info.field_name} {text!r}: needs a fixed port")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> PeersConfig:
        host, _ = parse_hostport(self.listen)
        if self.advertise is None and host in ("0.0.0.0", "::", ""):
            raise ValueError("peers.advertise is needed when peers.listen is a wildcard address")
        if self.rate_burst_bytes < self.max_push_pull_bytes:
            raise ValueError("peers.rate_burst_bytes must be >= peers.max_push_pull_bytes")
        self.core_config()  # unknown or invalid protocol settings fail here
        return self

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen

    def core_config(self) -> Any:
        """The membership core's ``Config`` with ``protocol`` applied."""
        import dataclasses

        from qosd.mesh.membership.core import Config

        names = {f.name: f.type for f in dataclasses.fields(Config)}
        unknown = sorted(set(self.protocol) - set(names))
        if unknown:
            raise ValueError(f"peers.protocol: unknown setting(s) {', '.join(unknown)}")
        values = {k: int(v) if names[k] in ("int", int) else float(v)
                  for k, v in self.protocol.items()}
        return Config(**values)  # type: ignore[arg-type]  # Config checks each value


class EtcdSection(BaseModel):
    """``cluster.etcd``: where the mesh's etcd is and how this node uses it
    (docs/cluster.md "Choosing a back end", docs/operations.md "etcd")."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[str] = Field(min_length=1, description="host:port of etcd's members "
                                 "(client URLs; a name stands for all its addresses)")
    cert_file: Path | None = Field(default=None, description="this node's client certificate "
                                   "(PEM), for etcd's --client-cert-auth")
    key_file: Path | None = Field(default=None, description="its private key (PEM)")
    ca_file: Path | None = Field(default=None, description="the CA of etcd's server "
                                 "certificates; set: TLS, unset: plain HTTP/2")
    server_name: str | None = Field(default=None, description="the name etcd's certificate "
                                    "must carry (default: the first endpoint's host)")
    prefix: str = Field(default="/mmmesh/", pattern=r"^/[A-Za-z0-9._/-]*$",
                        description="every key of this mesh lives under it")
    lease_ttl_s: int = Field(default=10, ge=2, le=3600, description="a node that stops "
                             "renewing its lease is gone this long after (renewed every ttl/3)")
    timeout_s: float = Field(default=5.0, gt=0, le=60, description="deadline of one request")
    sla_period_s: float = Field(default=5.0, gt=0, le=3600, description="this node's SLA "
                                "windows are written this often (one key per node)")
    advertise: str | None = Field(default=None, description="an address shown for this node "
                                  "in the members table (display only)")

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        for text in v:
            _, port = parse_hostport(text.split("://")[-1], what="cluster.etcd.endpoints")
            if port == 0:
                raise ValueError(f"cluster.etcd.endpoints {text!r}: needs a port")
        return v

    @model_validator(mode="after")
    def _tls(self) -> EtcdSection:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cluster.etcd: cert_file and key_file go together")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("cluster.etcd: a client certificate needs ca_file (TLS)")
        return self


class ClusterConfig(BaseModel):
    """``cluster:``: which back end holds the mesh's policy versions, reports
    and SLA windows.  ``gossip`` (default) is the ``peers:`` section's mesh;
    ``etcd`` needs ``cluster.etcd``."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["gossip", "etcd"] = "gossip"
    etcd: EtcdSection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        if self.backend == "etcd" and self.etcd is None:
            raise ValueError("cluster.backend etcd needs a cluster.etcd section")
        return self


class MeshLink(BaseModel):
    """This node's uplink for mesh-wide policies (``mmmeshctl policy apply --cluster``):
    the fields given replace the policy's ``link`` (docs/policy.md, "Mesh-wide and
    per-node fields"); without ``mesh_link`` the policy's link is applied as written."""

    model_config = ConfigDict(extra="forbid")

    device: IfName | None = Field(default=None, description="interface to shape")
    rate: Rate | None = Field(default=None, description="its capacity, bit/s (tc units)")


class SockEndpointConfig(BaseModel):
    """One replica of a stage as the socket layer sees it: ``address:port`` is
    replica ``replica`` (port 0: every port of the address, a pod)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(description="the replica's (pod's) own IP address")
    port: int = Field(default=0, ge=0, le=65535, description="its listening port; 0 = any")
    replica: int = Field(default=0, ge=0, lt=SOCK_MAX_REPLICAS,
                         description=f"replica index 0..{SOCK_MAX_REPLICAS - 1}")
    instance: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="whose SLA windows speak for this replica: the instance qosd ties its "
        "reports to (GET /v1/sla instances[].instance: unit:<name>.service, pod:<uid>/<id>, "
        "uid:<uid>:<cgroup>, or the label root/the admin socket names); none: not judged")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address") from None


class SockStageConfig(BaseModel):
    """A stage of the mesh on this node: its name (as its sidecars report
    it), the socket layer's number for it, its replicas' endpoints and the
    source prefixes of its pods (the key of its stage overrides)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="the stage as SLA reports "
                      "name it (POST /v1/sla stage)")
    id: int = Field(ge=1, le=0xFFFFFFFF, description="the socket layer's stage number")
    endpoints: list[SockEndpointConfig] = Field(default_factory=list, max_length=64)
    senders: list[str] | None = Field(
        default=None, max_length=64, description="source prefixes of the stage's pods "
        "(stage overrides); default: its endpoints' addresses")

    @field_validator("senders")
    @classmethod
    def _prefixes(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        out = []
        for i, p in enumerate(v):
            try:
                out.append(str(ipaddress.ip_network(p, strict=False)))
            except ValueError as e:
                raise ValueError(f"senders[{i}] {p!r}: {e}") from None
        return out

    @model_validator(mode="after")
    def _replicas(self) -> SockStageConfig:
        seen: dict[int, str] = {}
        owner: dict[str, int] = {}
        for j, e in enumerate(self.endpoints):
            if e.instance is not None and seen.setdefault(e.replica, e.instance) != e.instance:
                raise ValueError(f"replica {e.replica} has two instances: "
                                 f"{seen[e.replica]!r} and {e.instance!r}")
            if e.instance is not None and owner.setdefault(e.instance, e.replica) != e.replica:
                raise ValueError(f"endpoints[{j}].instance {e.instance!r}: already speaks for "
                                 f"replica {owner[e.instance]} (one reporter, one replica)")
        return self

    def sender_prefixes(self) -> list[str]:
        """``senders``, or the endpoints' addresses as host prefixes."""
        if self.senders is not None:
            return list(self.senders)
        return sorted({str(ipaddress.ip_network(e.address)) for e in self.endpoints})


class SocketLayerConfig(BaseModel):
    """``socket_layer:``: the stages of this node (names, endpoints, sender
    prefixes: qosd drives stage overrides from them whether or not the
    socket layer is on) and the socket layer itself (sockops + SOCKHASH +
    sk_msg, docs/socklayer.md "qosd"), off by default."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="load (or adopt) the socket layer at "
                          "start and drive its replica weights")
    cgroup: str = Field(default="", max_length=4096, description="cgroup v2 of the mesh's pods: "
                        "a path below the cgroup v2 mount (wherever it is), or absolute inside "
                        "it; '' = the root (every socket of the node; the endpoints filter)")
    redirect: bool = Field(default=True, description="same-node frames socket to socket "
                           "(sk_msg redirect); false: everything over TCP, still counted")
    all_sockets: bool = Field(default=False, description="every TCP socket of the cgroup is a "
                              "mesh socket (refused with the root cgroup)")
    stages: list[SockStageConfig] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> SocketLayerConfig:
        names: set[str] = set()
        ids: set[int] = set()
        eps: set[tuple[str, int]] = set()
        for i, st in enumerate(self.stages):
            if st.name in names:
                raise ValueError(f"stages[{i}].name {st.name!r}: used by another stage")
            if st.id in ids:
                raise ValueError(f"stages[{i}].id {st.id}: used by another stage")
            names.add(st.name)
            ids.add(st.id)
            for j, e in enumerate(st.endpoints):
                if (e.address, e.port) in eps:
                    raise ValueError(f"stages[{i}].endpoints[{j}] {e.address}:{e.port}: "
                                     "listed twice")
                eps.add((e.address, e.port))
        if len(eps) > (cap := SOCK_TUNABLES["MM_SOCK_MAX_ENDPOINTS"]):
            raise ValueError(f"stages[].endpoints: {len(eps)} in all, the socket layer holds "
                             f"at most {cap}")
        if self.all_sockets and self.cgroup.strip("/") in ("", "."):
            raise ValueError("all_sockets needs a cgroup: on the root it would take every "
                             "socket of the node")
        return self


class EgressConfig(BaseModel):
    """``egress:``: how this node's uplink realises the policy's classes
    (docs/dataplane.md "Egress modes"; docs/operations.md "Egress modes").

    ``htb``: one root HTB (hard guarantees; one qdisc lock for every TX
    queue); ``fq``: mq with one sch_fq per TX queue, priority bands and EDT
    pacing per class (no root lock; guarantees per band); ``auto``: fq when
    the device has more than one TX queue and the kernel has sch_fq with
    priority bands (Linux >= 6.7), else htb."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "htb", "fq"] = Field(
        default="auto", description="auto | htb | fq; auto: fq on a multiqueue device whose "
        "kernel has sch_fq bands, else htb")


class QosdConfig(BaseSettings):
    """Everything qosd needs to know about its node."""

    model_config = SettingsConfigDict(env_prefix="MMMESH_QOSD_", extra="forbid")

    node_name: str = Field(default_factory=socket.gethostname,
                           description="name reported to peers and in status")
    uplinks: list[str] = Field(
        default_factory=list,
        description="devices qosd may shape; empty = whatever the policy's link.device names",
    )
    netns: str | None = Field(default=None,
                              description="network namespace of the uplinks (testbeds)")
    state_dir: Path = Field(default=Path("/var/lib/mmmesh"),
                            description="policy store (versions, history)")
    api_socket: Path = Field(default=Path("/run/mmmesh/qosd.sock"),
                             description="admin API unix socket (mode 0600)")
    sla_socket: Path | None = Field(
        default=Path("/run/mmmesh/sla.sock"),
        description="report-only socket for sidecars (POST /v1/sla only, mode 0666)")
    sla_reporters: list[ReporterRule] = Field(
        default_factory=lambda: list(DEFAULT_REPORTERS),
        description="who may report which stages on sla_socket (qosd/sla/reporters.py); default: "
                    "root any, units mmmesh-sidecar@<stage>.service their own, pods any")
    sla_limits: SlaLimits = Field(
        default_factory=SlaLimits,
        description="per-sender, per-uid and board-wide bounds of the SLA board "
                    "(qosd/sla/quota.py)")
    api_tcp: str | None = Field(default=None,
                                description="host:port for the admin API over TCP (token needed)")
    api_token: str | None = Field(default=None, description="bearer token for the TCP API")
    api_token_file: Path | None = Field(default=None, description="file holding the token")
    metrics_addr: str | None = Field(default="127.0.0.1:9464",
                                     description="host:port of the Prometheus endpoint")
    resync_interval_s: float = Field(default=10.0, gt=0, le=3600,
                                     description="periodic drift check and repair")
    sla_controller_period_s: float = Field(
        default=5.0, gt=0, le=3600,
        description="the SLA controller's window (docs/controller.md); the sidecars' "
        "report interval")
    sla_controller_enabled: bool = Field(
        default=True, description="run the SLA controller; false: the kernel keeps the "
        "policy's values whatever the SLA windows say (explain still answers)")
    initial_policy: Path | None = Field(
        default=None, description="policy applied at first start, when the store is empty")
    history_limit: int = Field(default=50, ge=2, le=10000)
    log_level: str = Field(default="INFO")
    peers: PeersConfig | None = Field(default=None, description="membership in the mesh "
                                      "(gRPC, mTLS); none: this node runs alone")
    mesh_link: MeshLink | None = Field(
        default=None, description="this node's link for mesh-wide policies (device, rate); "
        "none: the policy's link as written")
    cluster: ClusterConfig | None = Field(
        default=None, description="the mesh's store: gossip (the peers: section, default) or "
        "etcd (cluster.etcd)")
    socket_layer: SocketLayerConfig = Field(
        default_factory=SocketLayerConfig, description="the stages of this node and the socket "
        "layer (sockops + sk_msg; off by default; docs/socklayer.md \"qosd\")")
    egress: EgressConfig = Field(
        default_factory=EgressConfig, description="the uplink's egress mode: auto (default), "
        "htb or fq (docs/dataplane.md \"Egress modes\")")

    @model_validator(mode="after")
    def _one_backend(self) -> QosdConfig:
        if self.cluster is not None and self.cluster.backend == "etcd" and self.peers is not None:
            raise ValueError("cluster.backend is etcd: remove the peers: section (the gossip "
                             "back end's)")
        return self

    @field_validator("api_tcp", "metrics_addr")
    @classmethod
    def _hostport(cls, v: str | None, info: ValidationInfo) -> str | None:
        """``host:port`` or ``[v6-address]:port`` (mmmesh/net.py); "" means None.
        Port 0 is refused: clients must know where to connect."""
        if v is None or v == "":
            return None
        _, port = parse_hostport(v, what=str(info.field_name))
        if port == 0:
            raise ValueError(f"{info.field_name} {v!r}: needs a fixed port (1..65535), not 0")
        return v

    def token(self) -> str | None:
        if self.api_token:
            return self.api_token
        if self.api_token_file:
            return self.api_token_file.read_text().strip() or None
        return None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _CONFIG_FILE.get() or os.environ.get("MMMESH_QOSD_CONFIG") or str(DEFAULT_CONFIG)
        return (init_settings, env_settings,
                YamlConfigSettingsSource(settings_cls, yaml_file=path))


_CONFIG_FILE: ContextVar[str | None] = ContextVar("qosd_config_file", default=None)
"""The file :func:`load_config` reads (for the settings source; the process
environment is left as it was)."""


def load_config(path: str | None = None, **overrides: Any) -> QosdConfig:
    """Reads the config file (``path``, else ``MMMESH_QOSD_CONFIG``, else the
    default) with env overrides."""
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    token = _CONFIG_FILE.set(path)
    try:
        return QosdConfig(**overrides)
    finally:
        _CONFIG_FILE.reset(token)
