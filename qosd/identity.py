"""Who sent an SLA report: the sender's identity from its credentials, never
from the report's body.

The report socket (sla.sock, mode 0666) is open to every local process.  The
transport reads the connecting process's credentials with SO_PEERCRED when it
accepts the connection and hands them over in the request's scope
(``scope["extensions"]["mmmesh.peer"] == {"pid", "uid", "gid"}``,
:func:`peer_of`).  :class:`SenderResolver` turns them into a :class:`Sender`
from the process's cgroup v2 path (``/proc/<pid>/cgroup``, the ``0::`` line):

    pod       a Kubernetes container: ``pod:<pod uid>/<container id>``
              (kubepods cgroups of containerd, CRI-O and docker, with the
              systemd or the cgroupfs driver)
    unit      a systemd system service: ``unit:<name>.service``
    process   anything else: ``uid:<uid>:<cgroup path>``
    admin     the root-only admin socket, or TCP with the token (no credentials
              needed: :data:`ADMIN`)

Only root can create cgroups at the top of the hierarchy, so a path is a pod
only when it starts at the kubepods root, and a unit only when nothing but
slices lies above its ``.service`` segment.  A user's own delegated subtree
(``/user.slice/user-1000.slice/user@1000.service/...``) can hold cgroups of any
name, but it is below ``user@1000.service``, which is never taken as a unit
identity: such processes are ``process`` senders, and the per-uid cap of
qosd/sla/quota.py bounds all of them together.

/proc is read through one directory fd of ``/proc/<pid>`` (both files belong
to one process, and a process that exits meanwhile fails the read instead of
another one being read), the process's uid must be the connection's, and the
result is cached per (pid, uid, gid) for ``ttl_s``.  The pid itself comes
from the connect(): a sender that exits and whose pid is reused within the
cache time could be taken for the new process of the same uid; SO_PEERPIDFD
(Linux 6.5) would close that gap.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mmmesh.errors import MeshError

__all__ = [
    "ADMIN",
    "PEER_EXTENSION",
    "Peer",
    "ReportRefused",
    "Sender",
    "SenderResolver",
    "peer_of",
    "sender_of_cgroup",
]

PEER_EXTENSION = "mmmesh.peer"  # the ASGI scope key the API server (qosd/httpd/http11.py) fills
MAX_PROC_READ = 64 * 1024  # /proc/<pid>/cgroup and status are far smaller


REFUSAL_CODES = (
    # 403: who is sending (qosd/identity.py, qosd/api/app.py), or what (qosd/sla/reporters.py)
    "no_peer_credentials", "sender_unknown", "sender_gone", "sender_changed", "not_allowed",
    "stage_not_allowed",
    # 422: a number out of bounds that reached the board (qosd/sla/board.py)
    "invalid_request",
    # 429: a rate or a quota (qosd/sla/quota.py)
    "rate_limited", "too_many_senders", "board_full", "sender_quota", "uid_quota",
)
"""Every ``ReportRefused.code``: ``mmmesh_sla_reports_refused_total{code}`` has a
series for each from the start (at 0), so ``increase()`` sees the first refusal."""


class ReportRefused(MeshError):
    """A report qosd will not take: 403 (who is sending, or which stage), 429
    (a quota or rate), 422 (a number out of bounds that reached the board
    without the API's validation).  ``code`` says why in one word, one of
    :data:`REFUSAL_CODES`."""

    def __init__(self, status: int, code: str, message: str,
                 retry_after: float | None = None) -> None:
        if code not in REFUSAL_CODES:
            raise ValueError(f"refusal code {code!r} is not in REFUSAL_CODES")
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of a unix-socket connection (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_of(scope: Mapping[str, Any]) -> Peer | None:
    """The credentials the transport put in a request's ``scope``; None when
    it put none (TCP, or a server that does not read them)."""
    ext = scope.get("extensions") or {}
    raw = ext.get(PEER_EXTENSION) if isinstance(ext, Mapping) else None
    if not isinstance(raw, Mapping):
        return None
    vals = [raw.get(k) for k in ("pid", "uid", "gid")]
    if not all(type(v) is int and v >= 0 for v in vals):
        return None
    return Peer(*vals)  # type: ignore[arg-type]


Kind = Literal["admin", "pod", "unit", "process"]


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent a report (see the module doc).  ``key`` names it: quotas and
    the board's rows belong to it."""

    kind: Kind
    key: str
    uid: int
    pid: int | None = None
    cgroup: str | None = None
    pod: str | None = None  # pod UID (dashes)
    container: str | None = None  # container id (64 hex) or None
    unit: str | None = None  # e.g. mmmesh-sidecar@asr.service

    @property
    def names_instances(self) -> bool:
        """Root and the admin socket may speak for several sidecars: the
        report's ``instance`` keeps their windows apart.  Any other sender is
        one instance, its identity."""
        return self.kind == "admin" or self.uid == 0

    @property
    def unit_instance(self) -> str | None:
        """The instance of a template unit (``mmmesh-sidecar@asr.service``:
        ``asr``), systemd's ``\\xNN`` escapes undone."""
        if self.unit is None or "@" not in self.unit:
            return None
        inst = self.unit.split("@", 1)[1].rsplit(".", 1)[0]
        return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), inst) or None

    def describe(self) -> str:
        """For messages: the identity, its uid and pid."""
        if self.kind == "admin":
            return "the admin socket"
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"{self.key} (uid {self.uid}{pid})"


ADMIN = Sender(kind="admin", key="admin", uid=0)

# --------------------------------------------------------------------------
# cgroup paths
# --------------------------------------------------------------------------
_KUBE_ROOT = re.compile(r"^(kubepods|kubepods\.slice|kubelet\.slice)$")
_KUBE_QOS = re.compile(r"^((kubelet-)?kubepods(-(burstable|besteffort))?\.slice|"
                       r"burstable|besteffort|kubepods)$")
_POD_SYSTEMD = re.compile(r"^(?:kubelet-)?kubepods(?:-(?:burstable|besteffort))?"
                          r"-pod([0-9a-f][0-9a-f_]{7,63})\.slice$")
_POD_CGROUPFS = re.compile(r"^pod([0-9a-f][0-9a-f-]{7,63})$")
_CONTAINER = re.compile(r"^(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")
_USER_MANAGER = re.compile(r"^user@\d+\.service$")


def _segments(path: str) -> tuple[list[str], bool]:
    """The path's parts, and whether it was shown relative to our cgroup
    namespace (``/../../x``: its ``..`` parts are dropped; what follows them is
    below an ancestor we share, which only root can create children of)."""
    parts = [p for p in path.split("/") if p]
    relative = bool(parts) and parts[0] == ".."
    while parts and parts[0] == "..":
        parts.pop(0)
    return parts, relative


def _pod(parts: list[str], relative: bool) -> tuple[str, str | None] | None:
    """(pod UID, container id or None) when ``parts`` start at the kubepods
    root (or, relative to a shared ancestor, at any level of it) and hold only
    kubepods levels above the pod."""
    for i, part in enumerate(parts):
        m = _POD_SYSTEMD.match(part) or _POD_CGROUPFS.match(part)
        if m is None:
            if _KUBE_QOS.match(part) or _KUBE_ROOT.match(part):
                continue
            return None
        if not relative and (i == 0 or not _KUBE_ROOT.match(parts[0])):
            return None
        c = _CONTAINER.match(parts[i + 1]) if i + 1 < len(parts) else None
        return m.group(1).replace("_", "-"), (c.group(1) if c else None)
    return None


def _unit(parts: list[str]) -> str | None:
    """The system service whose cgroup holds the process: the first
    ``.service`` part with only slices above it (not a user's manager)."""
    for part in parts:
        if part.endswith(".slice"):
            continue
        if part.endswith(".service") and not _USER_MANAGER.match(part):
            return part
        return None
    return None


def sender_of_cgroup(peer: Peer, cgroup: str | None) -> Sender:
    """The sender a process with these credentials in this cgroup v2 path is
    (``None``: the path could not be read; the uid alone names it)."""
    parts, relative = _segments(cgroup or "")
    pod = _pod(parts, relative)
    if pod is not None:
        uid_, cid = pod
        return Sender("pod", f"pod:{uid_}/{cid or '-'}", peer.uid, peer.pid, cgroup,
                      pod=uid_, container=cid)
    unit = _unit(parts)
    if unit is not None:
        return Sender("unit", f"unit:{unit}", peer.uid, peer.pid, cgroup, unit=unit)
    return Sender("process", f"uid:{peer.uid}:{cgroup or '?'}", peer.uid, peer.pid, cgroup)


def cgroup_path(text: str) -> str | None:
    """The cgroup v2 path in a ``/proc/<pid>/cgroup`` file (the ``0::`` line;
    on a v1-only system systemd's ``name=systemd`` hierarchy)."""
    v1 = None
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        ctrl, _, path = rest.partition(":")
        if hid == "0" and ctrl == "":
            return path
        if "name=systemd" in ctrl.split(","):
            v1 = path
    return v1


# --------------------------------------------------------------------------
# Reading /proc
# --------------------------------------------------------------------------
class SenderResolver:
    """Peer credentials -> :class:`Sender`, reading ``proc`` (a path, so tests
    can point it at a tree of their own), cached for ``ttl_s`` per
    (pid, uid, gid), at most ``max_entries`` of them."""

    def __init__(self, proc: str | os.PathLike[str] = "/proc", ttl_s: float = 2.0,
                 max_entries: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.proc = Path(proc)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._cache: OrderedDict[Peer, tuple[float, Sender]] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # /proc lookups (cache misses)

    def resolve(self, peer: Peer) -> Sender:
        """The sender behind ``peer``, or :class:`ReportRefused` (403) when its
        process cannot be seen (pid 0: another pid namespace), is gone, or no
        longer runs as the connection's uid."""
        now = self.clock()
        with self._lock:
            hit = self._cache.get(peer)
            if hit is not None and hit[0] > now:
                return hit[1]
        sender = self._read(peer)
        with self._lock:
            self._cache.pop(peer, None)
            self._cache[peer] = (now + self.ttl_s, sender)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return sender

    def _read(self, peer: Peer) -> Sender:
        if peer.pid <= 0:
            raise ReportRefused(403, "sender_unknown", f"uid {peer.uid}: qosd cannot see the "
                                "sending process (pid 0: it is in another pid namespace; run "
                                "qosd in the host's, e.g. hostPID: true)")
        self.reads += 1
        try:
            fd = os.open(self.proc / str(peer.pid), os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            raise ReportRefused(403, "sender_gone", f"pid {peer.pid} (uid {peer.uid}): the "
                                "sending process is gone") from None
        try:
            uids = _status_uids(_read_at(fd, "status"))
            cgroup = cgroup_path(_read_at(fd, "cgroup"))
        except (OSError, ValueError):
            raise ReportRefused(403, "sender_gone", f"pid {peer.pid} (uid {peer.uid}): the "
                                "sending process is gone") from None
        finally:
            os.close(fd)
        if peer.uid not in uids:
            raise ReportRefused(403, "sender_changed", f"pid {peer.pid} runs as uid "
                                f"{'/'.join(map(str, uids))}, not as the connection's uid "
                                f"{peer.uid} (its pid was reused, or it changed user)")
        return sender_of_cgroup(peer, cgroup)


def _read_at(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dirfd)
    with contextlib.closing(os.fdopen(fd, "rb", buffering=0)) as f:
        return f.read(MAX_PROC_READ).decode("utf-8", "replace")


def _status_uids(text: str) -> tuple[int, ...]:
    """Real and effective uid from a ``/proc/<pid>/status`` text."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            real, eff = line.split()[1:3]
            return (int(real), int(eff))
    raise ValueError("no Uid line")
