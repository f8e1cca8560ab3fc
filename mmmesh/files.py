"""Atomic file writes: a temporary file in the same directory, fsync, rename,
fsync of the directory.  A reader sees the old file or the new one, never a
part of one.  (The policy store has its own, stricter variant with error
reporting of its own: qosd/store/local.py.)"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[IO[bytes]], None],
                 mode: int = 0o644) -> Path:
    """Writes ``data`` (bytes, text, or a function writing to a binary file) to ``path``."""
    p = Path(path)
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
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return p


def write_json(path: str | os.PathLike[str], data: Any, **dumps: Any) -> Path:
    """``data`` as indented JSON, atomically."""
    return write_atomic(path, json.dumps(data, indent=2, **dumps) + "\n")
