"""Egress mode fq's share of the C/Python ABI (one source: mmmesh/abi.py,
rendered into bpf/include/mm_abi.h and mm_maps.h by mmmesh/abigen.py).

The generic checks (every constant, struct and map generated, the kernel's
map sizes) are tests/mmmesh/test_abi.py; these name what egress mode fq
added, so that dropping one from the generator's lists fails here by name,
and check the Python-only constants against the kernel's sch_fq UAPI."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from mmmesh import abi, abigen

BPF = Path(abigen.INCLUDE_DIR).parent


def test_the_pacing_constants_are_generated_with_python_values() -> None:
    text = abigen.HEADER_PATH.read_text()
    want = {
        "MM_ABI_VERSION": abi.ABI_VERSION, "MM_CBF_PACED": abi.CBF_PACED,
        "MM_CBF_OVER_HORIZON": abi.CBF_OVER_HORIZON, "MM_CFG_PACING": abi.CFG_PACING,
        "MM_PACE_SLOTS": abi.PACE_SLOTS, "MM_PACE_DROP_NS": abi.PACE_DROP_NS,
        "MM_NSEC_PER_SEC": abi.NSEC_PER_SEC,
    }  # fmt: skip
    for name, value in want.items():
        assert abi.constants()[name] == value, name
        m = re.search(rf"^#define {name} (\S+)$", text, re.MULTILINE)
        assert m and int(m.group(1), 0) == value, name
    assert abi.ABI_VERSION >= 4  # 4: egress mode fq's fields and map


def test_pace_map_and_the_pacer_fields_are_in_the_generated_headers() -> None:
    (pace,) = [m for m in abi.MAPS if m.name == "pace_map"]
    assert (pace.kind, pace.key, pace.value, pace.max_entries) == (
        "array", ctypes.c_uint32, abi.PaceState, "MM_PACE_SLOTS")
    assert "pace_map, MM_PACE_SLOTS" in abigen.MAPS_HEADER_PATH.read_text()
    text = abigen.HEADER_PATH.read_text()
    for cname, typ in (("mm_class_info", abi.ClassInfo), ("mm_boost_info", abi.BoostInfo)):
        assert {"horizon_us", "pace_Bps"} <= {f for f, _ in typ._fields_}
        assert (typ.horizon_us.offset, typ.pace_Bps.offset, ctypes.sizeof(typ)) == (8, 16, 24)
        for f in ("horizon_us", "pad2", "pace_Bps"):
            assert f"__builtin_offsetof(struct {cname}, {f})" in text
    assert "struct mm_pace_state {" in text and ctypes.sizeof(abi.PaceState) == 16


def test_every_pacer_has_a_slot_and_the_drop_is_past_sch_fqs_horizon() -> None:
    slots = {abi.pace_slot(c, lvl) for c in range(abi.MAX_CLASSES)
             for lvl in range(abi.MAX_BOOSTS + 1)}
    assert len(slots) == abi.PACE_SLOTS and max(slots) == abi.PACE_SLOTS - 1
    assert abi.PACE_SLOTS & (abi.PACE_SLOTS - 1) == 0  # the C masks with PACE_SLOTS - 1
    assert abi.PACE_DROP_NS > abi.FQ_HORIZON_US * 1000 > abi.PACE_MAX_HORIZON_US * 1000
    assert abi.PACE_MIN_HORIZON_US <= abi.PACE_MAX_HORIZON_US


def test_band_slots_fit_sch_fqs_priomap_and_name_no_htb_class() -> None:
    # include/uapi/linux/pkt_sched.h: FQ_BANDS 3, TC_PRIO_MAX 15 (priomap[16])
    assert (abi.FQ_BANDS, abi.FQ_PRIO_SLOTS) == (3, 16)
    assert abi.FQ_PRIO_BASE + abi.FQ_BANDS == abi.FQ_PRIO_SLOTS
    # a band slot written under an HTB root names no class (major 0): demoted
    assert all((abi.FQ_PRIO_BASE + b) >> 16 == 0 for b in range(abi.FQ_BANDS))
    assert abi.FQ_ROOT_MAJOR != abi.HTB_MAJOR
    assert abi.FQ_CHILD_MAJOR > abi.FQ_ROOT_MAJOR


def test_the_pacer_uses_the_generated_names_not_their_values() -> None:
    pace = (BPF / "lib" / "pace.h").read_text()
    src = pace + (BPF / "lib" / "classify.h").read_text()
    for value in (abi.PACE_DROP_NS, abi.NSEC_PER_SEC, abi.PACE_SLOTS):
        for spelling in (str(value), hex(value)):
            assert not re.search(rf"\b{spelling}\b", pace, re.IGNORECASE), spelling
    for name in ("MM_PACE_SLOTS", "MM_PACE_DROP_NS", "MM_NSEC_PER_SEC", "MM_CBF_PACED",
                 "MM_CBF_OVER_HORIZON", "pace_map"):
        assert name in src, name
    assert "MM_CFG_PACING" in src
