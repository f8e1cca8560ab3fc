"""The sidecar YAML a model team copies from docs/sidecar.md is valid and short."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from sidecar.config import SidecarConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_sidecar_yaml_is_valid_and_a_dozen_lines() -> None:
    doc = (ROOT / "docs" / "sidecar.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert block, "docs/sidecar.md has no yaml example"
    text = block.group(1)
    cfg = SidecarConfig.model_validate(yaml.safe_load(text))
    assert cfg.stage and cfg.outputs and cfg.runner.target
    # the report-only socket: sidecars run without root and cannot use the admin one
    assert str(cfg.qosd.socket) == "/run/mmmesh/sla.sock"
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 14, f"{len(lines)} lines"


def test_every_top_level_field_is_in_the_docs() -> None:
    doc = (ROOT / "docs" / "sidecar.md").read_text()
    missing = [f for f in SidecarConfig.model_fields if f"`{f}`" not in doc and f"{f}:" not in doc]
    assert not missing, f"docs/sidecar.md does not name {missing}"
