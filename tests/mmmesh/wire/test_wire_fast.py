"""The compiled codec (mmmesh/wire/_cwire.c) against the pure-Python reference
(mmmesh/wire/_codec.py), byte for byte (hypothesis).

For every input, both give the same result (the same header bytes; decoded
headers with the same fields, values, value types and hdr_len; the same
payload views) or the same exception (type, message, WireError reason and
offset).  Also: the compiled path is what ``mmmesh.wire`` runs when it was
built, ``MMMESH_WIRE=python`` and a missing extension select the reference.

The extension is built at install (pyproject.toml, optional); a checkout
without it skips the comparisons (and fails them when CI is set: the suite
must have run them)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mmmesh import wire
from mmmesh.abi import MMH_MAX_PAYLOAD, Flag, Modality, Tlv
from mmmesh.wire import Header, TensorSpec, _codec

try:
    from mmmesh.wire import _cwire  # type: ignore[attr-defined]
except ImportError:  # not built here
    _cwire = None

if _cwire is not None and _codec.IMPLEMENTATION != "c":  # (MMMESH_WIRE=python: set it up here)
    _cwire.setup(Header, TensorSpec, _codec._py_decode_header, _codec._py_decode_frame,
                 _codec._py_encode_header, _codec._py_frame)
if _cwire is None and os.environ.get("CI"):
    pytest.fail("mmmesh/wire/_cwire was not built (pip install -e . builds it)", pytrace=False)
needs_c = pytest.mark.skipif(_cwire is None, reason="the compiled codec is not built here")

MANY = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KNOWN_TYPES = {int(t) for t in Tlv}
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
# values around and beyond every field's range, of the wrong type too
wild_int = st.one_of(st.integers(-2, 2**64 + 2), st.sampled_from([2**8, 2**16, 2**32, 2**63,
                                                                   -(2**63), 2**200]))
wild = st.one_of(wild_int, st.booleans(), st.floats(allow_nan=False), st.text(max_size=3),
                 st.none())


def opt(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | s


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly good values, sometimes wild ones."""
    return st.one_of(good, good, good, wild)


headers = st.builds(
    Header,
    modality=field(u8) | st.sampled_from(list(Modality)),
    sla_class=field(u8),
    flags=field(st.sampled_from([0, int(Flag.ERROR), int(Flag.END_OF_STREAM), 3]) | u8),
    payload_len=field(st.integers(0, MMH_MAX_PAYLOAD + 1)),
    stream_id=opt(field(u32)),
    sequence=opt(field(u64)),
    timestamp_ns=opt(field(u64)),
    deadline_ns=opt(field(u64)),
    fps=opt(field(u16)),
    bitrate=opt(field(u32)),
    density=opt(field(u32)),
    tensor=opt(st.builds(TensorSpec, field(u8),
                         st.one_of(st.lists(field(u32), max_size=10).map(tuple),
                                   st.lists(u32, max_size=3)))),
    traceparent=opt(st.one_of(st.binary(min_size=26, max_size=26),
                              st.binary(min_size=26, max_size=26).map(bytearray),
                              st.binary(min_size=26, max_size=26).map(memoryview),
                              st.binary(max_size=30))),
    error=opt(st.one_of(st.tuples(field(u16), st.text(max_size=300)),
                        st.tuples(u16, st.just("\udc80")), st.lists(u16, max_size=2))),
    extra=st.one_of(st.just(()), st.lists(
        st.tuples(u8, st.binary(max_size=12)), max_size=4).map(tuple)),
)
# every field within its range: what a sidecar sends and receives
valid_headers = st.builds(
    Header,
    modality=u8,
    sla_class=u8,
    flags=st.sampled_from([0, int(Flag.ERROR), int(Flag.END_OF_STREAM), 3]) | u8,
    payload_len=st.integers(0, MMH_MAX_PAYLOAD),
    stream_id=opt(u32),
    sequence=opt(u64),
    timestamp_ns=opt(u64),
    deadline_ns=opt(u64),
    fps=opt(u16),
    bitrate=opt(u32),
    density=opt(u32),
    tensor=opt(st.builds(TensorSpec, u8, st.lists(u32, max_size=8).map(tuple))),
    traceparent=opt(st.binary(min_size=26, max_size=26)),
    error=opt(st.tuples(u16, st.text(max_size=40))),
    # (unknown TLVs to encode go to the reference: mostly none, so the compiled path runs)
    extra=st.just(()) | st.just(()) | st.lists(
        st.tuples(u8.filter(lambda t: t not in KNOWN_TYPES), st.binary(max_size=12)),
        min_size=1, max_size=3).map(tuple),
)
aligns = st.one_of(st.just(1), st.integers(-1, 66), st.sampled_from([4, 8, 16, 64, True]))


def norm(v: Any) -> Any:
    """A comparable picture of a codec result: types and values all the way down."""
    if isinstance(v, Header):
        return ("Header", [(k, norm(x)) for k, x in vars(v).items()],
                [(k, norm(getattr(v, k))) for k in Header.__dataclass_fields__])
    if isinstance(v, TensorSpec):
        return ("TensorSpec", norm(v.dtype), norm(v.shape))
    if isinstance(v, memoryview):
        return ("memoryview", v.format, v.ndim, v.nbytes, v.tobytes())
    if isinstance(v, list | tuple):
        return (type(v).__name__, [norm(x) for x in v])
    return (type(v).__name__, v)


def outcome(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return ("ok", norm(fn(*args, **kw)))
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        return ("raised", type(e).__name__, str(e), getattr(e, "reason", None),
                getattr(e, "offset", None))


def same(c_fn: Any, py_fn: Any, *args: Any, **kw: Any) -> Any:
    got, want = outcome(c_fn, *args, **kw), outcome(py_fn, *args, **kw)
    assert got == want, (args, kw)
    return got


def encodings(h: Header) -> list[bytes]:
    out = []
    for align in (1, 8):
        try:
            out.append(_codec._py_encode_header(h, align=align))
        except (ValueError, TypeError):
            pass
    return out


def buffers(data: bytes) -> list[Any]:
    """The same bytes as the buffer kinds a sidecar hands the codec."""
    padded = bytearray(b"\xee" + data)
    return [data, bytearray(data), memoryview(data), memoryview(padded)[1:],
            np.frombuffer(data, dtype=np.uint8) if data else data]


# --------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------
@needs_c
@MANY
@given(headers | valid_headers, aligns, st.none() | st.integers(-1, MMH_MAX_PAYLOAD + 1))
@example(Header(Modality.AUDIO, stream_id=7, sequence=1, tensor=TensorSpec(1, (4,))), 1, None)
@example(Header(Modality.TEXT, error=(1, "x" * 240)), 1, None)  # one byte over 255
def test_encode_header_is_the_reference(h: Header, align: Any, plen: int | None) -> None:
    same(_cwire.encode_header, _codec._py_encode_header, h)
    same(_cwire.encode_header, _codec._py_encode_header, h, align=align)
    same(_cwire.encode_header, _codec._py_encode_header, h, align=align, payload_len=plen)


@needs_c
@MANY
@given(headers | valid_headers, aligns, st.sampled_from(["bytes", "bytearray", "u8", "f32", "2d", "empty",
                                         "strided", "int", "none", "i8", "bool", "scalar",
                                         "0d", "view"]))
def test_frame_is_the_reference(h: Header, align: Any, kind: str) -> None:
    payload: Any = {
        "bytes": b"abc", "bytearray": bytearray(5), "u8": np.arange(7, dtype=np.uint8),
        "f32": np.arange(6, dtype=np.float32), "2d": np.ones((3, 4), dtype=np.int16),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "strided": np.arange(10, dtype=np.float64)[::2], "int": 3, "none": None,
        "i8": np.array([5], dtype=np.int8), "bool": np.array([True, False]),
        "scalar": np.float32(2.5), "0d": np.array(7, dtype=np.int64),
        "view": memoryview(b"abcdef")[1:4],
    }[kind]
    same(_cwire.frame, _codec._py_frame, h, payload)
    same(_cwire.frame, _codec._py_frame, h, payload, align=align)
    same(_cwire.frame, _codec._py_frame, h)


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------
@needs_c
@MANY
@given(st.binary(max_size=300))
def test_decode_of_random_bytes_is_the_reference(data: bytes) -> None:
    for raw in (data, b"MMH\x01" + data, b"MMH\x01" + bytes([12 + len(data) % 244]) + data):
        for buf in buffers(raw):
            same(_cwire.decode_header, _codec._py_decode_header, buf)
            same(_cwire.decode_frame, _codec._py_decode_frame, buf)


@needs_c
@MANY
@given(valid_headers, st.data())
def test_decode_of_valid_and_mutated_headers_is_the_reference(h: Header,
                                                              data: st.DataObject) -> None:
    for raw in encodings(h):
        payload = data.draw(st.binary(max_size=40))
        for buf in buffers(raw + payload):  # valid (the payload may be short: truncated)
            same(_cwire.decode_header, _codec._py_decode_header, buf)
            same(_cwire.decode_frame, _codec._py_decode_frame, buf)
        mutated = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(mutated) - 1))
            mutated[i] = data.draw(u8)
        for buf in buffers(bytes(mutated) + payload):
            same(_cwire.decode_header, _codec._py_decode_header, buf)
            same(_cwire.decode_frame, _codec._py_decode_frame, buf)


@needs_c
def test_every_size_and_count_limit_is_the_reference() -> None:
    """The edges hypothesis rarely draws: an ERROR message of every length
    around the 255-byte TLV and header limits, with and without other TLVs;
    every tensor rank 0..9; every alignment; 15..18 TLVs (PAD and unknown)."""
    full = Header(Modality.VIDEO, 3, 1, 10, stream_id=1, sequence=2, timestamp_ns=3,
                  deadline_ns=4, fps=5, bitrate=6, density=7,
                  tensor=TensorSpec(1, (2, 3)), traceparent=bytes(range(26)))
    for base in (Header(Modality.TEXT), full):
        for n in range(262):
            for msg in ("x" * n, "é" * (n // 2)):
                h = Header(**{**vars(base), "error": (9, msg)})
                for align in (1, 4, 64):
                    same(_cwire.encode_header, _codec._py_encode_header, h, align=align)
                    for raw in encodings(h):
                        same(_cwire.decode_header, _codec._py_decode_header, raw)
    for ndim in range(10):
        h = Header(Modality.TENSOR, tensor=TensorSpec(ndim % 256, tuple(range(1, ndim + 1))))
        same(_cwire.encode_header, _codec._py_encode_header, h)
        for raw in encodings(h):
            same(_cwire.decode_header, _codec._py_decode_header, raw)
    for align in range(-1, 70):
        for h in (Header(Modality.TEXT), full, Header(1, stream_id=1, fps=3)):
            same(_cwire.encode_header, _codec._py_encode_header, h, align=align)
            same(_cwire.frame, _codec._py_frame, h, b"abc", align=align)
    for count in range(14, 19):
        for tlv in (b"\x00\x00", b"\x77\x01z", b"\x00\x03abc"):
            body = tlv * count
            raw = b"MMH\x01" + bytes([12 + len(body) if 12 + len(body) < 256 else 255]) + \
                b"\x07\x00\x00\x00\x00\x00\x00" + body
            same(_cwire.decode_header, _codec._py_decode_header, raw)


@needs_c
def test_every_field_at_its_edges_is_the_reference() -> None:
    """Each field of a header at and beyond the ends of its range (and of the
    wrong type), encoded; each TLV with every value length 0..40, decoded."""
    bits = {"modality": 8, "sla_class": 8, "flags": 8, "payload_len": 32, "stream_id": 32,
            "sequence": 64, "timestamp_ns": 64, "deadline_ns": 64, "fps": 16, "bitrate": 32,
            "density": 32}
    base = Header(Modality.AUDIO, 2, 0, 100, stream_id=1, sequence=2,
                  tensor=TensorSpec(1, (3,)), traceparent=bytes(26), error=(1, "e"))
    for name, b in bits.items():
        top = MMH_MAX_PAYLOAD if name == "payload_len" else (1 << b) - 1
        for v in (-1, 0, 1, top - 1, top, top + 1, (1 << b), (1 << 64), True, 1.0, "1", None):
            h = Header(**{**vars(base), name: v})
            same(_cwire.encode_header, _codec._py_encode_header, h)
            same(_cwire.frame, _codec._py_frame, h, b"xy")
    for plen in (-1, 0, MMH_MAX_PAYLOAD - 1, MMH_MAX_PAYLOAD, MMH_MAX_PAYLOAD + 1, 2**32):
        same(_cwire.encode_header, _codec._py_encode_header, base, payload_len=plen)
    for n in range(31):
        for kind in (bytes, bytearray, memoryview):
            h = Header(**{**vars(base), "traceparent": kind(bytes(n))})
            same(_cwire.encode_header, _codec._py_encode_header, h)
    for spec in (TensorSpec(256, (1,)), TensorSpec(-1, ()), TensorSpec(1, (2**32,)),
                 TensorSpec(1, (-1,)), TensorSpec(1, [1, 2]), TensorSpec(True, (1,)),  # type: ignore[arg-type]
                 TensorSpec(1, (True,))):
        same(_cwire.encode_header, _codec._py_encode_header, Header(**{**vars(base),
                                                                       "tensor": spec}))
    for err in ((2**16, "x"), (-1, "x"), (1, b"x"), (1,), (1, "x", 2), [1, "x"], (True, "x")):
        same(_cwire.encode_header, _codec._py_encode_header, Header(**{**vars(base),
                                                                       "error": err}))
    # every TLV type (and two unknown ones) with every value length 0..40
    for typ in sorted(KNOWN_TYPES | {0x05, 0x7F}):
        for ln in range(41):
            for first in (0, 1, 2, 8, 9, 0xFF):
                value = bytes([first]) + bytes(range(1, ln)) if ln else b""
                body = bytes([typ, ln]) + value
                for tail in (b"", b"\x01\x04\x00\x00\x00\x07"):
                    hb = body + tail
                    raw = b"MMH\x01" + bytes([12 + len(hb)]) + b"\x07\x00\x00\x00\x00\x00\x02" + hb
                    same(_cwire.decode_header, _codec._py_decode_header, raw)
                    same(_cwire.decode_frame, _codec._py_decode_frame, raw + b"pp")
                    same(_cwire.decode_frame, _codec._py_decode_frame, raw + b"p")
    for ndim in range(11):  # TENSOR: dtype, ndim, ndim x u32, any length
        for ln in range(46):
            value = (bytes([3, ndim]) + bytes(range(2, ln)))[:ln]
            raw = b"MMH\x01" + bytes([14 + ln]) + b"\x07\x00\x00\x00\x00\x00\x00" + \
                bytes([Tlv.TENSOR, ln]) + value
            same(_cwire.decode_header, _codec._py_decode_header, raw)


@needs_c
def test_odd_arguments_go_to_the_reference() -> None:
    h = Header(Modality.TENSOR, stream_id=1)
    raw = _codec._py_encode_header(h)
    cases: list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]] = [
        (_cwire.decode_header, _codec._py_decode_header, (), {}),
        (_cwire.decode_header, _codec._py_decode_header, (raw, raw), {}),
        (_cwire.decode_header, _codec._py_decode_header, ("text",), {}),
        (_cwire.decode_header, _codec._py_decode_header,
         (np.frombuffer(raw * 2, np.uint8)[::2],), {}),
        (_cwire.decode_frame, _codec._py_decode_frame, (None,), {}),
        (_cwire.encode_header, _codec._py_encode_header, (h,), {"nope": 1}),
        (_cwire.encode_header, _codec._py_encode_header, (h, 1), {}),
        (_cwire.encode_header, _codec._py_encode_header, ("not a header",), {}),
        (_cwire.encode_header, _codec._py_encode_header, (h,), {"align": 2.0}),
        (_cwire.frame, _codec._py_frame, (h,), {"payload": b"x"}),
        (_cwire.frame, _codec._py_frame, (h, b"x", b"y"), {}),
    ]
    for c_fn, py_fn, args, kw in cases:
        same(c_fn, py_fn, *args, **kw)


# --------------------------------------------------------------------------
# which one runs
# --------------------------------------------------------------------------
@needs_c
def test_the_package_runs_the_compiled_codec_when_built() -> None:
    if os.environ.get("MMMESH_WIRE", "").lower() == "python":
        pytest.skip("MMMESH_WIRE=python in this environment")
    assert _codec.IMPLEMENTATION == "c"
    assert wire.decode_header is _cwire.decode_header is _codec.decode_header
    assert wire.encode_header is _cwire.encode_header
    assert wire.frame is _cwire.frame and wire.decode_frame is _cwire.decode_frame


def _implementation_in_a_child(code: str, env: dict[str, str]) -> str:
    script = textwrap.dedent(code) + textwrap.dedent("""
        from mmmesh.wire import Header, _codec, decode_header, encode_header, frame
        h = Header(7, stream_id=3, sequence=9)
        assert decode_header(encode_header(h)) == h
        assert bytes(frame(h, b"ab")[1]) == b"ab"
        print(_codec.IMPLEMENTATION, decode_header.__module__)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, **env}, check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_mmmesh_wire_python_selects_the_reference() -> None:
    assert _implementation_in_a_child("", {"MMMESH_WIRE": "python"}) == \
        "python mmmesh.wire._codec"


def test_without_the_extension_the_reference_runs() -> None:
    blocker = """
        import sys
        class NoC:
            def find_spec(self, name, path=None, target=None):
                if name == "mmmesh.wire._cwire":
                    raise ImportError("not built")
        sys.meta_path.insert(0, NoC())
    """
    assert _implementation_in_a_child(blocker, {"MMMESH_WIRE": ""}) == \
        "python mmmesh.wire._codec"


# --------------------------------------------------------------------------
# one source of truth: the C file's numbers are mmmesh.abi's
# --------------------------------------------------------------------------
def test_the_c_codecs_constants_are_the_abis() -> None:
    """Every number _cwire.c spells out (its #defines, the TLV enum, the
    integer TLVs' order, sizes and field names) is mmmesh/abi.py's (and
    _codec._INT_TLVS'): read from the C source, so it holds on a machine
    where the extension is not built too."""
    import re
    from pathlib import Path

    from mmmesh import abi

    src = (Path(_codec.__file__).with_name("_cwire.c")).read_text()
    defines = {m[1]: m[2] for m in re.finditer(r"^#define (\w+) (.+?)\s*$", src, re.MULTILINE)}
    def value(text: str) -> int:  # 12, 0x4D4D4801u, (1u << 30)
        m = re.fullmatch(r"\(?(0x[0-9A-Fa-f]+|\d+)u?(?: << (\d+))?\)?", text)
        assert m is not None, text
        return int(m[1], 0) << int(m[2] or 0)

    num = {k: value(v) for k, v in defines.items() if k != "PY_SSIZE_T_CLEAN"
           and not v.endswith("\\")}
    assert num == {
        "MMH_MAGIC_V1": abi.MMH_MAGIC_V1_U32,
        "MMH_PREAMBLE_LEN": abi.MMH_PREAMBLE_LEN,
        "MMH_HDR_MAX": abi.MMH_HDR_MAX,
        "MMH_MAX_TLVS": abi.MMH_MAX_TLVS,
        "MMH_MAX_PAYLOAD": abi.MMH_MAX_PAYLOAD,
        "TENSOR_MAX_DIMS": abi.TENSOR_MAX_DIMS,
        "TRACEPARENT_LEN": wire.TRACEPARENT_LEN,
        "N_INT": len(_codec._INT_TLVS),
    }
    enum = re.search(r"enum \{(.*?)\};", src, re.DOTALL)
    assert enum is not None
    tlvs = {m[1]: int(m[2], 16) for m in re.finditer(r"TLV_(\w+) = (0x[0-9A-Fa-f]+)", enum[1])}
    assert tlvs == {t.name: int(t) for t in Tlv}
    order = re.search(r"INT_TYPE\[N_INT\] = \{(.*?)\};", src, re.DOTALL)
    sizes = re.search(r"INT_SIZE\[N_INT\] = \{(.*?)\};", src, re.DOTALL)
    names = re.search(r"INT_NAME\[N_INT\] = \{(.*?)\};", src, re.DOTALL)
    assert order and sizes and names
    assert [s.strip().removeprefix("TLV_") for s in order[1].split(",")] == \
        [t.name for _, t, _ in _codec._INT_TLVS]
    assert [int(s) for s in sizes[1].split(",")] == [st.size for _, _, st in _codec._INT_TLVS]
    assert re.findall(r'"(\w+)"', names[1]) == [a for a, _, _ in _codec._INT_TLVS]
