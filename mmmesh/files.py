"""Atomic file writes: a temporary file in the same directory, fsync, rename,
fsync of the directory.  A reader sees the old file or the new one, never a
part of one, and once the call returns the new one survives a crash.  The one
implementation: the policy store (qosd/store/local.py) writes its version
files with it too (mode 0600, no directories made: its own are 0700)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "write_atomic", "write_json"]


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[IO[bytes]], None],
                 mode: int = 0o644, *, parents: bool = True) -> Path:
    """Writes ``data`` (bytes, text, or a function writing to a binary file) to
    ``path`` with permissions ``mode``.  ``parents``: make missing directories
    first (else a missing directory is the ``FileNotFoundError`` it is).  The
    temporary file is removed on any error, which is raised as it was."""
    p = Path(path)
    if parents:
        p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(p.parent)
    return p


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync(2) of the directory ``path``: a rename or a new file in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike[str], data: Any, **dumps: Any) -> Path:
    """``data`` as indented JSON, atomically."""
    return write_atomic(path, json.dumps(data, indent=2, **dumps) + "\n")
