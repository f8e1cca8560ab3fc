"""The versioned, persisted SLA policy store of qosd.

Layout of ``state_dir`` (created with mode 0700 when missing)::

    state_dir/
        .lock                        flock(2) target: one writer at a time, across processes
        current.json                 {"version": N, "sha256": "<hex>"}: the current version
        current.json.corrupt         a current.json that failed its checks (kept for inspection)
        policies/
            0000000001.json          {"version", "created_at", "author", "note",
            0000000002.json           "sha256", "policy_yaml"}; sha256 is over policy_yaml
            0000000003.json.corrupt  a version file that failed its checks (kept)
            0000000004.json.abandoned  prepared, never activated (kept, number taken)
            0000000005.json.pending  prepared, not yet activated or abandoned

Every write is atomic: a temp file in the same directory is written, flushed
and fsync'ed, then ``os.replace``'d over its name, then the directory is
fsync'ed.

A new version goes through two steps, and ``current.json`` is the commit
point between them:

1. :meth:`prepare` writes ``policies/N.json.pending``: the number N is taken
   for good, the version is not current and not in the history.  (qosd then
   puts it into the kernel.)
2. :meth:`activate` writes ``current.json`` naming N, then renames the pending
   file to ``N.json``.  A crash between the two is finished on the next load
   (``current.json`` names N and only ``N.json.pending`` exists: it is renamed).

A prepared version that is not activated is :meth:`abandon`'ed (renamed to
``N.json.abandoned``), or, after a crash, listed by :meth:`pending` until its
owner abandons it.  So a version that never became current can never become
current later by accident: not on a reload, and not when ``current.json`` is
damaged (the fall-back only considers ``N.json`` files, which were all named
by a ``current.json`` once).  :meth:`commit` is both steps at once.

Version numbers increase monotonically and are never reused: the next one is
1 + the highest number ever seen on disk, corrupt files set aside and the
version a corrupt ``current.json`` claimed included.  History is bounded to the
newest ``history_limit`` version files; the current version is never deleted.

Corrupt content is never silently replaced and never makes loading fail: a
file that fails its checks is renamed to ``<name>.corrupt``, the problem is
logged and appended to :attr:`PolicyStore.problems`, and the store starts from
the last version it can prove.  Only I/O errors (permission denied, a file
where the directory should be, a full disk on commit) raise
:class:`~qosd.errors.StoreCorruptError`.

The store is thread-safe, and safe for several processes on the same
directory: every disk operation runs under an exclusive ``flock`` on
``.lock``, and a commit first re-reads the directory, so ``base_version`` is
checked against what is really on disk.  Reads (:meth:`current`,
:meth:`history`, :meth:`get`) answer from memory; :meth:`reload` catches up
with other processes' commits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from mmmesh.errors import PolicyError
from mmmesh.failpoints import failpoint
from mmmesh.files import write_atomic
from mmmesh.policy import Policy, parse_policy
from qosd.errors import ConflictError, NotFoundError, StoreCorruptError
from qosd.model import PolicyVersion

__all__ = ["PolicyStore"]

log = logging.getLogger("qosd.store.local")

CURRENT = "current.json"
POLICIES = "policies"
LOCK = ".lock"
_VERSION_RE = re.compile(r"(\d{10,})\.json")
_ASIDE_RE = re.compile(r"(\d{10,})\.json(?:\.pending)?(?:\.\d+)?\.(?:corrupt|abandoned)")
_PENDING_RE = re.compile(r"(\d{10,})\.json\.pending")
_TEMP_RE = re.compile(r"\..+\.tmp")
_MAX_VERSION = 10**18  # a claim above this is garbage, not a version anybody was given


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _version_name(version: int) -> str:
    return f"{version:010d}.json"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` atomically and durably (mmmesh.files: temp, fsync,
    replace, fsync dir), private to this user (0600) in a directory that must exist."""
    write_atomic(path, data, 0o600, parents=False)


def _to_json(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


class _Corrupt(Exception):
    """A state file failed its checks; the message says why."""


def _json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; _Corrupt saying why it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Corrupt(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _Corrupt(f"not a JSON object but {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class _Stat:
    """What identifies one on-disk state of a file (version files are never rewritten)."""

    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Stat:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


class PolicyStore:
    """Versioned SLA policies persisted under ``state_dir`` (see the module docstring).

    ``problems`` lists, in order, every corruption found and set aside by this
    instance; nothing in it is ever raised.
    """

    def __init__(self, state_dir: Path | str, history_limit: int = 50) -> None:
        """Open (creating when missing) the store in ``state_dir`` and load what is there.

        Raises ValueError for ``history_limit < 1`` and StoreCorruptError for
        I/O errors; corrupt content is set aside and recorded in ``problems``.
        """
        if not _is_int(history_limit) or history_limit < 1:
            raise ValueError(f"history_limit must be an integer >= 1, got {history_limit!r}")
        self.state_dir = Path(state_dir)
        self.history_limit = history_limit
        self.problems: list[str] = []
        self._lock = threading.RLock()
        self._versions: dict[int, PolicyVersion] = {}
        self._pending: dict[int, PolicyVersion] = {}
        self._pending_stats: dict[int, _Stat] = {}
        self._stats: dict[int, _Stat] = {}
        self._current: int = 0
        self._high: int = 0  # highest version number ever seen
        self._policies = self.state_dir / POLICIES
        self._current_path = self.state_dir / CURRENT
        with self._io(self.state_dir, "cannot create the state directory"):
            self._mkdir(self.state_dir)
            self._mkdir(self._policies)
        self.reload()

    # -- reading -----------------------------------------------------------
    @property
    def version(self) -> int:
        """The current version number; 0 when the store holds no current policy."""
        with self._lock:
            return self._current

    def current(self) -> PolicyVersion | None:
        """The current policy version, None when there is none yet."""
        with self._lock:
            return self._versions.get(self._current) if self._current else None

    def get(self, version: int) -> PolicyVersion:
        """One stored version; NotFoundError when it was never stored or was pruned."""
        with self._lock:
            try:
                return self._versions[version]
            except KeyError:
                raise NotFoundError(f"no policy version {version}") from None

    def history(self) -> list[PolicyVersion]:
        """Every stored version, newest first."""
        with self._lock:
            return [self._versions[v] for v in sorted(self._versions, reverse=True)]

    def reload(self) -> None:
        """Re-read the directory (e.g. to see another process's commits)."""
        with self._lock, self._flock():
            self._load_locked()

    # -- writing -----------------------------------------------------------
    def commit(self, policy: Policy, *, base_version: int | None = None,
               author: str | None = None, note: str | None = None) -> PolicyVersion:
        """Store ``policy`` as a new version and make it current (prepare +
        activate).

        With ``base_version`` given, the commit succeeds only while the current
        version is still ``base_version`` (ConflictError otherwise); None
        always wins.  Raises PolicyError if the canonical text does not parse
        back, and StoreCorruptError when the disk write fails (the previous
        version stays current and the new number is not reused).
        """
        pv = self.prepare(policy, base_version=base_version, author=author, note=note)
        try:
            return self.activate(pv, base_version=base_version)
        except BaseException:
            with contextlib.suppress(StoreCorruptError):
                self.abandon(pv)
            raise

    def prepare(
        self,
        policy: Policy,
        *,
        base_version: int | None = None,
        author: str | None = None,
        note: str | None = None,
    ) -> PolicyVersion:
        """Write ``policy`` as version N = 1 + the highest number ever seen, not
        current yet (``N.json.pending``).  N is taken for good.

        ConflictError when ``base_version`` is given and not current; PolicyError
        if the canonical text does not parse back; StoreCorruptError on I/O
        errors (the number is taken only if the file was written)."""
        text = policy.to_yaml()
        stored = parse_policy(text, source="canonical policy")  # what a reload will see
        with self._lock, self._flock():
            self._load_locked()
            if base_version is not None and base_version != self._current:
                raise ConflictError(base_version, self._current)
            version = self._high + 1
            pv = PolicyVersion(version=version, policy=stored, text=text, sha256=_sha256(text),
                               created_at=time.time(), author=author, note=note)
            path = self._pending_path(version)
            record = {"version": pv.version, "created_at": pv.created_at, "author": pv.author,
                      "note": pv.note, "sha256": pv.sha256, "policy_yaml": pv.text}
            with self._io(path, "cannot write the policy version"):
                _atomic_write(path, _to_json(record))
            self._high = version  # the file is on disk: its number is taken
            self._pending[version] = pv
            failpoint("store.prepare.written")
            return pv

    def activate(self, pv: PolicyVersion, *, base_version: int | None = None) -> PolicyVersion:
        """Make the prepared version ``pv`` current: ``current.json`` first (the
        commit point), then ``N.json.pending`` becomes ``N.json``.

        ConflictError when ``base_version`` is given and another version became
        current meanwhile (``pv`` stays pending: abandon it); NotFoundError when
        ``pv`` is not pending any more; StoreCorruptError on I/O errors (the
        previous version stays current unless current.json was written)."""
        with self._lock, self._flock():
            self._load_locked()
            if base_version is not None and base_version != self._current:
                raise ConflictError(base_version, self._current)
            pending = self._pending.get(pv.version)
            if pending is None or pending.sha256 != pv.sha256:
                raise NotFoundError(f"policy version {pv.version} is not pending")
            self._write_current(pending)
            failpoint("store.activate.current")
            self._promote(pv.version)
            failpoint("store.activate.renamed")
            self._prune_locked()
            return self._versions[pv.version]

    def abandon(self, pv: PolicyVersion) -> None:
        """The prepared version ``pv`` will not be activated: set it aside as
        ``N.json.abandoned`` (its number stays taken).  No-op if not pending."""
        with self._lock, self._flock():
            self._pending.pop(pv.version, None)
            path = self._pending_path(pv.version)
            target = path.with_name(_version_name(pv.version) + ".abandoned")
            with self._io(path, "cannot abandon the pending version"):
                if not path.exists():
                    return
                os.replace(path, target)
                _fsync_dir(path.parent)

    def pending(self) -> list[PolicyVersion]:
        """Prepared versions neither activated nor abandoned (after a crash:
        an apply that never finished), oldest first."""
        with self._lock:
            return [self._pending[v] for v in sorted(self._pending)]

    def _pending_path(self, version: int) -> Path:
        return self._policies / (_version_name(version) + ".pending")

    def _promote(self, version: int) -> None:
        """``N.json.pending`` -> ``N.json`` (current.json already names N)."""
        pv = self._pending.pop(version)
        src, dst = self._pending_path(version), self._policies / _version_name(version)
        with self._io(dst, "cannot activate the policy version"):
            os.replace(src, dst)
            _fsync_dir(self._policies)
        self._versions[version] = pv
        with contextlib.suppress(OSError):
            self._stats[version] = _Stat.of(dst.stat())

    # -- loading -----------------------------------------------------------
    def _load_locked(self) -> None:
        """Bring memory in line with the disk; sets corrupt files aside.  Holds the flock."""
        with self._io(self._policies, "cannot read the policy directory"):
            self._remove_temp_files(self._policies)
            self._remove_temp_files(self.state_dir)
            names = os.listdir(self._policies)
        present: set[int] = set()
        old_pending, self._pending = self._pending, {}
        for name in sorted(names):
            if m := _ASIDE_RE.fullmatch(name):
                self._saw(int(m[1]))
            elif m := _PENDING_RE.fullmatch(name):
                self._saw(int(m[1]))
                self._load_pending(int(m[1]), self._policies / name, old_pending)
            elif m := _VERSION_RE.fullmatch(name):
                number = int(m[1])
                self._saw(number)
                if self._load_version(number, self._policies / name):
                    present.add(number)
        for gone in set(self._versions) - present:  # pruned or set aside by another process
            del self._versions[gone]
            self._stats.pop(gone, None)
        self._saw_aside_current_claims()
        self._load_current()
        self._prune_locked()

    def _load_pending(self, number: int, path: Path, old: dict[int, PolicyVersion]) -> None:
        """Loads (or keeps, when its file is unchanged) one pending version."""
        with self._io(path, "cannot read the pending policy version"):
            st = _Stat.of(path.stat())
            if self._pending_stats.get(number) == st and number in old:
                self._pending[number] = old[number]
                return
            raw = path.read_bytes()
        try:
            self._pending[number] = self._parse_version(number, raw)
            self._pending_stats[number] = st
        except _Corrupt as e:
            self._set_aside(path, str(e))

    def _load_version(self, number: int, path: Path) -> bool:
        """Loads (or keeps cached) one version file; False when it was set aside."""
        with self._io(path, "cannot read the policy version"):
            st = _Stat.of(path.stat())
            if self._stats.get(number) == st and number in self._versions:
                return True
            raw = path.read_bytes()
        try:
            pv = self._parse_version(number, raw)
        except _Corrupt as e:
            self._versions.pop(number, None)
            self._stats.pop(number, None)
            self._set_aside(path, str(e))
            return False
        self._versions[number] = pv
        self._stats[number] = st
        return True

    @staticmethod
    def _parse_version(number: int, raw: bytes) -> PolicyVersion:
        obj = _json_object(raw)
        version, text, sha = obj.get("version"), obj.get("policy_yaml"), obj.get("sha256")
        created_at, author, note = obj.get("created_at"), obj.get("author"), obj.get("note")
        if not _is_int(version) or version != number:
            raise _Corrupt(f"its version field is {version!r}, its name says {number}")
        if not isinstance(text, str):
            raise _Corrupt("policy_yaml is missing or not a string")
        if not isinstance(sha, str):
            raise _Corrupt("sha256 is missing or not a string")
        try:
            actual = _sha256(text)
        except UnicodeEncodeError:  # lone surrogates from a \ud800 escape
            raise _Corrupt("policy_yaml is not encodable as UTF-8") from None
        if actual != sha:
            raise _Corrupt(f"sha256 mismatch: recorded {sha[:16]}..., content {actual[:16]}...")
        if (
            not isinstance(created_at, int | float)
            or isinstance(created_at, bool)
            or not math.isfinite(created_at)
        ):
            raise _Corrupt(f"created_at is not a number: {created_at!r}")
        for field, value in (("author", author), ("note", note)):
            if value is not None and not isinstance(value, str):
                raise _Corrupt(f"{field} is not a string or null: {value!r}")
        try:
            policy = parse_policy(text, source=_version_name(number))
        except PolicyError as e:
            raise _Corrupt(f"the policy no longer parses: {e}") from None
        return PolicyVersion(
            version=number,
            policy=policy,
            text=text,
            sha256=sha,
            created_at=float(created_at),
            author=author,
            note=note,
        )

    def _load_current(self) -> None:
        """Reads current.json; sets it aside and falls back when it cannot be trusted."""
        path = self._current_path
        raw: bytes | None = None
        with self._io(path, "cannot read"), contextlib.suppress(FileNotFoundError):
            raw = path.read_bytes()
        if raw is None:
            if self._versions:  # lost, or a crash before the very first current.json
                self._fall_back(f"{path}: missing although policy versions exist")
            else:
                self._current = 0
            return
        try:
            self._current = self._check_current(raw)
        except _Corrupt as e:
            self._set_aside(path, str(e))
            self._fall_back(None)

    def _check_current(self, raw: bytes) -> int:
        obj = _json_object(raw)
        version, sha = obj.get("version"), obj.get("sha256")
        if not _is_int(version) or version < 1:
            raise _Corrupt(f"version is not a positive integer: {version!r}")
        self._saw(version)
        if version not in self._versions and version in self._pending:
            if sha == self._pending[version].sha256:
                self._promote(version)  # a crash between current.json and the rename
        if version not in self._versions:
            raise _Corrupt(f"names version {version}, which is missing or corrupt")
        if sha != self._versions[version].sha256:
            raise _Corrupt(f"sha256 does not match version {version}'s")
        return version

    def _fall_back(self, problem: str | None) -> None:
        """Make the highest verified version current and write a fresh current.json."""
        best = max(self._versions, default=0)
        if problem is not None:
            self._problem(problem)
        if best:
            self._problem(f"{self.state_dir}: starting from version {best}, the last good one")
            self._current = best
            self._write_current(self._versions[best])
        else:
            self._problem(f"{self.state_dir}: no good policy version left; the store is empty")
            self._current = 0

    def _write_current(self, pv: PolicyVersion) -> None:
        path = self._current_path
        with self._io(path, "cannot write"):
            _atomic_write(path, _to_json({"version": pv.version, "sha256": pv.sha256}))
        self._current = pv.version

    def _saw(self, version: int) -> None:
        if version <= _MAX_VERSION:
            self._high = max(self._high, version)

    def _saw_aside_current_claims(self) -> None:
        """Counts the versions that set-aside current.json files claimed as seen."""
        with self._io(self.state_dir, "cannot read the state directory"):
            names = os.listdir(self.state_dir)
        for name in names:
            if name.startswith(CURRENT) and name.endswith(".corrupt"):
                with contextlib.suppress(OSError, ValueError, RecursionError):
                    obj = json.loads((self.state_dir / name).read_bytes())
                    if isinstance(obj, dict) and _is_int(obj.get("version")):
                        self._saw(obj["version"])

    # -- housekeeping ------------------------------------------------------
    def _prune_locked(self) -> None:
        """Delete version files beyond the newest ``history_limit``, never the current one."""
        keep = set(sorted(self._versions, reverse=True)[: self.history_limit])
        keep.add(self._current)
        doomed = [v for v in self._versions if v not in keep]
        for v in doomed:
            path = self._policies / _version_name(v)
            with self._io(path, "cannot delete the old policy version"):
                path.unlink(missing_ok=True)
            del self._versions[v]
            self._stats.pop(v, None)
        # abandoned applies: the newest history_limit are kept (the highest
        # number on disk always survives, so no number is ever handed out twice)
        with self._io(self._policies, "cannot list the policy directory"):
            abandoned = sorted(n for n in os.listdir(self._policies)
                               if n.endswith(".json.abandoned"))
        for name in abandoned[: max(0, len(abandoned) - self.history_limit)]:
            with self._io(self._policies / name, "cannot delete the abandoned version"):
                (self._policies / name).unlink(missing_ok=True)
            doomed.append(0)
        if doomed:
            with self._io(self._policies, "cannot sync"):
                _fsync_dir(self._policies)

    def _set_aside(self, path: Path, reason: str) -> None:
        """Rename a corrupt file to ``<name>.corrupt`` (never over an earlier one) and record it."""
        target = path.with_name(path.name + ".corrupt")
        n = 2
        while target.exists():
            target = path.with_name(f"{path.name}.{n}.corrupt")
            n += 1
        with self._io(path, "cannot set the corrupt file aside"):
            os.rename(path, target)
            _fsync_dir(path.parent)
        self._problem(f"{path}: {reason}; set aside as {target.name}")

    def _problem(self, message: str) -> None:
        self.problems.append(message)
        log.error("%s", message)

    @staticmethod
    def _remove_temp_files(directory: Path) -> None:
        """Temp files left by a writer that died; safe to delete under the flock."""
        for name in os.listdir(directory):
            if _TEMP_RE.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)

    @staticmethod
    def _mkdir(path: Path) -> None:
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        """Exclusive flock on ``state_dir/.lock`` (one writer across processes)."""
        path = self.state_dir / LOCK
        with self._io(path, "cannot open the lock file"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            with self._io(path, "cannot lock"):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # also releases the lock

    @staticmethod
    @contextlib.contextmanager
    def _io(path: Path, what: str) -> Iterator[None]:
        """Turns an OSError into StoreCorruptError naming ``path``."""
        try:
            yield
        except OSError as e:
            reason = f"{what}: {e.strerror or e}"
            raise StoreCorruptError(str(path), reason) from e
