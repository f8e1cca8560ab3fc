"""Pinned dataplanes on bpffs: where they live, whether one can be adopted,
and compiling a new one into place.

Programs and maps of a device are pinned under ``/sys/fs/bpf/mmmesh/<dev>/``
(``@<netns>/<dev>`` for a device in a named netns), named as in
``abi.PROGRAMS`` and ``abi.MAPS``.  One of the same ABI version and build id
(``meta_map``) is adopted; anything else is replaced by a new build compiled
into a staging directory and swapped in only once it is pinned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import subprocess
import sys
from collections.abc import Callable

from mmmesh import abi
from mmmesh.errors import DataplaneError, MeshError

from . import _bpf
from ._maps import Maps

log = logging.getLogger("mmmesh.dataplane")

BPFFS = "/sys/fs/bpf"
PIN_ROOT = os.path.join(BPFFS, "mmmesh")
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


def unpin(directory: str) -> None:
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


def pinned_state(directory: str, want_build: int) -> str:
    """"adopt" (same ABI and build), "replace" (something else is pinned) or
    "absent"."""
    if not os.path.isdir(directory):
        return "absent"
    needed = [*abi.PROGRAMS.values(), *abi.MAP_NAMES]
    if any(not os.path.exists(os.path.join(directory, n)) for n in needed):
        return "replace"
    try:
        maps = Maps.open_pinned(directory)
    except DataplaneError:
        return "replace"
    try:
        ok = maps.abi_version() == abi.ABI_VERSION and maps.build_id() == want_build
    finally:
        maps.close()
    return "adopt" if ok else "replace"


def _stamp_tc(directory: str, build: int) -> None:
    maps = Maps.open_pinned(directory)
    try:
        maps.write_meta(build)
    finally:
        maps.close()


def load_and_pin(directory: str, tunables: dict[str, int] | None, build: int, *,
                 layer: str = "tc", stamp: Callable[[str, int], None] = _stamp_tc) -> None:
    """Compiles and pins into a staging directory in a child process (bcc and
    clang cost ~100 MB that a long-running caller should not keep), stamps
    it (``stamp(dir, build)``: the layer's meta map), and only then swaps it
    for whatever was pinned before: a failed compile leaves a working
    dataplane reachable.  ``layer`` names the object (``_bcc.LAYERS``)."""
    # bpffs refuses names with a dot; '%' is not something ifnames use
    staging = os.path.join(os.path.dirname(directory), "%new%" + os.path.basename(directory))
    unpin(staging)
    cmd = [sys.executable, "-m", "mmmesh.dataplane._bcc", staging]
    if layer != "tc":
        cmd += ["--layer", layer]
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
        stamp(staging, build)
        try:
            unpin(directory)
            os.rename(staging, directory)
        except OSError as e:
            raise DataplaneError(e.errno or errno.EIO, f"swap pins into {directory}: {e}") from e
    except BaseException:
        try:
            unpin(staging)
        except OSError:
            pass
        raise


def pinned_prog_ids(directory: str) -> dict[str, int]:
    """direction -> id of the program pinned in ``directory`` (missing ones left out)."""
    out: dict[str, int] = {}
    for direction, name in abi.PROGRAMS.items():
        try:
            fd = _bpf.obj_get(os.path.join(directory, name))
        except MeshError:
            continue
        try:
            out[direction] = int(_bpf.prog_info(fd).id)
        finally:
            os.close(fd)
    return out
