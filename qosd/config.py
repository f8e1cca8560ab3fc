"""qosd's configuration: /etc/mmmesh/qosd.yaml, every field overridable by
environment (``MMMESH_QOSD_<FIELD>``, e.g. ``MMMESH_QOSD_RESYNC_INTERVAL_S=5``).

Precedence: environment > file > defaults.  The file is the one named by
``--config`` or ``MMMESH_QOSD_CONFIG``; a missing default file is fine, a
missing named file is an error."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from mmmesh._net import parse_hostport

from .reporters import DEFAULT_REPORTERS, ReporterRule
from .slaquota import SlaLimits

DEFAULT_CONFIG = Path("/etc/mmmesh/qosd.yaml")


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
        description="who may report which stages on sla_socket (qosd/reporters.py); default: "
                    "root any, units mmmesh-sidecar@<stage>.service their own, pods any")
    sla_limits: SlaLimits = Field(
        default_factory=SlaLimits,
        description="per-sender, per-uid and board-wide bounds of the SLA board "
                    "(qosd/slaquota.py)")
    api_tcp: str | None = Field(default=None,
                                description="host:port for the admin API over TCP (token needed)")
    api_token: str | None = Field(default=None, description="bearer token for the TCP API")
    api_token_file: Path | None = Field(default=None, description="file holding the token")
    metrics_addr: str | None = Field(default="127.0.0.1:9464",
                                     description="host:port of the Prometheus endpoint")
    resync_interval_s: float = Field(default=10.0, gt=0, le=3600,
                                     description="periodic drift check and repair")
    initial_policy: Path | None = Field(
        default=None, description="policy applied at first start, when the store is empty")
    history_limit: int = Field(default=50, ge=2, le=10000)
    log_level: str = Field(default="INFO")

    @field_validator("api_tcp", "metrics_addr")
    @classmethod
    def _hostport(cls, v: str | None, info: ValidationInfo) -> str | None:
        """``host:port`` or ``[v6-address]:port`` (mmmesh/_net.py); "" means None.
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
        path = os.environ.get("MMMESH_QOSD_CONFIG") or str(DEFAULT_CONFIG)
        return (init_settings, env_settings,
                YamlConfigSettingsSource(settings_cls, yaml_file=path))


def load_config(path: str | None = None, **overrides: Any) -> QosdConfig:
    """Reads the config file (``path`` or the default) with env overrides."""
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"config file {path} does not exist")
        os.environ["MMMESH_QOSD_CONFIG"] = path
    return QosdConfig(**overrides)
