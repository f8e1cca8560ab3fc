"""The socket layer's share of the one ABI and its pure-Python parts: the
generated map header does not drift, the entry file defines exactly the
programs of ``_abi.SOCK_PROGRAMS``, the kernel's maps have the ctypes
layouts; cgroup v2 discovery, pin names, endpoints, the weighted pick's
reference model."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from mmmesh import abi as _abi
from mmmesh import abigen as _abigen
from mmmesh.dataplane import Endpoint
from mmmesh.dataplane._sock import cgroup2_mount, pin_name, resolve_cgroup
from mmmesh.dataplane._socklayer import addr16, addr_text
from mmmesh.errors import DataplaneError, NotSupportedError
from testkit.privileged import require_privileged
from testkit.socklayer_kit import swrr_counts

BPF = Path(__file__).resolve().parents[3] / "bpf"


def test_sock_map_header_is_generated_from_abi_module() -> None:
    assert _abigen.SOCK_MAPS_HEADER_PATH.read_text() == _abigen.render_sock_maps(), (
        "bpf/include/mm_sock_maps.h is stale: run scripts/gen_abi.py"
    )


def test_entry_file_defines_the_programs_and_no_maps() -> None:
    entry = (BPF / "mm_sock.c").read_text()
    defined = set(re.findall(r"^int (\w+)\(struct (?:bpf_sock_ops|sk_msg_md) \*\w+\)\s*$",
                             entry, re.MULTILINE))
    assert defined == set(_abi.SOCK_PROGRAMS.values())
    for path in (BPF / "mm_sock.c", *BPF.glob("lib/sock*.h")):
        src = path.read_text()
        assert not re.search(r"BPF_(SK_STORAGE|SOCKHASH|TABLE|F_TABLE)\(|section\(\"maps/", src)
    maps_h = _abigen.SOCK_MAPS_HEADER_PATH.read_text()
    for m in _abi.SOCK_MAPS:
        assert re.search(rf"\b{m.name}\b", maps_h), m.name


def test_sock_maps_share_the_scratch_definition_and_keep_the_tc_list() -> None:
    scratch = next(m for m in _abi.MAPS if m.name == "scratch_map")
    assert scratch in _abi.SOCK_MAPS  # lib/mmh.h names it; the same definition
    assert not set(_abi.SOCK_MAP_NAMES) - {"scratch_map"} & set(_abi.MAP_NAMES)
    assert len(set(_abi.SOCK_MAP_NAMES)) == len(_abi.SOCK_MAPS)
    assert max(_abi.SockEvent) < _abi.SOCK_NR_EVENTS
    assert _abi.SOCK_CARRY_SIZE > _abi.MMH_HDR_MAX
    assert _abi.SOCK_MAX_REPLICAS & (_abi.SOCK_MAX_REPLICAS - 1) == 0


@pytest.mark.privileged
def test_kernel_map_layouts_match_ctypes() -> None:
    require_privileged()
    from mmmesh.dataplane import _bpf
    from mmmesh.dataplane._bcc import compile_and_load

    obj = compile_and_load(layer="sock")
    try:
        assert set(obj.map_fds) == set(_abi.SOCK_MAP_NAMES)
        assert set(obj.prog_fds) == set(_abi.SOCK_PROGRAMS.values())
        for m in _abi.SOCK_MAPS:
            info = _bpf.map_info(obj.map_fds[m.name])
            assert info.key_size == ctypes.sizeof(m.key), m.name
            assert info.value_size == ctypes.sizeof(m.value), m.name
        assert _bpf.map_info(obj.map_fds["sock_hash"]).type == 18  # BPF_MAP_TYPE_SOCKHASH
        assert _bpf.map_info(obj.map_fds["sock_state_map"]).type == 24  # SK_STORAGE
    finally:
        obj.close()


MOUNTINFO = """\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,cpu
"""


@pytest.mark.parametrize(("text", "want"), [
    (MOUNTINFO, "/sys/fs/cgroup/unified"),  # hybrid (systemd's legacy layout)
    ("30 1 0:26 / /sys/fs/cgroup rw,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
     "/sys/fs/cgroup"),  # unified
    ("30 1 0:26 / /mnt/cg\\0402 rw - cgroup2 none rw\n", "/mnt/cg 2"),  # escaped path
])
def test_cgroup2_mount_is_found(tmp_path: Path, text: str, want: str) -> None:
    f = tmp_path / "mountinfo"
    f.write_text(text)
    assert cgroup2_mount(str(f)) == want


def test_no_cgroup2_mount_is_not_supported(tmp_path: Path) -> None:
    f = tmp_path / "mountinfo"
    f.write_text(MOUNTINFO.replace("cgroup2 cgroup2", "tmpfs tmpfs"))
    with pytest.raises(NotSupportedError):
        cgroup2_mount(str(f))


def test_cgroup_paths_and_pin_names() -> None:
    m = "/sys/fs/cgroup"
    assert resolve_cgroup("", m) == (m, "")
    assert resolve_cgroup("kubepods.slice/pod1", m) == (f"{m}/kubepods.slice/pod1",
                                                       "kubepods.slice/pod1")
    assert resolve_cgroup(f"{m}/mesh/", m) == (f"{m}/mesh", "mesh")
    with pytest.raises(DataplaneError):
        resolve_cgroup("/sys/fs/other", m)
    with pytest.raises(DataplaneError):
        resolve_cgroup("../x", m)
    assert pin_name("") == "@root"
    assert pin_name("kubepods.slice/pod 1") == "kubepods%2Eslice%2Fpod%201"  # bpffs: no dots
    assert "." not in pin_name("a.b") and "/" not in pin_name("a/b")


def test_endpoints_and_addresses() -> None:
    k = Endpoint("10.1.2.3", 7000, stage=2, replica=1).key()
    assert bytes(k.addr) == bytes(10) + b"\xff\xff" + bytes([10, 1, 2, 3]) and k.port == 7000
    assert addr_text(addr16("10.1.2.3")) == "10.1.2.3"
    assert addr_text(addr16("fd00::7")) == "fd00::7"
    assert addr16("::ffff:10.1.2.3") == addr16("10.1.2.3")  # mapped stays mapped
    for bad in (Endpoint("x", 1, 1), Endpoint("10.0.0.1", 70000, 1),
                Endpoint("10.0.0.1", 1, 1, replica=_abi.SOCK_MAX_REPLICAS),
                Endpoint("10.0.0.1", 1, -1)):
        with pytest.raises(DataplaneError):
            bad.key()


@pytest.mark.parametrize("weights", [[5, 3, 2], [1, 1], [7, 0, 1], [65535, 1], [1]])
def test_weighted_pick_gives_exact_shares_per_period(weights: list[int]) -> None:
    total = sum(weights)
    assert swrr_counts(weights, total * 3) == [w * 3 for w in weights]
    n = 10_000
    for got, w in zip(swrr_counts(weights, n), weights):
        assert abs(got - n * w / total) <= len(weights)  # smooth: never more than n behind
