"""``mmmesh wire encode|decode`` through mmmesh.cli.main and the installed script."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from mmmesh import cli
from mmmesh.abi import DType, Modality
from mmmesh.wire import Header, TensorSpec, decode_header, encode_header

ROOT = Path(__file__).resolve().parents[3]
MMMESH = ROOT / ".venv" / "bin" / "mmmesh"
JSON_KEYS = [
    "modality", "sla_class", "flags", "payload_len", "stream_id", "sequence", "timestamp_ns",
    "deadline_ns", "fps", "bitrate", "density", "tensor", "traceparent", "error", "extra",
    "hdr_len",
]  # fmt: skip
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
        ("", 0, "truncated"),
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


def decode_json(capsys: pytest.CaptureFixture[str], h: Header) -> dict[str, object]:
    code, out, err = run(capsys, "decode", encode_header(h).hex())
    assert (code, err) == (0, "")
    doc: dict[str, object] = json.loads(out)
    return doc


def test_decode_json_has_every_key_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    doc = decode_json(capsys, Header(Modality.AUDIO))
    assert list(doc) == JSON_KEYS
    assert doc["extra"] == [] and all(doc[k] is None for k in JSON_KEYS[4:14])


@pytest.mark.parametrize(
    ("modality", "dtype", "want_modality", "want_dtype"),
    [
        (Modality.VIDEO, DType.FP32, "video", "FP32"),
        (Modality.UNSPEC, DType.BF16, "unspec", "BF16"),
        (8, 0, 8, 0),  # unknown values are printed as numbers, not strings
        (200, 15, 200, 15),
        (255, 255, 255, 255),
    ],
)
def test_decode_unknown_modality_and_dtype_are_numbers(
    capsys: pytest.CaptureFixture[str], modality: int, dtype: int, want_modality: object,
    want_dtype: object,
) -> None:
    doc = decode_json(capsys, Header(modality, tensor=TensorSpec(dtype, (2, 3))))
    assert doc["modality"] == want_modality and type(doc["modality"]) is type(want_modality)
    assert doc["tensor"] == {"dtype": want_dtype, "shape": [2, 3]}


def test_decode_json_values(capsys: pytest.CaptureFixture[str]) -> None:
    h = Header(4, flags=0xFF, sequence=2**64 - 1, error=(65535, "déjà"),
               traceparent=b"\xff" * 26, extra=((0xF0, b""), (0x99, b"\xab\x01")))  # fmt: skip
    doc = decode_json(capsys, h)
    assert doc["flags"] == 0xFF and doc["sequence"] == 2**64 - 1
    assert doc["error"] == {"code": 65535, "message": "déjà"}
    assert doc["traceparent"] == "ff-" + "f" * 32 + "-" + "f" * 16 + "-ff"
    assert doc["extra"] == [{"type": 0xF0, "value": ""}, {"type": 0x99, "value": "ab01"}]


def test_docs_decode_example_is_what_the_cli_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The console example of docs/wire-format.md section 9, to the byte."""
    text = (ROOT / "docs" / "wire-format.md").read_text()
    section = text[text.index("## 9. The JSON of `mmmesh wire decode`") :]
    m = re.search(r"```console\n\$ mmmesh wire decode (\w+)\n(.*?)```", section, re.DOTALL)
    assert m is not None
    code, out, _ = run(capsys, "decode", m.group(1))
    assert code == 0 and out == m.group(2)
    first_cells = re.findall(r"^\| (`[a-z_]+`.*?) \|", section, flags=re.MULTILINE)
    documented = [k for cell in first_cells for k in re.findall(r"`([a-z_]+)`", cell)]
    assert documented == JSON_KEYS  # the key table names every key, in order


def test_encode_writes_reserved_flag_bits_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "encode", "--modality", "audio", "--flags", "0x81")
    assert code == 0 and decode_header(bytes.fromhex(out.strip())).flags == 0x81


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
