"""`mmmesh dataplane classify` is a test hook with an exact interface: one JSON
object per packet, TCP packets of one invocation sharing a flow table."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.layers.inet import IP, TCP, UDP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402
from scapy.packet import Raw  # noqa: E402
from scapy.utils import wrpcap  # noqa: E402

from mmmesh.wire import Header, encode_header  # noqa: E402
from testkit.privileged import require_privileged  # noqa: E402

pytestmark = pytest.mark.privileged
ROOT = Path(__file__).resolve().parents[3]
MMMESH = [sys.executable, "-m", "mmmesh.cli"]
POLICY = str(ROOT / "examples" / "policy.yaml")


def frames() -> list[bytes]:
    ip = IP(src="10.0.1.2", dst="10.0.2.2")
    return [
        bytes(Ether() / ip / UDP(sport=1, dport=7000) / Raw(encode_header(Header(modality=4)))),
        bytes(Ether() / ip / TCP(sport=5, dport=6, flags="PA")
              / Raw(encode_header(Header(modality=5, payload_len=4000)) + b"x" * 100)),
        bytes(Ether() / ip / TCP(sport=5, dport=6, flags="PA") / Raw(b"x" * 500)),
        bytes(Ether() / ip / UDP(sport=1, dport=7000) / Raw(b"MMH\x07garbage")),
        bytes(Ether() / ip / UDP(sport=1, dport=7000) / Raw(encode_header(Header(modality=200)))),
    ]


# The keys of one `classify --json` line, as docs/dataplane.md lists them.
JSON_KEYS = {"index", "verdict", "retval", "priority", "classid", "class_id", "class",
             "modality", "reason", "clamped", "flow_learnt", "dscp_rewritten", "duration_ns",
             "packet"}


def check(lines: list[str]) -> None:
    got = [json.loads(line) for line in lines]
    assert [g["index"] for g in got] == [0, 1, 2, 3, 4]
    assert all(set(g) == JSON_KEYS for g in got)
    assert all(g["verdict"] == "pass" for g in got)
    assert [(g["class"], g["reason"]) for g in got] == [
        ("voice", "parsed"), ("lidar", "parsed"), ("lidar", "flow_hit"),
        ("best-effort", "malformed"), ("best-effort", "parsed"),
    ]
    assert got[0]["priority"] == 0x1000B and got[0]["modality"] == "audio"
    assert got[0]["classid"] == "1:b" and got[0]["packet"] is not None  # voice has a DSCP
    assert got[3]["modality"] is None
    assert got[4]["modality"] == 200  # unknown modalities are numbers, as in wire decode


def hex_args(style: str) -> list[str]:
    """The frames as --hex arguments: all after one flag, one flag each, or mixed."""
    hexes = [f.hex() for f in frames()]
    if style == "one flag":
        return ["--hex", *hexes]
    if style == "a flag each":
        return [arg for h in hexes for arg in ("--hex", h)]
    return ["--hex", hexes[0], hexes[1], "--hex", hexes[2], "--hex", *hexes[3:]]


@pytest.mark.parametrize("style", ["one flag", "a flag each", "mixed"])
def test_classify_hex_json_keeps_every_frame(style: str) -> None:
    require_privileged()
    out = subprocess.run(
        [*MMMESH, "dataplane", "classify", "--policy", POLICY, "--json", *hex_args(style)],
        check=True, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    check(out.stdout.strip().splitlines())


def test_architecture_doc_lists_the_json_keys() -> None:
    text = (ROOT / "docs" / "dataplane.md").read_text()
    section = text[text.index("### Checking a packet: `mmmesh dataplane classify`"):]
    section = section[: section.index("\n## ")]
    assert set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)) == JSON_KEYS


def test_classify_pcap(tmp_path: Path) -> None:
    require_privileged()
    pcap = tmp_path / "in.pcap"
    wrpcap(str(pcap), [Ether(f) for f in frames()])
    out = subprocess.run(
        [*MMMESH, "dataplane", "classify", "--policy", POLICY, "--json", "--pcap", str(pcap)],
        check=True, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    check(out.stdout.strip().splitlines())


def test_bad_policy_is_refused_with_the_field_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples" / "policy.yaml").read_text().replace(
        "rate: 150mbit", "rate: lots"))
    out = subprocess.run(
        [*MMMESH, "dataplane", "classify", "--policy", str(bad), "--hex", "00" * 60],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 1
    assert "classes[2].rate" in out.stderr


def test_classify_in_egress_mode_fq_gives_bands() -> None:
    """``--egress fq``: the same verdicts, priority = the band's priomap slot,
    and the four keys docs/dataplane.md adds for it."""
    require_privileged()
    from mmmesh import abi
    from mmmesh.policy import load_policy
    from mmmesh.policy.egress import fq_band

    out = subprocess.run(
        [*MMMESH, "dataplane", "classify", "--policy", POLICY, "--egress", "fq", "--json",
         *hex_args("one flag")],
        check=True, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    got = [json.loads(line) for line in out.stdout.strip().splitlines()]
    fq_keys = {"band", "tstamp", "paced", "over_horizon"}
    assert all(set(g) == JSON_KEYS | fq_keys for g in got)
    pol = load_policy(POLICY)
    assert [(g["class"], g["reason"]) for g in got] == [
        ("voice", "parsed"), ("lidar", "parsed"), ("lidar", "flow_hit"),
        ("best-effort", "malformed"), ("best-effort", "parsed"),
    ]
    for g in got:
        band = fq_band(pol.class_named(g["class"]).priority)
        assert (g["band"], g["priority"], g["classid"]) == (band, abi.FQ_PRIO_BASE + band, None)
