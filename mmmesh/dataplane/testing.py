"""Helpers for tests and benchmarks that need dataplane state no packet made:
synthetic flow-table entries.  Not used by qosd."""

from __future__ import annotations

import ctypes
import socket
import time

from mmmesh import abi

from . import _bpf
from ._bpf import TestRunResult
from ._handle import Dataplane
from ._maps import Maps


def fill_flows(dp: Dataplane, n: int, class_ids: list[int], dst: str = "10.77.0.2") -> None:
    """Writes ``n`` synthetic egress TCP flows 10.200.x.y:port -> ``dst``:7000+i
    into the pinned flow table of ``dp`` (classes taken in turn from ``class_ids``)."""
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    daddr = bytes([0] * 10 + [0xFF, 0xFF]) + socket.inet_aton(dst)
    with Maps.open_pinned(dp.pin_dir) as maps:
        for i in range(n):
            k = abi.FlowKey()
            src = bytes([0] * 10 + [0xFF, 0xFF, 10, 200, (i >> 8) & 0xFF, i & 0xFF])
            ctypes.memmove(k.saddr, src, 16)
            ctypes.memmove(k.daddr, daddr, 16)
            k.sport = socket.htons(1024 + (i % 60000))
            k.dport = socket.htons(7000 + i // 60000)
            k.proto = socket.IPPROTO_TCP
            k.dir = abi.DIR_EGRESS
            v = abi.FlowInfo(last_seen_ns=now, packets=i + 1, bytes=(i + 1) * 1400,
                              class_id=class_ids[i % len(class_ids)], modality=4)
            maps.flows.update(k, v)


def prog_test_run(prog_fd: int, frame: bytes, repeat: int = 1) -> TestRunResult:
    """Runs a SCHED_CLS program on one Ethernet frame (BPF_PROG_TEST_RUN):
    verdict, the context after the run (``ctx.priority``, ``ctx.cb``), the
    frame as the program left it, and the mean ``duration_ns`` per run."""
    return _bpf.prog_test_run(prog_fd, frame, repeat=repeat)


class _ProgInfoFull(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32),
        ("gpl_compatible", ctypes.c_uint32), ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64), ("nr_jited_ksyms", ctypes.c_uint32),
        ("nr_jited_func_lens", ctypes.c_uint32), ("jited_ksyms", ctypes.c_uint64),
        ("jited_func_lens", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
        ("nr_func_info", ctypes.c_uint32), ("nr_line_info", ctypes.c_uint32),
        ("line_info", ctypes.c_uint64), ("jited_line_info", ctypes.c_uint64),
        ("nr_jited_line_info", ctypes.c_uint32), ("line_info_rec_size", ctypes.c_uint32),
        ("jited_line_info_rec_size", ctypes.c_uint32), ("nr_prog_tags", ctypes.c_uint32),
        ("prog_tags", ctypes.c_uint64), ("run_time_ns", ctypes.c_uint64),
        ("run_cnt", ctypes.c_uint64), ("recursion_misses", ctypes.c_uint64),
        ("verified_insns", ctypes.c_uint32), ("attach_btf_obj_id", ctypes.c_uint32),
        ("attach_btf_id", ctypes.c_uint32),
    ]


def prog_stats(fd: int) -> dict[str, int | None]:
    """Instruction counts of a loaded program; verified_insns needs Linux >= 5.16."""
    info = _ProgInfoFull()
    n = ctypes.c_uint32(ctypes.sizeof(info))
    try:
        rc = _bpf._lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(n))
    except Exception:  # noqa: BLE001 - optional statistics
        return {"xlated_insns": None, "jited_bytes": None, "verified_insns": None}
    if rc < 0:
        return {"xlated_insns": None, "jited_bytes": None, "verified_insns": None}
    full = n.value >= _ProgInfoFull.verified_insns.offset + 4
    return {
        "xlated_insns": info.xlated_prog_len // 8,
        "jited_bytes": info.jited_prog_len,
        "verified_insns": info.verified_insns if full and info.verified_insns else None,
    }


