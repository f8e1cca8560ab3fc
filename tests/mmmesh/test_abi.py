"""The C header is generated from mmmesh/abi.py and must not drift; the
kernel's view of every map (key/value sizes) must match the ctypes layouts."""

from __future__ import annotations

import ctypes
import re

import pytest

from mmmesh import abi
from mmmesh import abigen as _abigen
from testkit.privileged import require_privileged


def test_header_is_generated_from_abi_module() -> None:
    assert _abigen.HEADER_PATH.read_text() == _abigen.render(), (
        "bpf/include/mm_abi.h is stale: run scripts/gen_abi.py"
    )


def test_map_header_is_generated_from_abi_module() -> None:
    assert _abigen.MAPS_HEADER_PATH.read_text() == _abigen.render_maps(), (
        "bpf/include/mm_maps.h is stale: run scripts/gen_abi.py"
    )


def test_maps_and_programs_are_declared_only_by_the_generated_header() -> None:
    """One list: no BPF source declares a map or names a program that _abi does not."""
    from mmmesh.dataplane._bcc import BPF_DIR

    names = set(abi.MAP_NAMES)
    assert len(names) == len(abi.MAPS)
    for path in [*BPF_DIR.glob("*.c"), *BPF_DIR.glob("lib/*.h")]:
        src = path.read_text()
        assert not re.search(r"^\s*BPF_(F_)?(TABLE|ARRAY|HASH|PERCPU_ARRAY)\(", src, re.M), path
    entry = (BPF_DIR / "mm_tc.c").read_text()
    defined = set(re.findall(r"^int (\w+)\(struct __sk_buff \*\w+\)\s*$", entry, re.M))
    assert defined == set(abi.PROGRAMS.values())
    maps_h = _abigen.MAPS_HEADER_PATH.read_text()
    for m in abi.MAPS:
        assert f", {m.name}, {m.max_entries}" in maps_h, m.name


def test_header_defines_every_constant() -> None:
    text = _abigen.HEADER_PATH.read_text()
    for name, value in abi.constants().items():
        m = re.search(rf"^#define {name} (\S+)$", text, re.M)
        assert m, name
        assert int(m.group(1), 0) == value, name


def test_static_asserts_cover_every_field() -> None:
    text = _abigen.HEADER_PATH.read_text()
    for cname, typ in abi.STRUCTS:
        assert f"sizeof(struct {cname}) == {ctypes.sizeof(typ)}" in text
        for fname, _ in typ._fields_:
            assert f"__builtin_offsetof(struct {cname}, {fname})" in text


def test_bpf_sources_use_no_magic_numbers_for_shared_constants() -> None:
    """The MMH magic and the TLV numbers are spelled only in the generated header."""
    from mmmesh.dataplane._bcc import BPF_DIR

    for path in [*BPF_DIR.glob("*.c"), *BPF_DIR.glob("lib/*.h")]:
        src = path.read_text()
        assert "0x4D4D4801" not in src.upper().replace("0X", "0x"), path
        assert "0x4d4d48" not in src.lower(), path


def test_magic_matches_wire_constants() -> None:
    assert abi.MMH_MAGIC_V1_U32 == int.from_bytes(abi.MMH_MAGIC + bytes([abi.MMH_VERSION]), "big")
    assert abi.MMH_MAGIC_U24 == int.from_bytes(abi.MMH_MAGIC, "big")


@pytest.mark.privileged
def test_kernel_map_layouts_match_ctypes() -> None:
    require_privileged()
    from mmmesh.dataplane import _bpf
    from mmmesh.dataplane._bcc import compile_and_load

    obj = compile_and_load()
    try:
        assert set(obj.map_fds) == set(abi.MAP_NAMES)
        assert set(obj.prog_fds) == set(abi.PROGRAMS.values())
        for name, (ktype, vtype) in abi.MAP_LAYOUTS.items():
            info = _bpf.map_info(obj.map_fds[name])
            assert info.key_size == ctypes.sizeof(ktype), name
            assert info.value_size == ctypes.sizeof(vtype), name
        assert _bpf.map_info(obj.map_fds["flow_map"]).max_entries == abi.DEFAULT_MAX_FLOWS
    finally:
        obj.close()


@pytest.mark.privileged
def test_tunables_reach_the_compiled_program() -> None:
    require_privileged()
    from mmmesh.dataplane import _bpf
    from mmmesh.dataplane._bcc import compile_and_load

    obj = compile_and_load({"MM_MAX_FLOWS": 4096})
    try:
        assert _bpf.map_info(obj.map_fds["flow_map"]).max_entries == 4096
    finally:
        obj.close()
