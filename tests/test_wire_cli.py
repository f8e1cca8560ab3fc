"""``mmmesh wire encode|decode`` through mmmesh.cli.main and the installed script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mmmesh import cli
from mmmesh._abi import Modality
from mmmesh.wire import Header, decode_header, encode_header

MMMESH = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "mmmesh"
TRACE_TEXT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["wire", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_encode_minimal(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "encode", "--modality", "audio")
    assert (code, err) == (0, "")
    assert out == encode_header(Header(Modality.AUDIO)).hex() + "\n"


def test_encode_all_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "encode", "--modality", "video", "--class", "5", "--stream-id", "42", "--seq", "1000",
        "--fps", "60", "--bitrate", "0x10", "--density", "3", "--payload-len", "1234",
        "--timestamp-ns", "1700000000123456789", "--deadline-ns", "1700000000223456789",
    )  # fmt: skip
    assert code == 0
    text = out.strip()
    assert text == text.lower() and " " not in text
    h = decode_header(bytes.fromhex(text))
    assert h == Header(
        Modality.VIDEO, sla_class=5, payload_len=1234, stream_id=42, sequence=1000, fps=60,
        bitrate=16, density=3, timestamp_ns=1700000000123456789, deadline_ns=1700000000223456789,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value"),
    [
        *[(m.name.lower(), m) for m in Modality],
        ("lidar", Modality.POINT_CLOUD),
        ("pointcloud", Modality.POINT_CLOUD),
        ("point_cloud", Modality.POINT_CLOUD),
        ("voice", Modality.AUDIO),
        ("Voice", Modality.AUDIO),
    ],
)
def test_encode_modality_names(capsys: pytest.CaptureFixture[str], name: str, value: int) -> None:
    code, out, _ = run(capsys, "encode", "--modality", name)
    assert code == 0 and bytes.fromhex(out.strip())[5] == value


def test_encode_unknown_modality_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "encode", "--modality", "smell")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    for name in ("unspec", "text", "image", "video", "audio", "point_cloud", "control", "tensor",
                 "lidar", "pointcloud", "voice"):  # fmt: skip
        assert name in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--fps", "70000"],
        ["--class", "256"],
        ["--stream-id", "-1"],
        ["--payload-len", "2000000000"],
    ],
)
def test_encode_out_of_range_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run(capsys, "encode", "--modality", "audio", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


def test_decode_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    h = Header(Modality.POINT_CLOUD, sla_class=2, density=120000, extra=((0x99, b"\x01"),))
    code, out, err = run(capsys, "decode", encode_header(h.with_traceparent(TRACE_TEXT)).hex())
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["modality"] == "point_cloud" and doc["sla_class"] == 2
    assert doc["density"] == 120000 and doc["traceparent"] == TRACE_TEXT
    assert doc["extra"] == [{"type": 0x99, "value": "01"}]
    assert doc["hdr_len"] == 12 + 6 + 28 + 3
    assert {"flags", "payload_len", "stream_id", "sequence", "timestamp_ns", "deadline_ns",
            "fps", "bitrate", "tensor", "error"} <= doc.keys()  # fmt: skip


def test_encode_decode_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "encode", "--modality", "voice", "--class", "3", "--seq", "9")
    code, out, _ = run(capsys, "decode", out.strip())
    doc = json.loads(out)
    assert code == 0 and (doc["modality"], doc["sla_class"], doc["sequence"]) == ("audio", 3, 9)


@pytest.mark.parametrize(
    ("hexdata", "offset", "reason"),
    [
        ("4d4d4802" + "00" * 8, 3, "unsupported version 2"),
        ("00" * 12, 0, "bad magic"),
        ("4d4d4801", 4, "truncated"),
        ("4d4d48010e04000000000000" + "0104", 13, "value runs past hdr_len"),
    ],
)
def test_decode_malformed_exits_1(
    capsys: pytest.CaptureFixture[str], hexdata: str, offset: int, reason: str
) -> None:
    code, out, err = run(capsys, "decode", hexdata)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"byte {offset}" in lines[0] and reason in lines[0]


def test_decode_not_hex_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "decode", "zz")
    assert code == 1 and "not hex" in err


def test_installed_script() -> None:
    enc = subprocess.run(
        [str(MMMESH), "wire", "encode", "--modality", "lidar", "--density", "120000"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert enc.returncode == 0, enc.stderr
    dec = subprocess.run(
        [str(MMMESH), "wire", "decode", enc.stdout.strip()],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert dec.returncode == 0, dec.stderr
    assert json.loads(dec.stdout)["density"] == 120000
    bad = subprocess.run(
        [str(MMMESH), "wire", "decode", "4d4d4809" + "00" * 8],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 1 and "unsupported version 9" in bad.stderr
