"""The socket layer's kernel side: the cgroup v2 it attaches to, its pins,
attaching and detaching, and typed access to its maps.

Programs and maps are pinned under ``/sys/fs/bpf/mmmesh/sock/<cgroup>/``
(``abi.SOCK_PROGRAMS``, ``abi.SOCK_MAPS``; ``<cgroup>`` is the cgroup's
path below the cgroup v2 mount, percent-encoded: bpffs refuses dots, and
``@root`` for the root).  ``mm_sockops`` is attached to the cgroup and
``mm_sk_msg`` to ``sock_hash`` with BPF_PROG_ATTACH (no link), so both stay
attached when the loading process dies; a later loader with the same ABI
version and build id (``sock_meta_map``) adopts them.  The public face is
``SocketLayer`` (``_socklayer.py``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import string
from typing import Self

from mmmesh import abi
from mmmesh.errors import DataplaneError, NotSupportedError

from . import _bpf
from ._bpf import Map
from ._pins import PIN_ROOT

SOCK_PIN_ROOT = os.path.join(PIN_ROOT, "sock")
USER_MAPS = tuple(m for m in abi.SOCK_MAPS if m.user)
_SAFE = frozenset(string.ascii_letters + string.digits + "_-")
_OCTAL = re.compile(r"\\([0-7]{3})")


# ------------------------------------------------------------------ cgroup
def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` on a
    unified system, ``/sys/fs/cgroup/unified`` on a hybrid one)."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise NotSupportedError(f"cannot read {mountinfo}: {e}") from e
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) > sep + 1 and fields[sep + 1] == "cgroup2":
            return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
    raise NotSupportedError("no cgroup v2 hierarchy is mounted: sockops attach to a cgroup v2")


def resolve_cgroup(cgroup: str, mount: str) -> tuple[str, str]:
    """(absolute path, path below the mount; '' for the root) of ``cgroup``,
    given as a path below the mount or as an absolute path inside it."""
    path = os.path.normpath(cgroup if os.path.isabs(cgroup) else os.path.join(mount, cgroup))
    rel = os.path.relpath(path, mount)
    if rel == os.curdir:
        rel = ""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise DataplaneError(errno.EINVAL, f"{cgroup} is not inside the cgroup v2 mount {mount}")
    return path, rel


def pin_name(rel: str) -> str:
    """A cgroup path as one bpffs name: '@root', else percent-encoded."""
    if not rel:
        return "@root"
    return "".join(chr(b) if chr(b) in _SAFE else f"%{b:02X}" for b in rel.encode())


def pin_dir(rel: str) -> str:
    return os.path.join(SOCK_PIN_ROOT, pin_name(rel))


# -------------------------------------------------------------------- maps
class SockMaps:
    """The socket layer's maps that user space reads and writes, opened from
    a pin directory (owns the fds)."""

    def __init__(self, directory: str) -> None:
        self._maps: dict[str, Map] = {}
        try:
            for m in USER_MAPS:
                self._maps[m.name] = Map.open_pinned(os.path.join(directory, m.name), m.key,
                                                     m.value)
        except BaseException:
            self.close()
            raise
        self.config = self._maps["sock_config_map"]
        self.meta = self._maps["sock_meta_map"]
        self.hash = self._maps["sock_hash"]
        self.state = self._maps["sock_state_map"]
        self.flows = self._maps["sock_flow_map"]
        self.endpoints = self._maps["sock_ep_map"]
        self.weights = self._maps["sock_weight_map"]
        self.groups = self._maps["sock_group_map"]
        self.lanes = self._maps["sock_lane_map"]
        self.stats = self._maps["sock_stats_map"]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flags(self) -> int:
        cfg = self.config.lookup(0)
        return int(cfg.flags) if cfg is not None else 0

    def write_flags(self, flags: int) -> None:
        cur = self.config.lookup(0) or abi.SockConfig()
        self.config.update(0, abi.SockConfig(flags=flags, version=(int(cur.version) + 1)
                                              & 0xFFFFFFFF))

    def meta_info(self) -> tuple[int, int]:
        """(ABI version, build id) stamped into the pins."""
        m = self.meta.lookup(0)
        return (int(m.abi_version), int(m.build_id)) if m is not None else (0, 0)


def stamp(directory: str, build: int) -> None:
    """Writes the ABI version and build id into a freshly pinned layer."""
    meta = Map.open_pinned(os.path.join(directory, "sock_meta_map"), ctypes.c_uint32, abi.Meta)
    try:
        meta.update(0, abi.Meta(abi_version=abi.ABI_VERSION, build_id=build))
    finally:
        meta.close()


def pinned_state(directory: str, want_build: int) -> str:
    """"adopt" (same ABI and build), "replace" (something else or an
    incomplete set is pinned) or "absent"."""
    if not os.path.isdir(directory):
        return "absent"
    needed = [*abi.SOCK_PROGRAMS.values(), *abi.SOCK_MAP_NAMES]
    if any(not os.path.exists(os.path.join(directory, n)) for n in needed):
        return "replace"
    try:
        with SockMaps(directory) as maps:
            have_abi, build = maps.meta_info()
    except DataplaneError:
        return "replace"
    return "adopt" if (have_abi, build) == (abi.ABI_VERSION, want_build) else "replace"


# ------------------------------------------------------------------ attach
class Attachment:
    """Fds of a pinned layer's programs and sockhash, and of the cgroup."""

    def __init__(self, directory: str, cgroup_path: str) -> None:
        self.fds: dict[str, int] = {}
        try:
            self.fds["cgroup"] = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise DataplaneError(e.errno or errno.ENOENT, f"open cgroup {cgroup_path}: {e}") from e
        try:
            for name in (*abi.SOCK_PROGRAMS.values(), "sock_hash"):
                self.fds[name] = _bpf.obj_get(os.path.join(directory, name))
        except BaseException:
            self.close()
            raise
        self.ops = self.fds[abi.SOCK_PROGRAMS["sockops"]]
        self.msg = self.fds[abi.SOCK_PROGRAMS["sk_msg"]]
        self.ids = {k: int(_bpf.prog_info(self.fds[v]).id) for k, v in abi.SOCK_PROGRAMS.items()}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attached(self) -> dict[str, bool]:
        """Whether each program is attached where it belongs."""
        return {
            "sockops": self.ids["sockops"] in _bpf.prog_query(self.fds["cgroup"],
                                                               _bpf.BPF_CGROUP_SOCK_OPS),
            "sk_msg": self.ids["sk_msg"] in _bpf.prog_query(self.fds["sock_hash"],
                                                             _bpf.BPF_SK_MSG_VERDICT),
        }

    def attach(self) -> None:
        """sk_msg first: a socket takes the map's programs when it enters the
        map, so sockops must not add sockets to a map without its verdict.
        The cgroup attachment allows others (BPF_F_ALLOW_MULTI)."""
        have = self.attached()
        if not have["sk_msg"]:
            _bpf.prog_attach(self.msg, self.fds["sock_hash"], _bpf.BPF_SK_MSG_VERDICT)
        if not have["sockops"]:
            _bpf.prog_attach(self.ops, self.fds["cgroup"], _bpf.BPF_CGROUP_SOCK_OPS,
                             _bpf.BPF_F_ALLOW_MULTI)

    def detach(self) -> None:
        """sockops first (no new sockets), then the verdict; what is not
        attached is left alone."""
        for prog, target, kind in ((self.ops, self.fds["cgroup"], _bpf.BPF_CGROUP_SOCK_OPS),
                                   (self.msg, self.fds["sock_hash"], _bpf.BPF_SK_MSG_VERDICT)):
            try:
                _bpf.prog_detach(prog, target, kind)
            except DataplaneError as e:
                if e.errno not in (errno.ENOENT, errno.EINVAL):
                    raise
