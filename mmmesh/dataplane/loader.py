"""Bringing the dataplane up on a device, down again, and reading its state.

``up`` is idempotent: run it again with a new policy and it rewrites the
maps and reconciles the HTB tree in place.  A pinned dataplane of the same
ABI version is adopted (programs, maps and the flow table are kept); one of
another version is replaced.  ``down`` leaves the device as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from .. import _abi
from .._errors import DataplaneError
from ..policy import Policy
from . import _bpf
from ._compile import compile_policy
from ._maps import Maps
from ._netlink import Netlink

log = logging.getLogger("mmmesh.dataplane")

BPFFS = "/sys/fs/bpf"
PIN_ROOT = os.path.join(BPFFS, "mmmesh")
PROGRAMS = {"egress": "mm_egress", "ingress": "mm_ingress"}
MAP_NAMES = ("config_map", "class_map", "modality_map", "src_map", "flow_map", "stats_map",
             "meta_map", "scratch_map")
BPF_FS_MAGIC = 0xCAFE4A11


def pin_dir(iface: str, netns: str | None = None) -> str:
    """Where a device's programs and maps are pinned."""
    return os.path.join(PIN_ROOT, f"@{netns}", iface) if netns else os.path.join(PIN_ROOT, iface)


def ensure_bpffs() -> None:
    """Mounts bpffs at /sys/fs/bpf when it is not (as systemd would)."""
    if _is_bpffs(BPFFS):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    os.makedirs(BPFFS, exist_ok=True)
    if libc.mount(b"bpf", BPFFS.encode(), b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise DataplaneError(err, f"mount bpffs at {BPFFS}: {os.strerror(err)}")
    log.info("mounted bpffs at %s", BPFFS)


def _is_bpffs(path: str) -> bool:
    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    st = StatFs()
    if libc.statfs(path.encode(), ctypes.byref(st)) != 0:
        return False
    return (st.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC


@dataclass
class UpResult:
    iface: str
    netns: str | None
    adopted: bool
    prog_ids: dict[str, int] = field(default_factory=dict)
    policy_version: int = 0


def _unpin(directory: str) -> None:
    if not os.path.isdir(directory):
        return
    try:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
        parent = os.path.dirname(directory)
        if parent != PIN_ROOT and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)
    except OSError as e:
        raise DataplaneError(e.errno or errno.EIO, f"unpin {directory}: {e}") from e


def _pinned_state(directory: str, want_build: int) -> str:
    """"adopt" (same ABI and build), "replace" (something else is pinned) or
    "absent"."""
    if not os.path.isdir(directory):
        return "absent"
    needed = [*PROGRAMS.values(), *MAP_NAMES]
    if any(not os.path.exists(os.path.join(directory, n)) for n in needed):
        return "replace"
    try:
        maps = Maps.open_pinned(directory)
    except DataplaneError:
        return "replace"
    try:
        ok = maps.abi_version() == _abi.ABI_VERSION and maps.build_id() == want_build
    finally:
        maps.close()
    return "adopt" if ok else "replace"


def _load_and_pin(directory: str, tunables: dict[str, int] | None, build: int) -> None:
    """Compiles and pins into a staging directory in a child process (bcc and
    clang cost ~100 MB that a long-running caller should not keep), stamps
    it, and only then swaps it for whatever was pinned before: a failed
    compile leaves a working dataplane reachable."""
    # bpffs refuses names with a dot; '%' is not something ifnames use
    staging = os.path.join(os.path.dirname(directory), "%new%" + os.path.basename(directory))
    _unpin(staging)
    cmd = [sys.executable, "-m", "mmmesh.dataplane._bcc", staging]
    for k, v in sorted((tunables or {}).items()):
        cmd += ["-D", f"{k}={int(v)}"]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataplaneError(errno.EIO, f"running the BPF compiler failed: {e}") from e
        if proc.returncode != 0:
            msg = (proc.stderr.strip().splitlines() or ["compiler process failed"])[-1]
            raise DataplaneError(errno.EINVAL, f"loading the BPF programs failed: {msg}")
        maps = Maps.open_pinned(staging)
        try:
            maps.write_meta(build)
        finally:
            maps.close()
        try:
            _unpin(directory)
            os.rename(staging, directory)
        except OSError as e:
            raise DataplaneError(e.errno or errno.EIO, f"swap pins into {directory}: {e}") from e
    except BaseException:
        try:
            _unpin(staging)
        except OSError:
            pass
        raise


def up(policy: Policy, iface: str | None = None, netns: str | None = None, *,
       version: int = 0, force: bool = False, tunables: dict[str, int] | None = None,
       ingress: bool = True) -> UpResult:
    """Loads (or adopts) the classifier on ``iface`` and applies ``policy``."""
    iface = iface or policy.link.device
    compiled = compile_policy(policy, version)
    ensure_bpffs()
    directory = pin_dir(iface, netns)
    with Netlink(netns) as nl:
        idx = nl.ifindex(iface)
        from ._bcc import build_id  # source hashing only; bcc is not imported

        build = build_id(tunables)
        state = _pinned_state(directory, build)
        adopted = state == "adopt"
        if not adopted:
            if state == "replace":
                log.warning("replacing the pinned dataplane at %s (other ABI or build, or "
                            "incomplete)", directory)
            _load_and_pin(directory, tunables, build)
        maps = Maps.open_pinned(directory)
        try:
            maps.write_policy(compiled)
        finally:
            maps.close()
        assert compiled.htb is not None
        nl.apply_htb(idx, compiled.htb, force=force)
        nl.ensure_clsact(idx)
        prog_ids: dict[str, int] = {}
        attached = nl.bpf_filters(idx)
        for direction, prog in PROGRAMS.items():
            if direction == "ingress" and not ingress:
                nl.detach_bpf(idx, direction)
                continue
            fd = _bpf.obj_get(os.path.join(directory, prog))
            try:
                pid = int(_bpf.prog_info(fd).id)
                if attached.get(direction, {}).get("prog_id") != pid:
                    nl.attach_bpf(idx, direction, fd, prog)
                prog_ids[direction] = pid
            finally:
                os.close(fd)
    return UpResult(iface, netns, adopted, prog_ids, version)


def down(iface: str, netns: str | None = None) -> None:
    """Detaches and unpins everything ``up`` installed on ``iface``."""
    with Netlink(netns) as nl:
        if nl.link_exists(iface):
            idx = nl.ifindex(iface)
            for direction in PROGRAMS:
                nl.detach_bpf(idx, direction)
            nl.remove_clsact_if_empty(idx)
            nl.remove_htb(idx)
    _unpin(pin_dir(iface, netns))


def status(iface: str, netns: str | None = None, policy: Policy | None = None) -> dict[str, Any]:
    """What is installed on ``iface``: programs, counters, HTB classes."""
    directory = pin_dir(iface, netns)
    out: dict[str, Any] = {"iface": iface, "netns": netns, "pin_dir": directory}
    with Netlink(netns) as nl:
        idx = nl.ifindex(iface)
        out["programs"] = nl.bpf_filters(idx)
        htb = nl.htb_classes(idx)
    if not os.path.isdir(directory):
        out["loaded"] = False
        out["htb"] = {f"{k >> 16:x}:{k & 0xFFFF:x}": v for k, v in htb.items()}
        return out
    maps = Maps.open_pinned(directory)
    try:
        out["loaded"] = True
        out["abi_version"] = maps.abi_version()
        out["policy_version"] = maps.policy_version()
        stats = maps.read_stats()
        out["flows"] = maps.flow_count()
        names = {c.id: c.name for c in policy.classes} if policy else {}
        classes: dict[str, Any] = {}
        for cid in range(1, _abi.MAX_CLASSES):
            info = maps.classes.lookup(cid)
            if info is None or not info.valid:
                continue
            h = htb.get(int(info.classid), {})
            eg = stats["egress"].classes.get(cid, (0, 0))
            ig = stats["ingress"].classes.get(cid, (0, 0))
            classes[names.get(cid, str(cid))] = {
                "id": cid,
                "classid": f"{info.classid >> 16:x}:{info.classid & 0xFFFF:x}",
                "rank": int(info.rank),
                "egress_packets": eg[0], "egress_bytes": eg[1],
                "ingress_packets": ig[0], "ingress_bytes": ig[1],
                "htb": h,
            }
        out["classes"] = classes
        out["reasons"] = {d: s.reasons for d, s in stats.items()}
    finally:
        maps.close()
    return out


__all__ = ["UpResult", "down", "ensure_bpffs", "pin_dir", "status", "up"]
